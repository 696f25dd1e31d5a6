"""The checkpoint index's own digest (``index_sha256``): over the canonical JSON of the index without it,
checked on the exact bytes written where the file is as the writer left it."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Optional

__all__ = ["index_digest"]


#: The digest field as :func:`tplayers.checkpoint.index.build_index` writes it (compact JSON, keys sorted: never the first key).
_SIGNATURE = re.compile(rb',"index_sha256":"([0-9a-f]{64})"')


def _signed_body(data: bytes) -> Optional[dict]:
    """The index parsed from exactly the bytes its ``index_sha256`` covers, or None (then the caller
    parses ``data`` and checks the digest over its canonical JSON, which also accepts a reformatted file).

    An index written as :func:`tplayers.checkpoint.index.build_index` writes it is that canonical JSON with the digest field
    inserted, so removing the one field gives the hashed bytes: they are hashed as they are, and it is
    those bytes that are parsed, without serialising the document again.
    """
    found = list(_SIGNATURE.finditer(data))
    if len(found) != 1:
        return None
    m, digest = found[0], found[0].group(1).decode()
    body = data[: m.start()] + data[m.end() :]
    if hashlib.sha256(body).hexdigest() != digest:
        return None
    doc = json.loads(body)
    if not isinstance(doc, dict):
        return None
    doc["index_sha256"] = digest
    return doc


def index_digest(doc: dict) -> str:
    """SHA-256 hex of ``doc``'s canonical JSON without its ``index_sha256`` field."""
    body = {k: v for k, v in doc.items() if k != "index_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

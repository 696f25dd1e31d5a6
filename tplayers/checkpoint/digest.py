"""Digests of checkpoint data: XXH3-128 by default, SHA-256 as an option (and for old checkpoints).

The digests in a checkpoint's index guard against corruption (a flipped bit, a
truncated or swapped file), not against an attacker who can also rewrite the
index beside the data. For that job a fast non-cryptographic 128-bit hash is as
good as SHA-256, and it runs at memory speed (about a memory copy's rate, several
times SHA-256's; figures in docs/checkpoints.md and benchmarks/RESULTS.md). A
verified load from the page cache is therefore no longer bound by hashing.

Example::

    from tplayers.checkpoint.digest import block_digest, hex_length
    d = block_digest("xxh3_128")(b"some bytes")      # 16 raw bytes
    assert len(d.hex()) == hex_length("xxh3_128")
"""

from __future__ import annotations

import hashlib
from typing import Callable

import xxhash

__all__ = ["ALGORITHMS", "DEFAULT", "block_digest", "file_hasher", "hex_length", "check_algorithm", "label"]

#: Digest algorithms a checkpoint may use, and the one new checkpoints use.
ALGORITHMS = ("xxh3_128", "sha256")
DEFAULT = "xxh3_128"

_HEX = {"xxh3_128": 32, "sha256": 64}
_LABEL = {"xxh3_128": "XXH3-128", "sha256": "SHA-256"}


def check_algorithm(name: object, what: str = "digest") -> str:
    """``name`` if it is a known algorithm, else ``ValueError`` listing them."""
    if name not in ALGORITHMS:
        raise ValueError(f"{what} must be one of {list(ALGORITHMS)}, got {name!r}")
    return name  # type: ignore[return-value]


def hex_length(algorithm: str) -> int:
    """Hex characters of one digest."""
    return _HEX[algorithm]


def label(algorithm: str) -> str:
    """The name used in messages (``"XXH3-128"``, ``"SHA-256"``)."""
    return _LABEL[algorithm]


def block_digest(algorithm: str) -> Callable[[object], bytes]:
    """A function from a bytes-like block to its raw digest."""
    if algorithm == "sha256":
        return lambda data: hashlib.sha256(data).digest()
    return xxhash.xxh3_128_digest


def file_hasher(algorithm: str, header: bytes):
    """A running hash of a file: seeded with the digest of its header bytes, then
    fed every block digest in file order (``.update(raw)``, ``.hexdigest()``)."""
    if algorithm == "sha256":
        return hashlib.sha256(hashlib.sha256(header).digest())
    h = xxhash.xxh3_128()
    h.update(xxhash.xxh3_128_digest(header))
    return h

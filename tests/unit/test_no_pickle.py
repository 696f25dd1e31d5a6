"""No pickle between ranks anywhere in the library or its examples (docs/design.md, checkpoints; and the fresh-machine
issue): torch's object collectives pickle, and on a base install (no numpy) they fail outright."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
OBJECT_COLLECTIVES = re.compile(
    r"\b(broadcast_object_list|all_gather_object|gather_object|scatter_object_list|send_object_list|recv_object_list)\b"
)


def test_no_object_collectives_in_library_or_examples():
    hits = []
    for folder in ("tplayers", "kernels", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for no, line in enumerate(path.read_text().splitlines(), 1):
                if OBJECT_COLLECTIVES.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{no}: {line.strip()}")
    assert not hits, "object collectives pickle (use tensors):\n" + "\n".join(hits)

"""Ranks that must agree: compare a layer's configuration inside its layout exchange.

Layers that exchange a small integer row (the domain layers, ``gather``,
``scatter``) append their configuration to that row, so a
rank built with other arguments (kernel 3 here, 5 there; another ``dim``;
another dtype) fails with one ``ValueError`` on every rank, naming the field
and the ranks that differ, instead of a gloo abort or a hang. It costs no
extra message: the configuration rides in the exchange that already happens.
Fingerprints of replicated tensors ride the same way (``values``, from
:func:`value_fingerprints`: ranks seeded differently fail naming the tensors),
and :func:`raise_together` makes every rank raise one rank's error at a point
all of them reach (the region guard's refusals).

Example (every rank calls it with its own values)::

    from tplayers.comm.agree import exchange_agreed
    table = exchange_agreed([h_local], {"kernel_size": (3, 3), "padding_mode": "zeros"},
                            [mesh.get_group(0)], what="DistributedConv2d")
    sizes = [row[0][0] for row in table]          # every rank's h_local, in mesh order
"""

from __future__ import annotations

import zlib
from typing import Dict, List, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from tplayers.comm.collectives import exchange_grid_table

__all__ = ["config_code", "exchange_agreed", "check_agreement", "raise_together", "value_fingerprints"]

_INT64 = 2**63
_TEXT = 2000  # bytes of an error message that travel to the other ranks


def config_code(value: object) -> int:
    """A stable int64 standing for ``value`` on every rank (ints as themselves).

    Strings, tuples, dtypes, ``None`` and other values are coded by a CRC of their
    ``repr`` (stable across processes, unlike ``hash``), tagged so an int and a
    string can never collide by construction.
    """
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int) and -_INT64 < value < _INT64:
        return value
    return -(1 << 40) - zlib.crc32(repr(value).encode())


def _differing(rows: Sequence[Sequence[int]], names: Sequence[str], ranks=None):
    """``(name, {code: [ranks holding it]})`` for each of the rows' trailing ``len(names)`` codes that
    differs across them (rows in mesh order; ``ranks``: the global rank of each row, default its index)."""
    k = len(names)
    for j, name in enumerate(names):
        column = [int(r[len(r) - k + j]) for r in rows]
        if len(set(column)) == 1:
            continue
        groups: Dict[int, List[int]] = {}
        for i, code in enumerate(column):
            groups.setdefault(code, []).append(int(ranks[i]) if ranks is not None else i)
        yield name, groups


def check_agreement(
    rows: Sequence[Sequence[int]], names: Sequence[str], values: Mapping[str, object], what: str
) -> None:
    """``ValueError`` unless every rank's trailing ``len(names)`` codes match.

    ``rows`` are the exchanged rows in mesh order (every rank sees the same rows,
    so every rank raises the same error). ``values`` are this rank's values, shown
    in the message; ints from other ranks are shown too.
    """
    problems = []
    for name, groups in _differing(rows, names):
        shown = []
        for code, ranks in groups.items():
            mine = config_code(values[name]) == code
            label = (
                repr(values[name])
                if mine
                else (
                    str(code)
                    if isinstance(values[name], int) and not isinstance(values[name], bool)
                    else "another value"
                )
            )
            shown.append(f"ranks {ranks}: {label}")
        problems.append(f"{name} differs across ranks ({'; '.join(shown)})")
    if problems:
        raise ValueError(
            f"{what}: every rank must be built and called with the same arguments, but " + "; ".join(problems)
        )


def value_fingerprints(named: Mapping[str, torch.Tensor]) -> Dict[str, int]:
    """A bit-exact int64 fingerprint of each tensor's values, for :func:`exchange_agreed`'s ``values``.

    The tensor's bytes are read as integer words (its element size), and the sum and the sum of
    squares of the words (wrapping int64, so exact and independent of the reduction order) are
    coded with the shape and dtype: equal tensors give equal codes on every rank and device, a
    differently seeded one a different code. One pass over each tensor, one device-to-host copy
    for all of them; meta tensors (no values) are coded by shape and dtype only.
    """
    words = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    sums, names = [], list(named)
    for name in names:
        t = named[name].detach()
        if t.device.type == "meta" or t.numel() == 0 or t.element_size() not in words:
            sums.append(None)
            continue
        flat = t.contiguous().reshape(-1)
        flat = flat.view(torch.uint8) if flat.dtype == torch.bool else flat.view(words[t.element_size()])
        s1 = s2 = torch.zeros((), dtype=torch.int64, device=t.device)
        for start in range(0, flat.numel(), 1 << 22):  # bounded int64 copies
            w = flat[start : start + (1 << 22)].to(torch.int64)
            s1, s2 = s1 + w.sum(), s2 + (w * w).sum()
        sums.append(torch.stack([s1, s2]))
    got = [s for s in sums if s is not None]
    host = torch.stack([s.to(got[0].device) for s in got]).cpu().tolist() if got else []  # one copy
    it = iter(host)
    return {
        name: config_code((tuple(named[name].shape), str(named[name].dtype), None if s is None else tuple(next(it))))
        for name, s in zip(names, sums)
    }


def _check_values(rows: Sequence[Sequence[int]], names: Sequence[str], what: str, ranks) -> None:
    """``ValueError`` naming every tensor whose fingerprint differs across ranks, and the ranks."""
    problems = []
    for name, groups in _differing(rows, names, ranks):
        problems.append(f"{name!r} (" + " / ".join(f"ranks {g}" for g in groups.values()) + ")")
    if problems:
        raise ValueError(
            f"{what}: replicated tensors hold different values across ranks: {', '.join(problems)}. "
            "A replicated parameter or buffer must be the same on every rank: build every rank's "
            "model under one seed (torch.manual_seed before constructing it), or let "
            "parallelize_module copy one rank's values (src_rank=0, the default)"
        )


def exchange_agreed(
    row: Sequence[int],
    config: Mapping[str, object],
    groups: Sequence[dist.ProcessGroup],
    what: str,
    tag: str = "agree",
    *,
    error: Optional[BaseException] = None,
    values: Optional[Mapping[str, int]] = None,
    ranks: Optional[Sequence[int]] = None,
) -> List[List[List[int]]]:
    """:func:`exchange_grid_table` of ``row`` with ``config`` appended and checked.

    ``error``: an exception this rank found in its own arguments before the
    exchange. It travels as a flag in the same message, so every rank raises
    (this rank its own exception, the others a ``ValueError`` naming it) and no
    rank is left waiting in a later collective. ``values``: fingerprints of
    replicated tensors (:func:`value_fingerprints`), compared like ``config``
    (a ``ValueError`` on every rank names each tensor that differs and the
    ranks; ``ranks``: the global rank of each mesh position, for that message).
    Returns the table of the ``row`` part only (``table[c0][c1]``, mesh
    coordinates) after every check passed.
    """
    names = list(config)
    codes = [config_code(config[n]) for n in names]
    tensors = list(values or {})
    n = len(row)
    table = exchange_grid_table(
        [int(error is not None)] + list(row) + codes + [values[t] for t in tensors], groups, tag
    )
    flat = [r for line in table for r in line]
    failed = [rank for rank, r in enumerate(flat) if r[0]]
    if error is not None:
        raise error
    if failed:
        raise ValueError(
            f"{what}: rank(s) {failed} rejected their arguments (their error says why); no data was exchanged"
        )
    check_agreement([r[: len(r) - len(tensors)] for r in flat], names, config, what)
    _check_values(flat, tensors, what, ranks)
    return [[r[1 : n + 1] for r in line] for line in table]


def raise_together(
    error: Optional[BaseException],
    groups: Sequence[dist.ProcessGroup],
    what: str,
    tag: str = "agree.error",
    *,
    ranks: Optional[Sequence[int]] = None,
    cls: type = ValueError,
) -> None:
    """Every rank calls this at the same point with its own ``error`` (``None``: none here).

    If any rank passed one, every rank raises the same ``cls`` (a ``ValueError``) naming the
    ranks that failed and quoting the first one's message; else it returns. Cost: one small
    all-gather (a flag and a length per rank); the messages travel in a second one only when
    some rank failed. ``ranks``: the global rank of each mesh position, for the message
    (default: mesh positions in row-major order).
    """
    text = b"" if error is None else str(error).encode()[:_TEXT]
    table = exchange_grid_table([int(error is not None), len(text)], groups, tag)
    flat = [r for line in table for r in line]
    failed = [i for i, r in enumerate(flat) if r[0]]
    if not failed:
        return
    width = max(r[1] for r in flat)
    texts = exchange_grid_table(list(text) + [0] * (width - len(text)), groups, tag)
    first = bytes(texts[failed[0] // len(table[0])][failed[0] % len(table[0])][: flat[failed[0]][1]])
    names = [int(ranks[i]) for i in failed] if ranks is not None else failed
    raise cls(
        f"{what}: rank(s) {names} raised, so every rank raises this error. "
        f"Rank {names[0]}: {first.decode(errors='replace')}"
    )

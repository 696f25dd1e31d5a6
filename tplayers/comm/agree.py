"""Ranks that must agree: compare a layer's configuration inside its layout exchange.

Layers that exchange a small integer row once per local shape (the domain
layers, ``gather``, ``scatter``) append their configuration to that row, so a
rank built with other arguments (kernel 3 here, 5 there; another ``dim``;
another dtype) fails with one ``ValueError`` on every rank, naming the field
and the ranks that differ, instead of a gloo abort or a hang. It costs no
extra message: the configuration rides in the exchange that already happens.

Example (every rank calls it with its own values)::

    from tplayers.comm.agree import exchange_agreed
    table = exchange_agreed([h_local], {"kernel_size": (3, 3), "padding_mode": "zeros"},
                            [mesh.get_group(0)], what="DistributedConv2d")
    sizes = [row[0][0] for row in table]          # every rank's h_local, in mesh order
"""

from __future__ import annotations

import zlib
from typing import Dict, List, Mapping, Optional, Sequence

import torch.distributed as dist

from tplayers.comm.collectives import exchange_grid_table

__all__ = ["config_code", "exchange_agreed", "check_agreement"]

_INT64 = 2**63


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


def check_agreement(
    rows: Sequence[Sequence[int]], names: Sequence[str], values: Mapping[str, object], what: str
) -> None:
    """``ValueError`` unless every rank's trailing ``len(names)`` codes match.

    ``rows`` are the exchanged rows in mesh order (every rank sees the same rows,
    so every rank raises the same error). ``values`` are this rank's values, shown
    in the message; ints from other ranks are shown too.
    """
    k = len(names)
    if k == 0:
        return
    problems = []
    for j, name in enumerate(names):
        column = [int(r[len(r) - k + j]) for r in rows]
        if len(set(column)) == 1:
            continue
        groups: Dict[int, List[int]] = {}
        for rank, code in enumerate(column):
            groups.setdefault(code, []).append(rank)
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


def exchange_agreed(
    row: Sequence[int],
    config: Mapping[str, object],
    groups: Sequence[dist.ProcessGroup],
    what: str,
    tag: str = "agree",
    *,
    error: Optional[BaseException] = None,
) -> List[List[List[int]]]:
    """:func:`exchange_grid_table` of ``row`` with ``config`` appended and checked.

    ``error``: an exception this rank found in its own arguments before the
    exchange. It travels as a flag in the same message, so every rank raises
    (this rank its own exception, the others a ``ValueError`` naming it) and no
    rank is left waiting in a later collective. Returns the table of the ``row``
    part only (``table[c0][c1]``, mesh coordinates) after every check passed.
    """
    names = list(config)
    codes = [config_code(config[n]) for n in names]
    n = len(row)
    table = exchange_grid_table([int(error is not None)] + list(row) + codes, groups, tag)
    flat = [r for line in table for r in line]
    failed = [rank for rank, r in enumerate(flat) if r[0]]
    if error is not None:
        raise error
    if failed:
        raise ValueError(
            f"{what}: rank(s) {failed} rejected their arguments (their error says why); no data was exchanged"
        )
    check_agreement(flat, names, config, what)
    return [[r[1 : n + 1] for r in line] for line in table]

"""Fused and head-aware feature layouts of tensor-parallel linears, as data
(docs/design.md (tensor-parallel linears)).

A :class:`SectionLayout` says which global rows of a column-parallel weight
every rank holds when its output features are fused blocks (``sections``)
and/or whole heads (``head_dim``). It is computed once from
:func:`tplayers.sharding.section_layout` and yields the layer's
:class:`~tplayers.ShardSpec`, the local block sizes, the rows whose gradients
are summed over replicas (GQA), and the permutation that puts a gathered
output back in serial order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from tplayers.sharding import ShardSpec, offsets_from_sizes, section_layout, shard_range


def check_head_dim(layer: str, head_dim, features: int, what: str) -> Optional[int]:
    """Validate ``head_dim`` (None or a positive int dividing ``features``)."""
    if head_dim is None:
        return None
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"{layer}: head_dim must be a positive int or None, got {head_dim!r}")
    if features % head_dim:
        raise ValueError(f"{layer}: {what}={features} is not a whole number of heads of head_dim={head_dim}")
    return head_dim


def check_sections(layer: str, sections, out_features: int, head_dim: Optional[int]) -> Optional[Tuple[int, ...]]:
    """Validate ``sections`` (None, or positive ints summing to ``out_features``, each whole heads)."""
    if sections is None:
        check_head_dim(layer, head_dim, out_features, "out_features")
        return None
    if isinstance(sections, (str, bytes)) or not hasattr(sections, "__iter__"):
        raise ValueError(f"{layer}: sections must be a sequence of block sizes, got {sections!r}")
    out = tuple(sections)
    if not out or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in out):
        raise ValueError(f"{layer}: sections must be positive ints, got {sections!r}")
    if sum(out) != out_features:
        raise ValueError(f"{layer}: sections {list(out)} sum to {sum(out)}, expected out_features={out_features}")
    for i, n in enumerate(out):
        check_head_dim(layer, head_dim, n, f"sections[{i}]")
    return out


@dataclass(frozen=True)
class SectionLayout:
    """Which global rows of each fused block every rank of ``parts`` holds.

    >>> lay = SectionLayout.build("L", (8, 2, 2), parts=4, head_dim=1)
    >>> lay.table[1], lay.local_sections(1), lay.replicated
    ([(2, 4), (8, 9), (10, 11)], (2, 1, 1), (False, True, True))
    """

    sections: Tuple[int, ...]
    head_dim: Optional[int]
    table: List[List[Tuple[int, int]]]  # [rank][block] -> global (start, stop)
    replicated: Tuple[bool, ...]  # per block: some range is held by more than one rank

    @classmethod
    def build(cls, layer: str, sections: Sequence[int], parts: int, head_dim: Optional[int]) -> "SectionLayout":
        table = section_layout(sections, parts, head_dim)
        replicated = tuple(len({table[r][j] for r in range(parts)}) < parts for j in range(len(sections)))
        lay = cls(tuple(sections), head_dim, table, replicated)
        lay._check_groups(layer)
        return lay

    def _check_groups(self, layer: str) -> None:
        """Grouped-query attention: each rank's query heads must use only key/value heads it holds.

        Blocks with fewer heads than the largest block (and dividing it) are
        taken as key/value blocks of the largest ones (query blocks).
        """
        if self.head_dim is None:
            return
        heads = [n // self.head_dim for n in self.sections]
        most = max(heads)
        hd = self.head_dim
        offs = offsets_from_sizes(self.sections)
        for r, row in enumerate(self.table):
            for q in (i for i, h in enumerate(heads) if h == most):
                qa, qb = ((row[q][0] - offs[q]) // hd, (row[q][1] - offs[q]) // hd)
                for kv, h in enumerate(heads):
                    if h == most or most % h:
                        continue
                    ka, kb = ((row[kv][0] - offs[kv]) // hd, (row[kv][1] - offs[kv]) // hd)
                    need = {i * h // most for i in range(qa, qb)}
                    if not need <= set(range(ka, kb)):
                        raise ValueError(
                            f"{layer}: on {len(self.table)} ranks, rank {r} holds query heads [{qa}, {qb}) of "
                            f"block {q} ({most} heads), which use key/value heads {sorted(need)} of block {kv} "
                            f"({h} heads), but it holds [{ka}, {kb}); grouped-query attention needs a rank count "
                            f"that divides {most} and divides or is a multiple of {h}"
                        )

    def ranges(self, rank: int) -> List[Tuple[int, int]]:
        return self.table[rank]

    def local_sections(self, rank: int) -> Tuple[int, ...]:
        return tuple(b - a for a, b in self.table[rank])

    def local_total(self, rank: int) -> int:
        return sum(self.local_sections(rank))

    def spec(self, global_shape: Sequence[int], rank: int) -> ShardSpec:
        return ShardSpec.from_ranges(global_shape, 0, self.table[rank], len(self.table), rank)

    def replica_slots(self, rank: int) -> Tuple[Tuple[Tuple[int, int, int], ...], int]:
        """``(slots, buffer_rows)`` for :func:`tplayers.comm.replicas.sum_replica_grads`."""
        slots, at, local = [], 0, 0
        offs = offsets_from_sizes(self.sections)
        for j, (a, b) in enumerate(self.table[rank]):
            if self.replicated[j]:
                if b > a:
                    slots.append((local, b - a, at + a - offs[j]))
                at += self.sections[j]
            local += b - a
        return tuple(slots), at

    def gather_index(self) -> List[int]:
        """For each serial feature, its position in the rank-order concatenation of local outputs
        (the first rank holding it)."""
        where = [-1] * sum(self.sections)
        base = 0
        for row in self.table:
            local = 0
            for a, b in row:
                for f in range(a, b):
                    if where[f] < 0:
                        where[f] = base + local + f - a
                local += b - a
            base += local
        return where


def row_head_ranges(in_features: int, parts: int, rank: int, head_dim: Optional[int]) -> Tuple[int, int]:
    """``(start, stop)`` of the input features a row-parallel rank holds (whole heads with ``head_dim``)."""
    if head_dim is None:
        return shard_range(in_features, parts, rank)
    a, b = shard_range(in_features // head_dim, parts, rank)
    return a * head_dim, b * head_dim

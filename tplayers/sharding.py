"""The one shard-size convention of tplayers, and the arithmetic built on it.

Every layer, domain helper and checkpoint in tplayers splits a dimension of
length ``n`` over ``parts`` shards with :func:`shard_sizes`: balanced, the first
``n % parts`` shards get one extra element. Checkpoint indexes record the
convention by :data:`CONVENTION` so a file says how it was cut.

>>> shard_sizes(10, 4)
[3, 3, 2, 2]
>>> shard_sizes(2, 4)
[1, 1, 0, 0]
>>> shard_range(10, 4, 2)
(6, 8)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence, Tuple

import torch

__all__ = [
    "CONVENTION",
    "shard_sizes",
    "shard_range",
    "offsets_from_sizes",
    "ShardSpec",
    "section_layout",
    "head_shard_sizes",
]

#: Name under which checkpoint indexes record this convention.
CONVENTION = "balanced-first-remainder"


def _check_count(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def shard_sizes(n: int, parts: int) -> list[int]:
    """Sizes of the ``parts`` shards of a dimension of length ``n``.

    Balanced: the first ``n % parts`` shards hold ``n // parts + 1`` elements,
    the rest ``n // parts``. Shards may be empty when ``n < parts``.

    Args:
        n: the length of the dimension (>= 0).
        parts: the number of shards (>= 1).

    Returns:
        A list of ``parts`` ints summing to ``n``.

    Raises:
        TypeError: ``n`` or ``parts`` is not an int.
        ValueError: ``n < 0`` or ``parts < 1``.

    >>> shard_sizes(7, 3)
    [3, 2, 2]
    >>> shard_sizes(2, 4)
    [1, 1, 0, 0]
    """
    _check_count("n", n, 0)
    _check_count("parts", parts, 1)
    base, extra = divmod(n, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def shard_range(n: int, parts: int, index: int) -> Tuple[int, int]:
    """``(start, stop)`` of shard ``index`` of a dimension of length ``n`` (:func:`shard_sizes`' cut).

    Args:
        n: the length of the dimension (>= 0).
        parts: the number of shards (>= 1).
        index: which shard, ``0 <= index < parts``.

    Returns:
        ``(start, stop)``, the half-open global range the shard holds.

    Raises:
        TypeError: an argument is not an int.
        ValueError: a negative ``n`` or ``index``, ``parts < 1`` or ``index >= parts``.

    >>> shard_range(7, 3, 1)
    (3, 5)
    >>> [shard_range(10, 4, i) for i in range(4)]
    [(0, 3), (3, 6), (6, 8), (8, 10)]
    """
    _check_count("parts", parts, 1)
    _check_count("index", index, 0)
    if index >= parts:
        raise ValueError(f"index must be < parts={parts}, got {index}")
    _check_count("n", n, 0)
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def offsets_from_sizes(sizes: Sequence[int]) -> list[int]:
    """Start offsets of consecutive shards of the given sizes (any partition).

    >>> offsets_from_sizes([3, 0, 2])
    [0, 3, 3]
    """
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += int(s)
    return out


@dataclass(frozen=True)
class ShardSpec:
    """How one tensor of a parallel layer is laid out across a mesh axis, as data.

    ``global_shape`` is the serial (single-device) shape. ``dim`` is the sharded
    dimension, or ``None`` when every rank holds the whole tensor (replicated).
    This rank holds ``[start, stop)`` of ``dim``; ``index`` of ``parts`` shards.
    Layers use it to copy their slice in ``from_module``; checkpoints use it to
    save and reshard. One source of truth for both.

    A *multi-range* spec (fused layers: each block of a fused q,k,v sharded on
    its own) holds several global ranges of ``dim``, ``ranges``; the local
    tensor is their concatenation in that order, and ``start``/``stop`` are the
    hull of the ranges. Ranges of different ranks may coincide (a block
    replicated over a group of ranks, e.g. GQA key/value heads). Code that
    places local data in the global tensor iterates :attr:`spans`.

    Build one with :meth:`balanced` (the :func:`shard_sizes` cut), :meth:`replicated` or
    :meth:`from_ranges`; every parallel layer's ``shard_specs()`` returns them.

    Args:
        global_shape: the serial shape.
        dim: the sharded dim, or ``None`` (replicated).
        start, stop: the hull of the global range of ``dim`` this rank holds.
        parts, index: the number of shards and this one's index.
        ranges: the global ranges of a multi-range spec (``()`` for one range).

    Raises:
        ValueError: (:meth:`from_ranges`) a range outside ``dim``; (:meth:`take`) a full
            tensor whose shape is not ``global_shape``.

    >>> spec = ShardSpec.balanced((10, 4), dim=0, parts=4, index=1)
    >>> (spec.start, spec.stop, spec.local_shape)
    (3, 6, (3, 4))
    >>> fused = ShardSpec.from_ranges((12, 4), 0, [(0, 2), (4, 6), (8, 10)], parts=2, index=0)
    >>> (fused.spans, fused.local_shape, fused.local_offsets)
    (((0, 2), (4, 6), (8, 10)), (6, 4), (0, 2, 4))
    """

    global_shape: Tuple[int, ...]
    dim: Optional[int]
    start: int
    stop: int
    parts: int
    index: int
    ranges: Tuple[Tuple[int, int], ...] = ()

    @classmethod
    def balanced(cls, global_shape: Sequence[int], dim: Optional[int], parts: int, index: int) -> "ShardSpec":
        shape = tuple(int(s) for s in global_shape)
        if dim is None:
            return cls(shape, None, 0, 0, parts, index)
        start, stop = shard_range(shape[dim], parts, index)
        return cls(shape, dim, start, stop, parts, index)

    @classmethod
    def replicated(cls, global_shape: Sequence[int]) -> "ShardSpec":
        return cls(tuple(int(s) for s in global_shape), None, 0, 0, 1, 0)

    @classmethod
    def from_ranges(
        cls, global_shape: Sequence[int], dim: int, ranges: Sequence[Tuple[int, int]], parts: int, index: int
    ) -> "ShardSpec":
        """This rank holds the concatenation of the global ``ranges`` of ``dim`` (empty ones dropped)."""
        shape = tuple(int(s) for s in global_shape)
        kept = tuple((int(a), int(b)) for a, b in ranges if b > a)
        for a, b in kept:
            if not 0 <= a < b <= shape[dim]:
                raise ValueError(f"range [{a}, {b}) is outside dim {dim} of length {shape[dim]}")
        if len(kept) <= 1:  # one range (or none): the ordinary single-range form
            a, b = kept[0] if kept else (0, 0)
            return cls(shape, dim, a, b, parts, index)
        return cls(shape, dim, min(a for a, _ in kept), max(b for _, b in kept), parts, index, kept)

    @property
    def is_replicated(self) -> bool:
        return self.dim is None

    @property
    def spans(self) -> Tuple[Tuple[int, int], ...]:
        """The global ranges of ``dim`` this rank holds, in local order (``()`` if none or replicated)."""
        if self.dim is None:
            return ()
        if self.ranges:
            return self.ranges
        return ((self.start, self.stop),) if self.stop > self.start else ()

    @property
    def local_offsets(self) -> Tuple[int, ...]:
        """Where each of :attr:`spans` starts in the local tensor."""
        return tuple(offsets_from_sizes([b - a for a, b in self.spans]))

    @property
    def local_shape(self) -> Tuple[int, ...]:
        if self.dim is None:
            return self.global_shape
        shape = list(self.global_shape)
        shape[self.dim] = sum(b - a for a, b in self.spans)
        return tuple(shape)

    def for_index(self, index: int) -> "ShardSpec":
        """The spec of shard ``index`` of the same tensor (what rank ``index`` holds).

        >>> ShardSpec.balanced((10, 4), dim=0, parts=4, index=1).for_index(3).start
        8
        """
        if self.dim is None:
            return ShardSpec(self.global_shape, None, 0, 0, self.parts, index)
        return ShardSpec.balanced(self.global_shape, self.dim, self.parts, index)

    def transposed(self) -> "ShardSpec":
        """The same layout for the transpose of a 2-D tensor (the sharded dim follows its axis).

        A tensor-parallel linear stored ``(in, out)`` like transformers' ``Conv1D`` shards dim 1
        where an ``nn.Linear``'s ``(out, in)`` weight shards dim 0, with the same ranges.

        >>> ShardSpec.balanced((10, 4), dim=0, parts=4, index=1).transposed()
        ShardSpec(global_shape=(4, 10), dim=1, start=3, stop=6, parts=4, index=1, ranges=())
        """
        if len(self.global_shape) != 2:
            raise ValueError(f"transposed() needs a 2-D tensor, got global shape {self.global_shape}")
        dim = None if self.dim is None else 1 - self.dim
        return replace(self, global_shape=self.global_shape[::-1], dim=dim)

    def take(self, full):
        """This rank's slice of the full (serial-layout) tensor ``full`` (a copy when multi-range)."""
        if tuple(full.shape) != self.global_shape:
            raise ValueError(f"expected a tensor of global shape {self.global_shape}, got {tuple(full.shape)}")
        if self.dim is None:
            return full
        if not self.ranges:
            return full.narrow(self.dim, self.start, self.stop - self.start)
        return torch.cat([full.narrow(self.dim, a, b - a) for a, b in self.ranges], self.dim)


def head_shard_sizes(heads: int, parts: int, head_dim: int) -> list[int]:
    """Feature sizes when ``heads`` whole heads of ``head_dim`` features are split balanced.

    >>> head_shard_sizes(3, 2, 4)
    [8, 4]
    """
    return [n * head_dim for n in shard_sizes(heads, parts)]


def section_layout(sections: Sequence[int], parts: int, head_dim: Optional[int] = None) -> list[list[Tuple[int, int]]]:
    """Global ``(start, stop)`` of each fused block held by each rank: ``table[rank][block]``.

    The feature dim is the concatenation of blocks of sizes ``sections`` (e.g.
    a fused q, k, v); each block is sharded on its own. Without ``head_dim``
    each block is split with :func:`shard_range`. With ``head_dim`` every
    block is a whole number of heads, split into whole heads (balanced; ranks
    beyond the head count hold none), except a key/value block with fewer heads
    than ranks: it is replicated in groups, rank ``r`` holding head
    ``r * h // parts`` (Megatron / vLLM GQA). A key/value block is one with
    fewer heads than the layer's largest block, or the only block of a layer
    (a separate ``k_proj`` / ``v_proj``).

    >>> section_layout([4, 4], 2)
    [[(0, 2), (4, 6)], [(2, 4), (6, 8)]]
    >>> section_layout([8, 2, 2], 4, head_dim=1)[1]   # 8 query heads, 2 kv heads: kv head 0 on ranks 0, 1
    [(2, 4), (8, 9), (10, 11)]
    """
    _check_count("parts", parts, 1)
    offsets = offsets_from_sizes(sections)
    most = max(sections)
    table = []
    for r in range(parts):
        row = []
        for off, n in zip(offsets, sections):
            if head_dim is None:
                a, b = shard_range(n, parts, r)
            else:
                heads = n // head_dim
                kv = len(sections) == 1 or n < most
                if heads >= parts or not kv:
                    a, b = shard_range(heads, parts, r)
                else:
                    a = r * heads // parts
                    b = a + 1
                a, b = a * head_dim, b * head_dim
            row.append((off + a, off + b))
        table.append(row)
    return table

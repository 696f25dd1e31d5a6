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

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

__all__ = [
    "CONVENTION",
    "shard_sizes",
    "shard_range",
    "offsets_from_sizes",
    "ShardSpec",
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

    >>> shard_sizes(7, 3)
    [3, 2, 2]
    """
    _check_count("n", n, 0)
    _check_count("parts", parts, 1)
    base, extra = divmod(n, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def shard_range(n: int, parts: int, index: int) -> Tuple[int, int]:
    """``(start, stop)`` of shard ``index`` of a dimension of length ``n``.

    >>> shard_range(7, 3, 1)
    (3, 5)
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

    >>> spec = ShardSpec.balanced((10, 4), dim=0, parts=4, index=1)
    >>> (spec.start, spec.stop, spec.local_shape)
    (3, 6, (3, 4))
    """

    global_shape: Tuple[int, ...]
    dim: Optional[int]
    start: int
    stop: int
    parts: int
    index: int

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

    @property
    def is_replicated(self) -> bool:
        return self.dim is None

    @property
    def local_shape(self) -> Tuple[int, ...]:
        if self.dim is None:
            return self.global_shape
        shape = list(self.global_shape)
        shape[self.dim] = self.stop - self.start
        return tuple(shape)

    def for_index(self, index: int) -> "ShardSpec":
        """The spec of shard ``index`` of the same tensor (what rank ``index`` holds).

        >>> ShardSpec.balanced((10, 4), dim=0, parts=4, index=1).for_index(3).start
        8
        """
        if self.dim is None:
            return ShardSpec(self.global_shape, None, 0, 0, self.parts, index)
        return ShardSpec.balanced(self.global_shape, self.dim, self.parts, index)

    def take(self, full):
        """This rank's slice of the full (serial-layout) tensor ``full``."""
        if tuple(full.shape) != self.global_shape:
            raise ValueError(
                f"expected a tensor of global shape {self.global_shape}, got {tuple(full.shape)}"
            )
        if self.dim is None:
            return full
        return full.narrow(self.dim, self.start, self.stop - self.start)

"""Who holds what: a model's tensors as sharding data, agreed across ranks, and who writes which piece.

Every parameter and persistent buffer of ``model.state_dict()`` gets a
:class:`~tplayers.ShardSpec`: the one its :class:`~tplayers.layers.ShardedModule`
reports through ``shard_specs()``, or a replicated spec for everything else
(norms, embeddings, the tensors of domain-parallel layers). Nothing here knows
any layer type: sharding comes only from ``shard_specs()``.

Writers: each distinct non-empty range of a sharded tensor is written by the
lowest rank holding it (replicas along another mesh axis write nothing).
Replicated tensors are written once, spread over the ranks largest first onto
the least-loaded rank, so no rank writes every norm and embedding alone. This
assumes replicated tensors are identical on every rank, which tplayers layers
keep (their gradients are reduced over the group).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from tplayers.checkpoint.blocks import byte_view
from tplayers.checkpoint.format import CheckpointError, dtype_name, itemsize
from tplayers.checkpoint.wrapped import Staging, staged_target, unwrap
from tplayers.comm import record_collective
from tplayers.layers._common import ShardedModule
from tplayers.sharding import ShardSpec


@dataclass(frozen=True)
class LocalTensor:
    """One ``state_dict`` entry of this rank: the live tensor and how it is sharded."""

    key: str
    tensor: torch.Tensor
    spec: ShardSpec


def local_tensors(model: nn.Module, staging: Optional[Staging] = None) -> Dict[str, LocalTensor]:
    """``{state_dict key: LocalTensor}`` of ``model`` (the live parameters and buffers).

    Wrappers are looked through (:mod:`tplayers.checkpoint.wrapped`): DDP and
    ``torch.compile`` add no key prefix, and an FSDP2 ``DTensor`` counts as the
    tensor it shards: all-gathered over its dp mesh for a save (a collective),
    or, with ``staging`` (a load), a buffer that ``staging.finish()`` copies into it.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    model = unwrap(model)
    specs: Dict[str, ShardSpec] = {}
    for prefix, mod in model.named_modules(remove_duplicate=False):
        if isinstance(mod, ShardedModule):
            for name, spec in mod.shard_specs().items():
                specs[f"{prefix}.{name}" if prefix else name] = spec
    out = {}
    for key, t in model.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor):
            continue  # a model's own non-tensor entry (neuraloperator's ``_metadata``: its constructor arguments)
        spec = specs.get(key) or ShardSpec.replicated(t.shape)
        t = staged_target(t, staging)
        if tuple(t.shape) != spec.local_shape:
            raise ValueError(
                f"{key}: shard_specs() says this rank holds {spec.local_shape} of {spec.global_shape}, "
                f"but the tensor is {tuple(t.shape)}"
            )
        out[key] = LocalTensor(key, t, spec)
    return out


def real_views(local: Dict[str, LocalTensor]) -> Dict[str, LocalTensor]:
    """``local`` with every complex128 tensor replaced by its float64 real view (a trailing dim of 2:
    real, imaginary part), sharing memory with it: safetensors has ``C64`` (complex64, stored as it is)
    but no complex128 dtype, so such a tensor is stored, gathered and loaded as this view. The shard
    dim and ranges are unchanged (the new dim is last); a reader of the files sees ``F64`` of shape
    ``(*shape, 2)`` (``torch.view_as_complex`` restores it)."""
    out = {}
    for key, lt in local.items():
        if lt.tensor.dtype == torch.complex128:
            spec = replace(lt.spec, global_shape=tuple(lt.spec.global_shape) + (2,))
            lt = LocalTensor(key, torch.view_as_real(lt.tensor.detach()), spec)
        out[key] = lt
    return out


def stored(t: torch.Tensor) -> torch.Tensor:
    """A piece as it is stored (its natural layout) and as ``write_file`` takes it: on the CPU.

    On the CPU this is the tensor itself, detached (``write_file`` stages a
    non-contiguous one through a reused buffer); a device tensor is made
    contiguous on its device and copied to the host.
    """
    t = t.detach()
    return t if t.device.type == "cpu" else t.contiguous().to("cpu")


# ----------------------------------------------------------------------------
# Rank agreement (small JSON payloads over the default group; no pickle)
# ----------------------------------------------------------------------------


def world_info() -> Tuple[int, int]:
    """``(rank, world size)`` of the default group, or ``(0, 1)`` without torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


#: Payloads up to this many bytes travel in a single all-gather (a load's agreement, most saves').
_INLINE_BYTES = 248


def allgather_bytes(data: bytes) -> List[bytes]:
    """Every rank's ``data``, in rank order.

    One all-gather of fixed ``8 + _INLINE_BYTES``-byte records (length, then the
    bytes when they fit); a second all-gather of the padded payloads only when
    some rank's data is longer.
    """
    rank, world = world_info()
    if world == 1:
        return [data]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    rec = torch.zeros(8 + _INLINE_BYTES, dtype=torch.uint8)
    rec[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
    if data and len(data) <= _INLINE_BYTES:
        rec[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    rec = rec.to(device)
    recs = [torch.empty_like(rec) for _ in range(world)]
    record_collective("all_gather", rec.numel() * world, world, "checkpoint")
    dist.all_gather(recs, rec)
    recs = [r.cpu() for r in recs]
    sizes = [int(r[:8].view(torch.int64).item()) for r in recs]
    if max(sizes) <= _INLINE_BYTES:
        return [bytes(byte_view(r[8 : 8 + n].contiguous())) for r, n in zip(recs, sizes)]
    buf = torch.zeros(max(sizes), dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
    buf = buf.to(device)
    outs = [torch.empty_like(buf) for _ in range(world)]
    record_collective("all_gather", buf.numel() * world, world, "checkpoint")
    dist.all_gather(outs, buf)
    return [bytes(byte_view(o[:s].cpu().contiguous())) for o, s in zip(outs, sizes)]


def allgather_json(obj) -> list:
    return [json.loads(b) for b in allgather_bytes(json.dumps(obj).encode())]


def agree(error: Optional[str], payload=None) -> list:
    """Collective: raise :class:`CheckpointError` on every rank if ``error`` is set on any rank.

    Otherwise returns every rank's JSON-able ``payload``, in rank order.
    """
    rows = allgather_json([error, payload])
    bad = [(r, e) for r, (e, _) in enumerate(rows) if e]
    if bad:
        lines = "\n".join(f"  rank {r}: {e}" for r, e in bad)
        raise CheckpointError(f"checkpoint failed on {len(bad)} of {len(rows)} rank(s), nothing was changed:\n{lines}")
    return [p for _, p in rows]


# ----------------------------------------------------------------------------
# Global layout from every rank's specs
# ----------------------------------------------------------------------------


@dataclass
class GlobalTensor:
    """A tensor of the whole model: global shape, dtype, shard dim and each range's writer."""

    shape: Tuple[int, ...]
    dtype: str
    dim: Optional[int]
    #: (start, stop, rank, stored name) per piece; one (0, 0, rank, key) when replicated. The
    #: stored name is the key, or ``key[start:stop]`` when the rank writes several pieces of it
    #: (a fused layer's blocks).
    owners: List[Tuple[int, int, int, str]]

    @property
    def nbytes(self) -> int:
        n = itemsize(self.dtype)
        for s in self.shape:
            n *= s
        return n


def describe(local: Dict[str, LocalTensor]) -> list:
    """This rank's layout as JSON-able rows ``[key, global shape, dtype, dim, spans]``; ``spans``
    lists the ``[start, stop)`` ranges of ``dim`` this rank holds, in local order."""
    return [
        [k, list(v.spec.global_shape), dtype_name(v.tensor.dtype), v.spec.dim, [list(r) for r in v.spec.spans]]
        for k, v in sorted(local.items())
    ]


def local_piece(spec: ShardSpec, start: int, stop: int) -> Tuple[int, int]:
    """``(offset, length)`` in the local tensor of the global range ``[start, stop)`` of one of ``spec.spans``."""
    for (a, b), off in zip(spec.spans, spec.local_offsets):
        if a <= start and stop <= b:
            return off + start - a, stop - start
    raise AssertionError(f"[{start}, {stop}) is not inside one of this rank's ranges {spec.spans}")


def plan_layout(per_rank: Sequence[list]) -> Tuple[Dict[str, GlobalTensor], List[List[str]]]:
    """Check that the ranks' layouts fit together and choose a writer for every piece.

    ``per_rank[r]`` is rank ``r``'s :func:`describe`. Returns the global tensors
    and, per rank, the pieces it writes as ``(key, start, stop, stored name)``.
    Ranges of different ranks are identical (replicas) or disjoint; together
    they tile the dim. Deterministic: every rank computes the same answer from
    the same input, so errors are raised on every rank alike.
    """
    world = len(per_rank)
    rows = [{row[0]: row for row in rank_rows} for rank_rows in per_rank]
    keys = sorted(rows[0])
    for r in range(1, world):
        if set(rows[r]) != set(rows[0]):
            extra, lacking = sorted(set(rows[r]) - set(rows[0])), sorted(set(rows[0]) - set(rows[r]))
            raise CheckpointError(f"rank {r}'s model differs from rank 0's: extra keys {extra}, missing keys {lacking}")
    tensors: Dict[str, GlobalTensor] = {}
    load = [0] * world
    replicated = []
    for key in keys:
        _, shape, dtype, dim, _ = rows[0][key]
        for r in range(world):
            _, s2, t2, d2, _ = rows[r][key]
            if (s2, t2, d2) != (shape, dtype, dim):
                raise CheckpointError(
                    f"{key}: rank {r} has global shape {s2}, dtype {t2}, shard dim {d2}; rank 0 has {shape}, {dtype}, {dim}"
                )
        g = GlobalTensor(tuple(shape), dtype, dim, [])
        tensors[key] = g
        if dim is None:
            replicated.append(key)
            continue
        first: Dict[Tuple[int, int], int] = {}
        for r in range(world):
            for start, stop in rows[r][key][4]:
                if stop > start:
                    first.setdefault((start, stop), r)
        check_tiling(key, shape[dim], sorted(first), lambda rng: f"rank {first[rng]}")
        per_writer = [r for r in first.values()]
        g.owners = [
            (s, e, r, key if per_writer.count(r) == 1 else f"{key}[{s}:{e}]") for (s, e), r in sorted(first.items())
        ]
        row_bytes = g.nbytes // max(shape[dim], 1)
        for s, e, r, _ in g.owners:
            load[r] += (e - s) * row_bytes
    for key in sorted(replicated, key=lambda k: (-tensors[k].nbytes, k)):
        r = min(range(world), key=lambda i: (load[i], i))
        tensors[key].owners = [(0, 0, r, key)]
        load[r] += tensors[key].nbytes
    writes: List[List[Tuple[str, int, int, str]]] = [[] for _ in range(world)]
    for key in keys:
        for start, stop, r, name in tensors[key].owners:
            writes[r].append((key, start, stop, name))
    return tensors, writes


def check_tiling(key: str, n: int, ranges: Sequence[Tuple[int, int]], who) -> None:
    """Raise unless the sorted non-empty ``ranges`` tile ``[0, n)`` exactly (no gap, no overlap)."""
    expect = 0
    for rng in ranges:
        start, stop = rng
        if start < expect:
            raise CheckpointError(
                f"{key}: shard [{start}, {stop}) from {who(rng)} overlaps the previous one (ends at {expect})"
            )
        if start > expect:
            raise CheckpointError(
                f"{key}: elements [{expect}, {start}) of dim length {n} are held by no shard (gap before {who(rng)})"
            )
        expect = stop
    if expect != n:
        raise CheckpointError(f"{key}: shards cover [0, {expect}) of a dim of length {n}")

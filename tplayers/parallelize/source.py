"""``parallelize_module(..., src_rank=r)``: every parameter and buffer of the result from rank r.

Plan: before anything is swapped, record the serial model's tensors by dotted name. After the
swap, every tensor of the result is either

- a shard (a :class:`~tplayers.layers.ShardedModule` tensor whose spec has a sharded dim):
  rank ``r`` cuts every rank's slice from *its* serial tensor and scatters them, or
- anything else (replicated twins' tensors, norms, embeddings, buffers, untouched modules):
  broadcast from rank ``r``.

Grouped by dtype and flattened: one scatter and one broadcast per dtype for the whole model.
Values are copied into the model only after every transfer completed.

Modules matched by a partition function are different: a function may build its layer from a
transformed copy (regrouped rows, a new layout), whose shard specs do not describe rows of the
serial tensor. So :func:`partition_inputs` first gives every rank a copy of rank ``r``'s serial
module (one agreement exchange, one broadcast per dtype, rank ``r``'s CPU generator state too)
and the function runs on that copy on every rank, under that generator state: what it builds is
rank ``r``'s model by construction, and its output is never re-cut (``exclude`` below).
"""

from __future__ import annotations

import copy
import zlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tplayers.comm.agree import exchange_agreed
from tplayers.comm.collectives import exchange_grid_table
from tplayers.comm.source import broadcast_flat, mesh_index, scatter_flat
from tplayers.layers._common import ShardedModule
from tplayers.sharding import ShardSpec

__all__ = ["serial_tensors", "SourcePlan", "plan_from_source", "structure_digest", "check_src_rank", "partition_inputs"]


def serial_tensors(model: nn.Module) -> Dict[str, torch.Tensor]:
    """``{dotted name: tensor}`` for every parameter and buffer, aliases (ties) included."""
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    return named


def structure_digest(model: nn.Module) -> str:
    """Names, shapes and dtypes of every tensor, as a short string every rank's model must match."""
    return _digest([(k, tuple(t.shape), str(t.dtype)) for k, t in serial_tensors(model).items()])


def _digest(rows) -> str:
    return f"{len(rows)} tensors, crc32 {zlib.crc32(repr(rows).encode()):08x}"


@dataclass
class SourcePlan:
    """What :func:`plan_from_source` found: the tensors to scatter and to broadcast."""

    sharded: List[Tuple[str, torch.Tensor, ShardSpec]]  # (serial name, local tensor, spec): scattered
    replicated: List[Tuple[str, torch.Tensor]]  # broadcast
    # Shards whose other ranks' layouts ``spec.for_index`` cannot rebuild (a layout other than the
    # balanced one, e.g. one that regroups rows): the full serial tensor is broadcast and each rank
    # takes its own slice. More bytes than a scatter, exact for any layout ``take`` describes.
    sliced: List[Tuple[str, torch.Tensor, ShardSpec]] = field(default_factory=list)

    def digest(self) -> str:
        """Names, global shapes, shard dims and dtypes of the parallelized model's tensors."""
        rows = [(k, spec.global_shape, spec.dim, str(t.dtype)) for k, t, spec in self.sharded + self.sliced]
        return _digest(sorted(rows + [(k, tuple(t.shape), None, str(t.dtype)) for k, t in self.replicated]))

    def agree_layouts(self, mesh: DeviceMesh) -> None:
        """Make every rank take the same path per tensor: a shard is sliced from a broadcast if
        any rank's layout is not rebuildable by ``for_index`` (one small all-gather of a flag per
        shard; only called when some rank has such a layout)."""
        shards = sorted(self.sharded + self.sliced, key=lambda e: e[0])
        flags = [int(any(e is x for x in self.sliced)) for e in shards]
        table = exchange_grid_table(flags, [mesh.get_group(0)], "src_rank.layouts")
        anyone = [any(line[0][i] for line in table) for i in range(len(shards))]
        self.sharded = [e for e, f in zip(shards, anyone) if not f]
        self.sliced = [e for e, f in zip(shards, anyone) if f]

    def run(self, serial: Dict[str, torch.Tensor], mesh: DeviceMesh, src: int) -> None:
        """Move rank ``src``'s values into this rank's tensors (collective)."""
        me_is_src = mesh_index(mesh) == src
        sent = [t for _, t in self.replicated] + [serial[name] for name, _, _ in self.sliced]
        got = broadcast_flat(sent, mesh, src, "src_rank")
        new_rep, full_sliced = got[: len(self.replicated)], got[len(self.replicated) :]
        new_shard: List[torch.Tensor] = []
        if self.sharded:
            world = mesh.size(0)
            specs = [[spec.for_index(r) for _, _, spec in self.sharded] for r in range(world)]
            shapes = [[s.local_shape for s in row] for row in specs]
            pieces = None
            if me_is_src:
                pieces = [
                    [s.take(serial[name]).to(t.dtype) for (name, t, _), s in zip(self.sharded, row)] for row in specs
                ]
            new_shard = scatter_flat(pieces, shapes, [t for _, t, _ in self.sharded], mesh, src, "src_rank")
        with torch.no_grad():  # every transfer done: now write (a failure above changed nothing)
            for (_, t), v in zip(self.replicated, new_rep):
                t.copy_(v)
            for (_, t, _), v in zip(self.sharded, new_shard):
                t.copy_(v)
            for (_, t, spec), full in zip(self.sliced, full_sliced):
                t.copy_(spec.take(full))


def plan_from_source(
    result: nn.Module, serial: Dict[str, torch.Tensor], mesh: DeviceMesh, exclude: frozenset = frozenset()
) -> SourcePlan:
    """Classify every tensor of the swapped model ``result``; raise ``ValueError`` if one cannot
    be sourced (a meta tensor, a shard with no serial tensor of that name, a shard laid out over
    another mesh). ``exclude``: ids of tensors already rank ``src``'s by construction (what
    partition functions built from :func:`partition_inputs`), left as they are. Runs before
    any communication."""
    specs: Dict[str, ShardSpec] = {}
    for prefix, mod in result.named_modules(remove_duplicate=False):
        if isinstance(mod, ShardedModule):
            for name, spec in mod.shard_specs().items():
                specs[f"{prefix}.{name}" if prefix else name] = spec
    seen = set(exclude)
    sharded, replicated, sliced = [], [], []
    for key, t in serial_tensors(result).items():
        if id(t) in seen:  # a tied tensor moves once
            continue
        seen.add(id(t))
        if t.device.type == "meta":
            raise ValueError(
                f"src_rank: {key} is on the meta device and holds no values to send; "
                "materialise the model first, or pass src_rank=None"
            )
        spec = specs.get(key)
        if spec is None or spec.is_replicated:
            replicated.append((key, t))
            continue
        if mesh.ndim != 1 or spec.parts != mesh.size(0) or spec.index != mesh.get_local_rank(0):
            raise ValueError(
                f"src_rank: {key} is shard {spec.index} of {spec.parts}, but parallelize_module's "
                f"mesh is {tuple(mesh.shape)} with this rank at {mesh_index(mesh)}; shard over that mesh"
            )
        full = serial.get(key)
        if full is None or tuple(full.shape) != spec.global_shape:
            got = "no such tensor" if full is None else f"shape {tuple(full.shape)}"
            raise ValueError(
                f"src_rank: shard {key} of global shape {spec.global_shape} has no serial tensor "
                f"of that name and shape in the model before the plan ({got})"
            )
        (sharded if spec.for_index(spec.index) == spec else sliced).append((key, t, spec))
    return SourcePlan(sharded, replicated, sliced)


def check_src_rank(src_rank: Optional[int], mesh: DeviceMesh) -> None:
    """``TypeError``/``ValueError`` unless ``src_rank`` is ``None`` or an index into ``mesh``."""
    if src_rank is None:
        return
    if isinstance(src_rank, bool) or not isinstance(src_rank, int):
        raise TypeError(f"src_rank must be an int or None, got {type(src_rank).__name__}")
    if not 0 <= src_rank < mesh.size():
        raise ValueError(f"src_rank must be in [0, {mesh.size()}) (an index into the mesh), got {src_rank}")


def partition_inputs(matches, mesh: DeviceMesh, src: int, model_digest: str):
    """Rank ``src``'s serial module of every partition-function match, on every rank.

    Returns ``({id(match): copy of its module holding rank src's values}, rank src's CPU generator
    state)``. Collective: one agreement exchange (same model structure, same matches, same
    ``src``; a rank's local failure raises on every rank), then one broadcast per dtype. The
    model itself is not touched (the copies are what the functions get).
    """
    copies, error = {}, None
    try:
        for m in matches:
            copies[id(m)] = copy.deepcopy(m.module)
            for key, t in serial_tensors(copies[id(m)]).items():
                if t.device.type == "meta":
                    raise ValueError(
                        f"src_rank: {m.name}.{key} is on the meta device and holds no values to send "
                        "to the partition function; materialise the model first, or pass src_rank=None"
                    )
    except Exception as err:  # noqa: BLE001 - travels to every rank in the exchange, then re-raised
        error = err
    config = {"model tensors": model_digest, "partition-function modules": [m.name for m in matches], "src_rank": src}
    groups = [mesh.get_group(d) for d in range(mesh.ndim)]
    exchange_agreed([], config, groups, "parallelize_module", "src_rank.partition", error=error)
    targets, seen = [], set()
    for module in copies.values():
        for t in serial_tensors(module).values():
            if id(t) not in seen:
                seen.add(id(t))
                targets.append(t)
    rng = torch.get_rng_state().to(mesh.device_type)  # travels on the mesh's device (nccl: cuda)
    got = broadcast_flat(targets + [rng], mesh, src, "src_rank.partition")
    with torch.no_grad():
        for t, v in zip(targets, got):
            t.copy_(v)
    return copies, got[-1].cpu().clone()

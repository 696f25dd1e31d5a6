"""Neighborhood attention (NATTEN semantics), 1-D, 2-D and 3-D, single-device or domain-parallel.

``NeighborhoodAttention`` maps ``(B, H, W, C)`` to ``(B, H, W, C)``: a per-pixel ``qkv`` linear,
:func:`tplayers.na2d` attention over each pixel's ``kH x kW`` neighborhood (optionally with a
learnable relative-position bias), and a per-pixel ``proj`` linear. ``NeighborhoodAttention1d``
(``(B, L, C)``) and ``NeighborhoodAttention3d`` (``(B, D, H, W, C)``) are the same layer over one
and three spatial dims (``tplayers.na1d`` / ``na3d``). With ``shard_dims`` the input is this rank's
slice of the image along any one or two spatial dims (2-D: H ``(1,)``, W ``(2,)`` or both
``(1, 2)`` over a 2-D mesh; 3-D: e.g. D ``(1,)`` or D and H ``(1, 2)``):

* queries stay local; only the K and V halos travel (the window core's N-d halo exchange,
  :func:`tplayers.domain.window.gather_windows`), with per-rank asymmetric widths from global
  positions (:func:`tplayers.ops.na_layout.axis_plans`);
* the window rule uses global positions, so the result equals the single-device module on the
  gathered input, for any partition whose shards can supply their neighbours' halos (else
  ``ValueError`` on every rank, before any halo traffic);
* parameters are replicated and enter through :func:`~tplayers.comm.copy_many_to_parallel_region`
  (identity forward, one fused all-reduce of their gradients per mesh dim in backward), so every
  rank holds the serial model's parameter gradients.

Local shapes are exchanged (a small all-gather) as :mod:`tplayers.layers._domain`
says: cached per local shape inside a ``DomainParallel`` region call and under
``torch.compile``, on every call elsewhere (a partition that changes on some
ranks only is re-planned on every rank); the first also compares the parameters.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tplayers.comm import copy_many_to_parallel_region
from tplayers.domain.window import gather_windows
from tplayers.layers._common import ShardedModule
from tplayers.layers._na_layout import NALayout, _Layout
from tplayers.ops.na import AXIS_NAMES, check_window_fits, neighborhood_attention, normalize_window_args
from tplayers.ops.na_tile import INSTALL_HINT, natten_applies, natten_fused, natten_module, tile_attention
from tplayers.sharding import ShardSpec

__all__ = ["NeighborhoodAttention", "NeighborhoodAttention1d", "NeighborhoodAttention3d"]


class NeighborhoodAttention(NALayout, ShardedModule):
    """2-D neighborhood attention layer, ``(B, H, W, C) -> (B, H, W, C)``, NATTEN semantics.

    Parameters (all replicated): ``qkv`` (``nn.Linear(C, 3C)``), ``proj`` (``nn.Linear(C, C)``), with
    ``rel_pos_bias`` ``rpb`` ``(heads, 2kH - 1, 2kW - 1)``, added at ``(key - query) / dilation + k - 1``.

    Args:
        embed_dim, num_heads: ``C`` and the heads (``num_heads`` divides ``C``).
        kernel_size, dilation, is_causal, stride: the window (:func:`tplayers.na2d`), int or per dim;
            ``stride``: queries in a stride group share their leader's window (``<= kernel_size``).
        qkv_bias, qk_scale, proj_drop, rel_pos_bias: as NATTEN's module (no bias with stride > 1).
        local_backend: ``"auto"``: NATTEN's fused kernels on CUDA when natten is installed with
            them (``natten.HAS_LIBNATTEN``) and the call fits them (no ``rel_pos_bias``, kernels
            >= 2), else the tplayers kernels (on CUDA compiled ``flex_attention``); ``"natten"``
            requires natten; ``"tplayers"``; ``"tile"``: natten's tile path, tplayers kernel inside.
        mesh, shard_dims: ``shard_dims=None`` is single-device; ``(1,)`` / ``(2,)`` shard H / W over a
            1-D mesh, ``(1, 2)`` both over a 2-D mesh (input and output are then local slices).
        device, dtype: of the parameters.

    Returns:
        ``forward(x)``: ``(B, H, W, C)`` (this rank's slice when sharded), the single-device result.

    Raises:
        ValueError: bad sizes or window arguments; in ``forward``, an input that does not fit, or
            (on every rank, before any halo traffic) a partition that cannot supply the halos.
        ImportError: ``local_backend="natten"`` without natten, at the first forward.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import torch, tplayers
        mesh = tplayers.init_mesh()
        torch.manual_seed(0)
        serial = tplayers.NeighborhoodAttention(32, 4, kernel_size=5, rel_pos_bias=True)   # single device
        layer = tplayers.NeighborhoodAttention.from_module(serial, mesh=mesh, shard_dims=(1,))   # H sharded
        x = torch.randn(2, 12, 10, 32)
        y = tplayers.gather(layer(tplayers.shard(x, 1, mesh)), 1, mesh)
        torch.testing.assert_close(y, serial(x))
    """

    #: spatial dims of the input ``(B, *spatial, C)``
    spatial_rank = 2

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        kernel_size,
        dilation=1,
        is_causal=False,
        qkv_bias: bool = True,
        qk_scale: Optional[float] = None,
        proj_drop: float = 0.0,
        rel_pos_bias: bool = False,
        *,
        stride=1,
        local_backend: str = "auto",
        mesh: Optional[DeviceMesh] = None,
        shard_dims: Optional[Sequence[int]] = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        name, rank = type(self).__name__, self.spatial_rank
        for arg, value in (("embed_dim", embed_dim), ("num_heads", num_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: {arg} must be a positive int, got {value!r}")
        if embed_dim % num_heads:
            raise ValueError(f"{name}: embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        self.kernel_size, self.stride, self.dilation, self.is_causal = normalize_window_args(
            rank, kernel_size, stride, dilation, is_causal
        )
        if rel_pos_bias and any(s != 1 for s in self.stride):
            raise ValueError(f"{name}: rel_pos_bias needs stride 1 along every dim, got stride {self.stride}")
        if local_backend not in ("auto", "natten", "tplayers", "tile"):
            raise ValueError(
                f"{name}: local_backend must be 'auto', 'natten', 'tplayers' or 'tile', got {local_backend!r}"
            )
        if local_backend in ("natten", "tile") and (rel_pos_bias or min(self.kernel_size) < 2):
            raise ValueError(
                f"{name}: local_backend={local_backend!r} runs natten's whole-image kernels, which "
                f"need no rel_pos_bias and kernel_size >= 2 along every dim; got rel_pos_bias="
                f"{rel_pos_bias}, kernel_size={self.kernel_size}"
            )
        self.local_backend = local_backend
        self._natten_installed = natten_module() is not None  # looked up here, never while compiling
        self._natten_fused = natten_fused()  # "auto" takes natten only with its fused CUDA kernels
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.scale = qk_scale if qk_scale is not None else self.head_dim**-0.5
        kw = {"device": device, "dtype": dtype}
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim, bias=qkv_bias, **kw)
        self.proj = nn.Linear(embed_dim, embed_dim, **kw)
        self.proj_drop = nn.Dropout(proj_drop)
        if rel_pos_bias:
            self.rpb = nn.Parameter(torch.zeros(num_heads, *(2 * k - 1 for k in self.kernel_size), **kw))
            if self.rpb.device.type != "meta":
                nn.init.trunc_normal_(self.rpb, std=0.02, a=-2.0, b=2.0)
        else:
            self.register_parameter("rpb", None)
        self.shard_dims = None
        self.mesh = None
        self._groups: list = []
        if shard_dims is not None:
            dims = tuple(int(d) for d in shard_dims)
            allowed = [(d,) for d in range(1, rank + 1)] + [
                (a, b) for a in range(1, rank + 1) for b in range(a + 1, rank + 1)
            ]
            if dims not in allowed:
                raise ValueError(
                    f"{name}: shard_dims must be None or one of {allowed} (spatial dims of the "
                    f"(B, {', '.join(AXIS_NAMES[rank])}, C) input, at most two), got {tuple(shard_dims)}"
                )
            self.shard_dims = dims
            mesh = self._bind_mesh(mesh, len(dims))
            self._groups = [mesh.get_group(i) for i in range(mesh.ndim)]
            self._broadcast_parameters()
        self._layouts: Dict[Tuple[int, ...], _Layout] = {}
        self._tables: Dict[Tuple[int, ...], list] = {}  # the exchanged table each layout was planned from

    def _broadcast_parameters(self) -> None:
        """Make the freshly initialised replicated parameters identical on every domain rank."""
        with torch.no_grad():
            for group in self._groups:
                if dist.get_world_size(group) > 1:
                    for p in self.parameters():
                        if p.device.type != "meta":
                            dist.broadcast(p.data, dist.get_global_rank(group, 0), group=group)

    def shard_specs(self) -> Dict[str, ShardSpec]:
        """Every parameter is replicated."""
        return {name: ShardSpec.replicated(p.shape) for name, p in self.named_parameters()}

    @classmethod
    def from_module(
        cls, module: "NeighborhoodAttention", *, mesh: Optional[DeviceMesh] = None, shard_dims: Sequence[int] = (1,)
    ) -> "NeighborhoodAttention":
        """A domain-parallel twin of ``module`` holding a copy of its parameters.

        Build optimizers after swapping: the new parameters are new objects.
        """
        if not isinstance(module, NeighborhoodAttention) or module.spatial_rank != cls.spatial_rank:
            raise TypeError(f"{cls.__name__}.from_module expects a {cls.__name__}, got {type(module).__name__}")
        layer = cls(
            module.embed_dim,
            module.num_heads,
            module.kernel_size,
            module.dilation,
            module.is_causal,
            module.qkv.bias is not None,
            module.scale,
            module.proj_drop.p,
            module.rpb is not None,
            stride=module.stride,
            local_backend=module.local_backend,
            mesh=mesh,
            shard_dims=shard_dims,
            device="meta",
            dtype=module.qkv.weight.dtype,
        )
        layer = layer.to_empty(device=module.qkv.weight.device)
        layer._copy_shards_from(module)
        return layer

    def reset_layout(self) -> None:
        """Forget cached partitions (on every rank). Rarely needed: a ``DomainParallel`` region resets
        its layers when its partition changes, and a layer called elsewhere agrees on it every call."""
        self._layouts.clear()
        self._tables.clear()
        self._forget_rows()

    # ----------------------------------------------------------------- forward
    def _params(self):
        """Parameters as used in forward. Domain-parallel: they pass through
        :func:`copy_many_to_parallel_region` per mesh dim (identity forward; backward one fused
        all-reduce of all their gradients), so every rank holds the serial gradients."""
        params = [self.qkv.weight, self.qkv.bias, self.proj.weight, self.proj.bias, self.rpb]
        present = [p for p in params if p is not None]
        for group in self._groups:
            present = copy_many_to_parallel_region(present, group)
        pieces = iter(present)
        return [None if p is None else next(pieces) for p in params]

    def _tile_backend(self) -> Optional[str]:
        """The whole-image kernel of the tile path (``"natten"`` / ``"tplayers"``), or None for the
        key-halo path: fixed by ``local_backend``, the weights' device and whether natten is installed."""
        if self.local_backend == "natten":
            return "natten"
        if self.local_backend == "tile":
            return "tplayers"
        if (
            self.local_backend == "auto"
            and natten_applies(self.qkv.weight.device, self.kernel_size, self.rpb is not None, self._natten_fused)
            is None
        ):
            return "natten"
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rank = self.spatial_rank
        tile_backend = self._tile_backend()
        if tile_backend is not None:
            return self._forward_tile(x, tile_backend)
        if self.shard_dims is None:
            if not self._check_local(x):
                self._raise_bad_input(x)
            size, offset, plans = tuple(x.shape[1 : 1 + rank]), (0,) * rank, None
            check_window_fits(self.kernel_size, self.dilation, size, type(self).__name__)
        else:
            size, offset, plans = self._layout(x)  # validated on every rank before any halo traffic
        w_qkv, b_qkv, w_proj, b_proj, rpb = self._params()
        local = tuple(x.shape[: rank + 1])  # (B, *local spatial)
        qkv = F.linear(x, w_qkv, b_qkv).view(*local, 3, self.num_heads, self.head_dim)
        k_offset = offset
        if plans is None:  # views of qkv (backward: one stack, not a zero-filled qkv per slice)
            q, k, v = qkv.unbind(rank + 1)
        else:  # only K and V travel: the window core's N-d halo exchange (plans per axis)
            q, kv = qkv.split((1, 2), rank + 1)  # views; backward: one cat (select / narrow: a zero-filled qkv each)
            q = q.squeeze(rank + 1)  # (B, *s, heads, hd); kv (B, *s, 2, heads, hd)
            groups = {d + 1: self._groups[self.shard_dims.index(d)] for d in plans}
            # K and V leading (a view): the padded buffer holds each of them contiguous, as the kernels
            # read them (no copy of K and V before the exchange, none after it)
            kv = gather_windows(kv.movedim(rank + 1, 0), {d + 1: p for d, p in plans.items()}, groups, "zeros")
            k_offset = tuple(plans[1 + a].in_start if 1 + a in plans else offset[a] for a in range(rank))
            k, v = kv.unbind(0)
        out = neighborhood_attention(
            q,
            k,
            v,
            self.kernel_size,
            self.dilation,
            self.is_causal,
            stride=self.stride,
            scale=self.scale,
            global_size=size,
            q_offset=offset,
            k_offset=k_offset,
            rel_pos_bias=rpb,
        )
        out = F.linear(out.reshape(*local, self.embed_dim), w_proj, b_proj)  # (B, *s, C)
        return self.proj_drop(out)

    def _forward_tile(self, x: torch.Tensor, backend: str) -> torch.Tensor:
        """The tile path: q, k and v of this shard's tile (its rows plus the halos of
        :func:`~tplayers.ops.na_layout.tile_span`) through a whole-image kernel, then this
        shard's rows of the result."""
        rank = self.spatial_rank
        if self.shard_dims is None:
            if not self._check_local(x):
                self._raise_bad_input(x)
            check_window_fits(self.kernel_size, self.dilation, tuple(x.shape[1 : 1 + rank]), type(self).__name__)
            offset, plans = (0,) * rank, None
        else:
            _, offset, plans = self._layout(x)  # validated on every rank before any halo traffic
        if backend == "natten":  # every rank agreed on natten's presence in the layout exchange
            if not self._natten_installed:
                raise ImportError(
                    f"{type(self).__name__}(local_backend='natten'): natten is not installed ({INSTALL_HINT})"
                )
            why = natten_applies(x.device, self.kernel_size, False, True)
            if why is not None:
                raise ValueError(f"{type(self).__name__}(local_backend='natten'): {why}")
        w_qkv, b_qkv, w_proj, b_proj, _ = self._params()
        local = tuple(x.shape[: rank + 1])  # (B, *local spatial)
        qkv = F.linear(x, w_qkv, b_qkv).view(*local, 3, self.num_heads, self.head_dim)
        if plans is not None:  # q, k and v of the tile: the N-d halo exchange of all three
            groups = {d: self._groups[self.shard_dims.index(d)] for d in plans}
            qkv = gather_windows(qkv.contiguous(), plans, groups, "zeros")
        q, k, v = qkv.unbind(rank + 1)  # (B, *tile, heads, hd) each
        out = tile_attention(
            q, k, v, self.kernel_size, self.stride, self.dilation, self.is_causal, self.scale, backend=backend
        )
        for d, plan in (plans or {}).items():  # this shard's rows of the tile
            out = out.narrow(d, offset[d - 1] - plan.in_start, local[d])
        out = F.linear(out.reshape(*local, self.embed_dim), w_proj, b_proj)  # (B, *s, C)
        return self.proj_drop(out)

    def collectives(self):
        """Collectives per step: ``(forward list, backward list)``."""
        if self.shard_dims is None:
            return [], []
        what = "Q/K/V tile halo" if self._tile_backend() is not None else "K/V halo"
        halo = [f"{what} send/recv (dim {d})" for d in self.shard_dims]
        return halo, halo + ["all_reduce (all parameter grads, packed)"] * len(self.shard_dims)

    def extra_repr(self) -> str:
        stride = f"stride={self.stride}, " if any(s != 1 for s in self.stride) else ""
        return (
            f"{self.embed_dim}, num_heads={self.num_heads}, kernel_size={self.kernel_size}, {stride}"
            f"dilation={self.dilation}, is_causal={self.is_causal}, rel_pos_bias={self.rpb is not None}, "
            f"shard_dims={self.shard_dims}"
        )


class NeighborhoodAttention1d(NeighborhoodAttention):
    """1-D neighborhood attention layer, ``(B, L, C) -> (B, L, C)`` (:func:`tplayers.na1d`): the
    arguments of :class:`NeighborhoodAttention` over one spatial dim; ``rpb`` is ``(heads, 2k - 1)``;
    ``shard_dims=(1,)`` shards L over a 1-D mesh. Args, returns and raises as there.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import torch, tplayers
        torch.manual_seed(0)
        serial = tplayers.NeighborhoodAttention1d(16, 2, kernel_size=7, is_causal=True, stride=2)
        layer = tplayers.NeighborhoodAttention1d.from_module(serial, shard_dims=(1,))   # default mesh
        x = torch.randn(2, 40, 16)
        torch.testing.assert_close(tplayers.gather(layer(tplayers.shard(x, 1)), 1), serial(x))
    """

    spatial_rank = 1


class NeighborhoodAttention3d(NeighborhoodAttention):
    """3-D neighborhood attention layer, ``(B, D, H, W, C) -> (B, D, H, W, C)`` (:func:`tplayers.na3d`):
    the arguments of :class:`NeighborhoodAttention` per dim of three; ``rpb`` is
    ``(heads, 2kD - 1, 2kH - 1, 2kW - 1)``; ``shard_dims`` any one or two of ``1, 2, 3`` (D, H, W).
    Args, returns and raises as there.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import torch, tplayers
        torch.manual_seed(0)
        serial = tplayers.NeighborhoodAttention3d(16, 2, kernel_size=(3, 5, 5), dilation=(1, 2, 1))
        layer = tplayers.NeighborhoodAttention3d.from_module(serial, shard_dims=(2,))   # H, default mesh
        x = torch.randn(1, 6, 12, 9, 16)
        torch.testing.assert_close(tplayers.gather(layer(tplayers.shard(x, 2)), 2), serial(x))
    """

    spatial_rank = 3

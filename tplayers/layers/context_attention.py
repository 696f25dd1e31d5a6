"""Full attention over domain-sharded tokens as modules: :class:`ContextParallelAttention` (the
functional attention with its mesh and options stored, for hand-written code) and
:class:`DistributedMultiheadAttention` (the twin of ``nn.MultiheadAttention``).

Both give exactly this rank's rows of the serial attention on the gathered tokens; see
:func:`tplayers.functional.scaled_dot_product_attention` for the layout, positions and costs.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.distributed.device_mesh import DeviceMesh

from tplayers.attention.mha import multi_head_attention_forward
from tplayers.attention.sdpa import scaled_dot_product_attention
from tplayers.comm import copy_many_to_parallel_region
from tplayers.comm.collectives import all_reduce_sum
from tplayers.layers._common import RegionAware
from tplayers.layers._copy import MeshBound
from tplayers.mesh import resolve_mesh

__all__ = ["ContextParallelAttention", "DistributedMultiheadAttention"]

_MESH_DIMS = tuple(range(1, 9))


class _SumOverGroups(torch.autograd.Function):
    """forward: identity (a replicated tensor enters sharded computation) /
    backward: all-reduce (sum) of its gradient over every mesh dim's group."""

    @staticmethod
    def forward(ctx, x, groups):
        ctx.groups = groups
        return x.view_as(x)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        for group in ctx.groups:
            grad = all_reduce_sum(grad, group, "attention.replicated_kv.bwd")
        return grad, None


class ContextParallelAttention(RegionAware, MeshBound, nn.Module):
    """``F.scaled_dot_product_attention`` over tokens sharded on all ranks of ``mesh``.

    ``forward(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
    enable_gqa=False, q_positions=None, kv_positions=None)`` takes this rank's tokens
    ``(..., L_local, E)`` and returns this rank's rows. ``kv_sharded=False``: key/value are
    replicated (cross-attention on a text embedding): nothing moves forward, and their gradients
    are summed over the ranks in backward (``sum_replicated_grads``), so they are the serial ones.
    No parameters. See :func:`tplayers.functional.scaled_dot_product_attention`.

    Args:
        mesh: the mesh the tokens are sharded over (``None``: :func:`tplayers.default_mesh`).
        kv_sharded: whether key / value are sharded (else replicated).
        algorithm: ``"auto"``, ``"ring"`` or ``"all_gather"``.
        sum_replicated_grads: with ``kv_sharded=False``, sum the key / value gradients over the ranks.

    Returns:
        ``forward(...)``: this rank's rows of the serial attention.

    Raises:
        ValueError: in ``forward``, on every rank, arguments invalid on any rank.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import torch, torch.nn.functional as F, tplayers
        mesh = tplayers.init_mesh()
        torch.manual_seed(0)
        attn = tplayers.ContextParallelAttention(mesh=mesh)
        q, k, v = torch.randn(3, 1, 4, 64, 16).unbind(0)      # (N, heads, 64 pixels, head_dim)
        out = attn(*(tplayers.shard(t, 2, mesh) for t in (q, k, v)))   # this rank's pixels in, its rows out
        torch.testing.assert_close(tplayers.gather(out, 2, mesh), F.scaled_dot_product_attention(q, k, v))
    """

    def __init__(
        self,
        *,
        mesh: Optional[DeviceMesh] = None,
        kv_sharded: bool = True,
        algorithm: str = "auto",
        sum_replicated_grads: bool = True,
    ) -> None:
        super().__init__()
        self.mesh = resolve_mesh(mesh, _MESH_DIMS)
        self.kv_sharded, self.algorithm, self.sum_replicated_grads = bool(kv_sharded), algorithm, sum_replicated_grads
        self._groups = tuple(self.mesh.get_group(d) for d in range(self.mesh.ndim))

    def forward(
        self,
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
        q_positions=None,
        kv_positions=None,
    ):
        if not self.kv_sharded and self.sum_replicated_grads and self.mesh.size() > 1:
            key, value = _SumOverGroups.apply(key, self._groups), _SumOverGroups.apply(value, self._groups)
        return scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask,
            dropout_p,
            is_causal,
            scale,
            enable_gqa,
            mesh=self.mesh,
            kv_sharded=self.kv_sharded,
            q_positions=q_positions,
            kv_positions=kv_positions,
            algorithm=self.algorithm,
        )

    def extra_repr(self) -> str:
        return f"kv_sharded={self.kv_sharded}, algorithm={self.algorithm!r}, mesh={tuple(self.mesh.shape)}"


class DistributedMultiheadAttention(RegionAware, MeshBound, nn.MultiheadAttention):
    """``nn.MultiheadAttention`` over a sequence sharded on all ranks of ``mesh`` (pixels, frames).

    Same arguments, parameters and ``state_dict`` keys as ``nn.MultiheadAttention`` (it is one),
    plus ``mesh``, ``kv_sharded`` (False: key/value are replicated, e.g. a text embedding; their
    gradients are summed over the ranks) and ``algorithm``. ``forward(query, key, value,
    key_padding_mask=None, need_weights=True, attn_mask=None, average_attn_weights=True,
    is_causal=False, q_positions=None, kv_positions=None)``: query/key/value hold this rank's
    tokens along the sequence dim (dim 1 with ``batch_first``, else 0); ``key_padding_mask`` is
    ``(N, Lk_global)``, ``attn_mask`` ``(Lq_local, Lk_global)`` or ``(N*heads, Lq_local, Lk_global)``.
    Returns ``(output, weights)`` as ``nn.MultiheadAttention`` does: ``need_weights=True`` (its
    default) gives this rank's rows of the weights ``(N, Lq_local, Lk_global)`` by gathering K/V
    (the weights are rows of the full score matrix); ``need_weights=False`` is the ring path that
    never forms them (None). ``add_bias_kv`` and ``add_zero_attn`` raise ``ValueError``. The
    parameters are replicated; their gradients are
    summed over the ranks in backward (one all-reduce per mesh dim), so every ``.grad`` is the
    serial one. Build the optimizer after swapping in the twin.

    Args:
        embed_dim ... dtype: as ``nn.MultiheadAttention``.
        mesh, kv_sharded, algorithm: as :class:`ContextParallelAttention`.

    Returns:
        ``forward(...)``: ``(output, weights)``, this rank's rows of each.

    Raises:
        ValueError: ``add_bias_kv`` or ``add_zero_attn``; in ``forward``, invalid arguments on any rank.
        TypeError: ``from_module`` of a module that is not an ``nn.MultiheadAttention``.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import torch, tplayers
        mesh = tplayers.init_mesh()
        torch.manual_seed(0)
        serial = torch.nn.MultiheadAttention(32, 4, batch_first=True)
        attn = tplayers.DistributedMultiheadAttention.from_module(serial, mesh=mesh)
        x = torch.randn(2, 50, 32)                     # the same on every rank
        y, _ = attn(*[tplayers.shard(x, 1, mesh)] * 3, need_weights=False)   # this rank's tokens
        torch.testing.assert_close(tplayers.gather(y, 1, mesh), serial(x, x, x, need_weights=False)[0])
    """

    def __init__(
        self,
        embed_dim,
        num_heads,
        dropout=0.0,
        bias=True,
        add_bias_kv=False,
        add_zero_attn=False,
        kdim=None,
        vdim=None,
        batch_first=False,
        device=None,
        dtype=None,
        *,
        mesh: Optional[DeviceMesh] = None,
        kv_sharded: bool = True,
        algorithm: str = "auto",
    ) -> None:
        if add_bias_kv or add_zero_attn:
            name = "add_bias_kv" if add_bias_kv else "add_zero_attn"
            raise ValueError(
                f"DistributedMultiheadAttention: {name}=True is unsupported (its extra key token has "
                f"no owner among the sharded tokens)"
            )
        super().__init__(
            embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim, batch_first, device, dtype
        )
        self.mesh = resolve_mesh(mesh, _MESH_DIMS)
        self.kv_sharded, self.algorithm = bool(kv_sharded), algorithm
        self._groups = tuple(self.mesh.get_group(d) for d in range(self.mesh.ndim))

    @classmethod
    def from_module(
        cls,
        module: nn.MultiheadAttention,
        *,
        mesh: Optional[DeviceMesh] = None,
        kv_sharded: bool = True,
        algorithm: str = "auto",
    ) -> "DistributedMultiheadAttention":
        """The twin of ``module`` with a copy of its parameters (same keys, same values)."""
        if not isinstance(module, nn.MultiheadAttention):
            raise TypeError(
                f"DistributedMultiheadAttention.from_module expects an nn.MultiheadAttention, got "
                f"{type(module).__name__}"
            )
        weight = module.out_proj.weight
        twin = cls(
            module.embed_dim,
            module.num_heads,
            module.dropout,
            module.in_proj_bias is not None,
            module.bias_k is not None,
            module.add_zero_attn,
            module.kdim,
            module.vdim,
            module.batch_first,
            device=weight.device,
            dtype=weight.dtype,
            mesh=mesh,
            kv_sharded=kv_sharded,
            algorithm=algorithm,
        )
        with torch.no_grad():
            twin.load_state_dict(module.state_dict())
        twin.train(module.training)
        return twin

    def forward(
        self,
        query,
        key,
        value,
        key_padding_mask=None,
        need_weights=True,
        attn_mask=None,
        average_attn_weights=True,
        is_causal=False,
        q_positions=None,
        kv_positions=None,
    ):
        if self.batch_first and query.dim() == 3:  # (N, L, E) -> (L, N, E)
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        names = [n for n, _ in self.named_parameters()]
        params = [p for _, p in self.named_parameters()]
        if self.mesh.size() > 1:
            for group in self._groups:  # backward: sum the partial grads
                params = copy_many_to_parallel_region(params, group)
            if not self.kv_sharded:
                key, value = _SumOverGroups.apply(key, self._groups), _SumOverGroups.apply(value, self._groups)
        p = dict(zip(names, params))
        separate = not self._qkv_same_embed_dim
        out, weights = multi_head_attention_forward(
            query,
            key,
            value,
            self.embed_dim,
            self.num_heads,
            p.get("in_proj_weight"),
            p.get("in_proj_bias"),
            None,
            None,
            False,
            self.dropout,
            p["out_proj.weight"],
            p.get("out_proj.bias"),
            training=self.training,
            key_padding_mask=key_padding_mask,
            need_weights=need_weights,
            attn_mask=attn_mask,
            average_attn_weights=average_attn_weights,
            use_separate_proj_weight=separate,
            q_proj_weight=p.get("q_proj_weight"),
            k_proj_weight=p.get("k_proj_weight"),
            v_proj_weight=p.get("v_proj_weight"),
            is_causal=is_causal,
            mesh=self.mesh,
            kv_sharded=self.kv_sharded,
            q_positions=q_positions,
            kv_positions=kv_positions,
            algorithm=self.algorithm,
        )
        if self.batch_first and out.dim() == 3:
            out = out.transpose(0, 1)
        return out, weights

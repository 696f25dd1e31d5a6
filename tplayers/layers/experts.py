"""Expert parallelism: a mixture of experts' experts split over a mesh axis, whole experts per rank.

A transformers mixture of experts keeps its experts in one module whose parameters stack the
experts along dim 0 (``gate_up_proj`` ``(E, 2I, H)``, ``down_proj`` ``(E, H, I)``, biases
``(E, ...)``) and whose ``forward(hidden_states, top_k_index, top_k_weights)`` takes the tokens
``(T, H)``, each token's ``k`` chosen experts ``(T, k)`` and their routing weights ``(T, k)``, and
returns ``sum_j weight_j * expert_j(token)`` per token ``(T, H)``. :class:`ExpertParallelExperts`
holds the experts ``shard_range(E, tp, rank)`` of that stack (:func:`tplayers.shard_sizes`: uneven
counts allowed, a rank may hold none) and runs the model's own expert code on them:

1. each rank takes its balanced slice of the (replicated) tokens;
2. every (token, expert) pair of the slice, ordered by expert, goes with its routing weight to the
   rank holding the expert: one all-to-all (:class:`~tplayers.comm.dispatch.AllToAllRows`);
3. that rank runs the wrapped module's ``forward`` on the pairs it received (``k = 1``, expert ids
   made local), so whatever the model's experts do per pair (activation, biases, clamping, the
   routing weight) is done by the model's code;
4. the outputs go back by the reverse all-to-all and are summed per token in the serial order
   (ascending expert);
5. one all-gather makes the tokens replicated again.

Backward runs the adjoints in reverse: the all-gather's is this rank's slice, each all-to-all's the
reverse all-to-all, the token slice's an all-gather of the gradients of the hidden states and the
routing weights. So the router (replicated, outside this module) and everything before it get the
serial gradients on every rank, and each expert's parameters get theirs on the rank holding it.

The routing is read from ``top_k_index``, which tensor parallelism keeps replicated (the router
runs on replicated tokens): every rank derives the split sizes of both all-to-alls without a count
exchange. A first call per input shape compares the shapes, dtypes and a fingerprint of the ids
across ranks (``ValueError`` on every rank if they differ).
"""

from __future__ import annotations

import copy
import inspect
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tplayers.comm.agree import exchange_agreed, value_fingerprints
from tplayers.comm.collectives import gather_along_dim
from tplayers.comm.dispatch import all_to_all_rows, split_rows
from tplayers.layers._common import ShardedModule
from tplayers.sharding import ShardSpec, offsets_from_sizes, shard_sizes

__all__ = ["ExpertParallelExperts", "experts_interface_error"]

_SIGNATURE = ("hidden_states", "top_k_index", "top_k_weights")


def experts_interface_error(module: nn.Module) -> Optional[str]:
    """Why ``module`` is not an experts module :class:`ExpertParallelExperts` can split, or ``None``."""
    name = type(module).__name__
    try:
        params = list(inspect.signature(module.forward).parameters)[: len(_SIGNATURE)]
    except (TypeError, ValueError):
        params = []
    if tuple(params) != _SIGNATURE:
        return f"{name}.forward takes {tuple(params)}, expected {_SIGNATURE}"
    experts = getattr(module, "num_experts", None)
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 1:
        return f"{name} has no positive int num_experts (got {experts!r})"
    for child_name, child in module.named_children():
        if any(True for _ in child.parameters()) or any(True for _ in child.buffers()):
            return (
                f"{name}.{child_name} ({type(child).__name__}) holds tensors (only the experts' own stacks are split)"
            )
    tensors = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
    if not any(True for _ in module.parameters(recurse=False)):
        return f"{name} has no parameters of its own"
    for tname, t in tensors:
        if t.dim() < 1 or t.shape[0] != experts:
            return f"{name}.{tname} has shape {tuple(t.shape)}, expected the {experts} experts along dim 0"
    return None


class ExpertParallelExperts(ShardedModule):
    """A mixture of experts' experts module split over ``mesh``: each rank holds whole experts and
    the tokens travel to them (expert parallelism, see the module docstring for the data flow).

    forward: ``(hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k))``, all replicated
    -> ``(T, H)`` replicated, equal to the serial module's output. Collectives per step: forward
    an all-to-all to the experts, one back, an all-gather of the tokens (and an all-to-all of the
    routing weights when their dtype is not the hidden states'); backward their adjoints.

    The parameters keep the serial names (``gate_up_proj``, ``down_proj``, ...); this rank holds
    the experts ``shard_range(E, tp, rank)`` along dim 0, so checkpoints and
    :func:`~tplayers.gather_state_dict` save and gather the serial tensors.

    Args:
        experts: the serial experts module: ``forward(hidden_states, top_k_index, top_k_weights)``
            computing each (token, expert, weight) triple on its own and summing over the ``k``
            choices (transformers' ``@use_experts_implementation`` classes: Mixtral, Qwen3-MoE,
            DeepSeek, ...), an int ``num_experts``, and every own parameter and buffer stacked
            along dim 0 (its children without tensors, e.g. the activation).
        mesh: a 1-D mesh (``None``: :func:`tplayers.default_mesh`).

    Raises:
        ValueError: ``experts`` is not such a module (naming what differs); at call time, inputs
            of other shapes, expert ids out of range, or ranks whose inputs differ (on every rank).

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import copy, torch, tplayers, transformers
        torch.manual_seed(0)
        config = transformers.MixtralConfig(hidden_size=8, intermediate_size=12, num_local_experts=3)
        serial = transformers.models.mixtral.modeling_mixtral.MixtralExperts(config)
        torch.nn.init.normal_(serial.gate_up_proj), torch.nn.init.normal_(serial.down_proj)
        mesh = tplayers.init_mesh()
        ep = tplayers.ExpertParallelExperts(copy.deepcopy(serial), mesh=mesh)   # experts 0-1 | 2
        h, ids = torch.randn(5, 8), torch.randint(0, 3, (5, 2))
        w = torch.rand(5, 2)
        torch.testing.assert_close(ep(h, ids, w), serial(h, ids, w))
    """

    _pickle_empty = ("_agreed", "_owners")  # per-shape agreements and per-device tables: rebuilt after unpickling

    def __init__(self, experts: nn.Module, *, mesh: Optional[DeviceMesh] = None) -> None:
        super().__init__()
        if not isinstance(experts, nn.Module):
            raise TypeError(f"ExpertParallelExperts: experts must be an nn.Module, got {type(experts).__name__}")
        why = experts_interface_error(experts)
        if why is not None:
            raise ValueError(f"ExpertParallelExperts: {why}")
        mesh = self._bind_mesh(mesh)
        self._groups = [mesh.get_group(0)]
        self.tp_rank, self.tp_size = mesh.get_local_rank(0), mesh.size(0)
        self.num_experts = int(experts.num_experts)
        counts = shard_sizes(self.num_experts, self.tp_size)
        self.expert_counts: Tuple[int, ...] = tuple(counts)
        self.first_expert = offsets_from_sizes(counts)[self.tp_rank]
        self._shapes = {}
        persistent = {}
        for name, t in experts.named_parameters(recurse=False):
            self._shapes[name] = tuple(t.shape)
            local = ShardSpec.balanced(t.shape, 0, self.tp_size, self.tp_rank).take(t.detach())
            self.register_parameter(name, nn.Parameter(local.clone(), requires_grad=t.requires_grad))
        for name, t in experts.named_buffers(recurse=False):
            self._shapes[name] = tuple(t.shape)
            persistent[name] = name not in experts._non_persistent_buffers_set
            local = ShardSpec.balanced(t.shape, 0, self.tp_size, self.tp_rank).take(t)
            self.register_buffer(name, local.clone(), persistent=persistent[name])
        local = copy.copy(experts)  # the model's own expert code, run on this rank's experts
        local.num_experts = counts[self.tp_rank]
        self._local = (local,)  # a tuple: not a registered child (no state_dict keys of its own)
        self._bound_local()  # drop the serial stacks the copy still points at
        self._agreed = set()
        self._owners = {}

    @classmethod
    def from_module(cls, experts: nn.Module, *, mesh: Optional[DeviceMesh] = None) -> "ExpertParallelExperts":
        """The twin of ``experts`` holding this rank's experts (the same as the constructor)."""
        return cls(experts, mesh=mesh)

    def shard_specs(self) -> Dict[str, ShardSpec]:
        """Every tensor: the serial stack and this rank's experts along dim 0."""
        return {name: ShardSpec.balanced(shape, 0, self.tp_size, self.tp_rank) for name, shape in self._shapes.items()}

    def _bound_local(self) -> nn.Module:
        local = self._local[0]
        local._parameters = dict(self._parameters)  # this twin's (current) tensors, whatever .to() did
        local._buffers = dict(self._buffers)
        return local

    def _check(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> None:
        name = type(self).__name__
        for arg, t in (("hidden_states", hidden), ("top_k_index", index), ("top_k_weights", weights)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: {arg} must be a tensor, got {type(t).__name__}")
        if (
            hidden.dim() != 2
            or index.dim() != 2
            or weights.shape != index.shape
            or index.shape[0] != hidden.shape[0]
            or index.is_floating_point()
            or index.is_complex()
        ):
            raise ValueError(
                f"{name}: expected hidden_states (T, H), integer top_k_index (T, k) and top_k_weights (T, k), "
                f"got {tuple(hidden.shape)}, {tuple(index.shape)} ({index.dtype}) and {tuple(weights.shape)}"
            )

    def _agree(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> None:
        """First call per input shape: every rank's shapes, dtypes and expert ids alike (else ``ValueError``)."""
        key = (tuple(hidden.shape), tuple(index.shape), hidden.dtype, index.dtype, weights.dtype)
        if key in self._agreed:
            return
        config = {
            "experts": (self.num_experts,) + tuple(self._shapes[n] for n in sorted(self._shapes)),
            "inputs": tuple(str(k) for k in key),
            "top_k_index values": value_fingerprints({"ids": index})["ids"],
        }
        exchange_agreed([0], config, self._groups, type(self).__name__, "experts.agree")
        self._agreed.add(key)

    def _routing(self, index: torch.Tensor, tokens: List[int]) -> Tuple[List[int], List[int], torch.Tensor]:
        """``(send counts, receive counts, local expert id of each received pair)`` from the replicated
        ``index`` (T, k); ``tokens``: the token counts of the ranks' slices."""
        n, me, experts = self.tp_size, self.tp_rank, self.num_experts
        k = index.shape[1]
        device = index.device
        owner = self._owners.get(device)
        if owner is None:  # (E,): the rank holding each expert
            owner = torch.repeat_interleave(torch.arange(n), torch.tensor(self.expert_counts)).to(device)
            self._owners[device] = owner
        source = torch.repeat_interleave(torch.arange(n, device=device), torch.tensor(tokens, device=device))
        source = source[:, None].expand(-1, k).reshape(-1)  # (T*k,): the rank whose slice holds each pair
        flat = index.reshape(-1).long()
        dest = owner[flat.clamp(0, experts - 1)]
        counts = torch.bincount(source * n + dest, minlength=n * n)
        bounds = torch.stack([flat.min(), flat.max()]) if flat.numel() else flat.new_zeros(2)
        host = torch.cat([counts, bounds]).tolist()  # one device-to-host copy: the split sizes and the id range
        low, high = host[-2:]
        if low < 0 or high >= experts:
            raise ValueError(
                f"{type(self).__name__}: top_k_index must hold expert ids in [0, {experts}), got values in [{low}, {high}]"
            )
        table = [host[q * n : (q + 1) * n] for q in range(n)]  # table[q][d]: pairs from q's slice to rank d
        mine = dest == me
        order = torch.sort(source[mine] * experts + flat[mine], stable=True).values  # by (source rank, expert)
        return table[me], [row[me] for row in table], order % experts - self.first_expert

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        self._check(hidden_states, top_k_index, top_k_weights)
        local = self._bound_local()
        if self.tp_size == 1:
            return local(hidden_states, top_k_index, top_k_weights)
        self._agree(hidden_states, top_k_index, top_k_weights)
        group = self._groups[0]
        tokens, width = hidden_states.shape
        k = top_k_index.shape[1]
        sizes = shard_sizes(tokens, self.tp_size)
        start = offsets_from_sizes(sizes)[self.tp_rank]
        send, recv, local_ids = self._routing(top_k_index, sizes)
        # my tokens (T_me, H) and their weights (T_me, k); backward: one all-gather of both gradients
        h, w = split_rows([hidden_states, top_k_weights], sizes, group)
        ids = top_k_index.narrow(0, start, sizes[self.tp_rank]).reshape(-1)
        order = torch.sort(ids, stable=True).indices  # my pairs by expert, hence by destination rank
        token = torch.div(order, k, rounding_mode="floor")
        rows, pair_w = h[token], w.reshape(-1)[order]  # (P, H), (P,)
        got_rows, got_w = all_to_all_rows([rows, pair_w], send, recv, group, "experts.dispatch")
        if got_rows.shape[0]:
            out = local(got_rows, local_ids[:, None], got_w[:, None])  # (R, H): the model's own expert code
        else:  # nothing routed here: an empty output still in the graph (every rank runs every backward
            # collective) and zero gradients for this rank's experts, as the serial model's unused rows
            out = got_rows * 0 + got_w[:, None] * 0 + sum(p.reshape(-1)[:0].sum() for p in self.parameters())
        (back,) = all_to_all_rows([out], recv, send, group, "experts.combine")  # (P, H), my pairs' outputs
        y = hidden_states.new_zeros((sizes[self.tp_rank], width)).index_add(0, token, back.to(hidden_states.dtype))
        return gather_along_dim(y, 0, group, sizes)  # (T, H) replicated; backward: my slice

    def collectives(self):
        """Collectives per step: ``(forward list, backward list)``; the routing weights travel with the
        hidden states (one more all-to-all / all-gather each where their dtype differs)."""
        if self.tp_size == 1:
            return [], []
        fwd = ["all_to_all (dispatch)", "all_to_all (combine)", "all_gather (tokens)"]
        bwd = ["all_to_all (combine)", "all_to_all (dispatch)", "all_gather (token gradients)"]
        return fwd, bwd

    def extra_repr(self) -> str:
        mine = self.expert_counts[self.tp_rank]
        held = f"experts {self.first_expert}..{self.first_expert + mine - 1}" if mine else "no experts"
        return f"{type(self._local[0]).__name__}, num_experts={self.num_experts}, {held} on rank {self.tp_rank} of {self.tp_size}"

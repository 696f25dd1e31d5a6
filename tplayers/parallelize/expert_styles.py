"""The expert-parallel plan style: a mixture of experts' experts module split by whole experts."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from tplayers.layers.experts import ExpertParallelExperts, experts_interface_error
from tplayers.parallelize.styles import ParallelStyle, key_repr

__all__ = ["ExpertParallel"]


@dataclass(frozen=True)
class ExpertParallel(ParallelStyle):
    r"""Swap a mixture of experts' experts module for :class:`~tplayers.ExpertParallelExperts`:
    each rank holds whole experts (``shard_sizes(num_experts, tp)`` of them, uneven allowed) and
    the tokens travel to them with an all-to-all and back (expert parallelism over the
    tensor-parallel mesh). The router stays replicated; outputs and every gradient equal the
    serial model's. ``plan_from_transformers(model, expert_parallel=True)`` puts it on a
    transformers model's ``experts`` modules.

    Raises:
        ValueError: (from :func:`~tplayers.parallelize_module`, before anything changes) a matched
            module that is not an experts module of that interface (``forward(hidden_states,
            top_k_index, top_k_weights)``, ``num_experts``, tensors stacked along dim 0), naming
            what differs.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import copy, torch, tplayers, transformers
        torch.manual_seed(0)
        config = transformers.MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=3)
        serial = transformers.MixtralForCausalLM(config)
        plan = {r"model\.layers\.\d+\.mlp\.experts": tplayers.ExpertParallel()}
        model = tplayers.parallelize_module(copy.deepcopy(serial), plan)
        ids = torch.randint(0, 32, (2, 5))
        torch.testing.assert_close(model(ids).logits, serial(ids).logits)
    """

    accepts = (nn.Module,)

    def check(self, key, name, module):
        why = experts_interface_error(module)
        if why is not None:
            raise ValueError(
                f"plan key {key_repr(key)}: ExpertParallel expects a mixture of experts' experts module "
                f"(forward(hidden_states, top_k_index, top_k_weights), num_experts, tensors stacked by expert), "
                f"but module {name or '<root>'!r}: {why}"
            )

    def build(self, name, module, mesh):
        return ExpertParallelExperts.from_module(module, mesh=mesh)

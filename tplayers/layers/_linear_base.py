"""The shared base of the tensor-parallel linears: parameters laid out as one shard of the serial
``nn.Linear`` (initialised as its slice under the same seed), the sequence-parallel argument
checks, and ``shard_specs`` for checkpoints. :mod:`tplayers.layers.linear` builds
``ColumnParallelLinear`` and ``RowParallelLinear`` on it.

Transposed storage (``transposed=True``): the weight is kept ``(in_features, out_features)``
like Hugging Face transformers' ``Conv1D`` (GPT-2, GPT-J's relatives, ...), so ``state_dict``,
checkpoints and ``from_pretrained`` see the original layout; the math is the same linear
(the forward uses the ``(out, in)`` view ``weight.t()``). :func:`transposed_linear_dims`
recognises such a module by structure, without importing transformers.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tplayers.layers._common import ShardedModule, init_shards_like_serial
from tplayers.sharding import ShardSpec, shard_sizes

__all__ = ["ParallelLinearBase", "check_sequence_args", "check_sequence_dim", "transposed_linear_dims", "linear_dims"]


def _linear_weight_init(full: torch.Tensor) -> None:
    nn.init.kaiming_uniform_(full, a=math.sqrt(5))  # nn.Linear.reset_parameters, verbatim


def _linear_bias_init(fan_in: int):
    def init(full: torch.Tensor) -> None:
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        nn.init.uniform_(full, -bound, bound)

    return init


def _conv1d_weight_init(full: torch.Tensor) -> None:
    nn.init.normal_(full, std=0.02)  # transformers' Conv1D.__init__ (its bias: zeros, no draw)


def _zeros_init(full: torch.Tensor) -> None:
    nn.init.zeros_(full)


def transposed_linear_dims(module) -> Optional[Tuple[int, int]]:
    """``(in_features, out_features)`` if ``module`` is a linear stored ``(in, out)`` like
    transformers' ``Conv1D`` (``y = x @ weight + bias``), else ``None``.

    Recognised by structure, with no import of transformers: an ``nn.Module`` (not an
    ``nn.Linear``) whose only parameters are a 2-D ``weight`` of shape ``(nx, nf)`` and an
    optional ``bias`` of shape ``(nf,)``, and that either has an int attribute ``nf`` equal to
    ``weight.shape[1]`` or is a class named ``Conv1D``.

    >>> class Conv1D(nn.Module):          # transformers.pytorch_utils.Conv1D, in short
    ...     def __init__(self, nf, nx):
    ...         super().__init__()
    ...         self.nf, self.weight, self.bias = nf, nn.Parameter(torch.zeros(nx, nf)), nn.Parameter(torch.zeros(nf))
    >>> transposed_linear_dims(Conv1D(12, 4)), transposed_linear_dims(nn.Linear(4, 12))
    ((4, 12), None)
    """
    if isinstance(module, nn.Linear) or not isinstance(module, nn.Module):
        return None
    weight = module._parameters.get("weight")
    if weight is None or weight.dim() != 2:
        return None
    nx, nf = weight.shape
    bias = module._parameters.get("bias")
    if bias is not None and tuple(bias.shape) != (nf,):
        return None
    if set(module._parameters) - {"weight", "bias"} or any(True for _ in module.children()):
        return None
    has_nf = getattr(module, "nf", None)
    if not (
        type(module).__name__ == "Conv1D" or (isinstance(has_nf, int) and not isinstance(has_nf, bool) and has_nf == nf)
    ):
        return None
    return nx, nf


def linear_dims(module) -> Optional[Tuple[int, int, bool]]:
    """``(in_features, out_features, transposed)`` of an ``nn.Linear`` or a ``Conv1D``-like module
    (see :func:`transposed_linear_dims`), else ``None``."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, False
    dims = transposed_linear_dims(module)
    return None if dims is None else (dims[0], dims[1], True)


def check_sequence_args(layer: str, sequence_parallel, sequence_dim) -> None:
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"{layer}: sequence_parallel must be a bool, got {type(sequence_parallel).__name__}")
    if isinstance(sequence_dim, bool) or not isinstance(sequence_dim, int):
        raise TypeError(f"{layer}: sequence_dim must be an int, got {type(sequence_dim).__name__}")


def check_sequence_dim(x: torch.Tensor, dim: int, layer: str) -> int:
    """``dim`` normalised for ``x``; ``ValueError`` if it is out of range or the feature dim."""
    if not -x.dim() <= dim < x.dim() or dim % x.dim() == x.dim() - 1:
        raise ValueError(
            f"{layer}: sequence_dim={dim} must name a dim of the input other than the last "
            f"(features), got an input of shape {tuple(x.shape)}"
        )
    return dim % x.dim()


class ParallelLinearBase(ShardedModule):
    """Common construction of the two tensor-parallel linears."""

    #: which dim of ``weight`` (out, in) is sharded: 0 for Column, 1 for Row
    _weight_dim: int = 0

    def __init__(self, in_features, out_features, bias, mesh, device, dtype, transposed=False) -> None:
        super().__init__()
        if not isinstance(transposed, bool):
            raise TypeError(f"{type(self).__name__}: transposed must be a bool, got {type(transposed).__name__}")
        self.transposed = transposed
        for arg, value in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{type(self).__name__}: {arg} must be a positive int, got {value!r}")
        mesh = self._bind_mesh(mesh)
        self._group = mesh.get_group(0)
        self.tp_rank = mesh.get_local_rank(0)
        self.tp_size = mesh.size(0)
        self.in_features = in_features
        self.out_features = out_features
        self._setup_layout()
        specs = self._oriented_specs(bias)
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(specs["weight"].local_shape, **kw))
        if bias:
            self.bias = nn.Parameter(torch.empty(specs["bias"].local_shape, **kw))
        else:
            self.register_parameter("bias", None)
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def _setup_layout(self) -> None:
        """Validate and store layout options (fused sections, heads) before any tensor is made."""

    def _specs(self, bias: bool) -> Dict[str, ShardSpec]:
        size, rank = self.tp_size, self.tp_rank
        specs = {"weight": ShardSpec.balanced((self.out_features, self.in_features), self._weight_dim, size, rank)}
        if bias:
            bias_dim = 0 if self._weight_dim == 0 else None
            specs["bias"] = ShardSpec.balanced((self.out_features,), bias_dim, size, rank)
        return specs

    def _oriented_specs(self, bias: bool) -> Dict[str, ShardSpec]:
        specs = self._specs(bias)  # in the (out, in) orientation of nn.Linear
        if self.transposed:
            specs["weight"] = specs["weight"].transposed()  # stored (in, out), like Conv1D
        return specs

    def shard_specs(self) -> Dict[str, ShardSpec]:
        """``{"weight": ShardSpec, "bias": ShardSpec}``: global shapes and this rank's slice
        (the weight's global shape is ``(in, out)`` when ``transposed``)."""
        return self._oriented_specs(self.bias is not None)

    def dense_weight(self) -> torch.Tensor:
        """This rank's weight as ``nn.Linear`` orients it, ``(out, in)`` (a view when ``transposed``)."""
        return self.weight.t() if self.transposed else self.weight

    @property
    def partition_sizes(self) -> list:
        """Per-rank sizes of the sharded feature dim (this rank's local width on each rank)."""
        n = self.out_features if self._weight_dim == 0 else self.in_features
        return shard_sizes(n, self.tp_size)

    def reset_parameters(self) -> None:
        """Initialise this rank's shards as exactly its slice of a serial ``nn.Linear``.

        The full ``(out_features, in_features)`` weight and ``(out_features,)``
        bias are drawn with ``nn.Linear.reset_parameters``' exact calls and RNG
        sequence, on this layer's device and dtype, and this rank keeps its slice
        (Row's replicated bias: the whole of it). So under ``torch.manual_seed(s)``
        on every rank, a model built from these layers is the serial model built
        under the same seed, shard for shard, and the generator ends in the same
        state as after the serial layer (later layers match too).

        Cost: every rank draws the full weight once (the serial layer's memory
        and RNG time, freed right after); ``device="meta"`` skips it. Ranks seeded
        differently get slices of different draws: then Row's replicated bias
        differs across ranks. Seed every rank alike, or build the serial model and
        use :func:`~tplayers.parallelize_module` (``src_rank=0``) instead.

        With ``transposed=True`` the serial module is transformers' ``Conv1D(out, in)``
        instead: weight ``normal(std=0.02)`` of shape ``(in, out)``, bias zeros.
        """
        if self.transposed:
            init_shards_like_serial(self, {"weight": _conv1d_weight_init, "bias": _zeros_init})
            return
        init_shards_like_serial(self, {"weight": _linear_weight_init, "bias": _linear_bias_init(self.in_features)})

    @classmethod
    def from_module(cls, dense: nn.Module, *, mesh: Optional[DeviceMesh] = None, **options):
        """Build the parallel twin of ``dense`` holding exactly this rank's slice of it.

        ``dense`` is an ``nn.Linear`` or a linear stored ``(in, out)`` like transformers'
        ``Conv1D`` (see :func:`transposed_linear_dims`); the twin of a ``Conv1D`` keeps that
        storage (``transposed=True``), so its ``state_dict`` and checkpoints have the
        ``Conv1D``'s keys and shapes. ``options`` are the layer's own keywords
        (``gather_output``, ``sections``, ``head_dim``, ``input_is_parallel``, ``sequence_parallel``).
        Build optimizers after swapping: the new parameters are new objects.
        """
        dims = linear_dims(dense)
        if dims is None:
            raise TypeError(
                f"{cls.__name__}.from_module expects an nn.Linear or a Conv1D-like module "
                f"(weight (in, out) and nf), got {type(dense).__name__}"
            )
        if "transposed" in options:
            raise TypeError(
                f"{cls.__name__}.from_module: transposed follows the module "
                f"({type(dense).__name__}), got transposed={options['transposed']!r}"
            )
        in_features, out_features, transposed = dims
        layer = cls(
            in_features,
            out_features,
            bias=dense.bias is not None,
            mesh=mesh,
            device="meta",
            dtype=dense.weight.dtype,
            transposed=transposed,
            **options,
        )
        layer = layer.to_empty(device=dense.weight.device)
        layer._copy_shards_from(dense)
        return layer

    def _local_repr(self) -> str:
        w = tuple(self.weight.shape)
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, local_weight={w}, rank={self.tp_rank}/{self.tp_size}"
            + (", transposed=True" if self.transposed else "")
        )

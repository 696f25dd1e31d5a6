"""Lengths the model's code turned into values: a length as a pointwise op's value reads as its serial value,
and replicated tensors built after model code made a plain local number of a length are followed.

A length read from a sharded dim (:class:`~tplayers.region.lengths.ShardLen`) used as a *value* in a pointwise
op (HF's Swin shift mask: ``torch.arange(h) >= h - window_size``, where the grid is the serial one) is its
serial value (:func:`values_of`), as in the serial model.

Model code that passes a length through ``int()``, ``float()`` or numpy makes a plain local number of it
(MONAI's SwinUNETR: ``hp = int(np.ceil(h / ws)) * ws``); :func:`tplayers.region.lengths.lost` notes where,
on the region's guard. A replicated tensor a factory builds from then on, and everything computed from it,
may have this rank's size where the serial model's differs (MONAI's shifted-window mask, built from the
local height, marks each rank's last rows as wrapped around): :func:`taint` marks them, and
:func:`refuse_tainted` refuses them where they meet data of a window partition, on every rank (the marks
and the partition are the same on every rank), naming the line.
"""

from __future__ import annotations

import torch

from tplayers.region.lengths import ShardFloat, ShardLen, serial

__all__ = ["lengths_in", "values_of", "taint", "refuse_tainted"]


def lengths_in(args, kwargs) -> bool:
    """Whether a top-level argument is a length read from a sharded dim (or derived from one)."""
    return any(isinstance(a, (ShardLen, ShardFloat)) for a in (*args, *kwargs.values()))


def values_of(args, kwargs):
    """``args`` / ``kwargs`` with every top-level length a plain number: its serial value. A pointwise op takes a
    length as a value (HF Swin's shift mask: ``torch.arange(h) >= h - window_size``, the grid serial), and the
    serial model's value is the global one."""
    val = lambda a: serial(a) if isinstance(a, (ShardLen, ShardFloat)) else a  # noqa: E731
    return tuple(val(a) for a in args), {k: val(v) for k, v in kwargs.items()}


_LOCAL = "_tplayers_local_size"  # a replicated tensor built after a read length became a plain local number
_FACTORIES = frozenset(["zeros", "ones", "full", "empty", "arange", "linspace", "tensor", "as_tensor", "rand", "randn"])


def taint(g, name, args, kwargs, out) -> None:
    """After model code made a plain local number of a length read from a sharded dim (``g.lost``: MONAI's
    ``int(np.ceil(h / ws)) * ws``), a replicated tensor that a factory builds, and everything computed from
    it, may have this rank's size where the serial model's differs (MONAI's shifted-window mask, built
    from the local height). Such tensors are marked; :func:`refuse_tainted` refuses them where they meet
    windows."""
    tensors = [a for a in (*args, *kwargs.values()) if hasattr(a, _LOCAL)]
    tensors += [b for a in args if isinstance(a, (list, tuple)) for b in a if hasattr(b, _LOCAL)]
    marks = [getattr(t, _LOCAL) for t in tensors if getattr(t, _LOCAL)[0] is g.token]
    if name in _FACTORIES:
        marks.insert(0, (g.token, g.lost))
    if not marks:
        return
    for t in out if isinstance(out, (list, tuple)) else (out,):
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
            setattr(t, _LOCAL, marks[0])


def refuse_tainted(g, func, args, kwargs) -> None:
    """Refuse, on every rank, a replicated tensor marked by :func:`taint` meeting data of a window partition."""
    for a in (*args, *kwargs.values()):
        for t in a if isinstance(a, (list, tuple)) else (a,):
            mark = getattr(t, _LOCAL, None)
            if mark is not None and mark[0] is g.token and g.layout(t) is None:
                lay = next((g.layout(b) for b in (*args, *kwargs.values()) if g.layout(b) is not None), None)
                raise g.refuse(
                    g.error(
                        f"{getattr(func, '__name__', func)} of a replicated tensor built after {mark[1]} (a plain "
                        "local number: this rank's length, where the serial model has the global one) with data "
                        "of a window partition",
                        lay,
                        "Its size may be this rank's where the serial model's differs (MONAI's SwinUNETR builds its "
                        "shifted-window mask from int(np.ceil(h / window_size)) * window_size). Keep lengths as "
                        "read (math.ceil(h / ws) or -(-h // ws) keep them), or use depths without shifted windows.",
                    )
                )

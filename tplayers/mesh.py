"""Process groups and 1-D mesh axes.

tplayers never launches processes or keeps a process group of its own: it uses
``torch.distributed`` (``torchrun`` sets the environment, :func:`init_mesh`
initialises the default group from it) and ``DeviceMesh`` objects passed to
each layer. ``mesh=None`` everywhere means :func:`default_mesh`, a 1-D mesh
over all ranks.

Example (run with ``torchrun --nproc-per-node 2 script.py`` or plain
``python script.py``, which gets a world of one)::

    import tplayers
    mesh = tplayers.init_mesh()            # 1-D mesh named "tp" over all ranks
    layer = tplayers.ColumnParallelLinear(16, 32, mesh=mesh)
"""

from __future__ import annotations

import atexit
import math
import os
import sys
import time
from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["init_mesh", "default_mesh", "resolve_mesh", "axis_rank", "axis_size", "axis_group", "is_dtensor"]


def is_dtensor(t) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (an FSDP2 parameter, its gradient or
    optimizer state), without importing that module (about 0.8 s, sympy included): a DTensor exists
    only once it is loaded, so where it is not, nothing is one."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _default_device_type() -> str:
    if dist.is_initialized():
        return "cuda" if dist.get_backend() == "nccl" else "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


# The default process group this module created (None: none, or the user's own), and whether the
# exit hook is registered (once per process, when init_mesh first creates a group; never at import).
_created_group: Optional[dist.ProcessGroup] = None
_cleanup_registered = False
# How long the exit hook lets gloo's worker threads run (GIL released) before finalization.
_EXIT_SETTLE_S = 0.1


def _destroy_created_group() -> None:
    """Exit hook, registered when :func:`init_mesh` creates the default group.

    A script that never calls ``destroy_process_group()`` leaves its group to interpreter
    finalization, and on gloo (torch 2.13) that could abort the process with "terminate called
    without an active exception": a gloo worker thread drops its reference to a finished work a
    moment after the caller's ``wait()`` returned, and a work issued during a backward keeps that
    thread's state, which holds a Python ``contextvars.Context`` (``torch.autograd`` stashes one
    for every backward). Releasing it takes the GIL; when the main thread has meanwhile reached
    finalization, Python ends the asking thread inside a C++ destructor. Measured under torchrun
    at 3 ranks on a script ending with a ``DomainParallel`` backward: 4 aborts in 10 runs
    without ``destroy_process_group()``, 2 in 9 with it, none with this hook.

    So this hook destroys the group if it is still the one tplayers created (not one the user
    destroyed or replaced), then sleeps briefly with the GIL released so that such threads
    finish while the interpreter is whole. Idempotent; never raises.
    """
    global _created_group
    group, _created_group = _created_group, None
    try:
        if group is not None and dist.is_initialized() and dist.group.WORLD is group:
            dist.destroy_process_group()
    except Exception:  # exiting anyway: never turn a clean exit into a traceback
        pass
    time.sleep(_EXIT_SETTLE_S)


def _ensure_process_group(device_type: str, timeout: Optional[timedelta]) -> None:
    global _created_group, _cleanup_registered
    if dist.is_initialized():
        return
    backend = "nccl" if device_type == "cuda" else "gloo"
    kwargs = {} if timeout is None else {"timeout": timeout}
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        # Launched by torchrun (or an equivalent): rendezvous from the environment.
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, **kwargs)
    else:
        # A plain `python script.py`: a world of one, no network needed.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    # This group is ours: destroy it at exit unless the user does (registered now, never at import).
    _created_group = dist.group.WORLD
    if not _cleanup_registered:
        atexit.register(_destroy_created_group)
        _cleanup_registered = True


def init_mesh(
    shape: Optional[Sequence[int]] = None,
    names: Sequence[str] = ("tp",),
    device_type: Optional[str] = None,
    *,
    timeout: Optional[timedelta] = None,
) -> DeviceMesh:
    """Initialise the default process group if needed and return a ``DeviceMesh``.

    Under ``torchrun`` the group is initialised from the environment; a process started
    without a launcher gets a world of size 1 (no network), so the same script runs as is.
    Slice an N-D mesh by name (``mesh2d["tp"]``) for the layers, which take 1-D meshes.
    A default group that this call creates is destroyed when the interpreter exits (an ``atexit``
    hook registered then, never at import), unless the script destroyed it first; calling
    ``destroy_process_group()`` yourself stays fine. A group the script initialised itself is used
    as it is and never touched at exit.

    Args:
        shape: the mesh shape; ``None`` is a 1-D mesh over all ranks. Its product must be the
            world size, e.g. ``init_mesh((2, 2), ("dp", "tp"))`` on 4 ranks.
        names: one name per mesh dim.
        device_type: ``"cpu"`` (gloo) or ``"cuda"`` (nccl); default cuda when available.
        timeout: how long any collective of the mesh (every mesh dim's group, not only the
            default group) waits for a peer; PyTorch's default is 30 minutes, so pass minutes
            (``datetime.timedelta(minutes=5)``) to make a stalled rank fail its peers early.

    Returns:
        The ``DeviceMesh`` (``mesh_dim_names`` = ``names``).

    Raises:
        ValueError: ``device_type`` is not cpu/cuda, ``names`` does not have one entry per mesh
            dim, or ``shape`` does not multiply to the world size.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import torch, tplayers
        mesh = tplayers.init_mesh()                    # 1-D, named "tp", over all ranks
        assert mesh.ndim == 1 and mesh.mesh_dim_names == ("tp",)
        assert mesh.size() == torch.distributed.get_world_size()
    """
    device_type = device_type or _default_device_type()
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
    names = tuple(names)
    if shape is not None:
        shape = tuple(int(s) for s in shape)
        if len(shape) != len(names):
            raise ValueError(f"names must have one entry per mesh dim: shape {shape}, got names {names}")
    _ensure_process_group(device_type, timeout)
    world = dist.get_world_size()
    if shape is None:
        if len(names) != 1:
            raise ValueError(f"shape=None builds a 1-D mesh, so names needs 1 entry, got {names}")
        shape = (world,)
    if math.prod(shape) != world:
        raise ValueError(f"mesh shape {shape} must multiply to the world size {world}")
    return init_device_mesh(
        device_type, shape, mesh_dim_names=names, backend_override=_timeout_override(len(shape), timeout)
    )


def _timeout_override(ndim: int, timeout: Optional[timedelta]):
    """Per-dim backend options carrying ``timeout`` so a mesh's sub-groups honour it too.

    ``init_device_mesh`` builds the groups of an N-D mesh with ``new_group``, whose
    timeout is PyTorch's default (30 minutes), not the default group's; without
    this, a stalled peer in a ``mesh["tp"]`` collective would block for 30 minutes
    whatever ``init_mesh(timeout=...)`` said. A 1-D mesh reuses the default group.
    """
    if timeout is None or ndim == 1:
        return None
    if dist.get_backend() == "gloo":
        options = dist.ProcessGroupGloo._Options()
    else:
        options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return {i: (dist.get_backend(), options) for i in range(ndim)}


def default_mesh() -> DeviceMesh:
    """The mesh every layer uses for ``mesh=None``: 1-D over all ranks of the default group.

    It reuses the default group (initialised from the environment if needed, as
    :func:`init_mesh` does), so building it costs no communication.

    Returns:
        A 1-D ``DeviceMesh`` of size ``world_size``.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import torch, tplayers
        mesh = tplayers.default_mesh()
        assert mesh.ndim == 1 and mesh.size() == torch.distributed.get_world_size()
    """
    if not dist.is_initialized():
        _ensure_process_group(_default_device_type(), None)
    return DeviceMesh(_default_device_type(), torch.arange(dist.get_world_size()))


def resolve_mesh(mesh: Optional[DeviceMesh], ndim: int | Sequence[int] = 1) -> DeviceMesh:
    """``mesh`` itself, or :func:`default_mesh` for ``None``; checks its dimensionality."""
    if mesh is None:
        mesh = default_mesh()
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed DeviceMesh or None, got {type(mesh).__name__}")
    allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
    if mesh.ndim not in allowed:
        raise ValueError(
            f"mesh must be {' or '.join(f'{n}-D' for n in allowed)}, got a {mesh.ndim}-D mesh "
            f"{tuple(mesh.shape)}; slice an N-D mesh by name, e.g. mesh['tp']"
        )
    return mesh


def axis_group(mesh: DeviceMesh, dim: int = 0) -> dist.ProcessGroup:
    """Process group of mesh dimension ``dim``."""
    return mesh.get_group(dim)


def axis_rank(mesh: DeviceMesh, dim: int = 0) -> int:
    """This process's coordinate along mesh dimension ``dim``."""
    return mesh.get_local_rank(dim)


def axis_size(mesh: DeviceMesh, dim: int = 0) -> int:
    """Number of ranks along mesh dimension ``dim``."""
    return mesh.size(dim)

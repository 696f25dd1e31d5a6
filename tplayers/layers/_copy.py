"""Copying and pickling modules that hold a mesh and its process groups.

A parallel layer stores its ``DeviceMesh`` and the mesh dims' ``ProcessGroup``
objects. Process groups are live connections, not state: they cannot be
pickled, and a copy of a layer must talk over the same connections as the
original. :class:`MeshBound` makes both work:

- ``copy.deepcopy(layer)`` copies parameters, buffers and cached layouts, and
  keeps the mesh and the process groups **by reference** (the copy uses the
  very same ones, so it computes exactly what the original computes);
- ``pickle.dumps(layer)`` stores each process group as the index of the mesh
  dim it belongs to; the mesh pickles itself by group name (``DeviceMesh``'s own
  ``__getstate__``), so unpickling in a process where that mesh exists (the
  same one, or one started the same way) rebinds the groups. Layout caches are
  pickled empty (rebuilt by the first call, with its small exchange, on every rank).

Example::

    import copy, pickle, torch, tplayers
    mesh = tplayers.init_mesh()
    layer = tplayers.ColumnParallelLinear(8, 6, mesh=mesh)
    twin = copy.deepcopy(layer)                      # same mesh, own parameters
    again = pickle.loads(pickle.dumps(layer))        # groups rebound by mesh dim
    x = torch.randn(2, 8)
    torch.testing.assert_close(twin(x), layer(x))
"""

from __future__ import annotations

import copy
from typing import Any, Dict, Iterator

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MeshBound"]


def _live_refs(value: Any) -> Iterator[Any]:
    """Process groups and meshes in ``value`` (itself, or inside a list/tuple/dict)."""
    if isinstance(value, (dist.ProcessGroup, DeviceMesh)):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _live_refs(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _live_refs(v)


class _MeshDimGroup:
    """Pickled stand-in for the process group of mesh dim ``dim``."""

    __slots__ = ("dim",)

    def __init__(self, dim: int) -> None:
        self.dim = dim

    def __getstate__(self):
        return self.dim

    def __setstate__(self, dim):
        self.dim = dim


def _mesh_groups(mesh) -> Dict[str, int]:
    if mesh is None:
        return {}
    return {mesh.get_group(i).group_name: i for i in range(mesh.ndim)}


def _to_refs(value: Any, names: Dict[str, int], owner: str) -> Any:
    if isinstance(value, dist.ProcessGroup):
        if value.group_name not in names:
            raise TypeError(f"{owner}: cannot pickle a process group that is not one of its mesh's dims")
        return _MeshDimGroup(names[value.group_name])
    if isinstance(value, list):
        return [_to_refs(v, names, owner) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(_to_refs(v, names, owner) for v in value)
    return value


def _from_refs(value: Any, mesh) -> Any:
    if isinstance(value, _MeshDimGroup):
        return mesh.get_group(value.dim)
    if isinstance(value, list):
        return [_from_refs(v, mesh) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(_from_refs(v, mesh) for v in value)
    return value


class MeshBound:
    """Mixin for ``nn.Module`` subclasses holding ``self.mesh`` and process groups in attributes.

    ``deepcopy`` shares the mesh and groups with the original; ``pickle`` stores
    groups as mesh-dim references (see the module docstring).
    """

    def __deepcopy__(self, memo):
        for value in self.__dict__.values():
            for ref in _live_refs(value):
                memo.setdefault(id(ref), ref)  # shared, never copied
        cls = type(self)
        new = cls.__new__(cls)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo)
        return new

    #: per-layout caches (plans, specs holding groups and callables): pickled empty, rebuilt on
    #: the first call after unpickling (one small exchange, as for a new layer)
    _pickle_empty = ("_layouts", "_tables")

    def __getstate__(self):
        state = super().__getstate__()  # nn.Module's: a copy of __dict__
        names = _mesh_groups(state.get("mesh"))
        owner = type(self).__name__
        return {k: (type(v)() if k in self._pickle_empty else _to_refs(v, names, owner)) for k, v in state.items()}

    def __setstate__(self, state):
        mesh = state.get("mesh")
        super().__setstate__({k: _from_refs(v, mesh) for k, v in state.items()})

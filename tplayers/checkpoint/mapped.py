"""A safetensors file mapped into memory, its tensors served as zero-copy views.

The reader's replacement for ``safe_open``: the header is the one
:func:`~tplayers.checkpoint.format.read_header` already parsed and checked, the
data section is one read-only shared mapping of the file (no copy-on-write
reservation: nothing is ever written through it), and read-ahead is turned off on that
mapping directly (``MADV_RANDOM``), so touching a page reads that page only.
Slicing a view touches nothing: a rank reads exactly the pages of the bytes it
copies or hashes.

Example::

    import torch, tempfile, os
    from safetensors.torch import save_file
    from tplayers.checkpoint.format import read_header
    from tplayers.checkpoint.mapped import MappedFile
    path = os.path.join(tempfile.mkdtemp(), "t.safetensors")
    save_file({"w": torch.arange(6.0).view(2, 3)}, path)
    prefix, header, _ = read_header(path)
    f = MappedFile(path, header, len(prefix))
    assert torch.equal(f.tensor("w")[:, 1:], torch.tensor([[1.0, 2.0], [4.0, 5.0]]))
"""

from __future__ import annotations

import mmap
import os
import warnings
from typing import Dict, Sequence, Tuple

import torch

from tplayers.checkpoint.format import CheckpointError, torch_dtype

__all__ = ["MappedFile"]


def _frombuffer(buf, dtype: torch.dtype, count: int = -1, offset: int = 0) -> torch.Tensor:
    """``torch.frombuffer`` over a read-only mapping, without its "not writable" warning: these
    views are only ever read (a write would fault, which is the point of mapping read-only)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset)


class MappedFile:
    """Tensors of one safetensors file as views of one memory mapping (see the module docstring).

    ``header`` is the checked header (``{name: {"dtype", "shape", "data_offsets"}}``,
    ``__metadata__`` removed) and ``data_start`` the byte where the data section starts.
    """

    def __init__(self, path: str, header: Dict[str, dict], data_start: int) -> None:
        self.path, self.header, self.data_start = path, header, data_start
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot be opened ({e.strerror or e})") from None
        try:
            self.size = os.fstat(self._fd).st_size
            self._map = mmap.mmap(self._fd, self.size, access=mmap.ACCESS_READ) if self.size else None
        except (OSError, ValueError) as e:
            os.close(self._fd)
            raise CheckpointError(f"{path}: cannot be mapped ({e})") from None
        if self._map is not None and hasattr(mmap, "MADV_RANDOM"):
            self._map.madvise(mmap.MADV_RANDOM)  # a hint: no read-ahead around a touched page
        self._bytes = _frombuffer(self._map, torch.uint8) if self._map is not None else None

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as a view of the mapping (nothing is read until its bytes are touched)."""
        e = self.header[name]
        dtype = torch_dtype(e["dtype"], self.path)  # read_header checked it: the name of the file is enough
        begin, end = e["data_offsets"]
        begin, end = begin + self.data_start, end + self.data_start
        if begin == end:
            return torch.empty(e["shape"], dtype=dtype)
        if begin % dtype.itemsize:  # an unaligned tensor (mixed dtypes): its own typed buffer view
            flat = _frombuffer(self._map, dtype, (end - begin) // dtype.itemsize, begin)
        else:
            flat = self._bytes[begin:end].view(dtype)
        return flat.view(e["shape"])

    def shape(self, name: str) -> Tuple[int, ...]:
        """The stored shape of tensor ``name``."""
        return tuple(self.header[name]["shape"])

    def box(self, name: str, box: Sequence[Tuple[int, int]]) -> torch.Tensor:
        """``[a, b)`` of each dim of tensor ``name`` (one pair per dim; ``[]`` for a 0-d tensor), a view."""
        t = self.tensor(name)
        if all(a == 0 and b == n for (a, b), n in zip(box, t.shape)):
            return t
        return t[tuple(slice(a, b) for a, b in box)]

    def close(self) -> None:
        """Close the file and drop the mapping (it is unmapped once no view of it is alive)."""
        if self._fd is not None:
            os.close(self._fd)
        self._bytes = self._map = self._fd = None

"""The safetensors file format, written and checked by hand, plus durable file-system steps.

A safetensors file is ``u64 little-endian N`` + ``N`` bytes of JSON header +
the raw tensor bytes. We write it ourselves (instead of ``save_file``) so the
bytes can be hashed block by block as they are written, shown on a progress
bar and fsynced; the result is a standard file that ``safetensors`` reads.

Integrity: every stored tensor is cut into blocks of whole rows (rows along its
stored dim 0, about ``block_bytes`` each) and each block gets a digest
(XXH3-128 by default, SHA-256 on request: :mod:`tplayers.checkpoint.digest`); a
piece of a tensor sharded on a dim > 0 is also hashed in bands along that dim
(:mod:`tplayers.checkpoint.blocks`). A reader checks exactly the blocks or bands
it reads, so verification never forces reading the whole file. A file's digest
is the hash of its header bytes' digest followed by, per tensor in file order,
its block digests and then its band digests: it changes if any byte of the file changes.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from tplayers.checkpoint.blocks import band_digests, band_width, block_rows, byte_view, row_blocks
from tplayers.checkpoint.digest import DEFAULT, block_digest, file_hasher

#: Default size of a hashed block (whole rows are kept together).
BLOCK_BYTES = 1 << 18
#: Refuse headers larger than this (a corrupted length would otherwise ask for gigabytes).
MAX_HEADER_BYTES = 100 << 20

_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "C64": torch.complex64,
}
for _name, _attr in (
    ("U16", "uint16"),
    ("U32", "uint32"),
    ("U64", "uint64"),
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)
_NAMES = {v: k for k, v in _DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint file or index is missing, malformed, corrupted or does not fit the model.

    Raised on every rank (the message names the failing ranks, files and keys);
    the model is unchanged. A ``ValueError``, so ``except ValueError`` catches it.

    >>> read_header("/no/such/file.safetensors")
    Traceback (most recent call last):
    ...
    tplayers.checkpoint.format.CheckpointError: /no/such/file.safetensors: file not found
    """


def dtype_name(dtype: torch.dtype) -> str:
    """safetensors' name of a torch dtype (``torch.float32 -> "F32"``)."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise CheckpointError(f"dtype {dtype} cannot be stored in safetensors") from None


def torch_dtype(name: str, where: str) -> torch.dtype:
    """The torch dtype of safetensors dtype ``name``; ``where`` names the file/key for errors."""
    if name not in _DTYPES:
        raise CheckpointError(f"{where}: unknown dtype {name!r}, expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def itemsize(name: str) -> int:
    """Bytes per element of safetensors dtype ``name``."""
    return _DTYPES[name].itemsize


def _write_all(fd: int, data) -> None:
    """Write every byte of ``data`` to ``fd`` (a single seam, so tests can interrupt a save)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


#: Bytes hashed and written at a time (whole hash blocks).
CHUNK_BYTES = 64 << 20
#: Start the disk write-back of every this many bytes as soon as they are written.
WRITEBACK_BYTES = 16 << 20


class _WriteBack:
    """Start write-back of a file's dirty pages while it is still being written (Linux; a hint).

    ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` queues the pages for the disk and
    returns, so the closing ``fsync`` (which is still what makes the file
    durable) finds little left to do. Elsewhere it does nothing.
    """

    _fn = None

    def __init__(self, fd: int) -> None:
        self.fd, self.done, self.written = fd, 0, 0
        if _WriteBack._fn is None:
            fn = (
                getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)
                if sys.platform.startswith("linux")
                else None
            )
            if fn is not None:
                fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
            _WriteBack._fn = fn or False

    def wrote(self, n: int) -> None:
        self.written += n
        if _WriteBack._fn and self.written - self.done >= WRITEBACK_BYTES:
            _WriteBack._fn(self.fd, self.done, self.written - self.done, 2)  # SYNC_FILE_RANGE_WRITE
            self.done = self.written


class _Stager:
    """Contiguous chunks of whole hash blocks of the tensors to write, staging non-contiguous ones.

    A contiguous tensor is sliced (no copy). Any other (a block narrowed out of a
    fused tensor along a dim > 0) is first copied whole into one of two reused
    buffers; reusing them avoids page-faulting fresh memory for every tensor.
    Double buffering: before a buffer is refilled,
    the hash job that last read it is waited for.
    """

    def __init__(self) -> None:
        self.buffers = [torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)]
        self.readers: List[Optional[Future]] = [None, None]  # last hash job reading each buffer
        self.turn = 0

    def chunks(self, t: torch.Tensor, k: int) -> Iterator[Tuple[torch.Tensor, Optional[int]]]:
        """``(chunk, slot)`` pairs covering ``t`` (rows along dim 0); ``slot`` is the buffer used, or None."""
        if t.dim() == 0:
            yield t.reshape(1).contiguous(), None
            return
        slot = None
        if not t.is_contiguous():
            slot, self.turn = self.turn, 1 - self.turn
            if self.readers[slot] is not None:
                self.readers[slot].result()
            need = t.numel() * t.element_size()
            if self.buffers[slot].numel() < need:
                self.buffers[slot] = torch.empty(need, dtype=torch.uint8)
            staged = self.buffers[slot][:need].view(t.dtype).view(t.shape)
            staged.copy_(t)
            t = staged
        row = t[:1].numel() * t.element_size()
        step = k * max(1, CHUNK_BYTES // max(row * k, 1))
        for i in range(0, t.shape[0], step):
            yield t[i : i + step], slot


def _hash_blocks(blocks: Sequence[memoryview], digest: Callable[[object], bytes]) -> List[bytes]:
    return [digest(b) for b in blocks]


class Hashed(NamedTuple):
    """The digests :func:`write_file` took of one tensor (hex strings)."""

    block_rows: int
    digests: List[str]
    band: Optional[int] = None  # indices of the band dim per band; None: no bands
    band_digests: Optional[List[str]] = None


def write_file(
    path: str,
    items: Sequence[Tuple[str, torch.Tensor]],
    metadata: Optional[Dict[str, str]] = None,
    *,
    block_bytes: int = BLOCK_BYTES,
    on_bytes: Optional[Callable[[int], None]] = None,
    hashes: bool = True,
    algorithm: str = DEFAULT,
    band_dims: Optional[Dict[str, int]] = None,
) -> Tuple[int, str, Dict[str, Hashed]]:
    """Write ``items`` (name, CPU tensor) as a standard safetensors file and fsync it.

    A tensor is stored as its logical row-major bytes; a non-contiguous one (a
    narrowed view) is staged through a reused buffer. The bytes go
    out in chunks of whole blocks, each hashed on a second thread while this one
    writes it, and the disk write-back starts as the file grows.
    ``band_dims`` (``{name: dim}``): also hash those tensors in bands along ``dim``
    (:mod:`tplayers.checkpoint.blocks`), on the same second thread.
    ``hashes=False`` skips the digests (the returned digest and lists are then empty).
    ``algorithm`` names the digest (:data:`tplayers.checkpoint.digest.ALGORITHMS`).

    Returns ``(size, file digest hex, {name: Hashed})``.
    The file must not exist yet (we only ever write into fresh temp paths).
    """
    header, offset = {}, 0
    for name, t in items:
        n = t.numel() * t.element_size()
        header[name] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = dict(metadata)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    prefix = struct.pack("<Q", len(raw)) + raw
    band_dims = band_dims or {}
    plan = [(name, block_rows(t.shape, t.element_size(), block_bytes), t) for name, t in items]
    widths = {
        name: band_width(t.shape, band_dims[name], t.element_size(), block_bytes)
        for name, t in items
        if name in band_dims
    }
    digest_fn = block_digest(algorithm) if hashes else None
    hashed: List[List[Future]] = [[] for _ in plan]
    banded: Dict[str, Future] = {}
    stager, scratch = _Stager(), [None]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    # Hash on a second thread while this one stages and writes (both release the GIL).
    with ThreadPoolExecutor(1) as pool:
        try:
            back = _WriteBack(fd)
            _write_all(fd, prefix)
            back.wrote(len(prefix))
            for (name, k, t), futures in zip(plan, hashed):
                if hashes and name in widths:  # reads ``t`` itself (never a staging buffer), in bands
                    banded[name] = pool.submit(band_digests, t, band_dims[name], widths[name], digest_fn, scratch)
                for chunk, slot in stager.chunks(t, k):
                    if hashes:
                        futures.append(pool.submit(_hash_blocks, row_blocks(chunk, k), digest_fn))
                        if slot is not None:
                            stager.readers[slot] = futures[-1]
                    data = byte_view(chunk)
                    _write_all(fd, data)
                    back.wrote(len(data))
                    if on_bytes is not None:
                        on_bytes(len(data))
            os.fsync(fd)
        finally:
            os.close(fd)
        digests = [[d for f in futures for d in f.result()] for futures in hashed]
        band_out = {name: f.result() for name, f in banded.items()}
    digest = file_hasher(algorithm, prefix)
    out: Dict[str, Hashed] = {}
    for (name, k, _), ds in zip(plan, digests):
        bs = band_out.get(name)
        for d in ds + (bs or []):
            digest.update(d)
        out[name] = Hashed(
            k,
            [d.hex() for d in ds],
            widths.get(name) if bs is not None else None,
            [d.hex() for d in bs] if bs is not None else None,
        )
    return len(prefix) + offset, digest.hexdigest() if hashes else "", out


def read_header(path: str) -> Tuple[bytes, Dict[str, dict], Dict[str, str]]:
    """Read and check the header of safetensors file ``path``.

    Returns ``(prefix bytes, {name: entry}, metadata)``. Raises
    :class:`CheckpointError` naming the file for a missing or truncated file, a
    header length larger than the file, malformed JSON, unknown dtypes, or data
    offsets that do not tile the data region exactly.
    """
    try:
        size = os.path.getsize(path)
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be opened ({e.strerror or e})") from None
    try:
        if hasattr(os, "posix_fadvise"):  # no kernel read-ahead: read the header, not megabytes after it
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated file ({size} bytes, no header length)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: header length {n} exceeds the file ({size} bytes): truncated or corrupted")
        raw = os.pread(fd, n, 8)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from None
    finally:
        os.close(fd)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: malformed header JSON ({type(e).__name__}: {e})") from None
    try:
        meta = _check_header(path, header, size - 8 - n)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, RecursionError, OverflowError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{path}: malformed header ({type(e).__name__}: {e})") from None
    return head + raw, header, meta


def _check_header(path: str, header, data_bytes: int) -> Dict[str, str]:
    """Validate a parsed header in place (``__metadata__`` popped); returns the metadata."""
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header must be a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CheckpointError(f"{path}: __metadata__ must map strings to strings, got {meta!r:.120}")
    spans = []
    for name, e in header.items():
        where = f"{path}: tensor {name!r}"
        if not (isinstance(e, dict) and isinstance(e.get("shape"), list) and isinstance(e.get("data_offsets"), list)):
            raise CheckpointError(f"{where}: malformed header entry")
        offsets = e["data_offsets"]
        if not all(_nonneg_int(s) for s in e["shape"]) or len(offsets) != 2 or not all(_nonneg_int(o) for o in offsets):
            raise CheckpointError(f"{where}: malformed shape or data_offsets")
        numel = 1
        for s in e["shape"]:
            numel *= s
        begin, end = offsets
        if end - begin != numel * itemsize(_check_name(e.get("dtype"), where)):
            raise CheckpointError(f"{where}: data_offsets {offsets} do not match shape {e['shape']}")
        spans.append((begin, end))
    expect = 0
    for begin, end in sorted(spans):
        if begin != expect:
            raise CheckpointError(f"{path}: tensor data is not contiguous at byte {begin} (expected {expect})")
        expect = end
    if expect != data_bytes:
        raise CheckpointError(
            f"{path}: header describes {expect} data bytes but the file holds {data_bytes}: truncated or corrupted"
        )
    return meta


def _nonneg_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_name(name, where: str) -> str:
    """``name`` if it is a known safetensors dtype name, else :class:`CheckpointError`."""
    torch_dtype(name if isinstance(name, str) else repr(name), where)
    return name

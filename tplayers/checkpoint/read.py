"""Read exactly the byte ranges a layout needs from a checkpoint, checking them as they come.

:class:`Reader` serves "the part of tensor ``key`` that holds ``[start, stop)``
of dim ``dim``" from whatever pieces the checkpoint has, through
one memory mapping per file (:class:`~tplayers.checkpoint.mapped.MappedFile`, the
bytes ``safe_open(...).get_slice`` would read, as views). Pieces are stored in their natural layout
(the tensor narrowed to the piece's range), so a piece read whole, or
along dim 0, is one contiguous span, and part of the range of a piece sharded
on a dim > 0 is part of each of its rows. With ``verify=True`` the read is
widened to whole hashed row blocks, or for that last case to whole bands along
the shard dim (at most one block or band extra at each end), and every block or
band read is checked against its digest (the algorithm the index names:
XXH3-128, or SHA-256 when saved with ``digest="sha256"``): bytes that are read are verified,
and bytes that are not needed are not read.
"""

from __future__ import annotations

import os
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from tplayers.checkpoint.blocks import band_digests, row_blocks
from tplayers.checkpoint.digest import DEFAULT, block_digest, file_hasher, label
from tplayers.checkpoint.format import CheckpointError, read_header, torch_dtype
from tplayers.checkpoint.index import Piece, Source, TensorEntry, stored_shape
from tplayers.checkpoint.mapped import MappedFile
from tplayers.checkpoint.pagecache import advise_exact_read

#: Bytes of page reads kept in flight ahead of the part being checked.
PREFETCH_BYTES = 512 << 20


class Part(NamedTuple):
    """One stored piece's share of a read, mapped but not yet read (see :meth:`Reader.plan`)."""

    key: str
    where: str  # "file: tensor 'key'" for messages
    piece: Piece
    dest: tuple  # slices of the requested box this part fills (``()``: all of it)
    mapped: torch.Tensor  # the stored part to read, a view of the mapped file
    first_block: Optional[int]  # index of mapped's first hashed block or band; None: not verified
    trim: tuple  # slices of ``mapped`` that were asked for (``()``: all of it)
    band_dim: Optional[int] = None  # verified in bands along this dim; None: in row blocks

    @property
    def nbytes(self) -> int:
        return self.mapped.numel() * self.mapped.element_size()


class Reader:
    """Read boxes of checkpoint tensors; counts ``bytes_read`` (tensor bytes mapped to be read).

    Example::

        with Reader(open_source("ckpt/")) as r:
            parts = r.read("0.weight", dim=0, start=3, stop=7)   # [(dest slices, tensor), ...]
    """

    def __init__(self, source: Source, *, verify: bool = True) -> None:
        self.source, self.verify = source, verify
        self.algorithm = source.info.get("algorithm") or DEFAULT
        self._digest = block_digest(self.algorithm) if source.files else None
        self.bytes_read = 0
        self.header_bytes = 0
        self._scratch: list = [None]  # reused for gathering bands
        self._handles: Dict[str, MappedFile] = {}
        self._in_file: Dict[str, Dict[str, Tuple[TensorEntry, Piece]]] = {}
        for key, entry in source.tensors.items():
            for p in entry.pieces:
                self._in_file.setdefault(p.file, {})[p.name or key] = (entry, p)

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for f in self._handles.values():
            f.close()
        self._handles = {}

    def check_files_present(self) -> None:
        """Cheap check of every file the index names: present and of the recorded size."""
        for path, info in self.source.files.items():
            if not os.path.isfile(path):
                raise CheckpointError(f"{path}: shard file missing")
            size = os.path.getsize(path)
            if size != info["size"]:
                raise CheckpointError(f"{path}: {size} bytes, the index says {info['size']}: truncated or replaced")

    def _open(self, path: str) -> MappedFile:
        if path not in self._handles:
            prefix, header = self._check_header(path)
            self._handles[path] = MappedFile(path, header, len(prefix))
        return self._handles[path]

    def _check_header(self, path: str) -> Tuple[bytes, Dict[str, dict]]:
        """The checked header of ``path`` (``(prefix bytes, {name: entry})``), matched against the index."""
        prefix, header, _ = read_header(path)
        self.header_bytes += len(prefix)
        info = self.source.files.get(path)
        if info is None:  # a plain safetensors file: its own header is the source
            return prefix, header
        expected = self._in_file.get(path, {})
        if set(header) != set(expected):
            raise CheckpointError(
                f"{path}: holds tensors {sorted(set(header) - set(expected))} the index does not list there "
                f"and lacks {sorted(set(expected) - set(header))}"
            )
        digest, hexes = file_hasher(self.algorithm, prefix), []
        for key in sorted(header, key=lambda k: header[k]["data_offsets"][0]):
            entry, piece = expected[key]
            got = (tuple(header[key]["shape"]), header[key]["dtype"])
            want = (stored_shape(entry.shape, entry.dim, piece.start, piece.stop), entry.dtype)
            if got != want:
                raise CheckpointError(f"{path}: tensor {key!r} is stored as {got}, the index says {want}")
            hexes.append("".join(piece.digests + (piece.band_digests or ())))
        digest.update(bytes.fromhex("".join(hexes)))  # a running hash: the same as one update per digest
        if digest.hexdigest() != info["digest"]:
            raise CheckpointError(
                f"{path}: {label(self.algorithm)} of header and block digests does not match the index: "
                "file or index corrupted"
            )
        return prefix, header

    def plan(self, key: str, dim: Optional[int], start: int = 0, stop: int = 0) -> List[Part]:
        """Map the parts of ``key`` covering ``[start, stop)`` of ``dim`` (all of it if ``dim`` is None).

        Nothing is read yet: each :class:`Part` holds a memory-mapped view of
        the stored rows (widened to whole hashed blocks when verifying), so
        :meth:`fetch_all` can ask the kernel for every part's pages up front.
        """
        entry = self.source.tensors[key]
        nd = len(entry.shape)
        lo, hi = [0] * nd, list(entry.shape)
        if dim is not None:
            lo[dim], hi[dim] = start, stop
        if any(h <= l for l, h in zip(lo, hi)):
            return []  # an empty box: nothing to read
        out = []
        for p in entry.pieces:
            plo, phi = [0] * nd, list(entry.shape)
            if entry.dim is not None:
                plo[entry.dim], phi[entry.dim] = p.start, p.stop
            ilo = [max(a, b) for a, b in zip(lo, plo)]
            ihi = [min(a, b) for a, b in zip(hi, phi)]
            if any(h <= l for l, h in zip(ilo, ihi)):
                continue
            want = [(ilo[g] - plo[g], ihi[g] - plo[g]) for g in range(nd)]  # stored coordinates
            whole = ilo == lo and ihi == hi  # the part fills the requested box
            dest = () if whole else tuple(slice(ilo[g] - lo[g], ihi[g] - lo[g]) for g in range(nd))
            band_dim = entry.dim if p.band is not None else None
            out.append(self._map_stored(key, p, want, dest, band_dim))
        return out

    def fetch_all(self, parts: Sequence[Part], window: Optional[int] = None) -> Iterator[Tuple[Part, torch.Tensor]]:
        """Yield ``(part, tensor)`` for each part, checked; ``tensor`` goes to ``box[part.dest]``.

        Pages are requested (``MADV_WILLNEED``) up to ``window`` bytes ahead of
        the part being hashed, so the disk works while the CPU verifies: the
        same bytes as reading part by part, in flight together.
        """
        window = PREFETCH_BYTES if window is None else window
        ahead, in_flight = 0, 0
        for i, part in enumerate(parts):
            while ahead < len(parts) and (ahead <= i or in_flight < window):
                advise_exact_read(parts[ahead].mapped)
                in_flight += parts[ahead].nbytes
                ahead += 1
            yield part, self._check(part)
            in_flight -= part.nbytes

    def read(self, key: str, dim: Optional[int], start: int = 0, stop: int = 0) -> List[Tuple[tuple, torch.Tensor]]:
        """The parts of ``key`` covering ``[start, stop)`` of ``dim`` (the whole tensor if ``dim`` is None).

        Returns ``[(dest, tensor)]``: ``tensor`` goes to ``local[dest]`` where
        ``local`` is the requested box (natural dim order).
        """
        return [(part.dest, t) for part, t in self.fetch_all(self.plan(key, dim, start, stop))]

    def read_box(self, key: str, dim: Optional[int] = None, start: int = 0, stop: int = 0) -> torch.Tensor:
        """``[start, stop)`` of ``dim`` of ``key`` (all of it when ``dim`` is None) as one new tensor."""
        entry = self.source.tensors[key]
        shape = list(entry.shape)
        if dim is not None:
            shape[dim] = stop - start
        box = torch.empty(shape, dtype=torch_dtype(entry.dtype, key))
        for dest, t in self.read(key, dim, start, stop):
            (box[dest] if dest else box).copy_(t)
        return box

    def _map_stored(
        self, key: str, p: Piece, want: List[Tuple[int, int]], dest: tuple, band_dim: Optional[int]
    ) -> Part:
        """Map ``want`` (a box in stored coordinates) of piece ``p``; when verifying, widened to the
        whole row blocks, or (a box narrowed along ``band_dim`` only) the whole bands, it touches."""
        f = self._open(p.file)
        where = f"{p.file}: tensor {key!r}"
        verified = self.verify and p.digests is not None
        stored_name = p.name or key
        if not want:  # a 0-d tensor
            t = f.box(stored_name, [])
            self.bytes_read += t.element_size()
            return Part(key, where, p, dest, t, 0 if verified else None, ())
        shape = f.shape(stored_name)
        box, first, by_band = want, None, None
        if verified:
            narrowed = [g for g, (a, b) in enumerate(want) if (a, b) != (0, shape[g])]
            if band_dim is not None and narrowed == [band_dim]:
                by_band, k = band_dim, p.band
            else:  # rows: any box narrowed along dim 0 only, or else every row of the piece
                k = p.block_rows
            g = 0 if by_band is None else by_band
            a, b = want[g] if narrowed in ([], [g]) else (0, shape[g])
            box = [(0, n) for n in shape]
            box[g] = (a // k * k, min(-(-b // k) * k, shape[g]))
            first = box[g][0] // k
        t = f.box(stored_name, box)
        self.bytes_read += t.numel() * t.element_size()
        trim = () if box is want else tuple(slice(x - bx, y - bx) for (x, y), (bx, _) in zip(want, box))
        return Part(key, where, p, dest, t, first, trim, by_band)

    def _check(self, part: Part) -> torch.Tensor:
        """``part``'s tensor (trimmed to what was asked for), its blocks or bands checked against their digests."""
        t = part.mapped
        if part.first_block is not None:
            if part.band_dim is None:
                self._check_blocks(part.where, part.piece, t.contiguous(), part.first_block)
            else:
                self._check_bands(part.where, part.piece, t, part.band_dim, part.first_block)
        return t[part.trim] if part.trim else t

    def _check_bands(self, where: str, p: Piece, t: torch.Tensor, dim: int, first: int) -> None:
        for i, got in enumerate(band_digests(t, dim, p.band, self._digest, self._scratch)):
            j = first + i
            if got.hex() != p.band_digests[j]:
                raise CheckpointError(
                    f"{where}: band {j} (indices [{j * p.band}, {(j + 1) * p.band}) of dim {dim} of the stored "
                    f"piece) fails its {label(self.algorithm)}: the file is corrupted"
                )

    def _check_blocks(self, where: str, p: Piece, t: torch.Tensor, first: int) -> None:
        if not (self.verify and p.digests is not None):
            return
        digest = self._digest
        for i, blk in enumerate(row_blocks(t, p.block_rows)):
            j = first + i
            if digest(blk).hex() != p.digests[j]:
                raise CheckpointError(
                    f"{where}: block {j} (stored rows [{j * p.block_rows}, {(j + 1) * p.block_rows})) fails its "
                    f"{label(self.algorithm)}: the file is corrupted"
                )

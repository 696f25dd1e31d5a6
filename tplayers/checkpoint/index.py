"""The JSON index of a sharded checkpoint directory, and a uniform view of either checkpoint form.

``DIR/index.json``::

    {
      "format": "tplayers.checkpoint", "version": 3, "digest": "xxh3_128", "layout": "natural",
      "convention": "balanced-first-remainder",   # tplayers.sharding.CONVENTION at save time
      "world_size": 2, "block_bytes": 262144,
      "files": {"rank-00000-of-00002.safetensors": {"size": 123, "digest": "<32 hex>"}, ...},
      "tensors": {
        "0.weight": {"shape": [30, 16], "dtype": "F32", "dim": 0,
                     "pieces": [{"file": "rank-00000-of-00002.safetensors", "start": 0, "stop": 15,
                                 "block_rows": 4096, "digests": ["<32 hex>", ...]}, ...]},
        "1.weight": {"shape": [16, 30], "dtype": "F32", "dim": 1,
                     "pieces": [{"file": "...", "start": 0, "stop": 15, "block_rows": 16,
                                 "digests": [...], "band": 15, "band_digests": [...]}, ...]},
        "2.bias":   {"shape": [16], "dtype": "F32", "dim": null,
                     "pieces": [{"file": "...", "block_rows": 65536, "digests": [...]}]}},
      "index_sha256": "<64 hex>"
    }

A piece of a tensor sharded along ``dim`` holds global range ``[start, stop)``
of that dim and is stored in its natural layout (the tensor narrowed to that
range), so a rank that loads the layout it saved reads each piece as one
contiguous span and copies it straight into its parameter. A rank that holds
several ranges (a fused layer's blocks, each sharded on its own) writes each as
its own piece; all but one per file carry ``"name": "key[start:stop]"``, the
safetensors key they are stored under (default: the tensor's key). A replicated
tensor (``dim: null``) is one piece. ``digests`` lists the digests of blocks of
``block_rows`` stored rows (dim 0), with the algorithm named by ``digest``
(:mod:`tplayers.checkpoint.digest`: ``xxh3_128`` by default, ``sha256`` on
request). A piece of a tensor sharded on ``dim > 0`` also lists
``band_digests``: digests of its bands of ``band`` indices along ``dim``
(:mod:`tplayers.checkpoint.blocks`), so a resharding reader that holds only
some of those indices checks just the bands it reads. A file's ``digest`` is
the hash of its header bytes' digest followed by, per tensor in file order, its
block digests and then its band digests.

There is one format before tplayers 1.0: this one. An index written by an
older tplayers (``version`` 1 or 2, or version 3 with ``"layout":
"shard-dim-first"``: pieces stored with their shard dim moved first) is refused
with a :class:`CheckpointError` that names the format and says how to convert it
(load and save it once with tplayers <= 0.1, whose default writes this format).

``index_sha256`` is the SHA-256 of the index itself: of its canonical
JSON (sorted keys, no spaces) without that one field. It covers every field that
decides where bytes land (shapes, dtypes, dims, ranges, file names and sizes,
block sizes and digests), so an edited or corrupted index is a
:class:`CheckpointError` naming ``index.json`` instead of wrong weights. It is
checked on every load, with or without ``verify`` (it costs microseconds; only
the data blocks' hashes are skipped by ``verify=False``).

A plain safetensors file (e.g. from ``consolidated=True`` or ``save_file``)
reads as the same structure: every tensor replicated, one piece, no block hashes.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from dataclasses import dataclass
from typing import Dict, NamedTuple, Optional, Tuple

from tplayers.checkpoint.digest import ALGORITHMS, DEFAULT, hex_length
from tplayers.checkpoint.format import CheckpointError, read_header, torch_dtype
from tplayers.checkpoint.layout import check_tiling
from tplayers.checkpoint.signature import _signed_body, index_digest

FORMAT = "tplayers.checkpoint"
VERSION = 3
INDEX_NAME = "index.json"
#: The one piece layout: a piece is the tensor narrowed to its range (recorded in the index as ``layout``).
NATURAL = "natural"
#: The last tplayers release that reads (and re-saves as this format) the older ones.
LAST_OLD_READER = "0.1"
_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\.safetensors")


class Piece(NamedTuple):
    """One stored piece: ``[start, stop)`` of the tensor's shard dim in ``file`` under ``name``."""

    file: str  # a path (directory + name) ready to open
    start: int
    stop: int
    block_rows: Optional[int]  # None: no block hashes (plain files)
    digests: Optional[Tuple[str, ...]]
    name: str = ""  # the safetensors key in ``file``: the tensor's key unless the index says otherwise
    band: Optional[int] = None  # shard-dim indices per hashed band (dim > 0); None: no bands
    band_digests: Optional[Tuple[str, ...]] = None


class TensorEntry(NamedTuple):
    shape: Tuple[int, ...]
    dtype: str
    dim: Optional[int]
    pieces: Tuple[Piece, ...]


@dataclass
class Source:
    """Everything a loader needs to know about a checkpoint, either form."""

    path: str
    tensors: Dict[str, TensorEntry]
    files: Dict[str, dict]  # path -> {"size", "digest"} (empty for a plain file)
    info: dict  # format, version, convention, world_size, block_bytes, algorithm


def open_source(path: str) -> Source:
    """Parse and validate a checkpoint directory's index, or a plain safetensors file's header."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return _parse_index(path)
    if os.path.isfile(path):
        _, header, meta = read_header(path)
        tensors = {
            k: TensorEntry(tuple(e["shape"]), e["dtype"], None, (Piece(path, 0, 0, None, None, k),))
            for k, e in header.items()
        }
        return Source(path, tensors, {}, {"format": "safetensors", "metadata": meta, "algorithm": None})
    raise CheckpointError(f"{path}: no checkpoint here (neither a checkpoint directory nor a safetensors file)")


_HEX = re.compile("[0-9a-f]*")  # a digest list, checked joined (error messages' slow path)


def _need(cond: bool, where, what) -> None:
    """Raise :class:`CheckpointError` ``"where: what"`` unless ``cond``; ``where`` and ``what`` may be
    callables, formatted only on failure (the per-piece messages would otherwise cost most of a parse)."""
    if not cond:
        where, what = (x() if callable(x) else x for x in (where, what))
        raise CheckpointError(f"{where}: {what}")


def _int(v) -> bool:
    return type(v) is int and v >= 0  # JSON gives plain ints; a bool is not one


def stored_shape(shape: Tuple[int, ...], dim: Optional[int], start: int, stop: int) -> Tuple[int, ...]:
    """Shape of the stored piece ``[start, stop)`` of ``dim`` of a tensor of ``shape``: the tensor
    narrowed to that range (``shape`` if ``dim`` is None).

    >>> stored_shape((6, 7), 1, 4, 7)
    (6, 3)
    """
    if dim is None:
        return tuple(shape)
    s = list(shape)
    s[dim] = stop - start
    return tuple(s)


def older_format(raw: dict) -> Optional[str]:
    """Why an index (a parsed JSON object of format :data:`FORMAT`) was written by an older tplayers,
    or None when it is this format: the version it names, or version 3's dropped shard-dim-first layout.

    >>> older_format({"version": 2})
    'written by an older tplayers (format v2): re-save it with tplayers <= 0.1 (load it, save it again)'
    >>> older_format({"version": 3, "layout": "natural"}) is None
    True
    """
    version, layout = raw.get("version"), raw.get("layout", NATURAL)
    if version in (1, 2) and not isinstance(version, bool):
        what = f"format v{version}"
    elif version == VERSION and not isinstance(version, bool) and layout == "shard-dim-first":
        what = f"format v{version}, layout {layout!r}"
    else:
        return None
    return (
        f"written by an older tplayers ({what}): re-save it with tplayers <= {LAST_OLD_READER} (load it, save it again)"
    )


def _digest_list(digests, count: int, hex_len: int) -> bool:
    """``digests`` is a list of ``count`` lowercase hex strings of ``hex_len`` characters each."""
    if not isinstance(digests, list) or len(digests) != count:
        return False
    if count and (set(map(type, digests)) != {str} or set(map(len, digests)) != {hex_len}):
        return False
    return _HEX.fullmatch("".join(digests)) is not None


def _digest_pool_ok(pool: list, hex_len: int) -> bool:
    """Every item of the lists in ``pool`` is a string of ``hex_len`` lowercase hex characters.

    C-level passes over all of them at once: joined by spaces, the spaces must sit exactly
    between items and ``bytes.fromhex`` must find ``hex_len`` digits per item (any other character,
    or a space inside an item, fails one of the two), and lowercasing must change nothing.
    """
    count = sum(map(len, pool))
    if not count:
        return True
    try:
        joined = " ".join(itertools.chain.from_iterable(pool))
    except TypeError:  # an item that is not a string
        return False
    if len(joined) != count * (hex_len + 1) - 1 or joined[hex_len :: hex_len + 1] != " " * (count - 1):
        return False
    try:
        digits = 2 * len(bytes.fromhex(joined))
    except ValueError:
        return False
    return digits == count * hex_len and joined.lower() == joined


def _parse_index(directory: str) -> Source:
    where = os.path.join(directory, INDEX_NAME)
    try:
        with open(where, "rb") as f:
            data = f.read()
        signed = _signed_body(data)
        raw = signed if signed is not None else json.loads(data)
    except FileNotFoundError:
        raise CheckpointError(f"{where}: missing; {directory} is not a tplayers checkpoint directory") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{where}: malformed JSON ({type(e).__name__}: {e})") from None
    except OSError as e:
        raise CheckpointError(f"{where}: cannot be read ({e})") from None
    try:
        return _parse_raw(directory, where, raw, signed is not None)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, RecursionError, OverflowError) as e:
        if isinstance(e, CheckpointError):
            raise
        # A shape of JSON no explicit check above foresaw: still an error naming the file.
        raise CheckpointError(f"{where}: malformed index ({type(e).__name__}: {e})") from None


def _parse_raw(directory: str, where: str, raw, signed: bool = False) -> Source:
    _need(isinstance(raw, dict), where, "must be a JSON object")
    _need(raw.get("format") == FORMAT, where, f"format must be {FORMAT!r}, got {raw.get('format')!r}")
    older = older_format(raw)
    _need(older is None, where, older)
    version = raw.get("version")
    _need(
        version == VERSION and not isinstance(version, bool),
        where,
        f"unsupported version {version!r:.80} (this reader knows {VERSION})",
    )
    _need(isinstance(raw.get("convention"), str), where, "missing shard convention name")
    _need(
        _int(raw.get("world_size")) and raw["world_size"] >= 1,
        where,
        f"world_size must be a positive int, got {raw.get('world_size')!r:.80}",
    )
    _need(
        _int(raw.get("block_bytes")) and raw["block_bytes"] >= 1,
        where,
        f"block_bytes must be a positive int, got {raw.get('block_bytes')!r:.80}",
    )
    algorithm = raw.get("digest")
    _need(algorithm in ALGORITHMS, where, f"digest must be one of {list(ALGORITHMS)}, got {algorithm!r:.80}")
    layout = raw.get("layout", NATURAL)
    _need(layout == NATURAL, where, f"layout must be {NATURAL!r}, got {layout!r:.80}")
    hex_digest = re.compile(f"[0-9a-f]{{{hex_length(algorithm)}}}")
    hex_len = hex_length(algorithm)
    files, tensors = raw.get("files"), raw.get("tensors")
    _need(isinstance(files, dict) and isinstance(tensors, dict), where, "needs 'files' and 'tensors' objects")
    real_dir = os.path.realpath(directory)
    out_files = {}
    for name, info in files.items():
        ok = isinstance(name, str) and _SAFE_NAME.fullmatch(name) is not None
        full = os.path.join(directory, name) if ok else str(name)
        _need(
            ok and os.path.dirname(os.path.realpath(full)) == real_dir,
            where,
            f"file name {name!r} is not a plain *.safetensors name inside {directory} (path traversal?)",
        )
        _need(
            isinstance(info, dict)
            and _int(info.get("size"))
            and isinstance(info.get("digest"), str)
            and hex_digest.fullmatch(info["digest"]) is not None,
            where,
            f"file {name!r}: needs an int size and a {algorithm} 'digest'",
        )
        out_files[full] = {"size": info["size"], "digest": info["digest"]}
    full_of = {name: os.path.join(directory, name) for name in files}
    pool: list = []  # every digest of every piece: their strings are checked together at the end
    out = {}
    for key, t in tensors.items():
        w = lambda: f"{where}: tensor {key!r}"  # noqa: E731 - formatted on failure only
        _need(
            isinstance(t, dict) and isinstance(t.get("shape"), list) and all(_int(s) for s in t["shape"]),
            w,
            "bad shape",
        )
        shape, dim = tuple(t["shape"]), t.get("dim")
        dtype = t.get("dtype") if isinstance(t.get("dtype"), str) else repr(t.get("dtype"))
        try:
            torch_dtype(dtype, "")
        except CheckpointError:
            torch_dtype(dtype, w())  # raises, naming the tensor
        _need(
            dim is None or (_int(dim) and dim < len(shape)),
            w,
            lambda: f"shard dim {dim!r} out of range for shape {list(shape)}",
        )
        pieces = t.get("pieces")
        _need(isinstance(pieces, list), w, "needs a 'pieces' list")
        parsed = []
        banded = dim not in (None, 0)
        for p in pieces:
            _need(
                type(p) is dict and p.get("file") in files, w, lambda: f"piece names a file not in 'files': {p!r:.200}"
            )
            start, stop = (p.get("start"), p.get("stop")) if dim is not None else (0, 0)
            _need(
                _int(start) and _int(stop) and (dim is None or start < stop <= shape[dim]),
                w,
                lambda: (
                    f"piece range [{start}, {stop}) is not a non-empty range of dim length {shape[dim] if dim is not None else '-'}"
                ),
            )
            stored = stored_shape(shape, dim, start, stop)
            rows = stored[0] if stored else 1
            k, digests = p.get("block_rows"), p.get("digests")
            _need(
                _int(k) and k >= 1 and type(digests) is list and len(digests) == -(-rows // k),
                w,
                lambda: f"piece in {p['file']}: block_rows / digests list malformed",
            )
            pool.append(digests)
            name = p.get("name", key)
            _need(
                type(name) is str and name != "__metadata__",
                w,
                lambda: f"piece in {p['file']}: bad stored name {name!r:.80}",
            )
            band, band_digests = None, None
            if banded:
                band, band_digests = p.get("band"), p.get("band_digests")
                _need(
                    _int(band)
                    and band >= 1
                    and type(band_digests) is list
                    and len(band_digests) == -(-(stop - start) // band),
                    w,
                    lambda: f"piece in {p['file']}: band / band_digests malformed",
                )
                pool.append(band_digests)
                band_digests = tuple(band_digests)
            parsed.append(Piece(full_of[p["file"]], start, stop, k, tuple(digests), name, band, band_digests))
        if dim is None:
            _need(len(parsed) == 1, w, lambda: f"a replicated tensor needs exactly 1 piece, got {len(parsed)}")
        else:
            parsed.sort(key=lambda p: p.start)
            check_tiling(
                w(),
                shape[dim],
                [(p.start, p.stop) for p in parsed],
                lambda rng: next(os.path.basename(p.file) for p in parsed if (p.start, p.stop) == rng),
            )
        out[key] = TensorEntry(shape, t["dtype"], dim, tuple(parsed))
    if not _digest_pool_ok(pool, hex_len):  # the slow path names the first bad piece
        for key, t in tensors.items():
            for p in t["pieces"]:
                for field in ("digests", "band_digests"):
                    _need(
                        field not in p or _digest_list(p[field], len(p[field]), hex_len),
                        f"{where}: tensor {key!r}",
                        lambda: f"piece in {p['file']}: {field} must be {hex_len}-character lowercase hex strings",
                    )
        _need(False, where, f"digest lists malformed (each must hold {hex_len}-character lowercase hex strings)")
    if not signed:  # after the structure, so a structural error keeps its precise message
        digest = raw.get("index_sha256")
        _need(
            isinstance(digest, str) and digest == index_digest(raw),
            where,
            "index digest mismatch: index.json was edited or corrupted (its index_sha256 does not "
            "match its contents), so it cannot be trusted to say where bytes belong",
        )
    info = {k: raw.get(k) for k in ("format", "version", "convention", "world_size", "block_bytes")}
    info["algorithm"] = algorithm
    return Source(directory, out, out_files, info)


def build_index(
    world: int,
    convention: str,
    block_bytes: int,
    files: Dict[str, dict],
    tensors: Dict[str, dict],
    algorithm: str = DEFAULT,
) -> bytes:
    """Serialise an index (see the module docstring for the fields)."""
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "digest": algorithm,
        "layout": NATURAL,
        "convention": convention,
        "world_size": world,
        "block_bytes": block_bytes,
        "files": files,
        "tensors": tensors,
    }
    doc["index_sha256"] = index_digest(doc)
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()  # canonical: see _signed_body

"""Save a model as a sharded checkpoint directory or one consolidated safetensors file (collective).

Crash safety. Everything is written under a temporary sibling of ``path``
(``.<name>.tmp-<token>``), every file is fsynced, then the directory, then it
is moved into place by :func:`tplayers.checkpoint.commit.commit`: a rename, or
an atomic exchange with the previous checkpoint followed by deleting it. A
crash before the move leaves the previous checkpoint untouched (plus a stray
temp sibling, safe to delete); after it, the new one is complete.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from typing import Dict, Optional, Sequence

import torch
from torch import nn

from tplayers.checkpoint.commit import commit, fsync_dir
from tplayers.checkpoint.digest import DEFAULT, check_algorithm
from tplayers.checkpoint.format import BLOCK_BYTES, CheckpointError, read_header, write_file
from tplayers.checkpoint.gather import gather_state_dict
from tplayers.checkpoint.index import FORMAT, INDEX_NAME, NATURAL, build_index
from tplayers.checkpoint.layout import (
    GlobalTensor,
    agree,
    allgather_json,
    describe,
    local_piece,
    local_tensors,
    plan_layout,
    real_views,
    stored,
    world_info,
)
from tplayers.checkpoint.optim import optimizer_tensors
from tplayers.checkpoint.progress import Progress
from tplayers.sharding import CONVENTION


def _piece(lt, start: int, stop: int):
    """The local rows holding global ``[start, stop)`` of ``lt``'s shard dim (the whole tensor if replicated)."""
    if lt.spec.dim is None:
        return lt.tensor
    offset, length = local_piece(lt.spec, start, stop)
    return lt.tensor.narrow(lt.spec.dim, offset, length)


def shard_file_name(rank: int, world: int) -> str:
    return f"rank-{rank:05d}-of-{world:05d}.safetensors"


def temp_sibling(path: str, token: str) -> str:
    parent, name = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{name}.tmp-{token}")


def save_checkpoint(
    model: nn.Module,
    path,
    *,
    consolidated: bool = False,
    progress: Optional[bool] = None,
    block_bytes: int = BLOCK_BYTES,
    digest: str = DEFAULT,
    optimizer=None,
) -> None:
    """Save ``model`` to ``path``; collective over the default process group (all ranks call it).

    - sharded (default): ``path`` becomes a directory with one safetensors file
      per rank and ``index.json`` (format version, shard convention, per tensor
      its global shape, dtype, shard dim and which file holds which range,
      block and file digests). Replicated tensors are written once.
    - ``consolidated=True``: ``path`` becomes one standard safetensors file whose
      keys and shapes are exactly the serial model's ``state_dict()``
      (``safetensors.torch.load_model`` loads it into the plain model).

    Either way it is written to a temporary sibling, fsynced and renamed, so a
    crash never leaves a half-written checkpoint at ``path``. ``digest`` names
    the integrity hash of the sharded form (``"xxh3_128"``, the default, runs at
    memory speed; ``"sha256"`` if you need it; see :mod:`tplayers.checkpoint.digest`). It never destroys
    data that is not a checkpoint: if ``path`` exists and is not a previous
    checkpoint (a tplayers checkpoint directory holding only its own files, or a
    safetensors file) nor an empty directory, every rank raises
    :class:`CheckpointError` before anything is written (see :func:`check_target`). ``progress``
    draws a bar on rank 0 (``None``: only for large saves to a terminal).

    ``model`` may be wrapped in ``DistributedDataParallel``, FSDP2 ``fully_shard`` or
    ``torch.compile``: the checkpoint holds the serial model's keys and shapes either way
    (:mod:`tplayers.checkpoint.wrapped`). ``optimizer`` (sharded form only) also saves its
    per-parameter state, sharded like each parameter (:mod:`tplayers.checkpoint.optim`).

    Args:
        model: the (parallelized, possibly wrapped) model; every rank passes its own.
        path: the directory (sharded) or file (``consolidated=True``) to write; the same on every rank.
        consolidated: write one standard safetensors file of the serial ``state_dict()``.
        progress: draw a progress bar on rank 0 (``None``: large saves to a terminal only).
        block_bytes: the size of the hashed blocks of the sharded form.
        digest: ``"xxh3_128"`` or ``"sha256"``.
        optimizer: also save its per-parameter state (sharded form only).

    Raises:
        CheckpointError: on every rank, before anything is written, when ``path`` holds something
            that is not a previous checkpoint.
        ValueError: a bad ``block_bytes`` or ``digest``, or ``optimizer`` with ``consolidated=True``.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import copy, torch, tplayers
        from torch import nn
        from tplayers.checkpoint import gather_state_dict, load_checkpoint, save_checkpoint
        mesh = tplayers.init_mesh()
        torch.manual_seed(0)                                  # the same serial model on every rank
        serial = nn.Sequential(nn.Linear(8, 30), nn.ReLU(), nn.Linear(30, 8))
        plan = {"0": tplayers.ColumnParallel(), "2": tplayers.RowParallel()}
        model = tplayers.parallelize_module(copy.deepcopy(serial), plan, mesh=mesh)
        save_checkpoint(model, "ckpt/")                                 # one file per rank + index.json
        save_checkpoint(model, "model.safetensors", consolidated=True)  # the serial model's state_dict
        plain = nn.Sequential(nn.Linear(8, 30), nn.ReLU(), nn.Linear(30, 8))
        load_checkpoint(plain, "model.safetensors")                     # a plain model loads it
        assert all(torch.equal(plain.state_dict()[k], v) for k, v in serial.state_dict().items())
    """
    path = os.fspath(path)
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes < 1:
        raise ValueError(f"block_bytes must be a positive int, got {block_bytes!r}")
    check_algorithm(digest)
    if consolidated and optimizer is not None:
        raise ValueError(
            "save_checkpoint: optimizer state is saved in the sharded form only "
            "(consolidated=True writes exactly the serial model's state_dict); got both"
        )
    rank, world = world_info()
    local = local_tensors(model)
    if optimizer is not None:
        local.update(optimizer_tensors(model, optimizer, local))
    local = real_views(local)  # complex128 as its float64 view
    refusal = check_target(path)
    if consolidated:
        agree(refusal)
        _save_consolidated(model, path, rank, progress)
        return
    rows = agree(refusal, {"token": secrets.token_hex(8), "tensors": describe(local)})
    tensors, writes = plan_layout([r["tensors"] for r in rows])
    tmp = temp_sibling(path, rows[0]["token"])
    info, error = None, None
    try:
        os.makedirs(tmp, exist_ok=True)
        items = [
            (name, stored(_piece(local[k], start, stop)), local[k].spec.dim) for k, start, stop, name in writes[rank]
        ]
        info = write_rank_file(tmp, rank, world, items, block_bytes, progress if rank == 0 else False, digest)
    except Exception as e:  # noqa: BLE001 - every rank must reach the exchange below, or peers hang
        error = f"{type(e).__name__}: {e}"
    infos = allgather_json({"info": info, "error": error})
    failed = [(r, x["error"]) for r, x in enumerate(infos) if x["error"]]
    commit_error, old = None, None
    if rank == 0:
        try:
            if failed:
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                old = finish_dir(tmp, path, world, tensors, [x["info"] for x in infos], block_bytes, digest)
                if old is not None:  # a directory's files are deleted by all ranks, anything else by rank 0
                    is_dir = os.path.isdir(old) and not os.path.islink(old)
                    old = {"path": old, "files": sorted(os.listdir(old)) if is_dir else None}
        except Exception as e:  # noqa: BLE001 - reported to every rank by `agree`
            commit_error = f"{type(e).__name__}: {e}"
    if failed:
        raise CheckpointError(
            f"save to {path} failed, the previous checkpoint (if any) is untouched:\n"
            + "\n".join(f"  rank {r}: {e}" for r, e in failed)
        )
    old = agree(commit_error, old)[0]
    if old is not None:
        remove_previous(old["path"], old["files"], rank, world)


def check_target(path: str) -> Optional[str]:
    """Why saving onto ``path`` would destroy data that is not a checkpoint, or None if it is safe.

    Safe: nothing there; an empty directory; a safetensors file (a previous
    consolidated checkpoint: its header parses); a tplayers checkpoint directory
    whose ``index.json`` names the format and which holds nothing but that index
    and the files it lists. Anything else (a folder with other files or
    subfolders, a file that is not safetensors, a symlink, an unreadable index)
    is refused, so the caller can move it aside deliberately.
    """
    if not os.path.lexists(path):
        return None
    refuse = f"{path} exists and is not a tplayers checkpoint; refusing to replace it"
    if os.path.islink(path):
        return f"{refuse} (it is a symlink: save to its target or remove the link)"
    if os.path.isfile(path):
        try:
            read_header(path)
        except CheckpointError as e:
            return f"{refuse} (not a safetensors file: {e})"
        return None
    if not os.path.isdir(path):
        return f"{refuse} (not a regular file or directory)"
    entries = sorted(os.listdir(path))
    if not entries:
        return None
    try:
        with open(os.path.join(path, INDEX_NAME), "rb") as f:
            index = json.loads(f.read())
        listed = set(index["files"]) if index.get("format") == FORMAT else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError):
        listed = None
    if listed is None:
        return f"{refuse} (a directory without a readable tplayers {INDEX_NAME}; it holds {_some(entries)})"
    foreign = [e for e in entries if e != INDEX_NAME and (e not in listed or not os.path.isfile(os.path.join(path, e)))]
    if foreign:
        return f"{refuse} (the checkpoint directory also holds other data: {_some(foreign)})"
    return None


def _some(names: Sequence[str], k: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:k])
    return shown + (f" and {len(names) - k} more" if len(names) > k else "")


def remove_previous(path: str, files: Optional[Sequence[str]], rank: int, world: int) -> None:
    """Delete the previous checkpoint, which the commit moved to ``path`` (collective).

    ``files``: the names in that directory, or None if it is not a directory.
    Freeing a large file's pages takes time, so every rank deletes a share of
    the files at once; rank 0 then removes the emptied directory. The new
    checkpoint is already in place: a failure here leaves only a stray
    ``.<name>.tmp-<token>`` sibling (safe to delete), and is raised on every rank.
    """
    error = None
    try:
        if files is None:
            if rank == 0:
                os.remove(path)
        else:
            for name in files[rank::world]:
                os.remove(os.path.join(path, name))
    except OSError as e:
        error = f"{type(e).__name__}: {e} (the new checkpoint is in place; delete {path})"
    agree(error)
    if rank == 0 and files is not None:
        os.rmdir(path)


def write_rank_file(
    directory: str, rank: int, world: int, items, block_bytes: int, progress, algorithm: str = DEFAULT
) -> dict:
    """Write one rank's pieces ``(stored name, stored tensor, shard dim or None)``; returns the facts
    the index needs about the file. Pieces sharded on a dim > 0 are also hashed in bands along it."""
    name = shard_file_name(rank, world)
    bar = Progress(sum(t.numel() * t.element_size() for _, t, _ in items), f"save {name}", progress)
    meta = {"format": "tplayers.checkpoint", "layout": NATURAL}
    band_dims = {n: d for n, _, d in items if d not in (None, 0)}
    size, digest, hashed = write_file(
        os.path.join(directory, name),
        [(n, t) for n, t, _ in items],
        meta,
        block_bytes=block_bytes,
        on_bytes=bar.update,
        algorithm=algorithm,
        band_dims=band_dims,
    )
    bar.close()
    return {"file": name, "size": size, "digest": digest, "blocks": {k: list(v) for k, v in hashed.items()}}


def finish_dir(
    tmp: str,
    path: str,
    world: int,
    tensors: Dict[str, GlobalTensor],
    infos: Sequence[dict],
    block_bytes: int,
    algorithm: str = DEFAULT,
) -> Optional[str]:
    """Write the index into ``tmp``, fsync it, and move ``tmp`` to ``path``; returns where the previous
    checkpoint now is (to be deleted), or None."""
    entries = {}
    for key, g in tensors.items():
        pieces = []
        for start, stop, r, name in g.owners:
            k, digests, band, band_digests = infos[r]["blocks"][name]
            piece = {"file": infos[r]["file"], "block_rows": k, "digests": digests}
            if band is not None:
                piece.update(band=band, band_digests=band_digests)
            if name != key:  # one of several pieces of this tensor in the file
                piece["name"] = name
            if g.dim is not None:
                piece.update(start=start, stop=stop)
            pieces.append(piece)
        entries[key] = {"shape": list(g.shape), "dtype": g.dtype, "dim": g.dim, "pieces": pieces}
    files = {x["file"]: {"size": x["size"], "digest": x["digest"]} for x in infos}
    index_path = os.path.join(tmp, INDEX_NAME)
    with open(index_path, "xb") as f:
        f.write(build_index(world, CONVENTION, block_bytes, files, entries, algorithm))
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    return commit(tmp, path, remove_old=False)


def _real(t: torch.Tensor) -> torch.Tensor:
    """complex128 as its float64 view (see :func:`~tplayers.checkpoint.layout.real_views`)."""
    return torch.view_as_real(t) if t.dtype == torch.complex128 else t


def _save_consolidated(model: nn.Module, path: str, rank: int, progress) -> None:
    full = gather_state_dict(model)  # rank 0 holds everything, others {}
    error = None
    if rank == 0:
        tmp = temp_sibling(path, secrets.token_hex(8))
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)  # as the sharded form does
            items = [(k, _real(v).detach().to("cpu").contiguous()) for k, v in full.items()]
            bar = Progress(sum(t.numel() * t.element_size() for _, t in items), f"save {path}", progress)
            write_file(
                tmp,
                items,
                {"format": "tplayers.consolidated", "convention": CONVENTION},
                on_bytes=bar.update,
                hashes=False,
            )
            bar.close()
            commit(tmp, path)
        except Exception as e:  # noqa: BLE001 - reported to every rank by `agree`
            error = f"{type(e).__name__}: {e}"
            if os.path.exists(tmp):
                os.remove(tmp)
    agree(error)

"""Load a checkpoint of any layout or world size into the current model (collective)."""

from __future__ import annotations

import os
from typing import List, NamedTuple, Optional

import torch
from torch import nn

from tplayers.checkpoint.format import CheckpointError, torch_dtype
from tplayers.checkpoint.index import open_source
from tplayers.checkpoint.layout import agree, local_tensors, real_views, world_info
from tplayers.checkpoint.optim import is_optimizer_key, optimizer_load_tensors
from tplayers.checkpoint.progress import Progress
from tplayers.checkpoint.read import Reader
from tplayers.checkpoint.wrapped import Staging


class LoadResult(NamedTuple):
    """What :func:`load_checkpoint` did on this rank: ``missing_keys`` and ``unexpected_keys``
    (empty unless ``strict=False``) and ``bytes_read`` (the tensor bytes this rank mapped to read).

    >>> import os, tempfile, torch
    >>> from torch import nn
    >>> from tplayers.checkpoint import load_checkpoint, save_checkpoint
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> save_checkpoint(nn.Sequential(nn.Linear(4, 4)), path)
    >>> res = load_checkpoint(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), path, strict=False)
    >>> res.missing_keys, res.unexpected_keys, res.bytes_read
    (['1.bias', '1.weight'], [], 80)
    >>> import shutil; shutil.rmtree(os.path.dirname(path))
    """

    missing_keys: List[str]  # in the model, not in the checkpoint (only with strict=False)
    unexpected_keys: List[str]  # in the checkpoint, not in the model (only with strict=False)
    bytes_read: int  # tensor bytes this rank mapped to read (what ``safe_open(...).get_slice`` would)


def load_checkpoint(
    model: nn.Module,
    path,
    *,
    strict: bool = True,
    verify: bool = True,
    cast: bool = False,
    progress=None,
    optimizer=None,
) -> LoadResult:
    """Load ``path`` (a checkpoint directory or a safetensors file) into ``model``, resharding as needed.

    Collective over the default process group: every rank calls it (a plain
    single-process model needs no process group). Works for a checkpoint
    saved at any world size or layout, a ``consolidated=True`` file, or any
    standard safetensors file of the serial model's ``state_dict()``.

    Each rank reads only the rows it holds (the byte ranges ``safe_open(...).get_slice`` would read).
    Before any parameter changes, every rank checks keys (``strict`` lists all
    missing and unexpected ones), global shapes, dtypes (no silent cast;
    ``cast=True`` converts), the index (format, coverage: no gaps or overlaps,
    file names inside the directory), every file's presence, size and header,
    and with ``verify=True`` the digest of every block it reads. The ranks
    then agree; if any rank found a problem, every rank raises
    :class:`~tplayers.checkpoint.CheckpointError` naming the file and key and
    no rank has changed anything.

    ``verify=False`` skips the block hashes (structure, sizes and headers are
    still checked) and reads exactly the needed rows instead of whole blocks.
    ``progress`` draws a bar on rank 0 (``None``: only for large loads to a terminal).
    Returns a :class:`LoadResult` (missing / unexpected keys, bytes read).

    ``model`` may be wrapped (DDP, FSDP2 ``fully_shard``, ``torch.compile``), like in
    :func:`save_checkpoint`. ``optimizer``: also restore its per-parameter state (saved with
    ``save_checkpoint(..., optimizer=)`` at any world size), resharded like the parameters;
    without it, optimizer entries in the checkpoint are ignored. Build the optimizer (same
    hyperparameters; they are not stored) before loading.

    Args:
        model: the (parallelized, possibly wrapped) model to fill; any world size or plan.
        path: a checkpoint directory or a safetensors file; the same on every rank.
        strict: every key must match (else the missing / unexpected ones are returned).
        verify: check the digest of every block read.
        cast: convert stored dtypes to the model's instead of refusing a mismatch.
        progress: draw a progress bar on rank 0 (``None``: large loads to a terminal only).
        optimizer: also restore its per-parameter state.

    Returns:
        A :class:`LoadResult`.

    Raises:
        CheckpointError: on every rank, with no parameter changed, for any problem found above.

    Example (``torchrun --nproc-per-node 2``, or 3, or plain ``python``)::

        import copy, torch, tplayers
        from torch import nn
        from tplayers.checkpoint import gather_state_dict, load_checkpoint, save_checkpoint
        mesh = tplayers.init_mesh()
        torch.manual_seed(0)                                  # the same serial model on every rank
        serial = nn.Sequential(nn.Linear(8, 30), nn.ReLU(), nn.Linear(30, 8))
        plan = {"0": tplayers.ColumnParallel(), "2": tplayers.RowParallel()}
        save_checkpoint(serial, "ckpt/")                      # a plain model (replicated) ...
        model = tplayers.parallelize_module(nn.Sequential(nn.Linear(8, 30), nn.ReLU(), nn.Linear(30, 8)), plan,
                                            mesh=mesh)
        res = load_checkpoint(model, "ckpt/")                 # ... loaded into shards
        assert res.missing_keys == [] and res.unexpected_keys == []
        x = torch.randn(4, 8)
        torch.testing.assert_close(model(x), serial(x))
    """
    path = os.fspath(path)
    rank, _ = world_info()
    copies, error, result = [], None, LoadResult([], [], 0)
    reader, staging = None, Staging()
    try:
        reader, copies, result = stage_load(
            model, path, strict=strict, verify=verify, cast=cast, optimizer=optimizer, staging=staging
        )
    except Exception as e:  # noqa: BLE001 - any local failure must still reach `agree`, or peers hang
        error = f"{type(e).__name__}: {e}"
    try:
        agree(error)
        apply_copies(copies, Progress(_nbytes(copies), f"load {path}", progress if rank == 0 else False))
        staging.finish()  # DTensor (FSDP2) shards and new optimizer state
    finally:
        if reader is not None:
            reader.close()
    return result


def stage_load(
    model: nn.Module,
    path: str,
    *,
    strict: bool,
    verify: bool,
    cast: bool,
    optimizer=None,
    staging: Optional[Staging] = None,
):
    """This rank's half of a load, changing nothing: validate, read (and verify) what it needs.

    Returns ``(reader, copies, result)``; ``copies`` are ``(tensor, dest, source)``
    for :func:`apply_copies`, whose sources stay valid until ``reader.close()``.
    Raises :class:`CheckpointError` on any problem. Not collective.
    """
    source = open_source(path)
    reader = Reader(source, verify=verify)
    try:
        reader.check_files_present()
        staging = Staging() if staging is None else staging
        local = local_tensors(model, staging)
        available = set(source.tensors)
        if optimizer is not None:
            local.update(optimizer_load_tensors(model, optimizer, local, source.tensors, staging, path))
        else:
            available = {k for k in available if not is_optimizer_key(k)}
        local = real_views(local)  # complex128 as its float64 view, as saved
        missing = sorted(set(local) - available)
        unexpected = sorted(available - set(local))
        if strict and (missing or unexpected):
            raise CheckpointError(
                f"{path}: keys do not match the model (strict=True): missing {missing}, unexpected {unexpected}"
            )
        keys = sorted(set(local) & available)
        problems = [msg for key in keys for msg in _mismatch(key, local[key], source.tensors[key], cast)]
        if problems:
            raise CheckpointError(
                f"{path}: {len(problems)} tensor(s) do not fit the model:\n    " + "\n    ".join(problems)
            )
        parts, targets = [], []  # each part with the local tensor (or a narrowed view of it) it fills
        for key in keys:
            spec, tensor = local[key].spec, local[key].tensor
            if spec.dim is None:
                boxes = [(tensor, reader.plan(key, None))]
            else:  # one box per global range this rank holds (several for a fused layer)
                boxes = [
                    (
                        tensor if b - a == tensor.shape[spec.dim] else tensor.narrow(spec.dim, off, b - a),
                        reader.plan(key, spec.dim, a, b),
                    )
                    for (a, b), off in zip(spec.spans, spec.local_offsets)
                ]
            for target, box_parts in boxes:
                parts += box_parts
                targets += [target] * len(box_parts)
        copies = [(target, part.dest, t) for target, (part, t) in zip(targets, reader.fetch_all(parts))]
    except BaseException:
        reader.close()
        raise
    return reader, copies, LoadResult(missing, unexpected, reader.bytes_read)


def apply_copies(copies, bar: Progress) -> None:
    """Write the staged sources into the model's tensors (the only step that changes the model)."""
    with torch.no_grad():
        for dst, dest, t in copies:
            (dst[dest] if dest else dst).copy_(t)
            bar.update(t.numel() * t.element_size())
    bar.close()


def _nbytes(copies) -> int:
    return sum(t.numel() * t.element_size() for _, _, t in copies)


def _mismatch(key, lt, entry, cast: bool) -> List[str]:
    """Why checkpoint tensor ``entry`` cannot be loaded into local tensor ``lt`` (empty if it can)."""
    out = []
    if tuple(entry.shape) != lt.spec.global_shape:
        out.append(
            f"tensor {key!r} has global shape {list(entry.shape)}, the model expects {list(lt.spec.global_shape)}"
        )
    got = torch_dtype(entry.dtype, f"tensor {key!r}")
    if got != lt.tensor.dtype and not cast:
        out.append(f"tensor {key!r} is {got}, the model holds {lt.tensor.dtype} (pass cast=True to convert)")
    return out

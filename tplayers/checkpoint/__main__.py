"""``python -m tplayers.checkpoint {inspect,merge,reshard}``: offline checkpoint work, one process.

python -m tplayers.checkpoint inspect ckpt/ [--verify]
python -m tplayers.checkpoint merge ckpt/ model.safetensors
python -m tplayers.checkpoint reshard ckpt/ ckpt-4/ --world-size 4
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from typing import List, Optional

from tplayers.checkpoint.commit import commit
from tplayers.checkpoint.digest import label
from tplayers.checkpoint.format import BLOCK_BYTES, CheckpointError, itemsize, write_file
from tplayers.checkpoint.index import Source, open_source
from tplayers.checkpoint.layout import plan_layout, stored
from tplayers.checkpoint.progress import Progress
from tplayers.checkpoint.read import Reader
from tplayers.checkpoint.save import check_target, finish_dir, temp_sibling, write_rank_file
from tplayers.sharding import CONVENTION, ShardSpec


def _nbytes(shape, dtype: str) -> int:
    n = itemsize(dtype)
    for s in shape:
        n *= s
    return n


def inspect(path: str, verify: bool = False, out=None) -> None:
    """Print the checkpoint's form, files, and per tensor its dtype, global shape, layout and size."""
    out = out or sys.stdout
    src = open_source(path)
    info = src.info
    if info["format"] == "safetensors":
        out.write(f"{path}: safetensors file, {len(src.tensors)} tensors, metadata {info['metadata']}\n")
    else:
        out.write(
            f"{path}: tplayers checkpoint v{info['version']}, saved at world size {info['world_size']}, "
            f"convention {info['convention']}, {len(src.files)} files\n"
        )
        for f, fi in sorted(src.files.items()):
            out.write(f"  {os.path.basename(f)}  {fi['size']} bytes  {info['algorithm']} {fi['digest'][:16]}...\n")
    total = 0
    for key, e in sorted(src.tensors.items()):
        size = _nbytes(e.shape, e.dtype)
        total += size
        if e.dim is None:
            layout = f"replicated in {os.path.basename(e.pieces[0].file)}"
        else:
            layout = f"dim {e.dim}: " + " ".join(f"{os.path.basename(p.file)}[{p.start}:{p.stop}]" for p in e.pieces)
        out.write(f"  {key:40s} {e.dtype:5s} {str(list(e.shape)):20s} {size:>12d} B  {layout}\n")
    out.write(f"total {total} bytes in {len(src.tensors)} tensors\n")
    if verify:
        with Reader(src, verify=True) as r:
            r.check_files_present()
            for key in sorted(src.tensors):
                r.read_box(key)
        hashed = (
            f"every block's {label(info['algorithm'])}" if src.files else "structure only (a plain file has no hashes)"
        )
        out.write(f"verified: {hashed}\n")


def merge(directory: str, out_path: str, progress: Optional[bool] = True) -> None:
    """Write one consolidated safetensors file (serial keys and shapes) from a checkpoint."""
    _refuse_unsafe(out_path)
    src = open_source(directory)
    with Reader(src, verify=True) as r:
        r.check_files_present()
        items = [(key, r.read_box(key)) for key in sorted(src.tensors)]
        tmp = temp_sibling(out_path, secrets.token_hex(8))
        bar = Progress(sum(t.numel() * t.element_size() for _, t in items), f"merge {out_path}", progress)
        try:
            write_file(
                tmp,
                items,
                {"format": "tplayers.consolidated", "convention": CONVENTION},
                on_bytes=bar.update,
                hashes=False,
            )
            commit(tmp, out_path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        bar.close()


def reshard(directory: str, out_dir: str, world_size: int, progress: Optional[bool] = True) -> None:
    """Rewrite a checkpoint as if saved at ``world_size`` ranks (balanced convention, same shard dims)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    _refuse_unsafe(out_dir)
    src: Source = open_source(directory)
    per_rank = [
        [
            [k, list(e.shape), e.dtype, e.dim, [list(_range(e.shape, e.dim, world_size, r))]]
            for k, e in sorted(src.tensors.items())
        ]
        for r in range(world_size)
    ]
    tensors, writes = plan_layout(per_rank)
    block_bytes = src.info.get("block_bytes") or BLOCK_BYTES
    tmp = temp_sibling(out_dir, secrets.token_hex(8))
    os.makedirs(tmp)
    with Reader(src, verify=True) as r:
        r.check_files_present()
        infos = []
        for rank in range(world_size):
            items = []
            for key, start, stop, name in writes[rank]:
                e = src.tensors[key]
                box = r.read_box(key, e.dim, start, stop) if e.dim is not None else r.read_box(key)
                items.append((name, stored(box), e.dim))
            infos.append(write_rank_file(tmp, rank, world_size, items, block_bytes, progress))
    finish_dir(tmp, out_dir, world_size, tensors, infos, block_bytes)  # the default digest


def _refuse_unsafe(out_path: str) -> None:
    """Never replace data that is not a checkpoint (same rule as ``save_checkpoint``)."""
    why = check_target(out_path)
    if why is not None:
        raise CheckpointError(why)


def _range(shape, dim, parts: int, index: int):
    spec = ShardSpec.balanced(shape, dim, parts, index)
    return spec.start, spec.stop


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tplayers.checkpoint", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("inspect", help="tensors, shapes, dtypes, layout and sizes")
    i.add_argument("path")
    i.add_argument("--verify", action="store_true", help="also read everything and check every block digest")
    m = sub.add_parser("merge", help="one consolidated safetensors file from a checkpoint directory")
    m.add_argument("dir")
    m.add_argument("out")
    r = sub.add_parser("reshard", help="rewrite a checkpoint directory for another world size")
    r.add_argument("dir")
    r.add_argument("out_dir")
    r.add_argument("--world-size", type=int, required=True)
    args = p.parse_args(argv)
    try:
        if args.cmd == "inspect":
            inspect(args.path, args.verify)
        elif args.cmd == "merge":
            merge(args.dir, args.out, progress=None)
        else:
            reshard(args.dir, args.out_dir, args.world_size, progress=None)
    except (CheckpointError, ValueError, OSError) as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)  # one line, whatever the message
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

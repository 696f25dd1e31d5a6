"""Triton halo pack / unpack on CUDA against a device-to-device copy of the same bytes (one GPU).

    python benchmarks/halo_pack_gpu.py

The halo exchange packs each face a neighbour needs (rows of a sharded dim, strided in memory: a
channels-last tensor's rows are not contiguous per channel) into one contiguous send buffer, and unpacks
the received buffer into the halo rows. The floor for both is a device-to-device copy of the same
buffer (read + write of ``buf``); the table prints GB/s counting bytes read and written, and the ratio
to the copy, for fp32 / bf16, contiguous and channels-last, 2-D and 3-D shapes.

A/B in the same run: each channels-last case is timed with the default kernel choice (the
channel-tiled kernel; with C = 3 it packs with the flat kernel and unpacks tiled) and with the flat
kernel forced (``tiled=False``), and the last two columns
give the default's speed over the flat kernel's. Each is timed per call (Python and the launch
included: small faces are launch-bound) and with the calls captured in a CUDA graph (the kernels
alone; the ratios there are to a copy in a graph too). Contiguous cases run the flat kernel either way
(one row). Both sides call ``tplayers.kernels.halo_pack`` directly (the front door,
``tplayers.ops.pack_faces``, adds the same Python overhead to each), after checking that each kernel
equals the torch reference bit for bit.

Without CUDA it prints one line and exits 0 (the kernels' exactness on the CPU runs in Triton's
interpreter: tests/kernels/test_halo_pack.py).
"""

from __future__ import annotations

import time

import torch

DEVICE = "cuda"
TITLE = "Triton halo pack/unpack vs device-to-device copy, channel-tiled vs flat kernel"

CASES = [  # (shape, face dim, rows per face, dtype, memory format): a 3x3 conv's 1-row halo is small
    # (launch-bound), a 7x7 / deep stack's 3 rows, and 32 rows (bandwidth-bound); C = 3 (one narrow tile)
    # and C = 256 (four channel blocks); faces of columns (dim 3); a channels_last_3d volume
    ((8, 64, 1024, 1024), 2, 3, torch.float32, torch.channels_last),
    ((8, 64, 1024, 1024), 2, 3, torch.float32, torch.contiguous_format),
    ((8, 64, 1024, 1024), 2, 3, torch.bfloat16, torch.channels_last),
    ((8, 64, 1024, 1024), 2, 32, torch.float32, torch.channels_last),
    ((8, 64, 1024, 1024), 2, 32, torch.float32, torch.contiguous_format),
    ((8, 64, 1024, 1024), 3, 3, torch.float32, torch.channels_last),
    ((8, 3, 1024, 1024), 2, 32, torch.float32, torch.channels_last),
    ((8, 256, 256, 256), 2, 3, torch.float32, torch.channels_last),
    ((2, 32, 256, 256, 256), 2, 3, torch.float32, torch.contiguous_format),
    ((2, 32, 256, 256, 256), 2, 3, torch.float32, torch.channels_last_3d),
]

_FORMATS = {
    torch.contiguous_format: "contiguous",
    torch.channels_last: "channels_last",
    torch.channels_last_3d: "channels_last_3d",
}


def _rate(fn, nbytes, repeats=50):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return nbytes / ((time.perf_counter() - t0) / repeats) / 1e9


def _graph_rate(fn, nbytes, calls=20, replays=5):
    """GB/s of ``fn`` with the launch overhead taken out: ``calls`` calls captured in one CUDA graph, timed
    over ``replays`` replays (the kernels' own speed; small faces are launch-bound per call)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compiled and warm before the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return nbytes * calls * replays / (time.perf_counter() - t0) / 1e9


def _row(cells):
    return "| " + " | ".join(cells) + " |"


def triton_table() -> None:
    if not torch.cuda.is_available():
        print(f"## {TITLE}: skipped, no CUDA")
        return
    from tplayers.ops import pack_faces_reference, triton_available, unpack_faces_reference

    if not triton_available():
        print(f"## {TITLE}: skipped, Triton not importable")
        return
    import triton

    from tplayers.kernels import halo_pack

    print(f"## {TITLE}")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}")
    print("# GB/s count bytes read + written (2x the buffer); two faces per call (the first and last `rows`")
    print("# rows of `dim`). 'call': 50 timed calls after one warm-up, Python and launch included; 'graph': 20")
    print("# calls captured in a CUDA graph, 5 replays (the kernels alone). speed-up = default / flat forced,")
    print("# graph timings, same run.")
    head = ["shape", "dim", "rows", "dtype", "layout", "kernel", "copy GB/s", "pack GB/s call", "unpack GB/s call"]
    head += ["pack / copy call", "unpack / copy call", "pack / copy graph", "unpack / copy graph"]
    head += ["pack speed-up", "unpack speed-up"]
    print(_row(head))
    print(_row(["---"] * len(head)))
    for shape, dim, rows, dtype, fmt in CASES:
        x = torch.randn(shape, device=DEVICE, dtype=dtype).contiguous(memory_format=fmt)
        n = shape[dim]
        faces = [(0, rows), (n - rows, rows)]
        ref = pack_faces_reference(x, dim, faces).contiguous()
        nbytes = 2 * ref.numel() * ref.element_size()  # read + write
        dst = torch.empty_like(ref)
        copy = _rate(lambda: dst.copy_(ref), nbytes)
        copy_graph = _graph_rate(lambda: dst.copy_(ref), nbytes)
        pack_auto, unpack_auto = (halo_pack._kernel_for(x, dim, faces, mode=mode) for mode in (0, 1))
        auto = pack_auto if pack_auto == unpack_auto else f"pack {pack_auto}, unpack {unpack_auto}"
        results = {}
        for choice in [None, False] if "tiled" in (pack_auto, unpack_auto) else [None]:
            # exact first: the buffer bit for bit, and the unpacked faces
            got = halo_pack.pack(x, dim, faces, tiled=choice)
            assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8)), (shape, dim, choice)
            out = torch.zeros_like(x)
            halo_pack.unpack(ref, out, dim, faces, tiled=choice)
            assert torch.equal(out, unpack_faces_reference(ref, torch.zeros_like(x), dim, faces)), (shape, dim, choice)
            del out
            pack_fn = lambda: halo_pack.pack(x, dim, faces, tiled=choice)
            unpack_fn = lambda: halo_pack.unpack(ref, x, dim, faces, tiled=choice)  # writes x's own faces back
            results[choice] = [_rate(pack_fn, nbytes), _rate(unpack_fn, nbytes)]
            results[choice] += [_graph_rate(pack_fn, nbytes), _graph_rate(unpack_fn, nbytes)]
        for choice, (pack, unpack, pack_graph, unpack_graph) in results.items():
            kernel = f"default: {auto}" if choice is None else "flat (forced)"
            speed = ["", ""]
            if choice is None and False in results:
                speed = [f"{pack_graph / results[False][2]:.2f}x", f"{unpack_graph / results[False][3]:.2f}x"]
            cells = [str(tuple(shape)), str(dim), str(rows), str(dtype)[6:], _FORMATS[fmt], kernel, f"{copy:.1f}"]
            cells += [f"{pack:.1f}", f"{unpack:.1f}", f"{pack / copy:.2f}", f"{unpack / copy:.2f}"]
            cells += [f"{pack_graph / copy_graph:.2f}", f"{unpack_graph / copy_graph:.2f}"]
            print(_row(cells + speed))


if __name__ == "__main__":
    triton_table()

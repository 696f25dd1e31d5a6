"""Triton halo pack / unpack on CUDA against a device-to-device copy of the same bytes (one GPU).

    python benchmarks/halo_pack_gpu.py

The halo exchange packs each face a neighbour needs (rows of a sharded dim, strided in memory: a
channels-last tensor's rows are not contiguous per channel) into one contiguous send buffer, and unpacks
the received buffer into the halo rows. The floor for both is a device-to-device copy of the same
buffer (read + write of ``buf``); the table prints GB/s counting bytes read and written, and the ratio
to the copy, for fp32 / bf16, contiguous and channels-last, 2-D and 3-D shapes. Without CUDA it prints
one line and exits (the kernels' exactness on the CPU runs in Triton's interpreter:
tests/kernels/test_halo_pack.py).
"""

from __future__ import annotations

import time

import torch


def _rate(fn, nbytes, repeats=50):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return nbytes / ((time.perf_counter() - t0) / repeats) / 1e9


def triton_table() -> None:
    print("## Triton halo pack/unpack vs device-to-device copy")
    if not torch.cuda.is_available():
        print("skipped: no CUDA")
        return
    from tplayers.ops import pack_faces, triton_available, unpack_faces

    if not triton_available():
        print("skipped: Triton not importable")
        return
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(
        f"{'shape':22s} {'dtype':9s} {'layout':14s} {'pack GB/s':>10s} {'unpack GB/s':>12s} {'copy GB/s':>10s} {'pack/copy':>10s} {'unpack/copy':>12s}"
    )
    cases = [  # (shape, rows per face, dtype, layout): a 3x3 conv's 1-row halo is small (launch-bound),
        # a 7x7 / deep stack's 3 rows, and 32 rows (bandwidth-bound)
        ((8, 64, 1024, 1024), 3, torch.float32, torch.channels_last),
        ((8, 64, 1024, 1024), 3, torch.float32, torch.contiguous_format),
        ((8, 64, 1024, 1024), 3, torch.bfloat16, torch.channels_last),
        ((8, 64, 1024, 1024), 32, torch.float32, torch.channels_last),
        ((8, 64, 1024, 1024), 32, torch.float32, torch.contiguous_format),
        ((2, 32, 256, 256, 256), 3, torch.float32, torch.contiguous_format),
    ]
    for shape, rows, dtype, fmt in cases:
        x = torch.randn(shape, device="cuda", dtype=dtype).contiguous(memory_format=fmt)
        n = shape[2]
        faces = [(0, rows), (n - rows, rows)]
        buf = pack_faces(x, 2, faces)
        torch.testing.assert_close(
            buf.flatten(), torch.cat([x.narrow(2, a, k).flatten() for a, k in faces]), rtol=0, atol=0
        )
        nbytes = 2 * buf.numel() * buf.element_size()  # read + write
        dst = torch.empty_like(buf)
        pack = _rate(lambda: pack_faces(x, 2, faces), nbytes)
        unpack = _rate(lambda: unpack_faces(buf, x, 2, faces), nbytes)
        copy = _rate(lambda: dst.copy_(buf), nbytes)
        layout = "channels_last" if fmt is torch.channels_last else "contiguous"
        print(
            f"{str(shape):22s} {rows:4d} {str(dtype)[6:]:9s} {layout:14s} {pack:10.1f} {unpack:12.1f} {copy:10.1f} "
            f"{pack / copy:10.2f} {unpack / copy:12.2f}"
        )


if __name__ == "__main__":
    triton_table()

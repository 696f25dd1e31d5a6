"""pack_faces (torch reference): always a new contiguous buffer, never a view of the input."""

import torch

from tplayers.ops import pack_faces, unpack_faces


def test_one_face_is_a_contiguous_copy_for_any_layout():
    base = torch.arange(2 * 3 * 4 * 10, dtype=torch.float64).reshape(2, 3, 4, 10)
    cases = [
        base,
        base[:, :, :, ::2],
        base.to(memory_format=torch.channels_last),
        base[:1, :1, :, 3:4],
        base.transpose(0, 3),
    ]
    for x in cases:
        for dim in range(x.dim()):
            for face in [(0, 1), (x.size(dim) - 1, 1), (0, x.size(dim))]:
                buf = pack_faces(x, dim, [face])
                want = x.narrow(dim, *face).reshape(-1)
                assert buf.is_contiguous() and buf.dim() == 1 and torch.equal(buf, want)
                assert buf.data_ptr() != x.data_ptr() or buf.numel() == 0
                buf.add_(1)  # writing the buffer leaves x alone
                assert torch.equal(x.narrow(dim, *face).reshape(-1), want)


def test_unpack_is_the_adjoint_of_one_face_pack():
    x = torch.randn(2, 3, 5, 4, dtype=torch.float64)[:, :, :, ::2]
    y = torch.randn(2 * 3 * 2 * 2, dtype=torch.float64)
    out = torch.zeros_like(x)
    unpack_faces(y, out, 2, [(3, 2)], accumulate=True)
    assert torch.allclose((pack_faces(x, 2, [(3, 2)]) * y).sum(), (x * out).sum())

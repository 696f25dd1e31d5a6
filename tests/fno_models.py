"""FNO models written as their authors wrote them (tests of the region guard's global sizes and slices):
the FNO paper's SpectralConv2d and FNO2d (Li et al. 2021, fourier_2d.py: channels-last, a grid of
coordinates concatenated, the domain padded for non-periodic data), in the weights' dtype."""

import torch
import torch.nn.functional as F
from torch import nn


class SpectralConv2d(nn.Module):
    def __init__(self, cin, cout, modes1, modes2, dtype=torch.complex128):
        super().__init__()
        self.cout, self.modes1, self.modes2 = cout, modes1, modes2
        scale = 1 / (cin * cout)
        self.weights1 = nn.Parameter(scale * torch.rand(cin, cout, modes1, modes2, dtype=dtype))
        self.weights2 = nn.Parameter(scale * torch.rand(cin, cout, modes1, modes2, dtype=dtype))

    def compl_mul2d(self, a, b):
        return torch.einsum("bixy,ioxy->boxy", a, b)

    def forward(self, x):
        batchsize = x.shape[0]
        x_ft = torch.fft.rfft2(x)
        out_ft = torch.zeros(batchsize, self.cout, x.size(-2), x.size(-1) // 2 + 1, dtype=x_ft.dtype)
        m1, m2 = self.modes1, self.modes2
        out_ft[:, :, :m1, :m2] = self.compl_mul2d(x_ft[:, :, :m1, :m2], self.weights1)
        out_ft[:, :, -m1:, :m2] = self.compl_mul2d(x_ft[:, :, -m1:, :m2], self.weights2)
        return torch.fft.irfft2(out_ft, s=(x.size(-2), x.size(-1)))


class FNO2d(nn.Module):
    """Input ``(B, X, Y, C)`` (channels last, sharded along X and Y); the grid is computed with torch."""

    def __init__(self, modes1, modes2, width, cin=1, padding=3):
        super().__init__()
        self.padding = padding
        self.fc0 = nn.Linear(cin + 2, width)
        self.convs = nn.ModuleList([SpectralConv2d(width, width, modes1, modes2) for _ in range(2)])
        self.ws = nn.ModuleList([nn.Conv2d(width, width, 1) for _ in range(2)])
        self.fc1, self.fc2 = nn.Linear(width, 16), nn.Linear(16, 1)

    def get_grid(self, shape):
        batchsize, size_x, size_y = shape[0], shape[1], shape[2]
        gridx = torch.linspace(0, 1, size_x, dtype=torch.float64)
        gridx = gridx.reshape(1, size_x, 1, 1).repeat([batchsize, 1, size_y, 1])
        gridy = torch.linspace(0, 1, size_y, dtype=torch.float64)
        gridy = gridy.reshape(1, 1, size_y, 1).repeat([batchsize, size_x, 1, 1])
        return torch.cat((gridx, gridy), dim=-1)

    def forward(self, x):
        grid = self.get_grid(x.shape)
        x = torch.cat((x, grid), dim=-1)
        x = self.fc0(x)
        x = x.permute(0, 3, 1, 2)
        if self.padding:
            x = F.pad(x, [0, self.padding, 0, self.padding])
        for i, (conv, w) in enumerate(zip(self.convs, self.ws)):
            x = conv(x) + w(x)
            if i + 1 < len(self.convs):
                x = F.gelu(x)
        if self.padding:
            x = x[..., : -self.padding, : -self.padding]
        x = x.permute(0, 2, 3, 1)
        return self.fc2(F.gelu(self.fc1(x)))

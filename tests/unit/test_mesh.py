"""init_mesh / default_mesh without a launcher, and argument checks."""

import subprocess
import sys
import textwrap

import pytest
from harness import run_ranks

import tplayers


def test_plain_python_gets_a_world_of_one():
    code = textwrap.dedent(
        """
        import os
        for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(k, None)
        import torch, tplayers
        mesh = tplayers.init_mesh(device_type="cpu")
        layer = tplayers.ColumnParallelLinear(3, 5, gather_output=True)   # mesh=None -> default_mesh()
        print(mesh.size(), mesh.mesh_dim_names, tuple(layer(torch.randn(2, 3)).shape))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[-2] == "1 ('tp',) (2, 5)"


def _mesh_checks(rank, world):
    with pytest.raises(ValueError, match="multiply to the world size 2"):
        tplayers.init_mesh((3,), device_type="cpu")
    with pytest.raises(ValueError, match="names must have one entry per mesh dim"):
        tplayers.init_mesh((1, 2), ("tp",), device_type="cpu")
    with pytest.raises(ValueError, match="device_type"):
        tplayers.init_mesh(device_type="tpu")
    mesh2d = tplayers.init_mesh((1, 2), ("dp", "tp"), device_type="cpu")
    with pytest.raises(ValueError, match=r"mesh must be 1-D, got a 2-D mesh \(1, 2\); slice"):
        tplayers.RowParallelLinear(4, 4, mesh=mesh2d)
    with pytest.raises(TypeError, match="DeviceMesh or None"):
        tplayers.RowParallelLinear(4, 4, mesh="tp")
    layer = tplayers.ColumnParallelLinear(4, 6, mesh=mesh2d["tp"])
    assert layer.weight.shape == (3, 4)
    return tplayers.default_mesh().size()


def test_mesh_argument_checks():
    assert run_ranks(_mesh_checks, 2, timeout=30) == [2, 2]

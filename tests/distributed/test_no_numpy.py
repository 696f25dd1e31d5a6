"""numpy is not a dependency: checkpoints, scatter and gather run where it cannot be imported.

The base install (the README's demo command) has no numpy; this runs the same
paths in a fresh interpreter where ``import numpy`` fails, on 2 gloo ranks.
"""

import os
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))

SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["numpy"] = None            # any `import numpy` now raises ImportError
    sys.path.insert(0, {tests!r})
    from harness import run_ranks

    def fn(rank, world, root):
        import os, torch, tplayers
        from torch import nn
        mesh = tplayers.init_mesh(device_type="cpu")
        torch.manual_seed(0)
        serial = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4))
        model = tplayers.parallelize_module(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4)),
                                            {{"0": tplayers.ColumnParallel(), "2": tplayers.RowParallel()}}, mesh=mesh)
        tplayers.load_checkpoint(model, os.path.join(root, "serial.safetensors"))   # plain file -> shards
        tplayers.save_checkpoint(model, os.path.join(root, "ckpt"))
        tplayers.save_checkpoint(model, os.path.join(root, "one.safetensors"), consolidated=True)
        back = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4))
        dist_back = tplayers.parallelize_module(back, {{"0": tplayers.ColumnParallel(), "2": tplayers.RowParallel()}}, mesh=mesh)
        tplayers.load_checkpoint(dist_back, os.path.join(root, "ckpt"))
        full = tplayers.gather_state_dict(dist_back, all_ranks=True)
        x = torch.randn(2, 3, 7, 5) if rank == 0 else None
        local = tplayers.scatter(x, 2, mesh)
        whole = tplayers.gather(local, 2, mesh)
        return sorted(full), float(whole.sum()), rank

    if __name__ == "__main__":
        import torch
        from torch import nn
        root = sys.argv[1]
        torch.manual_seed(0)
        serial = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4))
        import tplayers
        tplayers.save_checkpoint(serial, root + "/serial.safetensors", consolidated=True)
        outs = run_ranks(fn, 2, args=(root,), timeout=60)
        assert outs[0][0] == sorted(serial.state_dict()), outs
        try:
            import numpy  # noqa: F401
        except ImportError:
            print("NUMPY-FREE-OK")
    """
)


def test_checkpoint_and_scatter_without_numpy(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT.format(tests=os.path.dirname(HERE)))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "NUMPY-FREE-OK" in proc.stdout, proc.stdout + proc.stderr

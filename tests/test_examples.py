"""The examples run end to end under torchrun on 2 CPU ranks (short settings)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _torchrun(script, *args, timeout=240, ranks=2):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        os.path.join(ROOT, "examples", script),
        *args,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_tp_transformer_example():
    out = _torchrun("tp_transformer.py", "--steps", "10")
    assert "parity step 1" in out and "done" in out
    assert "plan on a mesh of 2 ranks" in out


def test_gpt2_example():
    out = _torchrun("gpt2_tp.py", "--steps", "3", "--layers", "1", "--seq", "16")
    assert "parity (fp64, one AdamW step)" in out and "tie kept: lm_head.weight is wte.weight = True" in out
    assert "step    3" in out and "done" in out


def test_llama_gqa_example_at_4_ranks():
    out = _torchrun("llama_tp.py", "--steps", "3", "--layers", "1", "--seq", "16", ranks=4)
    assert "parity (fp64, one AdamW step)" in out and "step    3" in out and "done" in out


def test_llama_example_at_3_ranks_says_why_heads_cannot_split_and_passes_parity():
    out = _torchrun("llama_tp.py", "--steps", "2", "--layers", "1", "--seq", "16", ranks=3)
    assert "attention heads cannot be split over 3 ranks" in out and "rank 1 holds query heads [3, 6)" in out
    assert "parity (fp64, one AdamW step)" in out and "step    2" in out and "done" in out


def test_hf_llama_example_at_4_ranks_sequence_parallel():
    out = _torchrun("hf_llama.py", "--steps", "2", "--layers", "1", "--sequence-parallel", ranks=4)
    assert "parity (fp64, one SGD step) on 4 ranks" in out and "every tensor equal = True" in out and "done" in out


def test_hf_llama_example_without_transformers_prints_one_line():
    # python -S: no site-packages, so no transformers (the script exits before importing torch)
    out = subprocess.run(
        [sys.executable, "-S", os.path.join(ROOT, "examples", "hf_llama.py")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["hf_llama.py: transformers is not installed (pip install transformers); skipped"]


def test_domain_cnn_example():
    out = _torchrun("domain_cnn.py", "--size", "32", "--steps", "3")
    assert "parity vs serial" in out and "step" in out


def test_unet_example_2d_and_3d():
    out = _torchrun("unet.py", "--steps", "2")
    assert "parity vs serial" in out and "step   1" in out
    out = _torchrun("unet.py", "--dims", "3", "--steps", "1")
    assert "3-D U-Net" in out and "parity vs serial" in out


def test_unet_attention_example_plan_and_by_hand():
    # the plan: the region guard routes the mid block's F.scaled_dot_product_attention (q/k/v are
    # non-contiguous unbind views of a transpose); by hand: ContextParallelAttention inside the region
    for mode in ("plan", "hand"):
        out = _torchrun("unet_attention.py", "--attention", mode, "--steps", "1")
        assert "parity vs serial" in out and "step   0" in out


def test_checkpoint_reshard_example(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    out = _torchrun("checkpoint_reshard.py", "train", ckpt)
    assert "saved" in out
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "3",
        os.path.join(ROOT, "examples", "checkpoint_reshard.py"),
        "reload",
        ckpt,
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "reloaded at 3 rank(s)" in res.stdout and "bitwise equal" in res.stdout


def test_data_parallel_example():
    out = _torchrun("data_parallel.py")
    assert "parity vs serial full batch" in out and "weights bitwise equal: True" in out
    assert "serial model + AdamW loaded" in out and "done" in out

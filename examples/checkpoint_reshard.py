"""Train at 2 ranks, save a sharded checkpoint, reload it at 3 ranks and at 1, export and load a consolidated file.

    torchrun --standalone --nproc-per-node 2 examples/checkpoint_reshard.py train  /tmp/tplayers-ckpt
    torchrun --standalone --nproc-per-node 3 examples/checkpoint_reshard.py reload /tmp/tplayers-ckpt
    python examples/checkpoint_reshard.py reload /tmp/tplayers-ckpt      # one process, plain model too

CPU and gloo by default. ``train`` writes ``DIR/sharded`` (one safetensors file
per rank + index.json) and ``DIR/model.safetensors`` (consolidated, the serial
model's state_dict). ``reload`` loads the sharded checkpoint into a
tensor-parallel model at the current world size and checks every tensor,
gathered, is bitwise equal to the consolidated file; in one process it also
loads both forms into the plain, un-parallelized model.
"""

import os
import sys
from datetime import timedelta

import torch
from safetensors.torch import load_file
from torch import nn

import tplayers
from tplayers.checkpoint import gather_state_dict, load_checkpoint, save_checkpoint

PLAN = {r"blocks\.\d+\.fc1": tplayers.ColumnParallel(), r"blocks\.\d+\.fc2": tplayers.RowParallel()}


class Block(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


class TinyLM(nn.Module):
    """Embedding, 2 MLP blocks (hidden 50: uneven over 3 ranks), tied-free output head."""

    def __init__(self, vocab=37, d=16, hidden=50):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d, hidden) for _ in range(2)])
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def train(root):
    mesh = tplayers.init_mesh(
        device_type="cpu", timeout=timedelta(minutes=2)
    )  # a stalled peer fails in minutes, not 30
    torch.manual_seed(0)  # same serial weights on every rank, then each keeps its shard
    model = tplayers.parallelize_module(TinyLM(), PLAN, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # after parallelize_module
    for step in range(5):
        idx = torch.randint(0, 37, (4, 12))
        loss = nn.functional.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if mesh.get_rank() == 0:
            print(f"step {step} loss {loss.item():.4f}")
    save_checkpoint(model, os.path.join(root, "sharded"))
    save_checkpoint(model, os.path.join(root, "model.safetensors"), consolidated=True)
    if mesh.get_rank() == 0:
        print(f"saved {root}/sharded at {mesh.size()} ranks and {root}/model.safetensors")


def reload(root):
    mesh = tplayers.init_mesh(
        device_type="cpu", timeout=timedelta(minutes=2)
    )  # a stalled peer fails in minutes, not 30
    reference = load_file(os.path.join(root, "model.safetensors"))
    model = tplayers.parallelize_module(TinyLM(), PLAN, mesh=mesh)
    load_checkpoint(model, os.path.join(root, "sharded"))
    full = gather_state_dict(model)
    if mesh.get_rank() == 0:
        assert all(torch.equal(full[k], reference[k]) for k in reference) and set(full) == set(reference)
        print(f"reloaded at {mesh.size()} rank(s): all {len(full)} tensors bitwise equal to the consolidated file")
    if mesh.size() == 1:
        for source in ("sharded", "model.safetensors"):
            plain = TinyLM()
            load_checkpoint(plain, os.path.join(root, source))
            assert all(torch.equal(v, reference[k]) for k, v in plain.state_dict().items())
            print(f"plain single-device model loaded {source}: bitwise equal")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("train", "reload"):
        sys.exit(__doc__)
    {"train": train, "reload": reload}[sys.argv[1]](sys.argv[2])
    # Leave together: a rank exiting with its gloo group alive can abort a peer still using it.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()

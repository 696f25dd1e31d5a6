"""Sharded safetensors checkpoints: save, gather, and reshard-on-load at any world size.

Safetensors only, never pickle. Sharding comes from each layer's
``shard_specs()`` (the same data ``from_module`` uses); every other tensor is
replicated and written once.

Example (``torchrun --nproc-per-node 2 train.py``, then reload at any size)::

    from tplayers.checkpoint import save_checkpoint, load_checkpoint, gather_state_dict
    save_checkpoint(model, "ckpt/")                        # one file per rank + index.json
    save_checkpoint(model, "model.safetensors", consolidated=True)
    load_checkpoint(model, "ckpt/")                        # any world size or plan

Offline: ``python -m tplayers.checkpoint {inspect,merge,reshard} ...``.
"""

from tplayers.checkpoint.format import CheckpointError
from tplayers.checkpoint.gather import gather_grads, gather_state_dict
from tplayers.checkpoint.load import LoadResult, load_checkpoint
from tplayers.checkpoint.save import save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "gather_state_dict", "gather_grads", "LoadResult", "CheckpointError"]

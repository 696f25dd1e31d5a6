"""Sharded safetensors checkpoints (save, gather, reshard-on-load)."""

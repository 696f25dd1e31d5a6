#!/usr/bin/env bash
# The README demo: every example on 2 CPU ranks (gloo), synthetic data, parity checks first.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
# torch warns at import when numpy is absent; tplayers does not use numpy (the base install has none).
export PYTHONWARNINGS="${PYTHONWARNINGS:+$PYTHONWARNINGS,}ignore:Failed to initialize NumPy"
RUN="$PY -m torch.distributed.run --standalone --nproc-per-node 2"
echo "=== tensor parallelism: a small transformer, parallelized with a plan"
$RUN examples/tp_transformer.py
echo "=== GPT-2: fused c_attn sharded per block, tied vocab-parallel embedding/head, vocab-parallel loss"
$RUN examples/gpt2_tp.py --steps 10
echo "=== Llama: grouped-query attention (8 query heads, 2 kv heads), fused gate_up, vocab-parallel"
$RUN examples/llama_tp.py --steps 10
echo "=== Hugging Face transformers: LlamaForCausalLM (GQA) from its own tp plan, one call (skipped without transformers)"
$RUN examples/hf_llama.py --steps 5
echo "=== domain parallelism: a CNN on a periodic field split across ranks (halo exchange)"
$RUN examples/domain_cnn.py
echo "=== U-Net (GroupNorm, time embedding) on a field split across ranks, trained with domain_mean"
$RUN examples/unet.py --steps 5
echo "=== a U-Net with self-attention over all mid-block pixels: the region guard routes F.scaled_dot_product_attention"
$RUN examples/unet_attention.py --attention plan --steps 3
echo "=== the same U-Net in 3-D, sharded along D"
$RUN examples/unet.py --dims 3 --steps 3
echo "=== neighborhood attention: a small NA transformer on an image split across ranks"
$RUN examples/na_transformer.py
echo "=== checkpoints: train at 2 ranks, save, reload at 3 ranks and at 1, consolidated export"
CKPT=$(mktemp -d)/ckpt
$RUN examples/checkpoint_reshard.py train "$CKPT"
$PY -m torch.distributed.run --standalone --nproc-per-node 3 examples/checkpoint_reshard.py reload "$CKPT"
$PY examples/checkpoint_reshard.py reload "$CKPT"
echo "=== data parallelism: FSDP2 over dp on a (dp, tp) mesh, checkpoint with AdamW state, resumed exactly"
$RUN examples/data_parallel.py

#!/usr/bin/env bash
# The CPU twin of the Qwen2.5-VL recipe (examples/qwen_vl/README.md): the recipe's layout scaled down to
# 4 CPU ranks (twin.yaml) with its train flags, less what a CPU run cannot take (bf16: fp32 here), on
# the handwritten digit captions, with a tiny Qwen2.5-VL-shaped model from flags (the tower: window and
# full attention, 2-D RoPE, 2x2 merger; the language model: M-RoPE, RMSNorm, SwiGLU, QKV bias, GQA) in
# place of a converted Qwen2.5-VL folder.
# Usage: examples/qwen_vl/cpu_twin.sh [OUT]   (default bench-results/qwen-vl-twin; the digits need
# `scripts/install.sh data`). Environment: ITERS (default 20), DIGITS (an existing `megatron-hetero
# data digits` folder; default OUT/digits).
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:-bench-results/qwen-vl-twin}"
mh="${MEGATRON_HETERO:-.venv/bin/megatron-hetero}"  # or e.g. MEGATRON_HETERO="python -m megatron_hetero"
iters="${ITERS:-20}"
digits="${DIGITS:-$out/digits}"
mkdir -p "$out"
[ -d "$digits/.nv-meta" ] || $mh data digits --out "$digits" --force
rm -rf "$out/run" "$out/run.jsonl"
model=(--vision-model-type qwen2.5-vl --patch-dim 2 --encoder-num-layers 2 --encoder-hidden-size 32
       --encoder-num-attention-heads 2 --num-layers 2 --hidden-size 64 --num-attention-heads 4
       --group-query-attention --num-query-groups 2 --position-embedding-type mrope --mrope-section 2 3 3
       --normalization RMSNorm --swiglu --add-qkv-bias --disable-bias-linear)
flags=(--micro-batch-size 10 --use-distributed-optimizer --clip-grad 1.0 --weight-decay 0.0
       --lr-decay-style cosine --log-interval 5 --save-interval 10)
$mh train --hetero-layout examples/qwen_vl/twin.yaml "${model[@]}" "${flags[@]}" \
    --data-path "$digits" --seq-length 16 --global-batch-size 40 --lr 5e-3 --lr-warmup-iters "$((iters / 10))" \
    --train-iters "$iters" --save "$out/run" --log-jsonl "$out/run.jsonl"
echo "log: $out/run.jsonl; checkpoint: $out/run"

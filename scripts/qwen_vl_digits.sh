#!/usr/bin/env bash
# Qwen2.5-VL's vision tower (window + full attention, 2-D RoPE, 2x2 patch merger) and a Qwen2.5-style
# language model with M-RoPE, trained from scratch on the digits captions on 2 CPU ranks (colocated:
# vision DP2, language TP2); docs/benchmarks/2026-12-07-qwen-vl-digits.md. Then:
#   python scripts/plot_qwen_vl_digits.py OUT --out docs/benchmarks/qwen_vl_digits_600   (600: ITERS)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-results/qwen-vl-digits}"
mh="${MEGATRON_HETERO:-.venv/bin/megatron-hetero}"  # or e.g. MEGATRON_HETERO="python -m megatron_hetero"
ITERS="${ITERS:-600}"
mkdir -p "$out"
[ -d "$out/digits/.nv-meta" ] || $mh data digits --out "$out/digits" --force
rm -f "$out/qwen.jsonl"
t0=$SECONDS
$mh train --hetero-placement colocated --hetero-edge "vision->language" --nproc-per-node 2 \
    --hetero-module vision:dp=2 --hetero-module language:tp=2 \
    --vision-model-type qwen2.5-vl --patch-dim 2 --encoder-hidden-size 32 --encoder-num-attention-heads 2 \
    --position-embedding-type mrope --mrope-section 2 3 3 --normalization RMSNorm --swiglu --add-qkv-bias \
    --disable-bias-linear --group-query-attention --num-query-groups 2 \
    --data-path "$out/digits" --seq-length 16 --global-batch-size 40 --micro-batch-size 20 \
    --lr 5e-3 --lr-warmup-iters 20 --lr-decay-style cosine --train-iters "$ITERS" \
    --log-interval 10 --eval-interval 50 --log-jsonl "$out/qwen.jsonl"
echo "{\"wall_s\": $((SECONDS - t0))}" > "$out/wall.json"

#!/usr/bin/env bash
# Qwen2.5-VL's vision tower and a Qwen2.5-style M-RoPE language model trained from scratch on the digits
# conversations (`data digits --chat`: 0, 1 or 2 digit images of 8 or 16 pixels a conversation) at
# native resolution (each image whole through the Qwen image processor: 2x2 or 4x4 merged tokens), on
# 2 CPU ranks, colocated: vision DP2, language TP2; held-out answer accuracy every EVAL iterations.
# docs/benchmarks/2026-12-07-qwen-vl-chat.md. Then:
#   python scripts/plot_qwen_vl_chat.py OUT --out docs/benchmarks/qwen_vl_chat_800   (800: ITERS)
# Usage: bash scripts/qwen_vl_chat.sh [OUT]   (default bench-results/qwen-vl-chat; needs `scripts/install.sh data`)
# ITERS / EVAL / LR / SEQ (environment) change the iterations, the evaluation interval (each evaluation
# reads the whole held-out split), the peak rate and the sequence length.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-results/qwen-vl-chat}"
mh="${MEGATRON_HETERO:-.venv/bin/megatron-hetero}"  # or e.g. MEGATRON_HETERO="python -m megatron_hetero"
ITERS="${ITERS:-800}"
mkdir -p "$out"
[ -d "$out/chat/.nv-meta" ] || $mh data digits --chat --out "$out/chat" --force
rm -f "$out/run.jsonl"
t0=$SECONDS
$mh train --hetero-placement colocated --hetero-edge "vision->language" --nproc-per-node 2 \
    --hetero-module vision:dp=2 --hetero-module language:tp=2 \
    --vision-model-type qwen2.5-vl --patch-dim 2 --encoder-hidden-size 32 --encoder-num-attention-heads 2 \
    --position-embedding-type mrope --mrope-section 2 3 3 --normalization RMSNorm --swiglu --add-qkv-bias \
    --disable-bias-linear --group-query-attention --num-query-groups 2 \
    --data-path "$out/chat" --seq-length "${SEQ:-128}" --global-batch-size 32 --micro-batch-size 16 \
    --lr "${LR:-5e-3}" --lr-warmup-iters 20 --lr-decay-style cosine --train-iters "$ITERS" \
    --log-interval 10 --eval-interval "${EVAL:-100}" --log-jsonl "$out/run.jsonl"
echo "{\"wall_s\": $((SECONDS - t0))}" > "$out/wall.json"
echo "wall time $((SECONDS - t0)) s; log in $out/run.jsonl"

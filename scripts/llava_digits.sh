#!/usr/bin/env bash
# The main job: a LLaVA-style two-stage run on real image-caption data (the handwritten digits),
# 4 CPU ranks, colocated heterogeneous layout: vision encoder DP4, language model TP2·DP2.
#   stage 1: encoder and language model frozen, the projector trains (LLaVA's alignment stage);
#   stage 2: from stage 1's checkpoint, the projector and the language model train, encoder frozen.
# Held-out loss and caption accuracy are printed every --eval-interval iterations.
# Usage: scripts/llava_digits.sh [OUT]   (default bench-results/llava-digits; needs `scripts/install.sh data`)
# STAGE1_ITERS / STAGE2_ITERS (environment) change the iterations (stage 2 counts on from stage 1's).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-results/llava-digits}"
mh="${MEGATRON_HETERO:-.venv/bin/megatron-hetero}"  # or e.g. MEGATRON_HETERO="python -m megatron_hetero"
mkdir -p "$out"
[ -d "$out/digits/.nv-meta" ] || $mh data digits --out "$out/digits" --force
rm -rf "$out/stage1" "$out/stage2"
model=(--data-path "$out/digits" --seq-length 16 --global-batch-size 40 --micro-batch-size 20
       --hetero-placement colocated --hetero-edge "vision->language" --eval-interval 50 --log-interval 10)
STAGE1_ITERS="${STAGE1_ITERS:-40}"
STAGE2_ITERS="${STAGE2_ITERS:-540}"
t0=$SECONDS
$mh train "${model[@]}" --hetero-module vision:dp=4,frozen --hetero-module language:tp=2,dp=2,frozen \
    --lr 5e-3 --lr-warmup-iters 5 --train-iters "$STAGE1_ITERS" \
    --save "$out/stage1" --log-jsonl "$out/stage1.jsonl"
t1=$SECONDS
$mh train "${model[@]}" --hetero-module vision:dp=4,frozen --hetero-module language:tp=2,dp=2 \
    --lr 5e-3 --lr-warmup-iters 20 --lr-decay-style cosine --train-iters "$STAGE2_ITERS" \
    --load "$out/stage1" --override-opt-param-scheduler --save "$out/stage2" --log-jsonl "$out/stage2.jsonl"
t2=$SECONDS
echo "{\"stage1_s\": $((t1 - t0)), \"stage2_s\": $((t2 - t1))}" > "$out/wall.json"
echo "wall time: stage 1 $((t1 - t0)) s, stage 2 $((t2 - t1)) s; logs in $out/stage1.jsonl, $out/stage2.jsonl"

#!/usr/bin/env bash
# The main job: LLaVA's two training stages on real data built from the handwritten digits, 4 CPU
# ranks, colocated heterogeneous layout: vision encoder DP4 (trunk frozen), language model TP2·DP2,
# a tiny Llama-style language model (RMSNorm, RoPE, SwiGLU, no biases).
#   stage 1 (alignment): image captions, encoder and language model frozen, the projector trains;
#   stage 2 (visual instruction tuning): multi-turn conversations about 0, 1 or 2 digit images of 8 or
#            16 pixels (1 or 4 image tiles each: a variable number of image tokens per sample), from
#            stage 1's weights (--pretrained-checkpoint); the projector and the language model train,
#            the loss covers the assistant turns only.
# Held-out loss and answer accuracy (every token of an answer right, teacher-forced) are printed every
# --eval-interval iterations of stage 2.
# Usage: scripts/llava_digits.sh [OUT]   (default bench-results/llava-digits; needs `scripts/install.sh data`)
# STAGE1_ITERS / STAGE2_ITERS (environment) change the iterations.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-results/llava-digits}"
mh="${MEGATRON_HETERO:-.venv/bin/megatron-hetero}"  # or e.g. MEGATRON_HETERO="python -m megatron_hetero"
mkdir -p "$out"
[ -d "$out/digits/.nv-meta" ] || $mh data digits --out "$out/digits" --force
[ -d "$out/chat/.nv-meta" ] || $mh data digits --chat --out "$out/chat" --force
rm -rf "$out/stage1" "$out/stage2" "$out/stage1.jsonl" "$out/stage2.jsonl"
STAGE1_ITERS="${STAGE1_ITERS:-40}"
STAGE2_ITERS="${STAGE2_ITERS:-800}"
common=(--hetero-placement colocated --hetero-edge "vision->language" --hetero-module vision:dp=4,frozen
        --normalization RMSNorm --position-embedding-type rope --swiglu --disable-bias-linear --log-interval 50)
t0=$SECONDS
$mh train "${common[@]}" --hetero-module language:tp=2,dp=2,frozen \
    --data-path "$out/digits" --seq-length 16 --global-batch-size 40 --micro-batch-size 20 \
    --lr 5e-3 --lr-warmup-iters 5 --train-iters "$STAGE1_ITERS" \
    --save "$out/stage1" --log-jsonl "$out/stage1.jsonl"
t1=$SECONDS
$mh train "${common[@]}" --hetero-module language:tp=2,dp=2 \
    --data-path "$out/chat" --seq-length 96 --global-batch-size 32 --micro-batch-size 16 \
    --pretrained-checkpoint "$out/stage1" \
    --lr 5e-3 --lr-warmup-iters 20 --lr-decay-style cosine --train-iters "$STAGE2_ITERS" --eval-interval 200 \
    --save "$out/stage2" --log-jsonl "$out/stage2.jsonl"
t2=$SECONDS
echo "{\"stage1_s\": $((t1 - t0)), \"stage2_s\": $((t2 - t1))}" > "$out/wall.json"
echo "wall time: stage 1 $((t1 - t0)) s, stage 2 $((t2 - t1)) s; logs in $out/stage1.jsonl, $out/stage2.jsonl"

#!/usr/bin/env bash
# LLaVA's two training stages with Qwen2.5-VL's vision tower and a Qwen2.5-style M-RoPE language model,
# from scratch, on 2 CPU ranks (colocated: vision DP2, language TP2), the model of scripts/qwen_vl_digits.sh
# and scripts/qwen_vl_chat.sh:
#   stage 1: the digits captions (fixed-size images), everything trains (from scratch there is no
#            trained tower or language model to keep frozen, unlike scripts/llava_digits.sh);
#   stage 2: the digits conversations at native resolution (each image whole through the Qwen image
#            processor), from stage 1's weights (--pretrained-checkpoint: the weights only, a fresh
#            optimizer and schedule); held-out answer accuracy every EVAL iterations.
# docs/benchmarks/2026-12-07-qwen-vl-chat.md#two-stages-captions-then-conversations. Then:
#   python scripts/plot_qwen_vl_chat.py OUT --log stage2.jsonl --out docs/benchmarks/qwen_vl_two_stage_1200   (1200: STAGE2_ITERS)
# Usage: bash scripts/qwen_vl_two_stage.sh [OUT]   (default bench-results/qwen-vl-two-stage; needs
# `scripts/install.sh data`). STAGE1_ITERS / STAGE2_ITERS / EVAL / SEED / WARMUP (environment) change
# the iterations of each stage (stage 1 at 600 is the caption run, seed 1234 alike), stage 2's
# evaluation interval (each evaluation reads the whole held-out split), the seed of both stages
# (initialisation and data order) and the warm-up iterations of each (20; below the iterations);
# FREEZE_TOWER=1 freezes the tower's blocks in stage 2 as LLaVA's stage 2 freezes its encoder (the
# patch merger, the projector, trains with the language model).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-results/qwen-vl-two-stage}"
mh="${MEGATRON_HETERO:-.venv/bin/megatron-hetero}"  # or e.g. MEGATRON_HETERO="python -m megatron_hetero"
STAGE1_ITERS="${STAGE1_ITERS:-600}"
STAGE2_ITERS="${STAGE2_ITERS:-1200}"
SEED="${SEED:-1234}"
mkdir -p "$out"
[ -d "$out/digits/.nv-meta" ] || $mh data digits --out "$out/digits" --force
[ -d "$out/chat/.nv-meta" ] || $mh data digits --chat --out "$out/chat" --force
rm -rf "$out/stage1" "$out/stage1.jsonl" "$out/stage2.jsonl"
common=(--hetero-placement colocated --hetero-edge "vision->language" --nproc-per-node 2
        --vision-model-type qwen2.5-vl --patch-dim 2 --encoder-hidden-size 32 --encoder-num-attention-heads 2
        --position-embedding-type mrope --mrope-section 2 3 3 --normalization RMSNorm --swiglu --add-qkv-bias
        --disable-bias-linear --group-query-attention --num-query-groups 2 --seed "$SEED" --log-interval 10)
t0=$SECONDS
$mh train --hetero-module vision:dp=2 --hetero-module language:tp=2 "${common[@]}" \
    --data-path "$out/digits" --seq-length 16 --global-batch-size 40 --micro-batch-size 20 \
    --lr 5e-3 --lr-warmup-iters "${WARMUP:-20}" --lr-decay-style cosine --train-iters "$STAGE1_ITERS" \
    --eval-interval 200 --save "$out/stage1" --log-jsonl "$out/stage1.jsonl"
t1=$SECONDS
$mh train --hetero-module "vision:dp=2${FREEZE_TOWER:+,frozen}" --hetero-module language:tp=2 "${common[@]}" \
    --data-path "$out/chat" --seq-length 128 --global-batch-size 32 --micro-batch-size 16 \
    --pretrained-checkpoint "$out/stage1" \
    --lr 5e-3 --lr-warmup-iters "${WARMUP:-20}" --lr-decay-style cosine --train-iters "$STAGE2_ITERS" \
    --eval-interval "${EVAL:-200}" --log-jsonl "$out/stage2.jsonl"
t2=$SECONDS
echo "{\"stage1_s\": $((t1 - t0)), \"stage2_s\": $((t2 - t1))}" > "$out/wall.json"
echo "wall time: stage 1 $((t1 - t0)) s, stage 2 $((t2 - t1)) s; logs in $out/stage1.jsonl, $out/stage2.jsonl"

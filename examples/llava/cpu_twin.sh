#!/usr/bin/env bash
# The CPU twin of the LLaVA recipe (examples/llava/README.md): stage 1 then stage 2 on 4 CPU ranks
# (gloo) on the handwritten digits, with the recipe's layouts scaled down (twin_stage1.yaml,
# twin_stage2.yaml) and its train flags, less what a CPU run cannot take (precision: fp32, as the
# H100 scripts today) and with train's tiny Llama-style model (RMSNorm, RoPE, SwiGLU, no biases) in
# place of converted CLIP + Llama weights.
#   stage 1: image captions; vision and language frozen, the projector trains; saves OUT/stage1
#   stage 2: multi-turn conversations about 0-2 digit images (1 or 4 tiles each: variable image
#            tokens), --pretrained-checkpoint OUT/stage1 (--finetune from it: iteration 0, a fresh
#            optimizer and schedule) at half stage 1's global batch, as LLaVA's 128 after 256;
#            language and projector train, the loss covers the assistant turns
# Usage: examples/llava/cpu_twin.sh [OUT]   (default bench-results/llava-twin; the digits need
# `scripts/install.sh data`). Environment: STAGE1_ITERS (default 20), STAGE2_ITERS (default 40),
# DIGITS (an existing `megatron-hetero data digits` folder; default OUT/digits), CHAT (an existing
# `megatron-hetero data digits --chat` folder; default OUT/chat).
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:-bench-results/llava-twin}"
mh="${MEGATRON_HETERO:-.venv/bin/megatron-hetero}"  # or e.g. MEGATRON_HETERO="python -m megatron_hetero"
s1="${STAGE1_ITERS:-20}"
s2="${STAGE2_ITERS:-40}"
digits="${DIGITS:-$out/digits}"
chat="${CHAT:-$out/chat}"
mkdir -p "$out"
[ -d "$digits/.nv-meta" ] || $mh data digits --out "$digits" --force
[ -d "$chat/.nv-meta" ] || $mh data digits --chat --out "$chat" --force
rm -rf "$out/stage1" "$out/stage2" "$out/stage1.jsonl" "$out/stage2.jsonl"
model=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 172
       --normalization RMSNorm --position-embedding-type rope --swiglu --disable-bias-linear
       --encoder-num-layers 2 --encoder-hidden-size 32 --encoder-num-attention-heads 4)
flags=(--micro-batch-size 10 --use-distributed-optimizer --sequence-parallel --recompute-granularity selective
       --clip-grad 1.0 --weight-decay 0.0 --lr-decay-style cosine --log-interval 5 --save-interval 10)
$mh train --hetero-layout examples/llava/twin_stage1.yaml "${model[@]}" "${flags[@]}" \
    --data-path "$digits" --seq-length 16 --global-batch-size 40 --lr 5e-3 --lr-warmup-iters "$((s1 / 10))" --train-iters "$s1" --save "$out/stage1" --log-jsonl "$out/stage1.jsonl"
$mh train --hetero-layout examples/llava/twin_stage2.yaml "${model[@]}" "${flags[@]}" \
    --pretrained-checkpoint "$out/stage1" --data-path "$chat" --seq-length 96 --global-batch-size 20 \
    --lr 2e-3 --lr-warmup-iters "$((s2 / 10))" --train-iters "$s2" --save "$out/stage2" --log-jsonl "$out/stage2.jsonl"
echo "logs: $out/stage1.jsonl, $out/stage2.jsonl; checkpoints: $out/stage1, $out/stage2"

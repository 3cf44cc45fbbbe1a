#!/usr/bin/env bash
# The audio-visual run (docs/benchmarks/2026-12-07-audio-visual.md): the spoken digits (`data digits
# --speech`, needs espeak-ng) trained on a colocated world 2 with vision DP2 (trunk frozen; VISION=
# vision:dp=2 trains it), the Whisper `audio` encoder TP2 and the language model TP2; held-out
# accuracy per modality every 200 iterations.
#   bash scripts/audio_visual.sh [OUT]     (ITERS=1200 by default)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-results/audio-visual}"
mh="${MEGATRON_HETERO:-.venv/bin/megatron-hetero}"  # or e.g. MEGATRON_HETERO="python -m megatron_hetero"
mkdir -p "$out"
[ -d "$out/speech/.nv-meta" ] || $mh data digits --speech --out "$out/speech" --force
rm -f "$out/run.jsonl"
t0=$SECONDS
$mh train --data-path "$out/speech" --hetero-placement colocated \
    --hetero-edge "vision->language" --hetero-edge "audio->language" \
    --hetero-module "${VISION:-vision:dp=2,frozen}" --hetero-module audio:tp=2 --hetero-module language:tp=2 \
    --normalization RMSNorm --position-embedding-type rope --swiglu --disable-bias-linear \
    --global-batch-size 32 --micro-batch-size 16 --lr 5e-3 --lr-warmup-iters 20 --lr-decay-style cosine \
    --train-iters "${ITERS:-1200}" --eval-interval 200 --eval-iters 4 --log-interval 50 --log-jsonl "$out/run.jsonl"
echo "{\"wall_s\": $((SECONDS - t0))}" > "$out/wall.json"
echo "wall time $((SECONDS - t0)) s; log in $out/run.jsonl"

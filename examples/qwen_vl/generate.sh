#!/usr/bin/env bash
# Regenerates the H100 files of the Qwen2.5-VL recipe (examples/qwen_vl/README.md) from today's planner:
#   qwen_vl.yaml, search.txt   `megatron-hetero search --out` for a Qwen2.5-VL-7B-shaped model on 2 x 8 H100
#                              (the tower priced over its patches with its windows: `--encoder qwen2.5-vl`)
#   train.sbatch               `megatron-hetero slurm` for 2 nodes x 8 GPUs with that layout
# Usage: examples/qwen_vl/generate.sh [OUT]   (default examples/qwen_vl; run from anywhere)
# The saved ranking leaves out the search's own run time and output path, which vary.
# tests/e2e/test_qwen_vl_example.py runs it into a temporary folder and compares with the committed files.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:-examples/qwen_vl}"
mh="${MEGATRON_HETERO:-$PWD/.venv/bin/megatron-hetero}"  # or e.g. MEGATRON_HETERO="python -m megatron_hetero"
mkdir -p "$out"

# Qwen2.5-VL-7B: its tower (the qwen2.5-vl preset: 32 blocks, hidden 1280, windows of 112 px, full
# attention in 4 blocks) at 448x448 pixels = 256 image tokens; the language model Qwen2.5-7B's sizes
# (28 layers, hidden 3584, 28 heads, SwiGLU 18944, vocabulary 152,064) over the 14B preset's pricing
# (bf16, distributed optimizer, sequence parallelism, selective recompute); sequence 4096, batch 128.
model=(--hardware h100_80gb --world-size 16 --encoder qwen2.5-vl --llm 14B --encoder-tokens 256
       --num-layers 28 --hidden-size 3584 --num-attention-heads 28 --ffn-hidden-size 18944
       --vocab-size 152064 --seq-length 4096 --global-batch-size 128 --micro-batch-size 2 --top 5)
$mh search "${model[@]}" --out "$out/qwen_vl.yaml" \
    | grep -v '^(written to' | sed -E 's/ evaluated in [0-9.]+ s/ evaluated/' > "$out/search.txt"

# The train flags. Paths are relative to the directory sbatch is called from (the repository root).
# No model flags: --load of the converted folder (`convert hf-to-checkpoint --model
# hf/Qwen2.5-VL-7B-Instruct --image-size 448x448 --seq-length 4096 --out ckpt/qwen_vl/pretrained`)
# builds the recorded model; the caption data's images are 448x448 (256 tokens, as converted).
flags=(--load ckpt/qwen_vl/pretrained --data-path data/captions-448 --tokenizer-model hf/Qwen2.5-VL-7B-Instruct/tokenizer.json
       --bf16 --micro-batch-size 2 --use-distributed-optimizer --sequence-parallel --recompute-granularity selective
       --clip-grad 1.0 --weight-decay 0.0 --lr-decay-style cosine --global-batch-size 128 --lr 1e-5
       --lr-warmup-iters 100 --train-iters 3000 --save ckpt/qwen_vl/run --save-interval 500
       --log-interval 10 --log-throughput --log-memory --log-jsonl logs/qwen_vl.jsonl)
root="$PWD"; abs_out="$(cd "$out" && pwd)"; scratch="$(mktemp -d)"; trap 'rm -rf "$scratch"' EXIT
mkdir -p "$scratch/examples" && ln -s "$abs_out" "$scratch/examples/qwen_vl"
slurm=(--nodes 2 --gpus-per-node 8 --time 04:00:00 --output logs/%x-%j.out --sbatch-option=--exclusive)
(cd "$scratch" && PYTHONPATH="${PYTHONPATH:-$root}" $mh slurm "${slurm[@]}" --hetero-layout examples/qwen_vl/qwen_vl.yaml \
    --job-name qwen-vl -- "${flags[@]}") > "$out/train.sbatch"
echo "wrote $out/qwen_vl.yaml $out/search.txt $out/train.sbatch"

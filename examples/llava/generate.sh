#!/usr/bin/env bash
# Regenerates the H100 files of the LLaVA recipe (examples/llava/README.md) from today's planner:
#   stage1.yaml, stage2.yaml     `megatron-hetero search --out` for a LLaVA-1.5-shaped model on 2 x 8 H100,
#                                with `frozen: true` added (search prices every module as trained)
#   stage1.sbatch, stage2.sbatch `megatron-hetero slurm` for 2 nodes x 8 GPUs with those layouts
# Usage: examples/llava/generate.sh [OUT]   (default examples/llava; run from anywhere)
# The saved rankings leave out the search's own run time and output path, which vary.
# tests/e2e/test_llava_example.py runs it into a temporary folder and compares with the committed files.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:-examples/llava}"
mh="${MEGATRON_HETERO:-$PWD/.venv/bin/megatron-hetero}"  # or e.g. MEGATRON_HETERO="python -m megatron_hetero"
py="${PYTHON:-python3}"
mkdir -p "$out"

# CLIP ViT-L/14-336 read at LLaVA-1.5's vision_feature_layer -2 (convert keeps 23 of its 24 layers),
# 576 = (336/14)^2 image tokens; Llama-2-7B. The --encoder/--llm presets are overridden in every size:
# they only switch the pricing to the production features (bf16, distributed optimizer, sequence
# parallelism, selective recompute). Searched at stage 2's global batch 128; stage 1 runs LLaVA's 256
# on the same layout (stage 2 starts from stage 1's weights with --finetune: any batch).
model=(--hardware h100_80gb --world-size 16 --encoder 1B --llm 14B
       --encoder-num-layers 23 --encoder-hidden-size 1024 --encoder-num-attention-heads 16
       --encoder-ffn-hidden-size 4096 --encoder-tokens 576
       --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008
       --vocab-size 32000 --seq-length 2048 --global-batch-size 128 --micro-batch-size 4 --top 5)

freeze() {  # freeze FILE MODULE...: add `frozen: true` to these modules of a search --out layout
    "$py" - "$@" <<'PY'
import sys
path, names = sys.argv[1], set(sys.argv[2:])
lines, out, current = open(path).read().splitlines(), [], None
for line in lines + [""]:
    indent = len(line) - len(line.lstrip())
    if current and (indent <= 2 or not line.strip()):
        out.append("    frozen: true")
        current = None
    if indent == 2 and line.strip().endswith(":") and line.strip()[:-1] in names:
        current = line.strip()[:-1]
    out.append(line)
text = "\n".join(out[:-1]) + "\n"
note = "# frozen: true added by examples/llava/generate.sh (search prices every module as trained)\n"
open(path, "w").write(note + text)
PY
}

for stage in 1 2; do
    $mh search "${model[@]}" --out "$out/stage$stage.yaml" \
        | grep -v '^(written to' | sed -E 's/ evaluated in [0-9.]+ s/ evaluated/' > "$out/search_stage$stage.txt"
done
freeze "$out/stage1.yaml" vision language   # stage 1: only the projector (inside vision) trains
freeze "$out/stage2.yaml" vision            # stage 2: the projector and the language model train

# The train flags. Paths are relative to the directory sbatch is called from (the repository root).
# No model flags: --load of converted weights builds the recorded model; --bf16 casts its fp32 weights.
# Stage 2 is LLaVA's fine-tuning: --pretrained-checkpoint stage 1 (--finetune from it: iteration 0,
# a fresh optimizer and schedule, batch 128; a requeued job resumes its own saves instead).
# Stage 2 reads conversations (data/llava-instruct: LLaVA-1.5's instruction mix in the conversation
# layout of docs/data.md), each image one 336x336 tile (--max-image-tiles 1: 576 tokens, as LLaVA-1.5
# resizes), rendered with the chat template of the Llama-2-chat tokenizer folder (the same tokenizer.json
# as the base model's; its template adds no token, so the vocabulary stays the checkpoint's 32,000).
data=(--image-processor hf/clip-vit-large-patch14-336 --patch-size 14 --bf16 --micro-batch-size 4
      --use-distributed-optimizer --sequence-parallel --recompute-granularity selective
      --clip-grad 1.0 --weight-decay 0.0 --lr-decay-style cosine
      --save-interval 500 --log-interval 10 --log-throughput --log-memory)
# slurm reads the layout at the path the script will pass to train (examples/llava/...): from a
# scratch folder where that path is $out, so OUT may be any folder.
root="$PWD"; abs_out="$(cd "$out" && pwd)"; scratch="$(mktemp -d)"; trap 'rm -rf "$scratch"' EXIT
mkdir -p "$scratch/examples" && ln -s "$abs_out" "$scratch/examples/llava"
slurm=(--nodes 2 --gpus-per-node 8 --time 04:00:00 --output logs/%x-%j.out --sbatch-option=--exclusive)
(cd "$scratch" && PYTHONPATH="${PYTHONPATH:-$root}" $mh slurm "${slurm[@]}" --hetero-layout examples/llava/stage1.yaml --job-name llava-stage1 -- \
    --load ckpt/llava/pretrained --data-path data/llava-pretrain --tokenizer-model hf/Llama-2-7b-hf/tokenizer.json "${data[@]}" \
    --global-batch-size 256 --lr 1e-3 --lr-warmup-iters 66 --train-iters 2181 \
    --save ckpt/llava/stage1 --log-jsonl logs/stage1.jsonl) > "$out/stage1.sbatch"
(cd "$scratch" && PYTHONPATH="${PYTHONPATH:-$root}" $mh slurm "${slurm[@]}" --hetero-layout examples/llava/stage2.yaml --job-name llava-stage2 -- \
    --pretrained-checkpoint ckpt/llava/stage1 --data-path data/llava-instruct --max-image-tiles 1 \
    --tokenizer-model hf/Llama-2-7b-chat-hf/tokenizer.json "${data[@]}" \
    --global-batch-size 128 --lr 2e-5 --lr-warmup-iters 156 --train-iters 5197 \
    --save ckpt/llava/stage2 --log-jsonl logs/stage2.jsonl) > "$out/stage2.sbatch"
echo "wrote $out/stage1.yaml $out/stage2.yaml $out/stage1.sbatch $out/stage2.sbatch"

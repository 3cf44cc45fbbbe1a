"""The CI version of the two-stage run of docs/benchmarks/2026-12-07-qwen-vl-chat.md
(scripts/qwen_vl_two_stage.sh): the Qwen2.5-VL tower and its M-RoPE language model trained on the
digits captions (fixed-size 8x8 images as pixel blocks, --seq-length 16) and saved, then trained on
conversations at native resolution (the image processor's patches, a tile one merged token, --seq-length
96) from those weights with --pretrained-checkpoint, on the scripts' 2-rank layout: the load is taken
(its first loss is not the from-scratch run's on the same samples)."""

from __future__ import annotations

import json

import pytest

from megatron_hetero.cli import main
from megatron_hetero.data.digits import write_digits_dataset

from qwen_chat_case import write_case

QWEN = ["--vision-model-type", "qwen2.5-vl", "--patch-dim", "2", "--position-embedding-type", "mrope"]
QWEN += ["--mrope-section", "2", "3", "3", "--normalization", "RMSNorm", "--swiglu", "--add-qkv-bias"]
QWEN += ["--disable-bias-linear", "--group-query-attention", "--num-query-groups", "2"]
QWEN += ["--encoder-hidden-size", "32", "--encoder-num-attention-heads", "2", "--lr", "5e-3"]
QWEN += ["--hetero-placement", "colocated", "--hetero-edge", "vision->language", "--nproc-per-node", "2"]
QWEN += ["--hetero-module", "vision:dp=2", "--hetero-module", "language:tp=2", "--lr-warmup-iters", "1"]


def _losses(log) -> list[float]:
    records = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    return [r["loss"] for r in records if "eval_loss" not in r]


@pytest.mark.timeout(300)
def test_conversations_at_native_resolution_start_from_the_caption_stage(tmp_path):
    captions = tmp_path / "digits"
    write_digits_dataset(captions)
    chat, proc = write_case(tmp_path, samples=16, val_samples=4)
    stage1 = ["train", *QWEN, "--data-path", str(captions), "--seq-length", "16", "--global-batch-size", "8"]
    stage1 += ["--micro-batch-size", "4", "--train-iters", "3", "--save", str(tmp_path / "stage1")]
    assert main(stage1) == 0
    stage2 = ["train", *QWEN, "--data-path", str(chat), "--image-processor", str(proc), "--seq-length", "96"]
    stage2 += ["--global-batch-size", "8", "--micro-batch-size", "4", "--train-iters", "2"]
    assert main([*stage2, "--pretrained-checkpoint", str(tmp_path / "stage1"), "--log-jsonl", str(tmp_path / "a")]) == 0
    assert main([*stage2, "--log-jsonl", str(tmp_path / "b")]) == 0
    tuned, fresh = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert len(tuned) == len(fresh) == 2
    assert abs(tuned[0] - fresh[0]) > 1e-3 * abs(fresh[0]), (tuned, fresh)  # stage 1's weights, not a fresh model

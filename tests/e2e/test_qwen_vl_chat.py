"""The CI version of docs/benchmarks/2026-12-07-qwen-vl-chat.md (scripts/qwen_vl_chat.sh): the Qwen2.5-VL
tower and an M-RoPE language model trained from scratch on digits conversations at native resolution
(the tiny set of `tests/qwen_chat_case.py`: 8x8, 12x12 and 8x16 images, up to two a sample, text-only
samples), on 2 CPU ranks with the script's two-module layout (colocated, vision DP2, language TP2): the
training loss falls and the held-out answer evaluation runs and is logged, with the answers to "What
digit is this?" counted apart."""

from __future__ import annotations

import json

import pytest

from megatron_hetero import cli

from qwen_chat_case import write_case

QWEN = ["--vision-model-type", "qwen2.5-vl", "--patch-dim", "2", "--position-embedding-type", "mrope"]
QWEN += ["--mrope-section", "2", "3", "3", "--normalization", "RMSNorm", "--swiglu", "--add-qkv-bias"]
QWEN += ["--disable-bias-linear", "--group-query-attention", "--num-query-groups", "2"]
QWEN += ["--encoder-hidden-size", "32", "--encoder-num-attention-heads", "2"]


@pytest.mark.timeout(300)
def test_the_qwen_tower_trains_on_conversations_on_two_modules(tmp_path, capsys):
    data, proc = write_case(tmp_path, samples=32, val_samples=8)
    log = tmp_path / "log.jsonl"
    argv = ["train", "--hetero-placement", "colocated", "--hetero-edge", "vision->language", *QWEN]
    argv += ["--hetero-module", "vision:dp=2", "--hetero-module", "language:tp=2", "--nproc-per-node", "2"]
    argv += ["--data-path", str(data), "--image-processor", str(proc), "--seq-length", "96"]
    argv += ["--global-batch-size", "8", "--micro-batch-size", "4", "--lr", "5e-3", "--lr-warmup-iters", "3"]
    argv += ["--train-iters", "16", "--log-interval", "1", "--eval-interval", "16", "--eval-iters", "1"]
    argv += ["--log-jsonl", str(log)]
    assert cli.main(argv) == 0
    records = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    loss = [r["loss"] for r in records if "loss" in r and "eval_loss" not in r]
    assert len(loss) >= 12 and sum(loss[-3:]) / 3 < 0.6 * sum(loss[:3]) / 3, loss
    evals = [r for r in records if "eval_loss" in r]
    assert [r["iteration"] for r in evals] == [16], evals
    assert evals[0]["eval_loss"] < loss[0] and 0.0 <= evals[0]["eval_accuracy"] <= 1.0, evals
    named = evals[0]["eval_parts"]["digit named"]  # the answers that read one image, counted apart
    assert named["answers"] >= 1 and 0.0 <= named["accuracy"] <= 1.0, evals
    out = capsys.readouterr().out
    assert "answer accuracy" in out and "held-out answers" in out

"""The Qwen2.5-VL tower on the digits captions (`data digits`, `train --data-path`): each merged token
reads its 4x4-pixel block (`energon_data.patchify` at merge * patch), cut into the Qwen image
processor's patch order by `models.qwen_encoder.blocks_to_patches` (held against the processor's own
reshape of the same pixels); a short CPU run (colocated, vision DP2, language TP2) lowers the
training loss and reports a held-out caption accuracy: the CI version of
docs/benchmarks/2026-12-07-qwen-vl-digits.md."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_hetero.cli import main
from megatron_hetero.data.digits import write_digits_dataset
from megatron_hetero.data.energon_data import CaptionDataConfig, patchify
from megatron_hetero.models.qwen_encoder import blocks_to_patches

QWEN = ["--vision-model-type", "qwen2.5-vl", "--patch-dim", "2", "--position-embedding-type", "mrope"]
QWEN += ["--mrope-section", "2", "3", "3", "--normalization", "RMSNorm", "--swiglu", "--add-qkv-bias"]
QWEN += ["--disable-bias-linear", "--group-query-attention", "--num-query-groups", "2"]


@pytest.mark.parametrize("channels", [1, 3])
def test_pixel_blocks_become_the_processors_patch_order(channels):
    g = torch.Generator().manual_seed(0)
    h, w, p, m, t = 8, 12, 2, 2, 2
    image = torch.rand(channels, h, w, generator=g)
    cfg = CaptionDataConfig("unused", patch_size=m * p, image_size=(h, w), channels=channels)
    blocks = patchify(image, cfg).unsqueeze(0)  # [1, tokens, C*(m*p)**2], scaled to [-1, 1]
    enc = SimpleNamespace(merge_size=m, patch_size=p, temporal_patch_size=t)
    got = blocks_to_patches(blocks, enc)[0]
    # the processor's own cut (`QwenImageProcessor.__call__`) of the same scaled RGB frame
    y = ((image.expand(3, -1, -1) if channels == 1 else image) - 0.5) / 0.5
    frames = np.repeat(y.numpy()[None], t, axis=0)
    gh, gw = h // p, w // p
    want = frames.reshape(1, t, 3, gh // m, m, p, gw // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    want = torch.from_numpy(np.ascontiguousarray(want)).reshape(gh * gw // 4, 4 * 3 * t * p * p)
    assert torch.equal(got, want)


@pytest.mark.timeout(300)
def test_qwen_tower_learns_the_digits_captions(tmp_path, capsys):
    data = tmp_path / "digits"
    write_digits_dataset(data)
    log = tmp_path / "log.jsonl"
    argv = ["train", "--hetero-placement", "colocated", "--hetero-edge", "vision->language"]
    argv += ["--hetero-module", "vision:dp=2", "--hetero-module", "language:tp=2", "--nproc-per-node", "2", *QWEN]
    argv += ["--encoder-hidden-size", "32", "--encoder-num-attention-heads", "2", "--data-path", str(data)]
    argv += ["--seq-length", "16", "--global-batch-size", "40", "--micro-batch-size", "20", "--lr", "5e-3"]
    argv += ["--lr-warmup-iters", "5", "--train-iters", "20", "--eval-interval", "20", "--log-jsonl", str(log)]
    assert main(argv) == 0
    records = [json.loads(x) for x in Path(log).read_text().splitlines() if x.strip()]
    loss = [r["loss"] for r in records if "loss" in r and "eval_loss" not in r]
    assert len(loss) >= 10 and sum(loss[-3:]) / 3 < 0.5 * sum(loss[:3]) / 3, loss
    assert "caption accuracy" in capsys.readouterr().out


def test_an_image_processor_is_refused_for_the_qwen_tower_on_captions(tmp_path, capsys):
    data = tmp_path / "digits"
    write_digits_dataset(data)
    proc = tmp_path / "preprocessor_config.json"
    proc.write_text(json.dumps({"image_processor_type": "Qwen2VLImageProcessor"}))
    argv = ["train", "--hetero-placement", "colocated", "--hetero-edge", "vision->language", *QWEN]
    argv += ["--hetero-module", "vision:dp=1", "--hetero-module", "language:tp=1"]
    argv += ["--data-path", str(data), "--seq-length", "16", "--image-processor", str(proc), "--train-iters", "1"]
    assert main(argv) == 2
    assert "native-resolution processor is not wired" in capsys.readouterr().err

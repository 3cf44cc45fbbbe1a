"""The spoken-digits data through `train --data-path` (image tiles and speech chunks, both variable
per sample, joined at the language model) on held-out two-encoder layouts gives the world-1 run's
losses, held-out loss and per-modality counts: colocated (vision DP2, audio TP2, language TP2) and
disjoint (vision | audio TP2 | language PP2). Tone clips stand in for eSpeak NG (`tests/speech_data.py`)."""

from __future__ import annotations

import json

import pytest

from speech_data import write_tone_dataset

pytest.importorskip("sklearn")
pytest.importorskip("megatron.energon")

EDGES = ["--hetero-edge", "vision->language", "--hetero-edge", "audio->language"]
CASES = {
    "world 1": ("colocated", ["vision:dp=1", "audio:dp=1", "language:dp=1"]),
    "colocated: vision DP2, audio TP2, language TP2": ("colocated", ["vision:dp=2", "audio:tp=2", "language:tp=2"]),
    "disjoint: vision | audio TP2 | language PP2": (
        "disjoint",
        ["vision:dp=1,ranks=0-0", "audio:tp=2,ranks=1-2", "language:pp=2,ranks=3-4"],
    ),
}
_RUNS: dict = {}


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    return write_tone_dataset(tmp_path_factory.mktemp("speech") / "d", samples=16, val_samples=8, mel_bins=8)


def test_the_speech_chunks_vary_per_sample(ds):
    from dataclasses import replace

    from megatron_hetero.config.data import CaptionDataConfig
    from megatron_hetero.data.chat_batches import resolve_chat_config
    from megatron_hetero.data.chat_default import chat_template_for
    from megatron_hetero.data.speech_batches import SpeechBatches
    from megatron_hetero.models.speech_runner import SPEECH_CHUNK
    from megatron_hetero.data.tokenizer import load_tokenizer

    cfg = replace(resolve_chat_config(CaptionDataConfig(str(ds), patch_size=4, num_workers=0)), kind="speech")
    data = SpeechBatches(
        cfg,
        load_tokenizer(None),
        chat_template_for(None),
        encoder="vision",
        speech_tokens=SPEECH_CHUNK,
        mel_bins=8,
        seq_length=256,
        global_batch=12,
    )
    chunks = data.image_tiles(range(12))["audio"]
    assert 0 in chunks and len(set(chunks) - {0}) > 1, chunks  # none, and clips of different lengths


def _run(name: str, ds, tmp_path_factory) -> list[dict]:
    from megatron_hetero.cli import main

    if name not in _RUNS:
        placement, modules = CASES[name]
        log = tmp_path_factory.mktemp("run") / "run.jsonl"
        argv = ["train", "--data-path", str(ds), "--hetero-placement", placement, *EDGES]
        for m in modules:
            argv += ["--hetero-module", m]
        argv += ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--lr", "1e-2"]
        argv += ["--global-batch-size", "4", "--micro-batch-size", "2", "--train-iters", "3", "--eval-interval", "3"]
        assert main([*argv, "--log-jsonl", str(log)]) == 0, name
        _RUNS[name] = [json.loads(line) for line in log.read_text().splitlines()]
    return _RUNS[name]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", [n for n in CASES if n != "world 1"])
def test_speech_data_on_two_encoder_layouts_matches_world_1(name, ds, tmp_path_factory):
    ref, got = _run("world 1", ds, tmp_path_factory), _run(name, ds, tmp_path_factory)
    assert all(r["grad_norm_per_module"]["audio"] > 0 for r in ref)  # the clips reach the speech encoder
    ref_losses, losses = [r["loss"] for r in ref], [r["loss"] for r in got]
    diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    print(f"\n{name}: loss {diff:.1e} relative")
    assert losses == pytest.approx(ref_losses, rel=1e-6), f"{name}: {losses} vs {ref_losses}"
    assert got[-1]["eval_loss"] == pytest.approx(ref[-1]["eval_loss"], rel=1e-6)
    assert got[-1]["eval_parts"] == ref[-1]["eval_parts"] and got[-1]["eval_accuracy"] == ref[-1]["eval_accuracy"]

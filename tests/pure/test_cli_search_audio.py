"""`megatron-hetero search --audio-encoder`: a speech encoder beside the image encoder gets its own
layout, the written layout has both encoders feeding the language model, and `train`'s line builds
the Whisper `audio` module; bad combinations exit 2 with one line."""

from __future__ import annotations

import json

import pytest

from megatron_hetero import cli
from megatron_hetero.layout.yaml_io import load_layout
from megatron_hetero.planner.presets import SPEECH_PRESETS, WHISPER_CHUNK_TOKENS

pytestmark = pytest.mark.pure


def test_search_plans_train_model_with_a_whisper_audio_encoder(capsys, tmp_path):
    out = tmp_path / "best.yaml"
    argv = ["search", "--world-size", "4", "--hardware", "h100_80gb", "--audio-encoder", "whisper"]
    argv += ["--audio-chunks", "2", "--encoder-feature-dim", "160", "--json", "--out", str(out)]
    assert cli.main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    best = doc["ranked"][0]["candidate"]
    assert len(best["extra_encoders"]) == 1 and best["extra_encoders"][0]["layers"] == 2
    lay = load_layout(out)
    assert {"vision", "audio"} <= set(lay.names)
    assert {e.src for e in lay.edges if e.dst.startswith("language")} >= {"vision", "audio"}
    header = out.read_text().splitlines()[3]
    assert "--audio-model-type whisper" in header and "--encoder-feature-dim 160" in header


def test_search_with_presets_prices_the_clip_length(capsys):
    base = ["search", "--world-size", "16", "--hardware", "h100_80gb", "--encoder", "1B", "--llm", "14B"]
    base += ["--seq-length", "4096", "--global-batch-size", "64", "--placements", "colocated", "--json"]
    steps = []
    for chunks in ("1", "4"):
        assert cli.main(base + ["--audio-encoder", "whisper-small", "--audio-chunks", chunks]) == 0
        doc = json.loads(capsys.readouterr().out)
        steps.append(doc["ranked"][0]["breakdown"]["total"])
    assert steps[1] > steps[0]  # a 2-minute clip costs more than a 30 s one at the same context
    assert SPEECH_PRESETS["whisper-small"].tokens == WHISPER_CHUNK_TOKENS


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--audio-chunks", "2"], "--audio-chunks applies to a speech encoder"),
        (["--audio-encoder", "whisper-tiny"], "is a preset: give --encoder/--llm presets too"),
        (["--audio-encoder", "whisper", "--llm", "14B"], "with --encoder/--llm presets choose a Whisper preset"),
        (["--audio-encoder", "whisper", "--audio-chunks", "0"], "--audio-chunks must be >= 1"),
        (["--audio-encoder", "whisper", "--segments", "2"], "--audio-encoder plans a second encoder's layout"),
    ],
)
def test_bad_audio_flags_exit_2_with_one_line(capsys, extra, message):
    assert cli.main(["search", "--world-size", "4", "--hardware", "h100_80gb", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1

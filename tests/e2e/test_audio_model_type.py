"""`train --audio-model-type whisper`: the layout's `audio` encoder is the Whisper speech encoder (on
its own TP2 layout beside a DP2 vision encoder); a layout without `audio` is refused at the door."""

from __future__ import annotations

import json

import pytest

from megatron_hetero.cli import main

LAYOUT = """placement: colocated
modules:
  vision:   {dp: 2}
  audio:    {tp: 2}
  language: {tp: 2}
edges:
  - vision -> language
  - audio -> language
"""


@pytest.mark.timeout(300)
def test_whisper_audio_module_trains(tmp_path, capsys):
    layout, log = tmp_path / "av.yaml", tmp_path / "log.jsonl"
    layout.write_text(LAYOUT)
    argv = ["train", "--hetero-layout", str(layout), "--audio-model-type", "whisper", "--train-iters", "2"]
    assert main(argv + ["--log-jsonl", str(log)]) == 0, capsys.readouterr().err[-3000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert 4.0 < records[0]["loss"] < 5.5  # ln(128) at initialisation
    assert records[1]["loss"] < records[0]["loss"]
    assert records[0]["grad_norm_per_module"]["audio"] > 0


def test_whisper_without_an_audio_module_is_refused(capsys):
    from pathlib import Path

    homogeneous = Path(__file__).parents[2] / "examples" / "layouts" / "homogeneous.yaml"
    assert main(["train", "--hetero-layout", str(homogeneous), "--audio-model-type", "whisper"]) == 2
    assert "--audio-model-type whisper needs an encoder module named `audio`" in capsys.readouterr().err

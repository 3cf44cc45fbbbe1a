"""`data digits --speech`: spoken digits synthesised with eSpeak NG, Whisper log-mel features, an
energon dataset of image + spoken question, speech-only and text-only conversations; held-out
voices in val. Needs the `espeak-ng` program (skipped, with the reason, without it); the missing-
synthesiser message is checked always; `train --data-path` reads the real clips."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from megatron_hetero.cli import main
from megatron_hetero.data import speech_synth

pytest.importorskip("sklearn")
pytest.importorskip("megatron.energon")
NEEDS_ESPEAK = pytest.mark.skipif(
    not speech_synth.synthesizer_available(), reason="espeak-ng is not installed (apt-get install espeak-ng)"
)


def test_a_missing_synthesiser_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no espeak-ng here
    assert main(["data", "digits", "--speech", "--out", str(tmp_path / "d")]) == 1
    err = capsys.readouterr().err
    assert "eSpeak NG is not installed" in err and "apt-get install espeak-ng" in err
    assert not (tmp_path / "d").exists()  # refused before anything is written


@pytest.fixture(scope="module")
def spoken(tmp_path_factory):
    out = tmp_path_factory.mktemp("speech") / "d"
    argv = ["data", "digits", "--speech", "--out", str(out), "--samples", "24", "--val-samples", "8"]
    assert main(argv + ["--train-shards", "1", "--mel-bins", "8", "--json"]) == 0
    return out


def _samples(path) -> dict[str, dict[str, bytes]]:
    out: dict[str, dict[str, bytes]] = {}
    with tarfile.open(path) as tf:
        for m in tf.getmembers():
            key, part = m.name.split(".", 1)
            out.setdefault(key, {})[part] = tf.extractfile(m).read()
    return out


@NEEDS_ESPEAK
@pytest.mark.timeout(300)
def test_spoken_conversations_clips_and_held_out_voices(spoken):
    import numpy as np

    from megatron_hetero.data.digits import DIGIT_WORDS
    from megatron_hetero.data.digits_speech import TRAIN_VOICES, VAL_VOICES

    voices = {}
    kinds = set()
    clips = {}
    for split, tar in (("train", spoken / "train" / "shard-000000.tar"), ("val", spoken / "val" / "shard-000000.tar")):
        for parts in _samples(tar).values():
            rec = json.loads(parts["json"])
            kinds.add(rec["kind"])
            text = " ".join(m["content"] for m in rec["conversation"])
            assert text.count("<speech>") == len(rec["speech"]) and text.count("<image>") == len(rec["images"])
            for part, said, phrase, voice in zip(rec["speech"], rec["said"], rec["phrases"], rec["voices"]):
                mel = np.load(io.BytesIO(parts[part]))
                assert mel.dtype == np.float32 and mel.ndim == 2 and mel.shape[1] == 8 and mel.shape[0] % 2 == 0
                assert DIGIT_WORDS[said] in phrase
                voices.setdefault(split, set()).add(voice)
                clips[(phrase, voice)] = mel
            if rec["kind"] == "image_speech":
                answer = rec["conversation"][-1]["content"]
                assert answer == f"{DIGIT_WORDS[rec['labels'][0]]} and {DIGIT_WORDS[rec['said'][0]]}"
    assert kinds == {"image_speech", "speech", "text"}
    assert voices["train"] <= {v.label() for v in TRAIN_VOICES}
    assert voices["val"] <= {v.label() for v in VAL_VOICES} and not voices["train"] & voices["val"]
    # a stored clip is the synthesiser + Whisper's extractor on the phrase, recomputed here
    (phrase, label), mel = next(iter(clips.items()))
    voice = {v.label(): v for v in TRAIN_VOICES + VAL_VOICES}[label]
    again = speech_synth.log_mel(speech_synth.synthesize(phrase, voice), 8)
    assert np.array_equal(again, mel)
    other = next(v for v in TRAIN_VOICES + VAL_VOICES if v.name != voice.name)
    assert not np.array_equal(speech_synth.log_mel(speech_synth.synthesize(phrase, other), 8), mel)


@NEEDS_ESPEAK
def test_energon_reads_the_conversations(spoken):
    from megatron_hetero.data.chat_data import read_conversations

    samples = read_conversations(str(spoken), "val", limit=8)
    assert len(samples) == 8
    assert all(s.meta["kind"] in ("image_speech", "speech", "text") for s in samples)


@NEEDS_ESPEAK
@pytest.mark.timeout(300)
def test_train_reads_the_speech_data_with_an_audio_module(spoken, capsys):
    argv = ["train", "--data-path", str(spoken), "--hetero-module", "vision:dp=1", "--hetero-module", "language:dp=1"]
    assert main(argv) == 2  # no `audio` module in the layout: said at the door
    assert "spoken-digits data feeds two encoders, an image encoder and `audio`" in capsys.readouterr().err
    argv += ["--hetero-module", "audio:dp=1", "--hetero-edge", "vision->language", "--hetero-edge", "audio->language"]
    argv += ["--hetero-placement", "colocated", "--train-iters", "2", "--num-layers", "1", "--hidden-size", "32"]
    assert main(argv + ["--num-attention-heads", "2", "--global-batch-size", "4", "--micro-batch-size", "2"]) == 0
    assert "iteration    2/2" in capsys.readouterr().out

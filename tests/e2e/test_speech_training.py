"""`train --data-path DIR` on the spoken-digits data (`data digits --speech`): the batches of two
variable encoders (image tiles, speech chunks) against the stored shards, the spec fitted to the data
with no other flag (`audio` becomes Whisper's encoder), and a short audio-visual run whose loss falls
and whose held-out evaluation counts each modality. The clips are tones standing in for eSpeak NG
(`tests/speech_data.py`): no synthesiser needed."""

from __future__ import annotations

import io
import json
import tarfile
from dataclasses import replace

import pytest
import torch

from speech_data import write_tone_dataset

pytest.importorskip("sklearn")
pytest.importorskip("megatron.energon")

G = 4
LAYOUT = [
    "--hetero-placement",
    "colocated",
    "--hetero-edge",
    "vision->language",
    "--hetero-edge",
    "audio->language",
    "--hetero-module",
    "vision:dp=1",
    "--hetero-module",
    "audio:dp=1",
    "--hetero-module",
    "language:dp=1",
]


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    return write_tone_dataset(tmp_path_factory.mktemp("speech") / "d", samples=24, val_samples=8, mel_bins=8)


@pytest.fixture(scope="module")
def batches(ds):
    from megatron_hetero.config.data import CaptionDataConfig
    from megatron_hetero.data.chat_batches import resolve_chat_config
    from megatron_hetero.data.chat_default import chat_template_for
    from megatron_hetero.data.speech_batches import SpeechBatches
    from megatron_hetero.data.tokenizer import load_tokenizer

    cfg = replace(resolve_chat_config(CaptionDataConfig(str(ds), patch_size=4, num_workers=0)), kind="speech")
    tok, template = load_tokenizer(None), chat_template_for(None)
    return SpeechBatches(
        cfg, tok, template, encoder="vision", speech_tokens=4, mel_bins=8, seq_length=160, global_batch=24
    )


def _shards(ds) -> dict[str, dict[str, bytes]]:
    out: dict[str, dict[str, bytes]] = {}
    with tarfile.open(ds / "train" / "shard-000000.tar") as tf:
        for m in tf.getmembers():
            key, part = m.name.split(".", 1)
            out.setdefault(key, {})[part] = tf.extractfile(m).read()
    return out


def test_batches_place_each_encoders_tokens_and_match_the_shards(ds, batches):
    import numpy as np

    from megatron_hetero.data.chat_batches import tile_features
    from megatron_hetero.data.caption_index import decode_image
    from megatron_hetero.data.speech_batches import clip_chunks, clip_features

    shards = _shards(ds)
    rows = range(0, 24)
    tiles = batches.image_tiles(rows)
    assert batches.image_reads == []  # counted from the JSON sizes and the .npy headers
    b = batches.batch(rows)
    assert {n: t.tolist() for n, t in b["tiles"].items()} == tiles
    assert len(set(tiles["audio"])) > 1 and 0 in tiles["audio"] and 0 in tiles["vision"]  # variable, some none
    v_at = a_at = 0
    for r, i in enumerate(rows):
        rec, ct, counts, kinds = batches._conversation(i)
        doc = json.loads(shards[rec.key]["json"])
        vm, am = b["image_mask"]["vision"][r], b["image_mask"]["audio"][r]
        assert not bool((vm & am).any())
        assert int(vm.sum()) == tiles["vision"][r] * 4 and int(am.sum()) == tiles["audio"][r] * 4
        for (start, length), kind in zip(ct.image_spans, kinds):  # each run under its own encoder's mask
            assert bool((am if kind == "speech" else vm)[start : start + length].all())
        for part in doc["images"]:
            want = tile_features(decode_image(shards[rec.key][part]), batches.cfg)
            assert torch.equal(b["features"]["vision"][v_at : v_at + len(want)], want)
            v_at += len(want)
        for part in doc["speech"]:
            mel = torch.from_numpy(np.load(io.BytesIO(shards[rec.key][part])))
            want = clip_features(mel, 4)
            assert len(want) == clip_chunks(mel.shape[0], 4)
            assert torch.equal(b["features"]["audio"][a_at : a_at + len(want)], want)
            a_at += len(want)
    assert v_at == len(b["features"]["vision"]) and a_at == len(b["features"]["audio"])


def test_train_flags_fit_the_spec_to_the_speech_data(ds):
    from megatron_hetero import cli
    from megatron_hetero.models.job_data import job_data, runner_factory
    from megatron_hetero.models.llava import LlavaSpec
    from megatron_hetero.config.model import EncoderSpec

    spec = LlavaSpec(encoders={"vision": EncoderSpec(offset=1), "audio": EncoderSpec(offset=17)})
    from megatron_hetero.cli.train_door import data_request

    def parse(argv):
        return data_request(cli.build_parser().parse_args(argv))

    got, data = job_data(parse(["train", "--data-path", str(ds)]), spec, G)
    assert data.kind == "speech" and data.image_size == (8, 8) and data.channels == 1
    v, a = got.encoders["vision"], got.encoders["audio"]
    assert (v.kind, v.tokens, v.feature_dim, v.offset, v.max_tiles) == ("linear", 4, 16, 1, 4)
    assert (a.kind, a.tokens, a.feature_dim, a.offset) == ("whisper", 32, 16, 17)  # Whisper, 2 x 8 bins a token
    assert a.max_tiles >= 2 and got.seq_length % 8 == 0 and got.seq_length >= a.offset + a.tokens
    assert runner_factory(data, got, G).__qualname__.startswith("speech_runner_factory")
    linear, _ = job_data(parse(["train", "--data-path", str(ds), "--audio-model-type", "linear"]), spec, G)
    assert linear.encoders["audio"].kind == "linear"  # said otherwise: kept
    with pytest.raises(ValueError, match=r"feeds two encoders, an image encoder and `audio`.*\['vision'\]"):
        job_data(parse(["train", "--data-path", str(ds)]), replace(spec, encoders={"vision": EncoderSpec()}), G)
    with pytest.raises(ValueError, match="--encoder-tokens 9: .* gives 4 per image tile"):
        job_data(parse(["train", "--data-path", str(ds), "--encoder-tokens", "9"]), spec, G)
    with pytest.raises(ValueError, match="--seq-length 8: too short for an image tile"):
        job_data(parse(["train", "--data-path", str(ds), "--seq-length", "8"]), replace(spec, seq_length=8), G)


@pytest.mark.timeout(300)
def test_a_short_audio_visual_run_learns_and_counts_each_modality(ds, tmp_path, capsys):
    """The CI version of the audio-visual run: a few steps at world 1, the loss falls, the held-out
    evaluation counts the digit shown and the digit said."""
    from megatron_hetero.cli import main

    log = tmp_path / "run.jsonl"
    argv = ["train", *LAYOUT, "--data-path", str(ds), "--global-batch-size", str(G), "--micro-batch-size", "2"]
    argv += ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--lr", "1e-2"]
    argv += ["--train-iters", "8", "--eval-interval", "8", "--log-jsonl", str(log)]
    assert main(argv) == 0, capsys.readouterr().err[-3000:]
    out = capsys.readouterr().out
    assert "digit shown" in out and "digit said" in out  # the validation line
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    losses = [r["loss"] for r in recs]
    assert sum(losses[-2:]) < sum(losses[:2]), losses
    assert all(r["grad_norm_per_module"]["audio"] > 0 for r in recs)  # the clips reach the Whisper encoder
    parts = recs[-1]["eval_parts"]
    assert set(parts) == {"digit shown", "digit said"}
    assert parts["digit said"]["answers"] > 0 and parts["digit shown"]["answers"] > 0
    assert all(p["accuracy"] is not None and 0 <= p["accuracy"] <= 1 for p in parts.values())

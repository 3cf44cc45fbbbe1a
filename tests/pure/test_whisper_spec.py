"""The Whisper encoder's description: read from and written as a Hugging Face config.json
(`models.hf_whisper_config`), checked against the layout (`models.architecture.check_whisper`), and
recorded in a checkpoint's model record (the record round trip)."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_hetero.checkpoint.records import spec_record
from megatron_hetero.layout import layout_from_dict
from megatron_hetero.models import hf_whisper_config as hwc
from megatron_hetero.models.architecture import check_architecture
from megatron_hetero.config.model import EncoderSpec, LlavaSpec

WHISPER_TINY = {  # openai/whisper-tiny's encoder fields
    "model_type": "whisper",
    "num_mel_bins": 80,
    "d_model": 384,
    "encoder_layers": 4,
    "encoder_attention_heads": 6,
    "encoder_ffn_dim": 1536,
    "max_source_positions": 1500,
    "activation_function": "gelu",
}


def test_whisper_tiny_config_reads_and_writes_back():
    fields = hwc.whisper_fields(WHISPER_TINY)
    assert fields["feature_dim"] == 160 and fields["tokens"] == 1500 and fields["kind"] == "whisper"
    enc = EncoderSpec(**fields)
    back = hwc.whisper_config_json(enc)
    assert {k: back[k] for k in WHISPER_TINY} == WHISPER_TINY
    assert hwc.whisper_fields(back) == fields


@pytest.mark.parametrize(
    "change,message",
    [
        ({"model_type": "clip_vision_model"}, "is not a Whisper model"),
        ({"activation_function": "relu"}, "activation_function 'relu' is not supported"),
        ({"encoder_attention_heads": 5}, "d_model 384 is not divisible by encoder_attention_heads 5"),
    ],
)
def test_configs_the_encoder_cannot_express_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        hwc.whisper_fields({**WHISPER_TINY, **change}, "--audio x")


def _check(audio: dict, enc: EncoderSpec, world: int) -> None:
    """The audio module on `audio` beside vision and language on DP `world` (colocated)."""
    audio = {**audio, "dp": world // (audio.get("tp", 1) * audio.get("pp", 1) * audio.get("cp", 1))}
    mods = {"vision": {"dp": world}, "audio": audio, "language": {"dp": world}}
    doc = {"placement": "colocated", "modules": mods, "edges": ["vision -> language", "audio -> language"]}
    spec = LlavaSpec(seq_length=40, encoders={"vision": EncoderSpec(offset=1), "audio": enc})
    check_architecture(layout_from_dict(doc, world_size=world), spec, ["language"])


WHISPER = EncoderSpec(kind="whisper", tokens=4, feature_dim=16, activation="gelu", offset=10)


def test_the_layout_checks_name_the_reason():
    _check({"tp": 2}, WHISPER, 2)
    with pytest.raises(ValueError, match=r"encoder audio: a Whisper encoder runs with pp 1 and cp 1"):
        _check({"pp": 2}, WHISPER, 2)
    with pytest.raises(ValueError, match=r"encoder audio: a Whisper encoder runs with pp 1 and cp 1"):
        _check({"cp": 2}, WHISPER, 2)
    with pytest.raises(ValueError, match=r"module audio: 4 attention heads are not divisible by tp\(8\)"):
        _check({"tp": 8}, WHISPER, 8)
    with pytest.raises(ValueError, match=r"two log-mel frames a token \(feature_dim = 2 \* mel bins, got 15\)"):
        _check({}, dataclasses.replace(WHISPER, feature_dim=15), 1)


def test_the_model_record_keeps_the_kind():
    spec = LlavaSpec(seq_length=40, encoders={"vision": EncoderSpec(offset=1), "audio": WHISPER})
    record = spec_record(spec)
    assert record["encoders"]["audio"]["kind"] == "whisper"
    assert LlavaSpec.from_record(record) == spec

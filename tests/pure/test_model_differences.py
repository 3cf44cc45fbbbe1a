"""What a run from a checkpoint's weights may change: the data fields (where image tokens go, how many
tiles, packing; with no position table the sequence length; a Qwen2.5-VL tower's image tokens and
feature format) but not a size that shapes a parameter."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_hetero.checkpoint.files import FORMAT, write_marker, write_train_state
from megatron_hetero.checkpoint.loadable import DATA_FIELDS, model_differences, weights_only_fields
from megatron_hetero.checkpoint.records import spec_record
from megatron_hetero.models.llava import EncoderSpec, LlavaSpec
from megatron_hetero.config.model import ModelFlags
from megatron_hetero.config.arch import ArchFlags
from megatron_hetero.training.job import recorded_spec

CAPTIONS = LlavaSpec(encoders={"vision": EncoderSpec(tokens=4, feature_dim=16, offset=1)})
CHAT = dataclasses.replace(
    CAPTIONS,
    encoders={"vision": EncoderSpec(tokens=4, feature_dim=16, offset=0, max_tiles=8)},
    reset_attention_mask=True,
)


def test_weights_only_runs_ignore_the_data_fields_and_nothing_else():
    saved, now = spec_record(CAPTIONS), spec_record(CHAT)
    assert "max_tiles" not in saved["encoders"]["vision"]  # default: left out of the record
    assert model_differences(saved, now)  # a resume must match them all
    assert model_differences(saved, now, DATA_FIELDS) == []
    wider = spec_record(dataclasses.replace(CHAT, encoders={"vision": EncoderSpec(tokens=9, feature_dim=16)}))
    (diff,) = model_differences(saved, wider, DATA_FIELDS)
    assert diff.startswith("encoders:") and "'tokens': 9" in diff


def _qwen(tokens: int, feature_dim: int, seq_length: int, **more) -> LlavaSpec:
    tower = EncoderSpec(tokens=tokens, feature_dim=feature_dim, patch_size=2, kind="qwen2.5-vl", **more)
    return LlavaSpec(
        encoders={"vision": tower}, seq_length=seq_length, position_embedding_type="mrope", mrope_section=(2, 3, 3)
    )


# the caption run's tower (8x8 grey images as 2x2 pixel blocks of 4x4) and the conversation run's (the
# image processor's patches at native resolution, a tile one merged token)
QWEN_CAPTIONS = _qwen(4, 16, 16, image_rows=2)
QWEN_CHAT = _qwen(1, 96, 128, max_tiles=32)


def test_a_qwen_tower_from_captions_to_native_conversations_differs_only_in_its_data():
    saved, now = spec_record(QWEN_CAPTIONS), spec_record(QWEN_CHAT)
    fields = weights_only_fields(now)
    assert {"seq_length", "encoders.tokens", "encoders.image_rows", "encoders.feature_dim"} <= set(fields)
    assert len(model_differences(saved, now)) == 2  # a resume must match them: encoders and seq_length
    assert model_differences(saved, now, fields) == []
    wider = spec_record(dataclasses.replace(QWEN_CHAT, hidden_size=2 * QWEN_CHAT.hidden_size))
    assert [d.split(":")[0] for d in model_differences(saved, wider, fields)] == ["hidden_size"]


def test_only_a_model_without_position_table_or_qwen_tower_frees_those_fields():
    learned = spec_record(dataclasses.replace(CHAT, position_embedding_type="learned_absolute"))
    assert weights_only_fields(learned) == DATA_FIELDS  # the sequence length sizes its position table
    rope = weights_only_fields(spec_record(dataclasses.replace(CHAT, position_embedding_type="rope")))
    assert "seq_length" in rope and "encoders.feature_dim" not in rope  # a linear patch embedding's input width


def test_recorded_spec_takes_the_jobs_data_fields_from_caption_weights(tmp_path):
    state = {"format": FORMAT, "iteration": 4, "model": spec_record(QWEN_CAPTIONS)}
    (tmp_path / "iter_0000004").mkdir()
    write_marker(tmp_path, 4, write_train_state(tmp_path / "iter_0000004", state))
    given = ModelFlags(language={"seq_length": 128}, encoder={"tokens": 1, "feature_dim": 96, "max_tiles": 32})
    got = recorded_spec(QWEN_CHAT, str(tmp_path), True, given, ArchFlags())
    tower = got.encoders["vision"]
    assert (got.seq_length, tower.tokens, tower.feature_dim, tower.max_tiles) == (128, 1, 96, 32)
    assert tower.hidden_size == QWEN_CAPTIONS.encoders["vision"].hidden_size  # the data sets image_rows later
    with pytest.raises(ValueError, match=r"seq_length \(--seq-length\): 16 in the checkpoint, 128 given"):
        recorded_spec(QWEN_CHAT, str(tmp_path), False, given, ArchFlags())  # a resume is the same model
    bigger = ModelFlags(language={"seq_length": 128, "hidden_size": 128}, encoder=given.encoder)
    with pytest.raises(ValueError, match="hidden_size"):
        recorded_spec(QWEN_CHAT, str(tmp_path), True, bigger, ArchFlags())

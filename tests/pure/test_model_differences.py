"""What a run from a checkpoint's weights may change: the data fields (where image tokens go, how many
tiles, packing) but not a size that shapes a parameter."""

from __future__ import annotations

import dataclasses

from megatron_hetero.checkpoint.loadable import DATA_FIELDS, model_differences
from megatron_hetero.checkpoint.records import spec_record
from megatron_hetero.models.llava import EncoderSpec, LlavaSpec

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

"""The planner's search prices a Qwen2.5-VL encoder (`planner.model.workload` of the encoder kind
"qwen2.5-vl"): a gated transformer over the image's patches, its attention meeting
`qwen_vision_cost.attention_span` keys per query (by hand for a 4x6-patch image), the merger handing
the language model merge**2 fewer tokens; its layer FLOPs in the cost terms are the tower's by hand,
and a windowed tower is priced below the same tower with full attention everywhere. Pure: no torch."""

from __future__ import annotations

import dataclasses

from megatron_hetero.planner.cost_terms import layer_flops_of
from megatron_hetero.planner.hardware import layer_flops
from megatron_hetero.config.model import LlavaSpec
from megatron_hetero.planner.model import workload
from megatron_hetero.planner.qwen_vision_cost import attention_span
from qwen_train_case import TOWER

QWEN = TOWER
SPEC = LlavaSpec(hidden_size=64, seq_length=24, encoders={"vision": QWEN})


def test_attention_span_by_hand():
    # 4x6 patches: windows of 16 and 8 patches (layer 0), the whole 24-patch frame (layer 1)
    got = attention_span([[1, 4, 6]], depth=2, full_layers=1, merge=2, patch=2, window=8)
    assert got == (16**2 + 8**2 + 24**2) / (2 * 24)


def test_workload_prices_the_tower_over_patches_with_its_windows():
    wl = workload(SPEC, global_batch=4, micro_batch=2)
    enc = wl.encoder
    assert (enc.seq, enc.gated, enc.ffn_hidden, enc.features) == (24, True, 48, 24)
    assert wl.image_tokens == 6  # the merger's tokens enter the language model
    assert enc.span == (16**2 + 8**2 + 24**2) / 48
    # the cost terms' layer FLOPs: the tower's dense terms + 4 * T * span * h
    assert layer_flops_of(enc, 24) == layer_flops(24, enc.span, 32, 48, gated=True)
    full = workload(
        dataclasses.replace(SPEC, encoders={"vision": dataclasses.replace(QWEN, fullatt_block_indexes=(0, 1))}), 4, 2
    ).encoder
    assert full.span == 24 and layer_flops_of(full, 24) > layer_flops_of(enc, 24)


def test_other_encoders_are_priced_as_before():
    wl = workload(LlavaSpec(), global_batch=4, micro_batch=2)
    assert wl.encoder.span == wl.encoder.seq and wl.image_tokens == wl.encoder.seq


def test_search_prices_the_qwen_tower_preset_and_refuses_a_non_square_image(capsys):
    from megatron_hetero import cli

    base = ["search", "--hardware", "h100_80gb", "--world-size", "64", "--encoder", "qwen2.5-vl", "--llm", "14B"]
    assert cli.main([*base, "--top", "1"]) == 0
    out = capsys.readouterr().out
    # Qwen2.5-VL-7B's tower at 448x448: 0.68B parameters over 1,024 patches a sample
    assert "encoder 0.68B (32 layers, h=1280, 1x1024 tokens/sample)" in out, out[:300]
    assert cli.main([*base, "--encoder-tokens", "250"]) == 2
    assert "square" in capsys.readouterr().err

"""The Qwen2.5-VL tower's forward FLOPs (`planner.qwen_vision_cost`) by hand for one small image, and
how they follow resolution: window layers grow linearly with the image, full layers quadratically."""

from __future__ import annotations

import pytest

from megatron_hetero.planner.qwen_vision_cost import frame_lengths, tower_forward_flops, window_lengths


def test_windows_cut_at_the_image_edge():
    # 4x6 patches, merge 2 -> 2x3 merged tokens; windows of 2x2 merged: a 2x2 and a 2x1 (16 and 8 patches)
    assert window_lengths([[1, 4, 6]], merge=2, blocks=2) == [16, 8]
    assert window_lengths([[2, 4, 4]], merge=2, blocks=2) == [16, 16]  # one window per frame
    assert frame_lengths([[1, 4, 6], [2, 4, 4]]) == [24, 16, 16]


def test_flops_by_hand():
    h, f, o = 8, 16, 12
    got = tower_forward_flops([[1, 4, 6]], hidden=h, ffn=f, depth=2, full_layers=1, out_hidden=o, patch=2, window=8)
    n = 24
    dense = 2 * n * 3 * h * h + 2 * n * h * h + 6 * n * h * f
    attention = 4 * h * ((16**2 + 8**2) + 24**2)
    embed = 2 * n * 24 * h
    merger = 2 * 6 * (4 * h) ** 2 + 2 * 6 * 4 * h * o
    assert got == 2 * dense + attention + embed + merger


def test_window_layers_scale_linearly_full_layers_quadratically():
    def attn(side: int, full: int) -> float:
        return tower_forward_flops([[1, side, side]], hidden=64, ffn=128, depth=4, full_layers=full, out_hidden=64)

    small, big = 32, 128  # patches a side: 16x the patches
    windowed = attn(big, 0) / attn(small, 0)
    full = attn(big, 4) / attn(small, 4)
    assert 15.5 < windowed < 16.5 and full > 2 * windowed
    with pytest.raises(ValueError, match="full_layers 5 must be within 0..depth"):
        tower_forward_flops([[1, 4, 4]], hidden=8, ffn=8, depth=4, full_layers=5, out_hidden=8)

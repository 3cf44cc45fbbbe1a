"""The Qwen2.5-VL vision tower built from Megatron-core parts computes transformers' forward.

A tiny random `Qwen2_5_VisionTransformerPretrainedModel` (4 blocks, full attention in blocks 1 and 3,
windows of 2 x 2 merged tokens, patch 2, temporal patch 2, 2 x 2 merge) runs on three images of
different sizes in one packed batch (grids 1x4x6, 1x6x4, 2x4x4: a window cut at the image's edge, a
non-square image, two frames). Its weights go through `convert.hf_qwen_vision.hf_to_tower` into
`models.qwen_vision.QwenVisionTower` on one forked rank; the merged tokens must equal transformers'
within 1e-5 relative (max |ours - hf| / max |hf|), and `tower_to_hf` returns the weights bitwise.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
import torch  # noqa: E402

from megatron_hetero.runtime.launcher import run_ranks  # noqa: E402

from qwen_vision_case import CONFIG, reference_grads, GRID, LAYOUT, reference, tower_rank  # noqa: E402

TOL = 1e-5


@pytest.mark.timeout(300)
def test_qwen_vision_tower_matches_transformers_on_mixed_sizes():
    from megatron_hetero.convert.hf_qwen_vision import tower_to_hf

    cfg, hf, patches, ref = reference()
    got = run_ranks(1, tower_rank, cfg, hf, patches, LAYOUT, timeout=240)[0]
    assert got["out"].shape == ref.shape == (sum(t * h * w for t, h, w in GRID) // 4, 40)
    rel = float((got["out"] - ref).abs().max() / ref.abs().max())
    print(f"\nQwen2.5-VL tower vs transformers, grids {GRID}: {rel:.2e} relative")
    assert rel <= TOL, rel
    back = tower_to_hf([got["shard"]], CONFIG["depth"], CONFIG["num_heads"])
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)
    assert "multiples of 2" in got["errors"][0] and "patches must be [16, 24]" in got["errors"][1]

    want = reference_grads(cfg, hf, patches)
    grads = tower_to_hf([{k: g for k, g in got["grads"].items()}], CONFIG["depth"], CONFIG["num_heads"])
    scale = max(float(g.abs().max()) for g in want.values())
    grad_rel = max(float((grads[k] - want[k]).abs().max()) for k in want) / scale
    print(f"parameter gradients vs transformers: {grad_rel:.2e} of the largest")
    assert grads.keys() == want.keys() and grad_rel <= 1e-5, grad_rel


def test_qwen_vision_tower_refuses_cp_and_uneven_pp_with_the_reason():
    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.models.qwen_vision import QwenVisionSpec, QwenVisionTower

    spec = QwenVisionSpec.from_hf(CONFIG)
    cases = (
        ({"cp": 2}, 2, "cp 1: its windows and images are attention segments"),
        ({"pp": 3}, 3, r"4 blocks do not split over pp\(3\)"),
    )
    for arith, world, why in cases:
        doc = {
            "placement": "colocated",
            "modules": {"vision": arith, "language": {"dp": world}},
            "edges": ["vision -> language"],
        }
        layout = layout_from_dict(doc, world_size=world)
        with pytest.raises(ValueError, match=why):
            QwenVisionTower(spec, layout.module("vision"), pgs=None)  # refused before any group is read


def test_priced_windows_are_the_towers_windows():
    """`planner.qwen_vision_cost.window_lengths` (pure) lists the windows the tower attends within."""
    from megatron_hetero.models.qwen_vision_windows import window_index
    from megatron_hetero.planner.qwen_vision_cost import window_lengths

    for grid in (GRID, [[1, 10, 14]], [[3, 2, 8], [1, 12, 2]]):
        assert window_lengths(grid, 2, 2) == window_index(torch.tensor(grid), 2, 2)[1]
        assert window_lengths(grid, 2, 4) == window_index(torch.tensor(grid), 2, 4)[1]

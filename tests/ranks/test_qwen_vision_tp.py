"""The Qwen2.5-VL vision tower with TP 2 on its own layout (colocated: vision TP2, language DP2) computes
transformers' forward on three images of different sizes (`qwen_vision_case`): each rank loads its
shard from `convert.hf_qwen_vision.hf_to_tower` (per-head qkv rows, SwiGLU gate and up halves, the
merger's rows and columns), both ranks' merged tokens equal transformers' within 1e-5 relative, and
the two shards put back by `tower_to_hf` are the Hugging Face weights bitwise."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
import torch  # noqa: E402

from megatron_hetero.runtime.launcher import run_ranks  # noqa: E402

from qwen_vision_case import CONFIG, reference_grads, reference, tower_rank  # noqa: E402

TOL = 1e-5
E = ["vision -> language"]
TP2 = {
    "placement": "colocated",
    "modules": {"vision": {"tp": 2}, "language": {"dp": 2}},
    "edges": ["vision -> language"],
}


@pytest.mark.timeout(300)
def test_qwen_vision_tower_tp2_matches_transformers():
    from megatron_hetero.convert.hf_qwen_vision import tower_to_hf

    cfg, hf, patches, ref = reference()
    got = run_ranks(2, tower_rank, cfg, hf, patches, TP2, timeout=240)
    rels = [float((g["out"] - ref).abs().max() / ref.abs().max()) for g in got]
    print(f"\nQwen2.5-VL tower TP2 vs transformers: {max(rels):.2e} relative")
    assert max(rels) <= TOL, rels
    qkv = "blocks.layers.0.self_attention.linear_qkv.weight"
    assert got[0]["shard"][qkv].shape[0] == 3 * CONFIG["hidden_size"] // 2  # a half of the heads each
    back = tower_to_hf([g["shard"] for g in got], CONFIG["depth"], CONFIG["num_heads"])
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)

    want = reference_grads(cfg, hf, patches)
    grads = tower_to_hf([g["grads"] for g in got], CONFIG["depth"], CONFIG["num_heads"])
    scale = max(float(g.abs().max()) for g in want.values())
    grad_rel = max(float((grads[k] - want[k]).abs().max()) for k in want) / scale
    print(f"parameter gradients vs transformers: {grad_rel:.2e} of the largest")
    assert grads.keys() == want.keys() and grad_rel <= 1e-5, grad_rel


PP2 = {
    "placement": "colocated",
    "modules": {"vision": {"pp": 2}, "language": {"dp": 2}},
    "edges": ["vision -> language"],
}


@pytest.mark.timeout(300)
def test_qwen_vision_tower_pp2_matches_transformers():
    """The tower's 4 blocks over 2 pipeline stages (blocks 0-1: a window and a full-attention layer
    each; the patch embedding on the first stage, the merger on the last): transformers' output."""
    cfg, hf, patches, ref = reference()
    got = [g for g in run_ranks(2, tower_rank, cfg, hf, patches, PP2, timeout=240) if g]
    assert len(got) == 1
    rel = float((got[0]["out"] - ref).abs().max() / ref.abs().max())
    print(f"\nQwen2.5-VL tower PP2 vs transformers: {rel:.2e} relative")
    assert rel <= TOL, rel


def test_qwen_vision_tower_dp2_gives_every_replica_the_same_output():
    """Vision DP2 (colocated with language DP2): each replica holds the whole tower and computes
    transformers' output on the batch (replicas differ only by the data they are given)."""
    cfg, hf, patches, ref = reference()
    doc = {"placement": "colocated", "modules": {"vision": {"dp": 2}, "language": {"dp": 2}}, "edges": E}
    got = run_ranks(2, tower_rank, cfg, hf, patches, doc, timeout=240)
    assert torch.equal(got[0]["out"], got[1]["out"])
    assert float((got[0]["out"] - ref).abs().max() / ref.abs().max()) <= TOL

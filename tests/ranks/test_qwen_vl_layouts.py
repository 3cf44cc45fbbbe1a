"""Qwen2.5-VL's whole forward (`models.qwen_vision` tower + `models.qwen_vl` M-RoPE decoder) on
per-module layouts equals transformers' `Qwen2_5_VLForConditionalGeneration` (`qwen_vl_case`: three
images of different sizes in one batch): colocated vision TP2 + language TP2 (2 ranks), and disjoint
vision @0 -> language TP2 @1-2 and vision @0 -> language PP2 @1-2 (the tower's merged tokens broadcast
from rank 0; the stages' hidden states by point-to-point; each stage computes the M-RoPE ids), and
vision @0 -> language CP2 @1-2 (each CP rank its load-balanced chunks; logits and loss put together). Position ids
exactly transformers' `get_rope_index`; logits within 1e-4, loss within 1e-5 relative on every
language rank; colocated, the TP shards of every gradient put together within 1e-5 of the largest."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from megatron_hetero.runtime.launcher import run_ranks  # noqa: E402

from qwen_vl_case import grads_as_hf, reference, reference_grads, vl_rank, whole_grads  # noqa: E402

E = ["vision -> language"]
LAYOUTS = {
    "colocated-tp2": (
        2,
        {"placement": "colocated", "modules": {"vision": {"tp": 2}, "language": {"tp": 2}}, "edges": E},
    ),
    "disjoint-v1-ltp2": (3, {"placement": "disjoint", "modules": {"vision": {}, "language": {"tp": 2}}, "edges": E}),
    "disjoint-v1-lpp2": (3, {"placement": "disjoint", "modules": {"vision": {}, "language": {"pp": 2}}, "edges": E}),
    "disjoint-v1-lcp2": (3, {"placement": "disjoint", "modules": {"vision": {}, "language": {"cp": 2}}, "edges": E}),
}


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_qwen_vl_layout_matches_transformers(ref, name):
    import torch

    cfg, hf, want = ref
    world, doc = LAYOUTS[name]
    got = [g for g in run_ranks(world, vl_rank, cfg, hf, doc, timeout=240) if g]
    assert len(got) == (1 if "pp2" in name else 2)  # every last-stage language rank answered
    for g in got:
        assert torch.equal(g["position_ids"], want["position_ids"])
        rel_logits = float((g["logits"] - want["logits"]).abs().max() / want["logits"].abs().max())
        rel_loss = abs(float(g["loss"]) - float(want["loss"])) / abs(float(want["loss"]))
        print(f"\nQwen2.5-VL {name} vs transformers: logits {rel_logits:.2e}, loss {rel_loss:.2e} relative")
        assert rel_logits <= 1e-4 and rel_loss <= 1e-5, (rel_logits, rel_loss)
    if name == "colocated-tp2":  # both modules on every rank: the TP shards of every gradient
        want, ours = reference_grads(cfg, hf), grads_as_hf(whole_grads([g["grads"] for g in got]), cfg)
        scale = max(float(g.abs().max()) for g in want.values())
        rel = max(float((ours[k] - want[k]).abs().max()) for k in want) / scale
        print(f"{name}: whole-model gradients vs transformers: {rel:.2e} of the largest")
        assert ours.keys() == want.keys() and rel <= 1e-5, rel

"""Qwen2.5-VL's whole forward from Megatron-core parts (`models.qwen_vl`: the vision tower, the image
tokens placed, the Qwen2.5 decoder with Megatron's M-RoPE) equals transformers'
`Qwen2_5_VLForConditionalGeneration` on one rank: two conversations, three images of different sizes
(one of two frames) in one batch (`qwen_vl_case`). Our M-RoPE ids equal `get_rope_index`'s exactly;
logits within 1e-4 and the loss within 1e-5 relative; every parameter's gradient of the loss within
1e-5 of the largest (the model trains as transformers')."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
import torch  # noqa: E402

from megatron_hetero.runtime.launcher import run_ranks  # noqa: E402

from qwen_vl_case import grads_as_hf, reference, reference_grads, vl_rank, whole_grads  # noqa: E402

LAYOUT = {"placement": "colocated", "modules": {"vision": {}, "language": {}}, "edges": ["vision -> language"]}


def check(got: dict, ref: dict, what: str) -> None:
    assert torch.equal(got["position_ids"], ref["position_ids"])
    rel_logits = float((got["logits"] - ref["logits"]).abs().max() / ref["logits"].abs().max())
    rel_loss = abs(float(got["loss"]) - float(ref["loss"])) / abs(float(ref["loss"]))
    print(f"\nQwen2.5-VL {what} vs transformers: logits {rel_logits:.2e}, loss {rel_loss:.2e} relative")
    assert rel_logits <= 1e-4 and rel_loss <= 1e-5, (rel_logits, rel_loss)


@pytest.mark.timeout(300)
def test_qwen_vl_world1_matches_transformers_with_mixed_image_sizes():
    cfg, hf, ref = reference()
    assert not torch.equal(ref["position_ids"][0], ref["position_ids"][1])  # the image ids differ per axis
    got = run_ranks(1, vl_rank, cfg, hf, LAYOUT, timeout=240)[0]
    check(got, ref, "world 1")
    want, ours = reference_grads(cfg, hf), grads_as_hf(whole_grads([got["grads"]]), cfg)
    scale = max(float(g.abs().max()) for g in want.values())
    rel = max(float((ours[k] - want[k]).abs().max()) for k in want) / scale
    print(f"whole-model gradients of the loss vs transformers: {rel:.2e} of the largest")
    assert ours.keys() == want.keys() and rel <= 1e-5, rel


def test_rope_index_counts_the_images_against_grid_thw():
    from megatron_hetero.models.qwen_mrope import rope_index

    tokens = torch.tensor([[5, 121, 120, 120, 7]])
    with pytest.raises(ValueError, match="needs 4 image tokens"):
        rope_index(tokens, torch.tensor([[1, 4, 4]]), image_token=120, vision_start=121, merge=2)
    with pytest.raises(ValueError, match="grid_thw lists 2 images, the text holds 1"):
        rope_index(tokens, torch.tensor([[1, 2, 4], [1, 2, 2]]), image_token=120, vision_start=121, merge=2)

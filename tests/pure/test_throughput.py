"""--log-throughput: Megatron-LM's FLOPs formula per module (`training/throughput.py`), against
hand computations of its terms for the tiny model, and the TFLOP/s per rank of a disjoint layout."""

from __future__ import annotations

import pytest

from megatron_hetero.layout.yaml_io import layout_from_dict
from megatron_hetero.config.model import EncoderSpec, LlavaSpec
from megatron_hetero.training.throughput import TransformerShape, module_flops, tflops_per_rank, training_flops

# the tiny language model: 2 layers, hidden 64, 4 heads (kv channels 16), MLP 256, 32 tokens, vocab 128
TINY = TransformerShape(layers=2, hidden=64, heads=4, ffn=256, seq=32, vocab=128)


def _tiny_language_by_hand(batch: int) -> int:
    """Megatron's terms written out for TINY: 3 (fwd, wgrad, dgrad) x 2 (multiply-add) per GEMM."""
    tokens = batch * 32
    qkv_and_out = 6 * (64 * (64 + 2 * 64) + 64 * 64)  # 6 * (h*(q + k + v) + q*h) = 98,304 per layer and token
    mlp = 6 * 64 * 256 * 2  # 6 * h * ffn * 2 (two GEMMs, no SwiGLU) = 196,608 per layer and token
    logits = 6 * 64 * 128  # 49,152 per token
    core = 6 * 64  # 6 * q / 2 (causal) * 2 (QK^T, PV) per layer, token and key
    return tokens * (2 * (qkv_and_out + mlp) + logits) + batch * 32 * 32 * core * 2


def test_tiny_language_model_flops_by_hand():
    assert _tiny_language_by_hand(8) == 169_869_312  # 163,577,856 token-linear + 6,291,456 core attention
    assert training_flops(TINY, 8) == 169_869_312
    assert training_flops(TINY, 1) == _tiny_language_by_hand(1)


def test_swiglu_gqa_and_experts_terms():
    gqa = TransformerShape(layers=1, hidden=64, heads=4, ffn=256, seq=32, vocab=0, query_groups=2, swiglu=True)
    tokens = 32
    by_hand = tokens * (6 * (64 * (64 + 2 * 32) + 64 * 64) + 6 * 64 * 256 * 3) + 32 * 32 * 6 * 64
    assert training_flops(gqa, 1) == by_hand
    moe = TransformerShape(layers=2, hidden=64, heads=4, ffn=256, seq=32, vocab=128, num_experts=4, topk=2, moe_ffn=96)
    # the MLP term becomes the top-2 experts' of width 96; attention and logits are unchanged
    assert training_flops(moe, 8) == _tiny_language_by_hand(8) - 8 * 32 * 2 * (6 * 64 * 256 * 2 - 6 * 64 * 96 * 2 * 2)
    assert training_flops(TransformerShape(layers=0, hidden=1, heads=1, ffn=0, seq=0), 8) == 0.0


def _disjoint():
    return layout_from_dict(
        {
            "placement": "disjoint",
            "modules": {
                "vision": {"dp": 2, "ranks": "0-1"},
                "language_a": {"tp": 2, "ranks": "2-3", "layers": "0-0"},
                "language_b": {"dp": 2, "ranks": "4-5", "layers": "1-1"},
            },
            "edges": ["vision -> language_a", "language_a -> language_b"],
        }
    )


def test_modules_and_tflops_per_rank_of_a_disjoint_layout():
    layout = _disjoint()
    spec = LlavaSpec(encoders={"vision": EncoderSpec()})
    flops = module_flops(spec, layout, 8)
    one_layer = (_tiny_language_by_hand(8) - 8 * 32 * 6 * 64 * 128) // 2  # one layer of the tiny model, no logits
    assert flops["language_a"] == one_layer  # layer 0, no output layer
    assert flops["language_b"] == one_layer + 8 * 32 * 6 * 64 * 128  # layer 1 and the logits
    # the encoder: 2 layers, hidden 32, 4 heads (kv 8), MLP 128, its 8 tokens as the sequence, no logits
    enc_layer = 8 * 8 * (6 * (32 * 96 + 32 * 32) + 6 * 32 * 128 * 2) + 8 * 8 * 8 * 6 * 32
    assert flops["vision"] == 2 * enc_layer
    whole, per_module = tflops_per_rank(flops, layout, 0.5)
    assert whole == pytest.approx(sum(flops.values()) / (0.5 * 6 * 1e12), rel=1e-15)
    for name in ("vision", "language_a", "language_b"):  # each module over its own 2 ranks
        assert per_module[name] == pytest.approx(flops[name] / (0.5 * 2 * 1e12), rel=1e-15)
    assert tflops_per_rank(flops, layout, 0.0) == (0.0, {n: 0.0 for n in flops})

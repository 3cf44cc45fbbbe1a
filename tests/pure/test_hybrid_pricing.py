"""The planner's pricing of a HybridModel language model (`--hybrid-layer-pattern`): the cost model
prices each layer as its type's share of a GPT layer's terms (`ModelSpec.layer_mix`: attention `*`,
dense MLP `-`, MoE `E`), so `*-*-` must price as the GPT model of 2 layers; the per-rank memory
model counts each stage's own layers (`planner.memory_params.hybrid_layer_params`), with the pattern's `|`
stages. (Real HybridModel parameter counts: tests/ranks/test_memory_model.py's hybrid cases.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megatron_hetero.layout import layout_from_dict
from megatron_hetero.planner import cost as C
from megatron_hetero.planner import cost_terms as CT
from megatron_hetero.planner import hardware as HW
from megatron_hetero.planner import memory as M
from megatron_hetero.planner import workload as W
from megatron_hetero.config.model import EncoderSpec, LlavaSpec
from megatron_hetero.planner.model import layer_mix_of, workload

HW_FILE = Path(__file__).resolve().parents[2] / "megatron_hetero" / "planner" / "hardware_presets" / "h100_80gb.json"
REL = 1e-12
ENC = W.ModelSpec("vision", 2, 256, 1024, 4, 64, kind="encoder")


@pytest.fixture(scope="module")
def prof() -> HW.Profile:
    return HW.Profile.from_hardware(HW.HardwareSpec.load(HW_FILE))


def _llm(layers: int, mix=None, **kw) -> W.ModelSpec:
    return W.ModelSpec("language", layers, 512, 2048, 8, 256, vocab=1000, layer_mix=mix, **kw)


def _wl(llm: W.ModelSpec, **kw) -> W.Workload:
    return W.Workload(ENC, llm, global_batch=16, micro_batch=2, **kw)


def test_layer_mix_counts_each_type_and_refuses_unpriced_symbols():
    assert layer_mix_of("*-*E") == (0.5, 0.25, 0.25)
    assert layer_mix_of("*-|*-") == (0.5, 0.5, 0.0)
    with pytest.raises(ValueError, match=r"\['M'\] are not priced"):
        layer_mix_of("*-M-")


@pytest.mark.parametrize("recompute", [None, "selective", "full"])
def test_star_dash_pairs_price_as_the_gpt_model_of_half_the_layers(prof, recompute):
    """`*-*-` (4 hybrid layers, half attention, half MLP) against GPT's 2 layers: every term of
    one layer x layers, the parameters, and whole candidates (pp 1 and 2, tp 2, cp 2); the one
    difference is real: under full recompute each of HybridModel's layers keeps its input."""
    gpt, hyb = _llm(2), _llm(4, (0.5, 0.5, 0.0))
    wg, wh = _wl(gpt, recompute=recompute), _wl(hyb, recompute=recompute)
    assert hyb.total_params == pytest.approx(gpt.total_params, rel=REL)
    for tp, cp in ((1, 1), (2, 1), (2, 2)):
        for a, b in zip(CT.layer_parts(prof, wg, gpt, 2, tp, cp), CT.layer_parts(prof, wh, hyb, 2, tp, cp)):
            assert 4 * float(b) == pytest.approx(2 * float(a), rel=REL)
        # full recompute keeps each layer's input: HybridModel's layers are twice GPT's, so twice the inputs
        kept = 2.0 if recompute == "full" else 1.0
        assert float(CT.act_bytes(wh, hyb, 2, tp, cp, 4)) == pytest.approx(
            kept * float(CT.act_bytes(wg, gpt, 2, tp, cp, 2)), rel=REL
        )
    for tp, cp, pp, dp in ((1, 1, 1, 4), (2, 1, 2, 2), (1, 2, 2, 1)):
        enc = W.Segment.of(1, 1, 1, tp * cp * pp * dp, layers=2)
        g = C.evaluate(W.Candidate("colocated", enc, (W.Segment.of(tp, cp, pp, dp, layers=2),)), wg, prof)
        h = C.evaluate(W.Candidate("colocated", enc, (W.Segment.of(tp, cp, pp, dp, layers=4),)), wh, prof)
        assert h.total == pytest.approx(g.total, rel=1e-9)
        if recompute != "full":
            assert h.memory_per_rank_peak == pytest.approx(g.memory_per_rank_peak, rel=1e-9)


def test_per_type_terms_sum(prof):
    """A mixed layer's FLOPs and parameters are its types' shares of the one-type layers'."""
    kw = dict(num_experts=8, moe_topk=2, moe_ffn_hidden=1024)
    only = {t: _llm(1, mix, **kw) for t, mix in (("*", (1, 0, 0)), ("-", (0, 1, 0)), ("E", (0, 0, 1)))}
    mixed = _llm(4, (0.5, 0.25, 0.25), **kw)
    tokens = 512.0
    flops = {t: float(CT.layer_flops_of(s, tokens)) for t, s in only.items()}
    assert float(CT.layer_flops_of(mixed, tokens)) == pytest.approx(
        0.5 * flops["*"] + 0.25 * flops["-"] + 0.25 * flops["E"], rel=REL
    )
    h, f, fe = 512, 2048, 1024
    assert flops["*"] == pytest.approx(3 * (8 * tokens * h * h + 4 * tokens * 256 * h), rel=REL)
    assert flops["-"] == pytest.approx(3 * 4 * tokens * h * f, rel=REL)
    assert flops["E"] == pytest.approx(3 * 4 * tokens * h * 2 * fe, rel=REL)  # top-2 experts
    assert only["*"].layer_params == 4 * h * h
    assert only["-"].layer_params == 2 * h * f
    assert only["E"].layer_params == h * 8 + 8 * 2 * h * fe  # router + 8 experts
    assert only["E"].expert_layer_params == 8 * 2 * h * fe
    assert mixed.layer_params == pytest.approx(
        0.5 * only["*"].layer_params + 0.25 * only["-"].layer_params + 0.25 * only["E"].layer_params, rel=REL
    )


def test_moe_layers_scale_with_experts_and_ep(prof):
    """An `E` layer's expert parameters scale with the number of experts; per rank they split over
    EP (a candidate's state shrinks with ep, the EP dispatch appears), its FLOPs with top-k."""
    wl = {n: _wl(_llm(4, (0.5, 0.25, 0.25), num_experts=n, moe_topk=2)) for n in (4, 8)}
    assert wl[8].llm.expert_layer_params == 2 * wl[4].llm.expert_layer_params
    k1 = _llm(4, (0.5, 0.25, 0.25), num_experts=8, moe_topk=1)
    assert float(CT.layer_flops_of(wl[8].llm, 512.0)) > float(CT.layer_flops_of(k1, 512.0))
    enc = W.Segment.of(1, 1, 1, 4, layers=2)
    by_ep = {
        ep: C.evaluate(W.Candidate("colocated", enc, (W.Segment.of(1, 1, 1, 4, layers=4, ep=ep),)), wl[8], prof)
        for ep in (1, 2, 4)
    }
    assert by_ep[1].memory_per_rank_peak > by_ep[2].memory_per_rank_peak > by_ep[4].memory_per_rank_peak
    _, tp1, _ = CT.layer_parts(prof, wl[8], wl[8].llm, 2, 1, 1, 1)
    _, tp4, _ = CT.layer_parts(prof, wl[8], wl[8].llm, 2, 1, 1, 4)
    assert float(tp4) > float(tp1) == 0.0  # tp 1: only the dispatch's all-to-alls, at ep 4


def test_workload_of_a_hybrid_spec_carries_the_mix_and_experts():
    spec = LlavaSpec(num_layers=4, hybrid_layer_pattern="*-*E", num_experts=4, moe_router_topk=2)
    spec = dataclasses.replace(spec, encoders={"vision": EncoderSpec()})
    llm = workload(spec, 8, 1).llm
    assert (llm.num_layers, llm.layer_mix, llm.num_experts, llm.moe_topk) == (4, (0.5, 0.25, 0.25), 4, 2)
    gpt = workload(dataclasses.replace(spec, hybrid_layer_pattern=None, num_experts=None), 8, 1).llm
    assert gpt.layer_mix is None and gpt.num_experts == 0


def _stage_params(pattern: str, pp: int, **kw) -> list[int]:
    layout = layout_from_dict(
        {"modules": {"vision": {"dp": pp}, "language": {"pp": pp}}, "edges": ["vision -> language"]}
    )
    spec = LlavaSpec(num_layers=len(pattern.replace("|", "")), hybrid_layer_pattern=pattern, **kw)
    return [M.stage_params(layout, spec, "language", r).total for r in range(pp)]


def test_memory_model_counts_each_layer_type_and_the_declared_stages():
    """Hand arithmetic (the tiny GPT: h 64, 4 heads, f 256, LayerNorm, biases, vocab 128, seq 64,
    untied): `*` = 2h + 4h^2 + 4h, `-` = 2h + 2hf + f + h; stages as `|` declares them."""
    spec = LlavaSpec()
    h, f, v, s = spec.hidden_size, spec.ffn_hidden_size or 4 * spec.hidden_size, spec.vocab_size, spec.seq_length
    attn, mlp = 2 * h + 4 * h * h + 4 * h, 2 * h + 2 * h * f + f + h
    first, last = v * h + s * h, 2 * h + v * h  # embeddings + positions; final norm + output layer
    assert _stage_params("*-*-", 1) == [first + 2 * attn + 2 * mlp + last]
    assert _stage_params("*-*|-", 2) == [first + 2 * attn + mlp, mlp + last]  # the declared split, 3 + 1
    assert _stage_params("*-*-", 2) == [first + attn + mlp, attn + mlp + last]  # the even split
    moe = _stage_params("*E", 1, num_experts=4, add_bias_linear=False)[0]
    attn_nb = 2 * h + 4 * h * h  # no linear biases
    assert moe == first + attn_nb + 2 * h + 4 * h + 4 * 2 * h * f + last
    gpt = LlavaSpec(num_layers=2)
    layout = layout_from_dict({"modules": {"vision": {}, "language": {}}, "edges": ["vision -> language"]})
    assert _stage_params("*-*-", 1) == [M.stage_params(layout, gpt, "language", 0).total]


@pytest.mark.parametrize("recompute", [None, "selective"])
def test_memory_model_activations_of_pairs_are_the_gpt_layers(recompute):
    """The per-rank activation bytes of `*-*-` (one norm and the attention's, one norm and the MLP's)
    are the GPT model of 2 layers' (Llama-style: RMSNorm, SwiGLU, grouped queries), on 2 stages too."""
    from megatron_hetero.planner.memory_terms import ActivationFeatures

    llama = dict(normalization="RMSNorm", swiglu=True, add_bias_linear=False, num_query_groups=2)
    feats = ActivationFeatures(dtype_bytes=4, sequence_parallel=False, recompute=recompute)
    for pp in (1, 2):
        layout = layout_from_dict(
            {"modules": {"vision": {"dp": pp}, "language": {"pp": pp}}, "edges": ["vision -> language"]}
        )
        hyb = LlavaSpec(num_layers=4, hybrid_layer_pattern="*-*-", **llama)
        gpt = LlavaSpec(num_layers=2, **llama)
        for r in range(pp):
            got = M.stage_activation_bytes(layout, hyb, "language", r, 2, feats)
            assert got == M.stage_activation_bytes(layout, gpt, "language", r, 2, feats)

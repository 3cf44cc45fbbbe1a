"""The cost model with two encoders (a vision and a speech encoder feeding one language model):
step times against a hand computation on a tiny case, the join of disjoint islands, the summed
colocated passes, and the layout a two-encoder candidate writes."""

from __future__ import annotations

import pytest

from megatron_hetero.planner import hardware as HW
from megatron_hetero.planner.cost import evaluate
from megatron_hetero.planner.hardware import layer_flops
from megatron_hetero.planner.workload import Candidate, ModelSpec, Segment, Workload

pytestmark = pytest.mark.pure

A, B = 1e-3, 1e-12  # every layer: a + b * FLOPs; every link free (alpha = beta = 0)
VISION = ModelSpec("vision", 2, 64, 256, 4, 16, kind="encoder")
# the speech encoder's sequence is the clip's: 2 chunks x 15 tokens, not the language context
AUDIO = ModelSpec("audio", 1, 32, 128, 4, 30, kind="encoder")
LLM = ModelSpec("language", 2, 64, 256, 4, 64, kind="llm")


def _profile() -> HW.Profile:
    free = HW.AlphaBeta(0.0, 0.0)
    return HW.Profile(
        layers={"default": HW.LayerModel(A, B)},
        links={"intra": free, "inter": free},
        devices_per_node=8,
        memory_bytes=1e12,
    )


def _wl(*extra: ModelSpec) -> Workload:
    return Workload(VISION, LLM, global_batch=4, micro_batch=1, recompute=None, extra_encoders=extra)


def _layer(spec: ModelSpec, samples: int) -> float:
    """One layer, forward + backward, over `samples` samples on one rank (the hand computation)."""
    return A + B * float(layer_flops(samples * spec.seq, spec.seq, spec.hidden, spec.ffn_hidden))


def test_disjoint_islands_run_in_parallel_and_join_at_the_language_model():
    cand = Candidate(
        "disjoint",
        Segment.of(layers=2),
        (Segment.of(layers=2),),
        encoder_ranks=1,
        extra_encoders=(Segment.of(layers=1),),
    )
    assert cand.world_size == 3
    bd = evaluate(cand, _wl(AUDIO), _profile())
    v, a, lm = 2 * _layer(VISION, 1), 1 * _layer(AUDIO, 1), 2 * _layer(LLM, 1)
    # 4 micro-batches of 1 sample: the longer encoder's fill, the LLM, 3 more runs of the bottleneck
    assert bd.micro_batches == 4
    assert bd.total == pytest.approx(max(v, a) + lm + 3 * max(v, a, lm), rel=1e-12)
    assert bd.boundary == 0.0 and bd.dp_comm == 0.0


def test_colocated_encoders_run_one_after_the_other():
    cand = Candidate("colocated", Segment.of(layers=2), (Segment.of(layers=2),), extra_encoders=(Segment.of(layers=1),))
    bd = evaluate(cand, _wl(AUDIO), _profile())
    # each encoder one pass over the whole batch (4 samples), then 4 LLM micro-batches of 1 sample
    hand = 2 * _layer(VISION, 4) + 1 * _layer(AUDIO, 4) + 4 * 2 * _layer(LLM, 1)
    assert bd.total == pytest.approx(hand, rel=1e-12)


def test_two_encoders_against_their_one_encoder_figures():
    """On a profile with links: disjoint memory is the largest island's (each one-encoder figure's
    max), a colocated rank holds both encoders (more than either alone), and the audio encoder's
    boundary adds to the vision one's."""
    prof = HW.Profile(
        layers={"default": HW.LayerModel(A, B)},
        links={"intra": HW.AlphaBeta(1e-5, 1e-9), "inter": HW.AlphaBeta(1e-5, 1e-9)},
        devices_per_node=8,
        memory_bytes=1e12,
    )
    one_v, one_a = _wl(), Workload(AUDIO, LLM, global_batch=4, micro_batch=1, recompute=None)
    llm = (Segment.of(tp=2, layers=2),)
    v, a = Segment.of(tp=2, layers=2), Segment.of(layers=1)  # islands of 2 and 1 ranks
    both = evaluate(Candidate("disjoint", v, llm, encoder_ranks=2, extra_encoders=(a,)), _wl(AUDIO), prof)
    only_v = evaluate(Candidate("disjoint", v, llm, encoder_ranks=2), one_v, prof)
    only_a = evaluate(Candidate("disjoint", a, llm, encoder_ranks=1), one_a, prof)
    assert both.memory_per_rank_peak == max(only_v.memory_per_rank_peak, only_a.memory_per_rank_peak)
    assert both.total >= max(only_v.total, only_a.total)
    v, a = Segment.of(dp=2, layers=2), Segment.of(tp=2, layers=1)  # both on the LLM's 2 ranks
    co = evaluate(Candidate("colocated", v, llm, extra_encoders=(a,)), _wl(AUDIO), prof)
    co_v = evaluate(Candidate("colocated", v, llm), one_v, prof)
    co_a = evaluate(Candidate("colocated", a, llm), one_a, prof)
    assert co.memory_per_rank_peak > max(co_v.memory_per_rank_peak, co_a.memory_per_rank_peak)
    assert co.boundary == pytest.approx(co_v.boundary + co_a.boundary, rel=1e-12)


def test_candidate_layout_and_checks():
    cand = Candidate(
        "disjoint",
        Segment.of(dp=2, layers=2),
        (Segment.of(tp=2, layers=2),),
        encoder_ranks=2,
        extra_encoders=(Segment.of(tp=2, layers=1),),
    )
    lay = cand.to_layout()
    assert [(m.name, m.size) for m in lay.modules] == [("vision", 2), ("audio", 2), ("language", 2)]
    assert sorted((e.src, e.dst) for e in lay.edges) == [("audio", "language"), ("vision", "language")]
    assert "encoder 2 TP2·CP1·PP1·DP1" in cand.describe() and "islands 2+2+2" in cand.describe()
    with pytest.raises(ValueError, match="lays out 2 encoders, the workload has 1"):
        evaluate(cand, _wl(), _profile())
    with pytest.raises(ValueError, match="encoder audio's segment holds 2 layers"):
        evaluate(
            Candidate(
                "colocated", Segment.of(layers=2), (Segment.of(layers=2),), extra_encoders=(Segment.of(layers=2),)
            ),
            _wl(AUDIO),
            _profile(),
        )
    with pytest.raises(ValueError, match="encoder names must differ"):
        _wl(VISION)


def test_train_model_with_a_whisper_encoder_as_the_cost_model_sees_it():
    """`planner.model.workload` of a vision + Whisper model: the audio encoder is an extra encoder on
    its own sequence (chunk tokens x chunks per clip), with Whisper's convolutions in its parameters."""
    import dataclasses

    from megatron_hetero.layout.spec import Edge, HeteroLayout, ModuleLayout
    from megatron_hetero.layout.validate import resolve_layout
    from megatron_hetero.config.model import spec_on_layout
    from megatron_hetero.planner.model import workload

    mods = (ModuleLayout(name="vision", dp=2), ModuleLayout(name="audio", tp=2), ModuleLayout(name="language", tp=2))
    edges = (Edge("vision", "language"), Edge("audio", "language"))
    lay = resolve_layout(HeteroLayout(placement="colocated", modules=mods, edges=edges), 2)
    spec = spec_on_layout(lay)
    audio = dataclasses.replace(spec.encoders["audio"], kind="whisper", feature_dim=160, tokens=15)
    spec = dataclasses.replace(spec, encoders={**spec.encoders, "audio": audio})
    wl = workload(spec, 8, 4, inputs={"audio": 2})
    (a,) = wl.extra_encoders
    assert (wl.encoder.name, a.name, a.seq, wl.extra_inputs) == ("vision", "audio", 15, (2,))
    eh, h = audio.hidden_size, spec.hidden_size
    convs = 80 * eh * 3 + eh + 3 * eh * eh + eh  # mel bins -> h and h -> h, kernel 3, with biases
    layers = audio.num_layers * (4 * eh * eh + 2 * eh * 4 * eh)
    assert a.params == layers + convs + 15 * eh + (eh + 1) * h + (h + 1) * h
    cand = Candidate("colocated", Segment.of(dp=2, layers=2), (Segment.of(tp=2, layers=2),))
    vision_only = workload(dataclasses.replace(spec, encoders={"vision": spec.encoders["vision"]}), 8, 4)
    both = dataclasses.replace(cand, extra_encoders=(Segment.of(tp=2, layers=2),))
    assert evaluate(both, wl, _profile()).total > evaluate(cand, vision_only, _profile()).total
    with pytest.raises(ValueError, match="inputs for encoders \\['speech'\\]"):
        workload(spec, 8, 4, inputs={"speech": 2})

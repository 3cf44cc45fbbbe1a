"""Cost model and search (plan/cost.py, plan/search.py, cli_search.py). Pure: no torch.

The searches are checked against brute force: the heteropipe DP against every layer partition x
strategy assignment (the seed's 189-configuration space and random cost tables), the multimodal
search against every candidate built one by one and scored by the scalar `cost.evaluate`.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hetero import cli_search
from megatron_hetero.layout import dump_layout, layout_from_dict
from megatron_hetero.plan import cost as C
from megatron_hetero.plan import search as S

REPO = Path(__file__).resolve().parents[1]
HW_FILE = REPO / "examples" / "hardware" / "h100_80gb.json"


@pytest.fixture(scope="module")
def hw() -> C.HardwareSpec:
    return C.HardwareSpec.load(HW_FILE)


@pytest.fixture(scope="module")
def prof(hw) -> C.Profile:
    return C.Profile.from_hardware(hw)


SMALL_ENC = C.ModelSpec("vision", 6, 1024, 4096, 16, 256, kind="encoder")
SMALL_LLM = C.ModelSpec("language", 8, 2048, 5632, 16, 2048, vocab=32000, gated=True)
SMALL_SPACE = S.SearchSpace(tp=(1, 2, 4), cp=(1, 2), pp=(1, 2, 3, 4), encoder_tp=(1, 2), encoder_pp=(1, 2))
TINYLLAMA = C.ModelSpec("tinyllama", 22, 2048, 5632, 32, 2048, vocab=32000, gated=True)
SEED_STRATEGIES = [S.Strategy(tp=1, dp=4), S.Strategy(tp=2, dp=2), S.Strategy(tp=4, dp=1)]


# ------------------------------------------------------------------------------------------
# hardware, profile, fits
# ------------------------------------------------------------------------------------------
def test_hardware_file_has_published_figures(hw) -> None:
    assert hw.peak_flops == pytest.approx(989.4e12)
    assert hw.memory_bytes == 80e9 and hw.devices_per_node == 8
    assert hw.intra_bandwidth == 450e9 and hw.inter_bandwidth == 50e9
    assert "datasheet" in hw.source.lower()


def test_profile_json_round_trip(prof, tmp_path) -> None:
    measured = C.Profile(prof.layers, prof.links, prof.devices_per_node, prof.memory_bytes, prof.host_bandwidth,
                         {"all_reduce": {"intra": {8: C.AlphaBeta(1e-4, 2e-12)}}}, "test")
    path = tmp_path / "p.json"
    measured.save(path)
    back = C.Profile.load(path)
    assert back == measured
    # the measured entry overrides the ring formula at n=8 intra only
    assert back.collective_time("all_reduce", 1e6, 8, False) == pytest.approx(1e-4 + 1e6 * 2e-12)
    assert back.collective_time("all_reduce", 1e6, 8, True) == pytest.approx(prof.collective_time("all_reduce", 1e6, 8, True))


def test_profile_and_hardware_errors(tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        C.Profile.load(bad)
    with pytest.raises(ValueError, match="cannot read"):
        C.HardwareSpec.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="unknown keys"):
        C.HardwareSpec.from_dict({"name": "x", "tflops": 1})
    with pytest.raises(ValueError, match="malformed|missing"):
        C.Profile.from_dict({"layers": {}})


def test_fit_alpha_beta_recovers_line() -> None:
    sizes = np.array([1e3, 1e4, 1e5, 1e6, 1e7])
    alpha, beta = C.fit_alpha_beta(sizes, 5e-6 + sizes / 40e9)
    assert alpha == pytest.approx(5e-6, rel=1e-6) and beta == pytest.approx(1 / 40e9, rel=1e-9)
    a0, b0 = C.fit_alpha_beta([1e3, 2e3], [-1e-6, 1e-6])  # negative intercept is clamped
    assert a0 == 0.0 and b0 > 0
    with pytest.raises(ValueError, match="2 distinct"):
        C.fit_alpha_beta([1e3, 1e3], [1.0, 2.0])


def test_fit_layer_model_recovers_parameters() -> None:
    truth = C.LayerModel(a=3e-5, b=2e-15)
    samples = []
    for tokens, tp, cp in [(2048, 1, 1), (4096, 2, 1), (8192, 4, 2), (16384, 8, 1)]:
        f = float(C.layer_flops(tokens, 2048, 2048, 5632, True)) / (tp * cp)
        samples.append({"tokens": tokens, "seq": 2048, "hidden": 2048, "ffn_hidden": 5632, "gated": True,
                        "tp": tp, "cp": cp, "seconds": float(truth.time(f))})
    fit = C.fit_layer_model(samples)
    assert fit.a == pytest.approx(truth.a, rel=1e-6) and fit.b == pytest.approx(truth.b, rel=1e-9)
    pairs = C.fit_layer_model([(1e12, 1e-3), (2e12, 2e-3)])
    assert pairs.b == pytest.approx(1e-15)
    with pytest.raises(ValueError, match="lacks key"):
        C.fit_layer_model([{"tokens": 1}])


# ------------------------------------------------------------------------------------------
# cost model sanity
# ------------------------------------------------------------------------------------------
def _wl(**kw) -> C.Workload:
    return C.Workload(SMALL_ENC, SMALL_LLM, **{"global_batch": 32, **kw})


def test_more_tp_less_compute_per_rank(prof) -> None:
    wl = _wl()
    compute = [float(C.layer_parts(prof, wl, SMALL_LLM, 4, tp, 1)[0]) for tp in (1, 2, 4, 8)]
    assert all(a > b for a, b in zip(compute, compute[1:]))
    tp_comm = [float(C.layer_parts(prof, wl, SMALL_LLM, 4, tp, 1)[1]) for tp in (1, 2, 4, 8)]
    assert tp_comm[0] == 0.0 and all(a < b for a, b in zip(tp_comm, tp_comm[1:]))
    cp_compute = [float(C.layer_parts(prof, wl, SMALL_LLM, 4, 1, cp)[0]) for cp in (1, 2, 4)]
    assert all(a > b for a, b in zip(cp_compute, cp_compute[1:]))
    # encoders do not shard their sequence over CP: the same work on every CP rank
    assert float(C.layer_parts(prof, wl, SMALL_ENC, 4, 1, 4)[0]) == float(C.layer_parts(prof, wl, SMALL_ENC, 4, 1, 1)[0])


@pytest.mark.parametrize("kind", C.COLLECTIVES)
def test_more_bytes_more_time(prof, kind) -> None:
    sizes = [1e3, 1e5, 1e7, 1e9]
    for n in (2, 4, 8, 16):
        for inter in (False, True):
            times = [float(prof.collective_time(kind, b, n, inter)) for b in sizes]
            assert all(a < b for a, b in zip(times, times[1:]))
        assert float(prof.collective_time(kind, 1e8, n, True)) > float(prof.collective_time(kind, 1e8, n, False))
    assert float(prof.collective_time(kind, 1e8, 1, False)) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        prof.collective_time("all_to_some", 1, 2, False)


def test_ring_formulas(prof) -> None:
    lo = prof.links["intra"]
    n, nbytes = 8, 1e8
    assert float(prof.collective_time("all_reduce", nbytes, n, False)) == pytest.approx(
        2 * (n - 1) * lo.alpha + 2 * (n - 1) / n * nbytes * lo.beta)
    assert float(prof.collective_time("all_gather", nbytes, n, False)) == pytest.approx(
        (n - 1) * lo.alpha + (n - 1) / n * nbytes * lo.beta)
    assert float(prof.collective_time("send_recv", nbytes, 2, False)) == pytest.approx(lo.alpha + nbytes * lo.beta)
    assert float(prof.collective_time("broadcast", nbytes, n, False)) == pytest.approx(3 * lo.alpha + nbytes * lo.beta)


def test_memory_model(prof) -> None:
    wl = _wl(distributed_optimizer=False)
    assert float(C.state_bytes(wl, 1e9, 8)) == pytest.approx(18e9)  # 2 + 4 + 12 bytes per parameter
    assert float(C.state_bytes(_wl(), 1e9, 4)) == pytest.approx(9e9)  # optimizer sharded over dp*cp
    a1 = float(C.act_bytes(wl, SMALL_LLM, 2, 1, 1, 4))
    assert a1 == pytest.approx(4 * 2 * 2048 * 2048 * 34)
    assert float(C.act_bytes(wl, SMALL_LLM, 2, 2, 2, 4)) == pytest.approx(a1 / 4)


def _candidates():
    L, Le = SMALL_LLM.num_layers, SMALL_ENC.num_layers
    seg = C.Segment
    return [
        C.Candidate("homogeneous", seg(2, 1, 2, 2, Le), (seg(2, 1, 2, 2, L),), first_stage_layers=3),
        C.Candidate("homogeneous", seg(1, 2, 1, 4, Le), (seg(1, 2, 1, 4, L),)),
        C.Candidate("colocated", seg(1, 1, 1, 8, Le), (seg(2, 1, 2, 2, L),)),
        C.Candidate("colocated", seg(1, 1, 2, 4, Le), (seg(1, 2, 2, 2, L),), offload=True),
        C.Candidate("disjoint", seg(2, 1, 1, 1, Le), (seg(2, 1, 3, 1, L),), encoder_ranks=2),
        C.Candidate("disjoint", seg(1, 1, 1, 2, Le), (seg(1, 1, 1, 2, 5), seg(2, 1, 1, 1, 3)), encoder_ranks=2),
    ]


@pytest.mark.parametrize("cand", _candidates(), ids=lambda c: c.describe())
def test_breakdown_sums_to_total(prof, cand) -> None:
    bd = C.evaluate(cand, _wl(images_per_sample=2), prof)
    parts = bd.compute + bd.tp_comm + bd.cp_comm + bd.pp_comm + bd.dp_comm + bd.boundary + bd.offload + bd.bubble
    assert parts == pytest.approx(bd.total, rel=1e-12)
    assert bd.total > 0 and bd.memory_per_rank_peak > 0 and bd.bubble >= 0


def test_pipeline_formula_and_offload(prof) -> None:
    wl = _wl()
    on, off = (C.evaluate(C.Candidate("colocated", C.Segment(1, 1, 1, 8, 6), (C.Segment(2, 1, 2, 2, 8),), offload=o),
                          wl, prof) for o in (True, False))
    assert on.offload > 0 and off.offload == 0
    assert on.memory_per_rank_peak < off.memory_per_rank_peak  # encoder state leaves during the LLM phase
    assert on.total - on.offload == pytest.approx(off.total)
    # more micro-batches at the same per-micro-batch cost: the bubble share shrinks
    small, large = (C.evaluate(C.Candidate("homogeneous", C.Segment(1, 1, 4, 2, 6), (C.Segment(1, 1, 4, 2, 8),),
                                           first_stage_layers=2), _wl(global_batch=g), prof) for g in (8, 64))
    assert small.bubble / small.total > large.bubble / large.total


def test_invalid_candidates_raise(prof) -> None:
    wl = _wl()
    seg = C.Segment
    with pytest.raises(ValueError, match="not divisible"):
        C.evaluate(C.Candidate("colocated", seg(1, 1, 1, 8, 6), (seg(1, 1, 1, 8, 8),)), _wl(global_batch=12), prof)
    with pytest.raises(ValueError, match="must equal the LLM"):
        C.evaluate(C.Candidate("homogeneous", seg(1, 1, 1, 8, 6), (seg(2, 1, 1, 4, 8),)), wl, prof)
    with pytest.raises(ValueError, match="layers"):
        C.evaluate(C.Candidate("disjoint", seg(1, 1, 1, 2, 6), (seg(1, 1, 1, 2, 5),), encoder_ranks=2), wl, prof)
    with pytest.raises(ValueError, match="placement"):
        C.evaluate(C.Candidate("mixed", seg(), (seg(layers=8),)), wl, prof)


# ------------------------------------------------------------------------------------------
# (a) heteropipe DP
# ------------------------------------------------------------------------------------------
def _seed_cost(prof):
    wl = C.Workload(SMALL_ENC, TINYLLAMA, global_batch=32)
    return S.transformer_stage_cost(prof, wl, TINYLLAMA, microbatch_samples=4, num_stages=2)


def test_seed_space_has_189_configurations() -> None:
    confs = list(S.enumerate_pipelines(22, 8, 2, SEED_STRATEGIES))
    assert len(confs) == 21 * 9 == 189


def test_seed_189_dp_equals_brute_force(prof) -> None:
    cost = _seed_cost(prof)
    best = S.heteropipe_search(22, 8, 2, SEED_STRATEGIES, cost, num_microbatches=8)
    ref = S.heteropipe_brute_force(22, 8, 2, SEED_STRATEGIES, cost, num_microbatches=8)
    every = [S.PipelinePlan(tuple(S.StagePlan(i, j, s, cost(i, j, s, k)) for k, (i, j, s) in enumerate(c)), 8).objective
             for c in S.enumerate_pipelines(22, 8, 2, SEED_STRATEGIES)]
    assert len(every) == 189
    assert best.objective == pytest.approx(min(every), rel=1e-12) == ref.objective
    # like the seed's measured result: with uniform blocks the homogeneous 11/11 TP1·DP4 split wins
    assert [(s.start, s.end, str(s.strategy)) for s in best.stages] == [(0, 11, "TP1·DP4"), (11, 22, "TP1·DP4")]


def test_heteropipe_prefers_tp_heavy_stage_when_costs_say_so() -> None:
    # a front-loaded model: the first layers are expensive unless split by TP
    def cost(i, j, s, k):
        return sum((8.0 if layer < 4 else 1.0) / s.tp + 0.3 * (s.tp - 1) for layer in range(i, j))

    best = S.heteropipe_search(12, 8, 2, SEED_STRATEGIES, cost, 8)
    ref = S.heteropipe_brute_force(12, 8, 2, SEED_STRATEGIES, cost, 8)
    assert best.objective == pytest.approx(ref.objective)
    assert best.stages[0].strategy.tp > best.stages[1].strategy.tp


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_heteropipe_dp_equals_brute_force_random_tables(data) -> None:
    L = data.draw(st.integers(1, 7), label="layers")
    S_ = data.draw(st.integers(1, min(L, 3)), label="stages")
    pool = [S.Strategy(1, 1), S.Strategy(2, 1), S.Strategy(1, 3), S.Strategy(2, 2)]
    strategies = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique=True), label="strategies")
    D = data.draw(st.integers(1, 9), label="devices")
    B = data.draw(st.integers(1, 6), label="microbatches")
    use_all = data.draw(st.booleans(), label="use_all")
    seed = data.draw(st.integers(0, 2 ** 31 - 1), label="seed")
    rng = np.random.default_rng(seed)
    table = np.round(rng.random((S_, L + 1, L + 1, len(strategies))) * 10, 1)  # ties on purpose
    table[rng.random(table.shape) < 0.1] = np.inf  # some infeasible (out-of-memory) stages

    def cost(i, j, s, k):
        return float(table[k, i, j, strategies.index(s)] * (j - i))

    try:
        got = S.heteropipe_search(L, D, S_, strategies, cost, B, use_all_devices=use_all).objective
    except ValueError:
        got = None
    try:
        ref = S.heteropipe_brute_force(L, D, S_, strategies, cost, B, use_all_devices=use_all).objective
    except ValueError:
        ref = None
    assert (got is None) == (ref is None)
    if got is not None:
        assert got == pytest.approx(ref, rel=1e-12)


def test_heteropipe_memory_limit_and_errors(prof) -> None:
    wl = C.Workload(SMALL_ENC, TINYLLAMA, global_batch=32)
    free = S.transformer_stage_cost(prof, wl, TINYLLAMA, 4, 2)
    tight = S.transformer_stage_cost(prof, wl, TINYLLAMA, 4, 2, memory_limit=7e9)
    a = S.heteropipe_search(22, 8, 2, SEED_STRATEGIES, tight, 8)
    assert a.objective == pytest.approx(S.heteropipe_brute_force(22, 8, 2, SEED_STRATEGIES, tight, 8).objective)
    assert a.objective > S.heteropipe_search(22, 8, 2, SEED_STRATEGIES, free, 8).objective
    # memory pressure on the first stage (2 in-flight micro-batches) makes it TP-heavy, the last DP-heavy
    assert [s.strategy.tp for s in a.stages] == [2, 1]
    with pytest.raises(ValueError, match="no feasible"):
        S.heteropipe_search(22, 8, 2, SEED_STRATEGIES, S.transformer_stage_cost(prof, wl, TINYLLAMA, 4, 2, 1e6), 8)
    with pytest.raises(ValueError, match="no feasible"):
        S.heteropipe_search(22, 7, 2, SEED_STRATEGIES, free, 8)
    with pytest.raises(ValueError, match="at least 3 layers"):
        S.heteropipe_search(2, 8, 3, SEED_STRATEGIES, free, 8)


# ------------------------------------------------------------------------------------------
# (b) multimodal search
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world,gbs,images,limit", [(8, 32, 2, None), (8, 32, 1, 3e9), (12, 48, 2, None), (16, 64, 1, 6e9)])
@pytest.mark.parametrize("prune", [True, False])
def test_search_equals_brute_force(prof, world, gbs, images, limit, prune) -> None:
    wl = C.Workload(SMALL_ENC, SMALL_LLM, global_batch=gbs, images_per_sample=images)
    ref = S.brute_force(wl, prof, world, limit, SMALL_SPACE)
    assert ref, "the small space must have feasible candidates"
    top = 12 if prune else len(ref)  # exhaustive mode: the whole ranking
    res = S.search(wl, prof, world, limit, SMALL_SPACE, top=top, prune=prune)
    got = [r.breakdown.total for r in res.ranked]
    want = [t for t, _ in ref[:top]]
    assert len(got) == len(want)
    assert got == pytest.approx(want, rel=1e-9)
    for kind, r in res.by_placement.items():
        assert r.breakdown.total == pytest.approx(min(t for t, c in ref if c.placement == kind), rel=1e-9)
    assert {c.placement for _, c in ref} == set(res.by_placement)
    if limit is not None:
        assert all(r.breakdown.memory_per_rank_peak <= limit for r in res.ranked)


@settings(max_examples=15, deadline=None)
@given(world=st.sampled_from([4, 6, 8, 12]), enc_layers=st.integers(1, 6), llm_layers=st.integers(2, 9),
       enc_hidden=st.sampled_from([512, 1024, 2048]), llm_hidden=st.sampled_from([1024, 2048, 4096]),
       seq=st.sampled_from([512, 4096, 32768]), batch_factor=st.sampled_from([1, 2, 4]),
       images=st.integers(1, 3), mem_quantile=st.sampled_from([None, 0.3, 0.7]))
def test_search_equals_brute_force_random_workloads(world, enc_layers, llm_layers, enc_hidden, llm_hidden, seq,
                                                    batch_factor, images, mem_quantile) -> None:
    prof = C.Profile.from_hardware(C.HardwareSpec.load(HW_FILE))
    enc = C.ModelSpec("vision", enc_layers, enc_hidden, 4 * enc_hidden, 8, 256, kind="encoder")
    llm = C.ModelSpec("language", llm_layers, llm_hidden, 3 * llm_hidden, 8, seq, vocab=1000, gated=True)
    wl = C.Workload(enc, llm, global_batch=24 * batch_factor, images_per_sample=images)
    free = S.brute_force(wl, prof, world, 1e18, SMALL_SPACE)
    limit = None
    if mem_quantile is not None:
        mems = sorted(C.evaluate(c, wl, prof).memory_per_rank_peak for _, c in free)
        limit = mems[int(mem_quantile * (len(mems) - 1))]
    ref = S.brute_force(wl, prof, world, limit if limit is not None else 1e18, SMALL_SPACE)
    res = S.search(wl, prof, world, limit if limit is not None else 1e18, SMALL_SPACE, top=8)
    assert [r.breakdown.total for r in res.ranked] == pytest.approx([t for t, _ in ref[:8]], rel=1e-9)
    assert {c.placement for _, c in ref} == set(res.by_placement)
    for kind, r in res.by_placement.items():
        assert r.breakdown.total == pytest.approx(min(t for t, c in ref if c.placement == kind), rel=1e-9)


def test_memory_limit_excludes_candidates(prof) -> None:
    wl = C.Workload(SMALL_ENC, SMALL_LLM, global_batch=32, images_per_sample=2)
    free = S.search(wl, prof, 8, 1e15, SMALL_SPACE, top=50)
    limit = free.best.breakdown.memory_per_rank_peak * 0.99
    tight = S.search(wl, prof, 8, limit, SMALL_SPACE, top=50)
    assert tight.best.breakdown.total > free.best.breakdown.total
    assert all(r.breakdown.memory_per_rank_peak <= limit for r in tight.ranked)
    assert free.best.candidate not in {r.candidate for r in tight.ranked}
    with pytest.raises(ValueError, match="memory limit"):
        S.search(wl, prof, 8, 1e6, SMALL_SPACE)


def test_two_segment_llm_is_searched(prof) -> None:
    # an LLM whose best split uses two different TP/DP segments can only be reached with max_segments=2
    wl = C.Workload(SMALL_ENC, SMALL_LLM, global_batch=32)
    space = S.SearchSpace(placements=("disjoint",), tp=(1, 2, 4), cp=(1,), pp=(1, 2), encoder_tp=(1, 2), encoder_pp=(1,))
    res = S.search(wl, prof, 10, None, space, top=500, prune=False)
    segs = {len(r.candidate.llm) for r in res.ranked}
    assert segs == {1, 2}
    one = S.search(wl, prof, 10, None, S.SearchSpace(**{**space.__dict__, "max_segments": 1}), top=5)
    assert all(len(r.candidate.llm) == 1 for r in one.ranked)
    assert res.best.breakdown.total <= one.best.breakdown.total


def test_best_layout_yaml_round_trips(prof) -> None:
    wl = C.Workload(SMALL_ENC, SMALL_LLM, global_batch=32, images_per_sample=2)
    res = S.search(wl, prof, 8, None, SMALL_SPACE, top=3)
    for cand in [res.best.candidate] + [r.candidate for r in res.by_placement.values()] + _candidates():
        layout = cand.to_layout()
        doc = yaml.safe_load(dump_layout(layout))
        back = layout_from_dict(doc, world_size=cand.world_size)
        assert back == layout
        assert back.world_size == cand.world_size
        if len(cand.llm) == 2:
            assert [m.layers.size for m in back.modules[1:]] == [s.layers for s in cand.llm]


def test_search_is_fast_on_100k_candidates(prof) -> None:
    wl = S.regime_workload("6B", "120B", 8192)
    t0 = time.perf_counter()
    res = S.search(wl, prof, 1024, memory_limit=float("inf"), prune=False, top=5)
    wall = time.perf_counter() - t0
    assert res.space_size >= 100_000 and res.evaluated == res.space_size
    assert wall < 5.0, f"{res.evaluated} candidates took {wall:.2f} s"
    pruned = S.search(wl, prof, 1024, memory_limit=float("inf"), prune=True, top=5)
    assert pruned.evaluated < res.evaluated
    assert [r.breakdown.total for r in pruned.ranked] == pytest.approx([r.breakdown.total for r in res.ranked], rel=1e-12)


def test_search_input_errors(prof) -> None:
    wl = C.Workload(SMALL_ENC, SMALL_LLM, global_batch=32)
    with pytest.raises(ValueError, match="world size"):
        S.search(wl, prof, 0)
    with pytest.raises(ValueError, match="unknown placements"):
        S.search(wl, prof, 8, space=S.SearchSpace(placements=("sideways",)))
    with pytest.raises(ValueError, match="positive integer"):
        C.ModelSpec("x", 0, 1, 1, 1, 1)


def test_regime_table_row_per_combination(prof) -> None:
    rows = S.regime_table(prof)
    assert len(rows) == len(S.ENCODER_PRESETS) * len(S.LLM_PRESETS) * len(S.REGIME_CONTEXTS) == 36
    assert {(r["encoder"], r["llm"], r["context"]) for r in rows} == {
        (e, m, c) for e in S.ENCODER_PRESETS for m in S.LLM_PRESETS for c in S.REGIME_CONTEXTS}
    assert {r["gpus"] for r in rows} == {64, 256, 1024}
    for r in rows:
        assert r["picked"] in ("homogeneous", "colocated", "disjoint")
        if r["gain"] is not None:
            assert r["gain"] >= -1e-12 and r["step_s"] == pytest.approx(r["homogeneous_s"] / (1 + r["gain"]))
    text = cli_search.regime_markdown(rows)
    assert len(text.splitlines()) == 38


# ------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------
def test_cli_search_writes_layout(tmp_path, capsys) -> None:
    out = tmp_path / "best.yaml"
    rc = cli_search.main(["search", "--world-size", "64", "--simulate", str(HW_FILE), "--encoder", "12B",
                          "--llm", "14B", "--top", "3", "--out", str(out)])
    text, err = capsys.readouterr()
    assert rc == 0, err
    assert "predicted gain over homogeneous" in text and "| 1 |" in text
    layout = yaml.safe_load(out.read_text())
    assert layout_from_dict(layout, world_size=64).world_size == 64


def test_cli_search_json_and_profile(tmp_path, capsys, prof) -> None:
    path = tmp_path / "profile.json"
    prof.save(path)
    rc = cli_search.main(["search", "--world-size", "8", "--profile", str(path), "--encoder-layers", "6",
                          "--encoder-hidden", "1024", "--encoder-ffn-hidden", "4096", "--image-tokens", "256",
                          "--llm-layers", "8", "--llm-hidden", "2048", "--llm-ffn-hidden", "5632", "--llm-heads", "16",
                          "--seq-length", "2048", "--global-batch-size", "32", "--memory-limit-gb", "60", "--json"])
    text, err = capsys.readouterr()
    assert rc == 0, err
    doc = json.loads(text)
    assert doc["ranked"][0]["breakdown"]["total"] > 0 and doc["best_layout"]["modules"]
    assert doc["memory_limit"] == 60e9


@pytest.mark.parametrize("argv,message", [
    (["search", "--world-size", "8"], "--profile PROFILE.json"),
    (["search", "--world-size", "8", "--simulate", "/nonexistent.json"], "cannot read"),
    (["search", "--simulate", str(HW_FILE)], "--world-size is required"),
    (["search", "--world-size", "8", "--simulate", str(HW_FILE), "--llm", "120B"], "memory limit"),
    (["search", "--world-size", "64", "--simulate", str(HW_FILE), "--placements", "nowhere"], "unknown placements"),
])
def test_cli_search_invalid_input_exit_2(capsys, argv, message) -> None:
    rc = cli_search.main(argv)
    _, err = capsys.readouterr()
    assert rc == 2 and message in err


def test_cli_regime_table_markdown(capsys) -> None:
    rc = cli_search.main(["search", "--regime-table", "--simulate", str(HW_FILE)])
    text, _ = capsys.readouterr()
    assert rc == 0
    lines = text.strip().splitlines()
    assert lines[0].startswith("| encoder | LLM | context | GPUs") and len(lines) == 2 + 36


def test_plan_modules_do_not_import_torch() -> None:
    code = ("import sys; import megatron_hetero.plan.cost, megatron_hetero.plan.search, megatron_hetero.cli_search; "
            "assert 'torch' not in sys.modules and 'torch.distributed' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)

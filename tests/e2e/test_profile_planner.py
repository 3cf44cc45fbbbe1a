"""`megatron-hetero profile`, the planner benchmark and search -> train (planner/profile_fit.py,
profiling/kernels.py, profiling/run.py, bench/planner.py, bench/planner_configs.py, bench/candidate.py,
the runtime space of planner/search.py).

Timings are not asserted (they depend on the machine and on whatever else runs on it): the profile
must fit and round-trip, the planner benchmark must produce its document, and every layout the
search can write must be one `megatron-hetero train` runs.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

import search_reference as R
from megatron_hetero import cli
from megatron_hetero.bench import planner as B
from megatron_hetero.planner import layout_cost as CA
from megatron_hetero.bench import planner_configs as PC
from megatron_hetero.layout import dump_layout, layout_from_dict
from megatron_hetero.planner import cost as C
from megatron_hetero.planner import cost_terms as CT
from megatron_hetero.planner import hardware as HW
from megatron_hetero.planner import profile_fit as F
from megatron_hetero.planner import search as S
from megatron_hetero.planner import search_space as SP
from megatron_hetero.planner import workload as W
from megatron_hetero.planner.model import workload
from megatron_hetero.profiling import run as T

REPO = Path(__file__).resolve().parents[2]
HW_FILE = REPO / "megatron_hetero" / "planner" / "hardware_presets" / "h100_80gb.json"
TINY = F.ProfileGrid(
    layer_shapes={"llm": ((64, 4, 32, 1), (64, 4, 32, 4)), "encoder": ((32, 4, 8, 1), (32, 4, 8, 8))},
    module_shapes={
        "llm": ((64, 4, 32, 2, 128), (128, 4, 32, 2, 256)),
        "encoder": ((32, 4, 8, 2, 64), (64, 4, 8, 2, 64)),
    },
    tp=(1, 2),
    cp=(1, 2),
    # 1 KiB vs 16 MiB, median of 4 samples: one descheduled sample (2 cores shared by every test
    # process) cannot hide the bytes term (with 2 samples of 8 MiB a fitted broadcast beta came out 0)
    sizes=(1 << 10, 1 << 24),
    iters=4,
    warmup=1,
    reps=1,
)


@pytest.fixture(scope="module")
def measured(tmp_path_factory, megatron_compat):
    out = tmp_path_factory.mktemp("profile") / "profile.json"
    prof, doc = T.run_profile(2, TINY, out=out, quiet_wait_s=0.0, tries=1)
    return prof, doc, out


def _synthetic(shared: bool) -> HW.Profile:
    """A measured-looking profile with every term the profile command fits."""
    lm = HW.LayerModel(2e-3, 3e-11)
    return HW.Profile(
        layers={"llm": lm, "encoder": HW.LayerModel(1.5e-3, 3e-11), "default": lm},
        links={"intra": HW.AlphaBeta(1e-3, 1e-9), "inter": HW.AlphaBeta(1e-3, 1e-9)},
        devices_per_node=8,
        memory_bytes=1e9,
        host_bandwidth=5e9,
        collectives={"all_reduce": {"intra": {2: HW.AlphaBeta(1.5e-3, 1e-9)}}},
        source="synthetic",
        overheads={
            "llm_io": HW.LayerModel(4e-3, 1e-11),
            "encoder_io": HW.LayerModel(2e-3, 0.0),
            "llm_io_tp": HW.LayerModel(0.0, 5.0),
            "optimizer": HW.LayerModel(2e-3, 1e-8),
            "data": HW.LayerModel(3e-4, 1e-6),
            "snapshot": HW.LayerModel(4e-4, 0.0),
            "grad_sync": HW.LayerModel(5e-4, 1.4),
        },
        cores=1.7 if shared else 0.0,
        concurrency=8 if shared else 0,
        layer_collectives={"all_reduce": {"intra": {2: HW.AlphaBeta(8e-4, 1e-9)}}},
        cpu_cores=2.0 if shared else 0.0,
    )


# ------------------------------------------------------------------------------------------
# profile
# ------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_profile_measures_fits_and_round_trips(measured) -> None:
    prof, doc, out = measured
    on_disk = json.loads(out.read_text())
    assert on_disk["world_size"] == 2 and on_disk["measurements"]["layers"] and on_disk["grid"]["tp"] == [1, 2]
    back = HW.Profile.load(out)
    assert back == prof
    for kind in ("llm", "encoder"):
        assert prof.layers[kind].a >= 0 and prof.layers[kind].b >= 0
        assert prof.layers[kind].a + prof.layers[kind].b > 0
    for kind in ("all_reduce", "all_gather", "broadcast", "send_recv"):
        ab = prof.collectives[kind]["intra"][2]
        assert ab.alpha >= 0 and ab.beta > 0, (kind, ab)  # 1 KiB vs 16 MiB: the bytes show
    assert prof.links["intra"].alpha > 0 and prof.links["intra"].beta >= 0
    assert set(prof.overheads) >= {"llm_io", "encoder_io", "llm_io_tp", "optimizer", "snapshot", "grad_sync"}
    assert prof.shared and 0 < prof.cores <= 2 and prof.concurrency == 2  # gloo on CPU: ranks share cores
    # a layer time and a collective time from the fitted profile are positive and grow with the work
    small, big = (float(prof.layer_time("llm", f)) for f in (1e6, 1e9))
    assert 0 < small <= big
    assert (
        float(prof.collective_time("all_reduce", 1e6, 2, False))
        > float(prof.collective_time("all_reduce", 1e3, 2, False))
        >= 0
    )
    text = F.summary(doc)
    assert "layer llm" in text and "send_recv" in text


def test_profile_grid_cases_respect_divisibility() -> None:
    grid = F.ProfileGrid()
    for c in F.layer_cases(grid, 4):
        assert 4 % (c["tp"] * c["cp"]) == 0 and c["heads"] % c["tp"] == 0
        assert c["kind"] == "llm" or c["cp"] == 1
        assert c["cp"] == 1 or c["seq"] % (2 * c["cp"]) == 0
    assert {c["n"] for c in F.collective_cases(grid, 8) if c["kind"] == "all_reduce"} == {2, 4, 8}
    assert {c["n"] for c in F.collective_cases(grid, 8) if c["kind"] == "send_recv"} == {2}
    with pytest.raises(ValueError, match="unknown module kind"):
        F.layer_cases(F.ProfileGrid(layer_shapes={"decoder": ((8, 1, 8, 1),)}), 2)
    with pytest.raises(ValueError, match=">= 2"):
        T.measure(1, TINY)


def test_profile_json_with_extra_terms_round_trips(tmp_path) -> None:
    prof = _synthetic(shared=True)
    path = tmp_path / "p.json"
    prof.save(path)
    assert HW.Profile.load(path) == prof
    doc = json.loads(path.read_text())
    doc["overheads"]["gpu_magic"] = {"a": 1, "b": 0}
    with pytest.raises(ValueError, match="unknown overheads"):
        HW.Profile.from_dict(doc)
    # an older profile without the new keys still loads, as a non-shared profile without overheads
    old = {
        k: v
        for k, v in prof.to_dict().items()
        if k not in ("overheads", "cores", "concurrency", "layer_collectives", "cpu_cores")
    }
    back = HW.Profile.from_dict(old)
    assert not back.shared and back.overheads == {} and back.uncontended == 1.0


# ------------------------------------------------------------------------------------------
# cost model on a measured-style profile
# ------------------------------------------------------------------------------------------
def test_shared_profile_step_is_work_or_uncontended_critical_path() -> None:
    model = PC.BenchModel()
    wl = workload(model.spec, model.global_batch_size, model.micro_batch_size)
    shared, own = _synthetic(True), _synthetic(False)
    for w, doc in PC.CONFIGS:
        cand = CA.candidate_for(PC.resolve(doc, w), model.spec)
        a, b = C.evaluate(cand, wl, shared), C.evaluate(cand, wl, own)
        parts = a.compute + a.tp_comm + a.cp_comm + a.pp_comm + a.dp_comm + a.boundary + a.offload + a.optimizer
        assert a.bubble >= -1e-12 and parts + a.bubble == pytest.approx(a.total, rel=1e-12)
        assert a.total >= b.total * shared.uncontended * (1 - 1e-12)  # never below the uncontended critical path
        assert a.total <= b.total * (1 + 1e-12)  # never above the critical path at full sharing
        assert b.optimizer > 0 and b.dp_comm > 0


def test_cores_at_runs_from_runnable_ranks_to_the_measured_cores() -> None:
    """Up to the machine's units every runnable rank has one; beyond, the throughput falls to the
    measured `cores` at the profile's concurrency; without `cpu_cores` it is flat."""
    p = dataclasses.replace(_synthetic(True), cores=1.5, concurrency=8, cpu_cores=2.0)
    got = p.cores_at(np.array([0.5, 1.0, 2.0, 5.0, 8.0]))
    g = (2.0 / 1.5 - 1.0) / 6.0
    assert got == pytest.approx([0.5, 1.0, 2.0, 2.0 / (1 + 3 * g), 1.5], rel=1e-12)
    assert np.all(np.diff(p.cores_at(np.linspace(2, 8, 13))) < 0)
    assert dataclasses.replace(p, cpu_cores=0.0).cores_at(np.array([1.0, 3.0])) == pytest.approx([1.5, 1.5])
    assert dataclasses.replace(p, cores=2.0).cores_at(np.array([1.0, 3.0, 8.0])) == pytest.approx([1.0, 2.0, 2.0])


def test_shared_step_from_the_runnable_ranks() -> None:
    """step = max(D / cores_at(k), P), D = work * cores, P = critical * cores / W, k = min(W, D / P),
    worked by hand on a profile with W = 8 ranks measured at 1.5 cores on a 2-core machine."""
    p = dataclasses.replace(_synthetic(True), cores=1.5, concurrency=8, cpu_cores=2.0)
    g = (2.0 / 1.5 - 1.0) / 6.0
    # islands idle a third of the time: k = 0.1 * 8 / 0.3 = 8/3 runnable ranks, more than 2 units
    k = 0.1 * 8 / 0.3
    assert float(CT.shared_step(p, 0.1, 0.3)) == pytest.approx(0.1 * 1.5 / (2.0 / (1 + g * (k - 2))), rel=1e-12)
    assert float(CT.shared_step(p, 0.1, 0.3)) < 0.1  # below the work at full sharing: the units did more
    # every rank always runnable: the work at the profile's sharing
    assert float(CT.shared_step(p, 0.1, 0.1)) == pytest.approx(0.1, rel=1e-12)
    # one rank runnable on average: the critical path with a unit to itself
    assert float(CT.shared_step(p, 0.1, 0.8)) == pytest.approx(0.8 * 1.5 / 8, rel=1e-12)
    # without cpu_cores: the earlier rule max(work, critical * uncontended)
    old = dataclasses.replace(p, cpu_cores=0.0)
    assert float(CT.shared_step(old, 0.1, 0.3)) == pytest.approx(0.1, rel=1e-12)
    assert float(CT.shared_step(old, 0.1, 0.8)) == pytest.approx(0.15, rel=1e-12)


def test_overheads_land_where_the_runtime_does_the_work() -> None:
    prof, model = _synthetic(False), PC.BenchModel()
    wl = workload(model.spec, model.global_batch_size, model.micro_batch_size)
    bare = HW.Profile(
        prof.layers, prof.links, prof.devices_per_node, prof.memory_bytes, prof.host_bandwidth, prof.collectives, "bare"
    )
    cand = W.Candidate("colocated", W.Segment.of(1, 1, 1, 4, 2), (W.Segment.of(1, 1, 1, 4, 4),))
    with_io, without = C.evaluate(cand, wl, prof), C.evaluate(cand, wl, bare)
    b = with_io.micro_batches
    llm_io = float(CT.io_time(prof, wl, wl.llm, wl.micro_batch, 1, 1)) + float(CT.data_time(prof, wl, wl.micro_batch))
    enc_io = float(CT.io_time(prof, wl, wl.encoder, wl.global_batch / 4, 1, 1)) + float(CT.data_time(prof, wl, 4))
    assert with_io.compute == pytest.approx(without.compute + b * llm_io + enc_io, rel=1e-9)
    # every pipeline stage of the language model builds its micro-batch; the output layer is on the last
    pp2 = W.Candidate("colocated", W.Segment.of(1, 1, 1, 4, 2), (W.Segment.of(1, 1, 2, 2, 4),))
    a, z = C.evaluate(pp2, wl, prof), C.evaluate(pp2, wl, bare)
    b2, data = a.micro_batches, float(CT.data_time(prof, wl, wl.micro_batch))
    llm_last = float(CT.io_time(prof, wl, wl.llm, wl.micro_batch, 1, 1))
    # the breakdown on a non-shared profile is the bottleneck stage's: the last one (output layer)
    assert a.compute == pytest.approx(z.compute + b2 * (llm_last + data) + enc_io, rel=1e-9)
    # phase-closing communication goes through the measured grad_sync overhead
    t = float(prof.collective_time("send_recv", 2 * 32 * 64 * 4, 2, False))
    assert float(CT.p2p_time(prof, wl, wl.llm, 2, 1, False)) == pytest.approx(5e-4 + 1.4 * 2 * t)
    assert float(CT.synced(prof, 0.0)) == 0.0
    # TP adds the fitted number of activation all-reduces over the TP group
    tp2 = float(CT.io_time(prof, wl, wl.llm, 2, 2, 1)) - float(
        prof.overhead_time("llm_io", CT.io_flops(wl, wl.llm, 2, 2, 1))
    )
    assert tp2 == pytest.approx(5.0 * float(CT.io_allreduce(prof, wl, wl.llm, 2, 2, 1)))


# ------------------------------------------------------------------------------------------
# layout <-> cost model mapping
# ------------------------------------------------------------------------------------------
def test_workload_and_candidate_mapping_is_consistent() -> None:
    model = PC.BenchModel()
    spec = model.spec
    wl = workload(spec, model.global_batch_size, model.micro_batch_size)
    assert (wl.llm.num_layers, wl.llm.hidden, wl.llm.heads, wl.llm.seq, wl.llm.vocab) == (4, 64, 4, 32, 128)
    assert (wl.encoder.num_layers, wl.encoder.hidden, wl.encoder.seq, wl.encoder.kind) == (2, 32, 8, "encoder")
    assert wl.llm.ffn_hidden == 4 * 64 and wl.dtype_bytes == 4 and not wl.distributed_optimizer
    assert wl.global_batch == 16 and wl.micro_batch == 2 and wl.image_tokens == 8
    kinds = set()
    for w, doc in PC.CONFIGS:
        lay = PC.resolve(doc, w)
        cand = CA.candidate_for(lay, spec)
        kinds.add(CA.kind_of(lay, spec))
        assert cand.world_size == w == lay.world_size
        wl_c = workload(spec, model.global_batch_size, CA.cost_micro_batch(lay, spec, model.micro_batch_size))
        # the cost model's micro-batch count is the runtime's: G / (dp of the first language module * mbs)
        assert W.check_candidate(cand, wl_c) == model.global_batch_size // (model.micro_batch_size * cand.llm[0].dp)
        assert S.train_micro_batch_size(cand, wl_c) == model.micro_batch_size
        assert sum(s.layers for s in cand.llm) == spec.num_layers
        if lay.placement == "disjoint":
            assert cand.placement == "disjoint" and cand.encoder_ranks == lay.module("vision").size
            # the candidate's own layout is the same job (module names aside)
            back = cand.to_layout()
            assert [m.size for m in back.modules] == [m.size for m in lay.modules]
            assert [(m.tp, m.cp, m.pp, m.dp) for m in back.modules] == [(m.tp, m.cp, m.pp, m.dp) for m in lay.modules]
        else:
            assert cand.placement == "colocated"  # homogeneous layouts run on the colocated schedule
            assert cand.to_layout() == lay
    assert kinds == {"homogeneous", "colocated", "disjoint"}
    assert sum(1 for w, _ in PC.CONFIGS if w == 4) >= 10 and sum(1 for w, _ in PC.CONFIGS if w == 8) >= 10


# ------------------------------------------------------------------------------------------
# search -> layouts the runtime runs
# ------------------------------------------------------------------------------------------
def _runtime_accepts(layout, job) -> None:
    from megatron_hetero.config.model import language_modules, segment_layers
    from megatron_hetero.plan.rank_plan import rank_plans
    from megatron_hetero.plan.roles import roles
    from megatron_hetero.training.setup import JobDraft, validate_job

    validate_job(JobDraft(layout, job))
    assert tuple(m.name for m in language_modules(layout, job.spec)) == roles(layout).language
    for m in language_modules(layout, job.spec):
        assert segment_layers(m, job.spec).size % m.pp == 0, m
    for name in job.spec.encoders:
        assert layout.module(name).cp == 1
    rank_plans(layout, job.global_batch_size, job.micro_batch_size)


@pytest.mark.parametrize("world", [4, 6, 8])
def test_every_runtime_candidate_is_accepted_by_train(world) -> None:
    model = PC.BenchModel(global_batch_size=24 if world == 6 else 16)
    spec = model.spec
    wl = workload(spec, model.global_batch_size, model.micro_batch_size)
    space = B.runtime_space(world, model)
    cands = [c for _, c in R.brute_force(wl, _synthetic(True), world, float("inf"), space)]
    assert {c.placement for c in cands} == {"colocated", "disjoint"}
    assert any(len(c.llm) == 2 for c in cands) == (world > 4)  # two halves of a >= 4-rank island
    if world == 8:  # segments that differ in DP, and in PP, both run
        assert any(len(c.llm) == 2 and c.llm[0].dp != c.llm[1].dp for c in cands)
        assert any(len(c.llm) == 2 and c.llm[0].pp != c.llm[1].pp for c in cands)

    def accepted(cand) -> bool:
        layout = layout_from_dict(yaml.safe_load(dump_layout(cand.to_layout())), world_size=world)  # as train reads it
        job = dataclasses.replace(model.job(1), micro_batch_size=S.train_micro_batch_size(cand, wl))
        try:
            _runtime_accepts(layout, job)
        except (ValueError, AssertionError):
            return False
        return True

    rejected = [c.describe() for c in cands if not accepted(c)]
    assert not rejected, rejected
    # the cost model's whole space has layouts the runtime rejects (uneven stages, encoder in stage 0)
    full = [
        c
        for _, c in R.brute_force(
            wl,
            _synthetic(True),
            world,
            float("inf"),
            SP.SearchSpace(
                tp=space.tp, cp=space.cp, pp=(1, 2, 3), encoder_tp=space.encoder_tp, encoder_pp=(1, 2), offload=(False,)
            ),
        )
    ]
    assert any(not accepted(c) for c in full if c.placement != "homogeneous")


@pytest.mark.parametrize("world", [8, 12, 16])
@pytest.mark.parametrize("prune", [True, False])
def test_runtime_space_vectorized_search_equals_brute_force(world, prune) -> None:
    """The vectorized search (simulated profile) restricted to the runtime's layouts, two-segment
    chains with equal DP and different TP/PP included, against scoring each candidate."""
    prof = HW.Profile.from_hardware(HW.HardwareSpec.load(HW_FILE))
    enc = W.ModelSpec("vision", 4, 1024, 4096, 16, 256, kind="encoder")
    llm = W.ModelSpec("language", 8, 2048, 5632, 16, 2048, vocab=32000, gated=True)
    wl = W.Workload(enc, llm, global_batch=48, micro_batch=1)
    space = SP.SearchSpace(
        tp=(1, 2, 4),
        cp=(1, 2),
        pp=(1, 2, 3, 4),
        encoder_tp=(1, 2),
        encoder_pp=(1, 2, 3),
        encoder_cp=(1, 2),
        runtime=True,
    )
    ref = R.brute_force(wl, prof, world, None, space)
    assert ref and {c.placement for _, c in ref} == {"colocated", "disjoint"}
    assert all(c.encoder.cp == 1 and 4 % c.encoder.pp == 0 and all(s.layers % s.pp == 0 for s in c.llm) for _, c in ref)
    if world != 12:
        assert any(len(c.llm) == 2 and c.llm[0].pp != c.llm[1].pp for _, c in ref)
    top = 15 if prune else len(ref)
    res = S.search(wl, prof, world, None, space, top=top, prune=prune)
    assert [r.breakdown.total for r in res.ranked] == pytest.approx([t for t, _ in ref[:top]], rel=1e-9)
    assert res.baseline is not None and res.gain >= -1e-12


@pytest.mark.parametrize("shared", [False, True])
def test_search_equals_brute_force_on_measured_style_profiles(shared) -> None:
    model = PC.BenchModel()
    wl = workload(model.spec, model.global_batch_size, model.micro_batch_size)
    prof = _synthetic(shared)
    space = B.runtime_space(8, model)
    res = S.search(wl, prof, 8, float("inf"), space, top=5)
    ref = R.brute_force(wl, prof, 8, float("inf"), space)
    assert [r.breakdown.total for r in res.ranked] == pytest.approx([t for t, _ in ref[:5]], rel=1e-12)
    assert res.baseline is not None
    e, s = res.baseline.candidate.encoder, res.baseline.candidate.llm[0]
    assert (e.tp, e.cp, e.pp, e.dp) == (s.tp, s.cp, s.pp, s.dp)
    assert res.gain is not None and res.gain >= -1e-12


@pytest.mark.timeout(180)
def test_search_out_yaml_trains_directly(tmp_path, capsys, megatron_compat) -> None:
    prof_path = tmp_path / "profile.json"
    _synthetic(True).save(prof_path)
    best = tmp_path / "best.yaml"
    model = [
        "--encoder-layers",
        "2",
        "--encoder-hidden",
        "32",
        "--encoder-ffn-hidden",
        "128",
        "--encoder-heads",
        "4",
        "--image-tokens",
        "8",
        "--llm-layers",
        "2",
        "--llm-hidden",
        "64",
        "--llm-ffn-hidden",
        "256",
        "--llm-heads",
        "4",
        "--vocab-size",
        "128",
        "--seq-length",
        "32",
    ]
    rc = cli.main(
        [
            "search",
            "--profile",
            str(prof_path),
            "--world-size",
            "4",
            *model,
            "--global-batch-size",
            "8",
            "--micro-batch-size",
            "1",
            "--out",
            str(best),
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "predicted gain over homogeneous" in out
    layout = yaml.safe_load(best.read_text())
    assert layout["placement"] in ("colocated", "disjoint")
    rc = cli.main(
        [
            "train",
            "--hetero-layout",
            str(best),
            "--train-iters",
            "1",
            "--global-batch-size",
            "8",
            "--micro-batch-size",
            "1",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "iteration    1/1 | lm loss" in out
    # --all-layouts searches the cost model's whole space and cannot write a layout for train
    rc = cli.main(
        [
            "search",
            "--profile",
            str(prof_path),
            "--world-size",
            "4",
            *model,
            "--global-batch-size",
            "8",
            "--all-layouts",
            "--out",
            str(best),
        ]
    )
    _, err = capsys.readouterr()
    assert rc == 2 and "--all-layouts" in err


# ------------------------------------------------------------------------------------------
# the planner benchmark, smoke
# ------------------------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_planner_benchmark_smoke(tmp_path) -> None:
    configs = [(4, PC._homo({"dp": 4})), (4, PC._dis({"dp": 2}, {"dp": 2}))]
    doc = B.run(
        tmp_path,
        iters=2,
        warmup=1,
        worlds=(4,),
        configs=configs,
        rounds=1,
        profile_rounds=1,
        grid=TINY,
        quiet_wait_s=0.0,
        retries=0,
        plot=False,
    )
    assert json.loads((tmp_path / "planner.json").read_text()) == json.loads(json.dumps(doc))
    rows = doc["configurations"]
    assert len(rows) in (2, 3)  # + the search's pick when it is not one of the configurations
    assert [r["source"] for r in rows[:2]] == ["config", "config"]
    for r in rows:
        assert r["measured_s"] > 0 and r["estimate_s"] > 0 and len(r["steps_s"][0]) == 3
        assert r["error"] == pytest.approx(r["estimate_s"] / r["measured_s"] - 1)
        assert set(r["breakdown"]) >= {"compute", "tp_comm", "dp_comm", "optimizer", "bubble", "total"}
        assert r["kind"] in ("homogeneous", "colocated", "disjoint")
    assert doc["mape"] == pytest.approx(sum(abs(r["error"]) for r in rows) / len(rows))
    pick = doc["picks"]["4"]
    assert 0 <= pick["index"] < len(rows) and pick["pick_over_fastest"] >= 0
    assert doc["profiles"]["4"]["world_size"] == 4
    text = B.table(doc)
    assert "| world | kind | configuration | measured | estimate | error |" in text and "MAPE" in text
    assert doc["round_mape"] is None and doc["profiles"]["4"]["cpu_cores"] >= 1  # one round; the machine's units


def test_round_noise_is_how_far_rounds_move_from_the_kept_one() -> None:
    rows = [{"rounds_s": [1.0, 1.2, 1.1]}, {"rounds_s": [2.0, 3.0]}, {"rounds_s": [5.0]}]
    got = B.round_noise(rows)
    assert got["round_mape"] == pytest.approx((0 + 0.2 + 0.1 + 0 + 0.5) / 5)
    assert got["round_spread"] == pytest.approx((0.2 + 0.5) / 2)  # median of two
    assert B.round_noise([{"rounds_s": [1.0]}]) == {"round_mape": None, "round_spread": None}

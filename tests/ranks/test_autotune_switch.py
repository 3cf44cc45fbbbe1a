"""`train --hetero-autotune` on forked gloo ranks (`training/autotune_run.py`): the in-process switch
colocated -> disjoint (losses equal to a run that loads the switch's checkpoint under the chosen
layout), the switch and its revert, twice (--autotune-rounds 2; back on the first layout: the losses of a run that never left
it, and no process group, thread or file descriptor left behind: `bench soak`'s counters), a run that
stays and says why (the real calibration and search), and the settings refused before any rank
starts. The decision is forced in the first two (`plan_switch` patched: the forked ranks inherit it),
so the tests check the mechanics, not this CPU's timings."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from parity import losses, max_loss_rel_diff, run_job
from megatron_hetero.bench.autotune import checkpoint_at
from megatron_hetero.layout import layout_from_dict
from megatron_hetero.planner import autotune as A
from megatron_hetero.training import autotune_run as R
from megatron_hetero.config.autotune import AutotuneConfig
from megatron_hetero.planner.layout_cost import candidate_for
from megatron_hetero.training.setup import JobConfig, validate_job, JobDraft

COLOC = {
    "placement": "colocated",
    "modules": {"vision": {"dp": 2}, "language": {"dp": 2}},
    "edges": ["vision -> language"],
}
DISJOINT = {"placement": "disjoint", "modules": {"vision": {}, "language": {}}, "edges": ["vision -> language"]}
ITERS, K = 6, 2  # windows: iterations 1-2 (then the decision), 3-4 (after a switch), 5-6


def tune(**kw) -> AutotuneConfig:
    return AutotuneConfig(hetero_autotune=True, autotune_steps=K, autotune_skip_layers=True, **kw)


def job(save: Path, iters: int = ITERS, **kw) -> JobConfig:
    return JobConfig(train_iters=iters, save=str(save), autotune=tune(**kw))


def force_switch_to(monkeypatch, doc: dict) -> None:
    """Every round decides to switch to `doc`'s layout (predicted 1 ms, measured 1 s)."""
    target = layout_from_dict(doc, world_size=2)

    def plan(trace, run, iteration, world, timings=None, shared=False, tried=(), check=None):
        spec = run.config.spec
        cur, to = candidate_for(run.layout, spec), candidate_for(target, spec)
        d = A.Decision(True, "switch: forced by the test", to, 1e-3, 999.0)
        return R.Plan(d, A.record_of(iteration, cur, d, 1.0), 0.0, {"iteration": iteration}, target)

    monkeypatch.setattr(R, "plan_switch", plan)


def probe_hook(iteration: int) -> dict:
    from megatron_hetero.bench.soak import probe

    p = probe()
    return {k: p[k] for k in ("process_groups", "threads", "open_fds")}


@pytest.mark.timeout(600)
def test_switch_colocated_to_disjoint_equals_resuming_its_checkpoint(tmp_path, monkeypatch, megatron_compat):
    force_switch_to(monkeypatch, DISJOINT)
    save = tmp_path / "run"
    got = run_job(COLOC, 2, job(save, autotune_rounds=1))
    recs = got[0]["records"]
    assert [r["iteration"] for r in recs] == list(range(1, ITERS + 1))
    doc = json.loads((save / "autotune.json").read_text())
    (d,) = doc["decisions"]
    assert d["iteration"] == K and d["kept"] is True and d["to_layout"].startswith("disjoint")
    assert d["measured_after_s"] > 0
    assert "placement: disjoint" in (save / "autotune-layout.yaml").read_text()
    # the reference: Megatron-style resume of the switch checkpoint under the chosen layout
    ref_dir = checkpoint_at(save, K, tmp_path / "ref")
    ref = run_job(DISJOINT, 2, JobConfig(train_iters=ITERS, load=str(ref_dir)))
    after, expect = losses(got)[K:], losses(ref)
    assert len(expect) == ITERS - K
    assert max_loss_rel_diff(after, expect) <= 1e-6, (after, expect)


@pytest.mark.timeout(600)
def test_switch_and_revert_leaves_the_first_layout_as_it_was(tmp_path, monkeypatch, megatron_compat):
    force_switch_to(monkeypatch, DISJOINT)
    monkeypatch.setattr(A, "after_switch", lambda before, after, noise_s=0.0: False)  # measured slower: go back
    save, iters = tmp_path / "run", 4 * K  # two rounds (--autotune-rounds 2): switch, back, switch, back
    layout = layout_from_dict(COLOC, world_size=2)
    j = job(save, iters, autotune_rounds=2)
    from megatron_hetero.runtime.launcher import run_ranks
    from megatron_hetero.training.trainer import train_rank

    got = run_ranks(
        2, train_rank, validate_job(JobDraft(layout, j)), collect_params=True, step_hook=probe_hook, timeout=300
    )
    assert [r["iteration"] for r in got[0]["records"]] == list(range(1, iters + 1))
    doc = json.loads((save / "autotune.json").read_text())
    assert [(d["iteration"], d["kept"]) for d in doc["decisions"]] == [(K, False), (2 * K, False)]
    assert all(d["to_layout"].startswith("disjoint") for d in doc["decisions"])
    assert "placement: colocated" in (save / "autotune-layout.yaml").read_text()
    assert sorted(p.name for p in save.glob("iter_*")) == [f"iter_{i:07d}" for i in (K, 2 * K, 3 * K, iters)]
    plain = run_job(COLOC, 2, JobConfig(train_iters=iters))
    assert max_loss_rel_diff(losses(got), losses(plain)) <= 1e-6
    for r in got:  # the same layout before the switches and after the reverts: the same live resources
        probes = {rec["iteration"]: rec["probe"] for rec in r["records"]}
        assert probes[iters] == probes[K], probes


@pytest.mark.timeout(600)
def test_a_run_that_gains_nothing_stays_and_says_why(tmp_path, megatron_compat):
    save = tmp_path / "run"
    gains_nothing = AutotuneConfig(hetero_autotune=True, autotune_steps=K, autotune_min_gain=100.0)
    j = JobConfig(train_iters=ITERS, save=str(save), autotune=gains_nothing)
    got = run_job(COLOC, 2, j)
    plain = run_job(COLOC, 2, JobConfig(train_iters=ITERS))
    assert losses(got) == losses(plain)  # the measuring (layers timed in-process) changes no number
    doc = json.loads((save / "autotune.json").read_text())
    (d,) = doc["decisions"]
    assert d["from_layout"] == d["to_layout"] and d["kept"] is True and d["measured_after_s"] is None
    (cal,) = doc["calibration"]
    assert cal["steps_measured"] == K - 1 and cal["measured_step_s"] > 0
    assert set(cal["factors"]) == {"encoder", "llm", "comm", "optimizer", "residual"}


@pytest.mark.parametrize(
    "change, says",
    [
        ({"save": None}, "needs --save DIR"),
        ({"trace": "/tmp/t.json"}, "leave out --trace"),
        ({"autotune": AutotuneConfig(hetero_autotune=True, autotune_steps=1)}, "--autotune-steps must be"),
        ({"autotune": AutotuneConfig(hetero_autotune=True, autotune_fix="audio.tp=2")}, "names ['audio']"),
        ({"autotune": AutotuneConfig(hetero_autotune=True, autotune_min_gain=-1.0)}, "--autotune-min-gain"),
        ({"train_iters": 3}, "--train-iters 3 is fewer"),
        ({"autotune": AutotuneConfig(hetero_autotune=True, autotune_rounds=0)}, "--autotune-rounds must be"),
    ],
)
def test_settings_refused_before_any_rank_starts(tmp_path, change, says):
    j = dataclasses.replace(JobConfig(train_iters=ITERS, save=str(tmp_path), autotune=AutotuneConfig(True)), **change)
    with pytest.raises(ValueError) as e:
        validate_job(JobDraft(layout_from_dict(COLOC, world_size=2), j))
    assert says in str(e.value)


def test_layer_cases_cover_the_degrees_the_search_may_choose():
    from megatron_hetero.planner.model import workload
    from megatron_hetero.training.autotune_layers import layer_case_dicts

    spec = JobConfig().spec  # heads 4, the default tiny model
    wl = workload(spec, 8, 2)
    cases = layer_case_dicts(wl, 4, encoder_images=2)
    llm = [(c["tp"], c["cp"], c["batch"]) for c in cases if c["module"] == "llm"]
    enc = [(c["tp"], c["cp"], c["batch"]) for c in cases if c["module"] == "encoder"]
    assert cases[0]["module"] == "llm" and (cases[0]["tp"], cases[0]["cp"]) == (1, 1)  # the kernel's solo case
    assert llm[:2] == [(1, 1, 2), (1, 1, 4)] and {(2, 1, 2), (4, 1, 2)} <= set(llm)
    # every TP degree at two sizes: its all-reduce's latency and its cost per byte, not one point
    assert {(2, 1, 4), (4, 1, 4)} <= set(llm) and {(2, 1, 2), (2, 1, 4), (4, 1, 2), (4, 1, 4)} <= set(enc)
    assert all(cp == 1 or wl.llm.seq % (2 * cp) == 0 for _, cp, _ in llm)
    assert enc[:2] == [(1, 1, 2), (1, 1, 4)] and all(cp == 1 for _, cp, _ in enc)
    assert all(c["hidden"] == (wl.llm.hidden if c["module"] == "llm" else wl.encoder.hidden) for c in cases)


def test_a_frozen_encoder_stays_frozen_on_the_chosen_layout():
    from megatron_hetero.training.autotune_checks import carry_settings

    spec = JobConfig().spec
    frozen = {**COLOC, "modules": {"vision": {"dp": 2, "frozen": True}, "language": {"dp": 2}}}
    src = layout_from_dict(frozen, world_size=2)
    segments = {
        "placement": "disjoint",
        "modules": {"vision": {}, "language_a": {"layers": "0-0"}, "language_b": {"layers": "1-1"}},
        "edges": ["vision -> language_a", "language_a -> language_b"],
    }
    dst = carry_settings(src, layout_from_dict(segments, world_size=3), spec)
    assert [(m.name, m.frozen) for m in dst.modules] == [("vision", True), ("language_a", False), ("language_b", False)]
    lang_frozen = {**COLOC, "modules": {"vision": {"dp": 2}, "language": {"dp": 2, "frozen": True}}}
    dst = carry_settings(layout_from_dict(lang_frozen, world_size=2), layout_from_dict(segments, world_size=3), spec)
    assert [m.frozen for m in dst.modules] == [False, True, True]


@pytest.mark.timeout(600)
def test_no_switch_without_room_to_measure_the_new_layout(tmp_path, monkeypatch, megatron_compat):
    force_switch_to(monkeypatch, DISJOINT)  # would switch, but only K - 1 steps are left to measure it in
    save = tmp_path / "run"
    got = run_job(COLOC, 2, job(save, 2 * K - 1))
    assert [r["iteration"] for r in got[0]["records"]] == list(range(1, 2 * K))
    doc = json.loads((save / "autotune.json").read_text())
    (d,) = doc["decisions"]
    assert d["from_layout"] == d["to_layout"] and d["kept"] is True
    assert "fewer than the --autotune-steps" in doc["calibration"][0]["reason"]
    assert "placement: colocated" in (save / "autotune-layout.yaml").read_text()


@pytest.mark.timeout(600)
def test_a_fit_that_fails_leaves_the_run_training_on_its_layout(tmp_path, monkeypatch, megatron_compat):
    """The cost model refusing what the window gave it (CI once fitted a negative price) is a stay
    with the reason, not a failed run: training goes on with the losses of a plain run."""

    def refuse(*args, **kwargs):
        raise ValueError("a candidate's predicted step must be a positive number of seconds, got -0.36")

    monkeypatch.setattr(R, "plan_switch", refuse)
    save = tmp_path / "run"
    got = run_job(COLOC, 2, job(save))
    plain = run_job(COLOC, 2, JobConfig(train_iters=ITERS))
    assert losses(got) == losses(plain)
    doc = json.loads((save / "autotune.json").read_text())
    (d,) = doc["decisions"]
    assert d["from_layout"] == d["to_layout"] and d["kept"] is True
    assert doc["calibration"][0]["reason"].startswith("stay: the cost model could not price this run (a candidate's")


def _hybrid(j: JobConfig) -> JobConfig:
    """`j` with the language model Megatron's HybridModel of `*-*-` (`--hybrid-layer-pattern`)."""
    from megatron_hetero.models.llava import LlavaSpec

    return dataclasses.replace(j, spec=LlavaSpec(num_layers=4, hybrid_layer_pattern="*-*-"))


@pytest.mark.timeout(600)
def test_hybrid_switch_colocated_to_disjoint_equals_resuming_its_checkpoint(tmp_path, monkeypatch, megatron_compat):
    """A HybridModel language model switches as GPT's does: its checkpoint resumed under the chosen layout."""
    force_switch_to(monkeypatch, DISJOINT)
    save = tmp_path / "run"
    got = run_job(COLOC, 2, _hybrid(job(save, autotune_rounds=1)))
    (d,) = json.loads((save / "autotune.json").read_text())["decisions"]
    assert d["iteration"] == K and d["kept"] is True and d["to_layout"].startswith("disjoint")
    ref_dir = checkpoint_at(save, K, tmp_path / "ref")
    ref = run_job(DISJOINT, 2, _hybrid(JobConfig(train_iters=ITERS, load=str(ref_dir))))
    after, expect = losses(got)[K:], losses(ref)
    assert len(expect) == ITERS - K
    assert max_loss_rel_diff(after, expect) <= 1e-6, (after, expect)


@pytest.mark.timeout(600)
def test_hybrid_round_calibrates_and_ranks_runnable_layouts(tmp_path, megatron_compat):
    """The real round on a HybridModel language model: its layers timed, the cost model (each layer
    its type's share) calibrated, the layouts ranked and checked; the run stays (min gain 100x) and
    its losses are those of a run without the autotune."""
    save = tmp_path / "run"
    gains_nothing = AutotuneConfig(hetero_autotune=True, autotune_steps=K, autotune_min_gain=100.0)
    got = run_job(COLOC, 2, _hybrid(JobConfig(train_iters=ITERS, save=str(save), autotune=gains_nothing)))
    plain = run_job(COLOC, 2, _hybrid(JobConfig(train_iters=ITERS)))
    assert losses(got) == losses(plain)
    doc = json.loads((save / "autotune.json").read_text())
    (d,) = doc["decisions"]
    assert d["from_layout"] == d["to_layout"] and d["kept"] is True
    (cal,) = doc["calibration"]
    print(f"\nhybrid autotune round: {cal['reason']}")
    assert cal["reason"].startswith("stay") and "no candidate layout fits" not in cal["reason"], cal["reason"]
    assert cal["predicted_current_s"] > 0 and cal["measured_step_s"] > 0

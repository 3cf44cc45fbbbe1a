"""`train --hetero-autotune` on a vision + Whisper audio layout: accepted before any rank starts,
rank 0's round (`plan_switch`, on a synthetic trace of a slow step) picks a layout that gives the
audio encoder its own degrees and that `train`'s checks accept, and a real round on forked gloo
ranks calibrates the cost model to both encoders' spans and ranks runnable two-encoder layouts."""

from __future__ import annotations

import dataclasses
import json

import pytest

from parity import losses, run_job
from megatron_hetero.layout import layout_from_dict
from megatron_hetero.models.llava import EncoderSpec, LlavaSpec
from megatron_hetero.runtime.trace import chrome_trace
from megatron_hetero.training import autotune_run as R
from megatron_hetero.training.autotune_checks import job_on, workload_of
from megatron_hetero.config.autotune import AutotuneConfig
from megatron_hetero.planner.layout_cost import candidate_for
from megatron_hetero.training.setup import JobConfig, validate_job, JobDraft

WHISPER = EncoderSpec(kind="whisper", tokens=4, feature_dim=16, num_layers=1, activation="gelu", offset=10)
SPEC = dataclasses.replace(LlavaSpec(seq_length=40), encoders={"vision": EncoderSpec(offset=1), "audio": WHISPER})
AV = {
    "placement": "colocated",
    "modules": {"vision": {"tp": 2}, "audio": {"tp": 2}, "language": {"tp": 2}},
    "edges": ["vision -> language", "audio -> language"],
}
ITERS, K = 6, 2


def _job(save, skip_layers: bool = True, **tune) -> JobConfig:
    cfg = AutotuneConfig(hetero_autotune=True, autotune_steps=K, autotune_skip_layers=skip_layers, **tune)
    return JobConfig(train_iters=ITERS, save=str(save), spec=SPEC, autotune=cfg)


def _slow_trace(world: int, steps: int = 3) -> dict:
    """Steps of 1 s each, the modules' spans a small part of them (the rest is the residual)."""
    payloads = []
    for r in range(world):
        spans, t = [], 0.0
        for _ in range(steps):
            for kind, module, dur in (
                ("encoder-forward", "vision", 0.01),
                ("encoder-forward", "audio", 0.01),
                ("llm-forward", "language", 0.02),
                ("llm-backward", "language", 0.04),
                ("boundary", "", 0.03),
                ("encoder-backward", "audio", 0.02),
                ("encoder-backward", "vision", 0.02),
                ("grad-reduce", "", 0.01),
            ):
                spans.append((kind, kind, int(t * 1e9), int((t + dur) * 1e9), {"module": module} if module else {}))
                t += dur
            t = t + 0.8
            spans.append(("optimizer", "optimizer", int(t * 1e9), int((t + 0.05) * 1e9), {}))
            t += 0.05
        payloads.append({"rank": r, "host": "h", "spans": spans})
    return chrome_trace(payloads)


def test_two_encoder_layout_is_accepted_and_its_round_picks_a_runnable_layout(tmp_path):
    layout = layout_from_dict(AV, world_size=2)
    job = _job(tmp_path, autotune_min_gain=0.0)
    run = validate_job(JobDraft(layout, job))  # the cost model takes both encoders now
    cur = candidate_for(layout, SPEC)
    assert [e.tp for e in cur.encoders] == [2, 2]
    plan = R.plan_switch(_slow_trace(2), run, iteration=K, world=2)
    assert plan.decision.switch, plan.decision.reason
    target = plan.decision.target
    assert len(target.extra_encoders) == 1 and target.describe() != cur.describe()
    lay = plan.layout
    assert {"vision", "audio"} <= set(lay.names)
    assert {e.src for e in lay.edges} >= {"vision", "audio"}
    assert plan.calibration["predicted_current_s"] == pytest.approx(plan.calibration["measured_step_s"], rel=1e-6)
    validate_job(job_on(run, lay, workload_of(run), load=None))  # train runs it


@pytest.mark.timeout(600)
def test_real_round_on_two_encoders_calibrates_and_ranks_runnable_layouts(tmp_path, megatron_compat):
    """The round on forked ranks: both encoders' spans calibrate the model, the two-encoder layouts are
    ranked and checked (the layers timed in-process first); the run stays (min gain 100x) with the
    losses of a run without the autotune."""
    save = tmp_path / "run"
    got = run_job(AV, 2, _job(save, skip_layers=False, autotune_min_gain=100.0))
    plain = run_job(AV, 2, JobConfig(train_iters=ITERS, spec=SPEC))
    assert losses(got) == losses(plain)
    doc = json.loads((save / "autotune.json").read_text())
    (d,) = doc["decisions"]
    assert d["from_layout"] == d["to_layout"] and d["kept"] is True
    (cal,) = doc["calibration"]
    print(f"\ntwo-encoder autotune round: {cal['reason']}")
    assert cal["reason"].startswith("stay") and "no candidate layout fits" not in cal["reason"], cal["reason"]
    assert cal["predicted_current_s"] > 0 and cal["measured_step_s"] > 0


@pytest.mark.timeout(600)
def test_real_round_switches_to_its_two_encoder_pick_and_trains_on(tmp_path, megatron_compat):
    """With no minimum gain the real round switches to its pick (every encoder's degrees searched, the
    audio encoder's among them), trains the switched layout through its checkpoint and measures it
    (kept or reverted)."""
    save = tmp_path / "run"
    got = run_job(AV, 2, _job(save, autotune_min_gain=0.0, autotune_rounds=1))
    assert len(losses(got)) == ITERS and all(x == x for x in losses(got))  # every step trained, no NaN
    (d,) = json.loads((save / "autotune.json").read_text())["decisions"]
    print(f"\ntwo-encoder autotune switch: {d['from_layout']} -> {d['to_layout']}, kept {d['kept']}")
    assert d["iteration"] == K and d["to_layout"] != d["from_layout"] and "encoder 2" in d["to_layout"]
    assert d["measured_after_s"] is not None and d["measured_after_s"] > 0


#: the spoken-digits shape: images of 0..2 tiles and clips of 0..3 speech chunks per sample
VARIABLE = dataclasses.replace(
    SPEC,
    encoders={
        "vision": EncoderSpec(offset=1, max_tiles=2),
        "audio": dataclasses.replace(WHISPER, offset=20, max_tiles=3),
    },
)


def test_variable_tiles_are_priced_at_the_most_a_sample_holds(tmp_path):
    """Conversation and speech data (`--encoder-max-tiles`): autotune accepts them and prices each
    encoder at its most tiles or chunks per sample, as the memory model does."""
    layout = layout_from_dict(AV, world_size=2)
    job = dataclasses.replace(_job(tmp_path), spec=VARIABLE)
    run = validate_job(JobDraft(layout, job))
    wl = workload_of(run)
    fixed = workload_of(JobDraft(layout, dataclasses.replace(job, spec=SPEC)))
    assert (wl.images_per_sample, wl.extra_inputs) == (2, (3,))
    assert (fixed.images_per_sample, fixed.extra_inputs) == (1, (1,))


@pytest.mark.timeout(600)
def test_real_round_with_variable_tiles_trains_on(tmp_path, megatron_compat):
    save = tmp_path / "run"
    got = run_job(AV, 2, dataclasses.replace(_job(save, autotune_min_gain=100.0), spec=VARIABLE))
    plain = run_job(AV, 2, JobConfig(train_iters=ITERS, spec=VARIABLE))
    assert losses(got) == losses(plain)
    (cal,) = json.loads((save / "autotune.json").read_text())["calibration"]
    assert cal["reason"].startswith("stay") and "no candidate layout fits" not in cal["reason"], cal["reason"]

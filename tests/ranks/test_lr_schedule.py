"""Learning-rate schedule (Megatron's OptimizerParamScheduler per module), gradient clipping by the
whole model's norm, the lr / grad norm in the records, and the schedule's state in checkpoints."""

from __future__ import annotations

import dataclasses
import math

import pytest

from parity import full_params, losses, max_loss_rel_diff, run_job, world1_doc
from megatron_hetero.checkpoint.scheduler_state import schedule_mismatch
from megatron_hetero.runtime.module_state import OptimConfig
from megatron_hetero.training.iteration_log import IterationLog, format_line
from megatron_hetero.config.lr_schedule import LRSchedule
from megatron_hetero.training.setup import JobConfig

COLOC = {
    "placement": "colocated",
    "modules": {"vision": {"dp": 2}, "language": {"tp": 2}},
    "edges": ["vision -> language"],
}


def expected_lr(step: int, lr: float, warmup: int, decay: int, style: str, min_lr: float) -> float:
    """Megatron's rule at `step` completed steps (the rate iteration step+1 runs at)."""
    if warmup > 0 and step <= warmup:
        return lr * step / warmup
    if style == "constant":
        return lr
    if step > decay:
        return min_lr
    ratio = (step - warmup) / (decay - warmup)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (lr - min_lr)


def test_validation_messages():
    with pytest.raises(ValueError, match="--lr-decay-style must be one of constant, linear, cosine"):
        LRSchedule(lr_decay_style="wsd").validate(1e-3, 10)
    with pytest.raises(ValueError, match="--lr-warmup-iters 10 must be smaller than the decay iterations 10"):
        LRSchedule(lr_warmup_iters=10).validate(1e-3, 10)
    with pytest.raises(ValueError, match="--min-lr must satisfy"):
        LRSchedule(min_lr=1.0).validate(1e-3, 10)
    LRSchedule(lr_warmup_iters=2, lr_decay_style="cosine", lr_decay_iters=20, min_lr=1e-5).validate(1e-3, 10)
    assert (
        schedule_mismatch(
            {"max_lr": 1e-3, "min_lr": 0.0, "lr_warmup_steps": 0, "lr_decay_steps": 4, "lr_decay_style": "constant"},
            LRSchedule().scheduler_config(1e-3, 8),
        )
        == []
    )  # no decay: decay iters play no part
    assert schedule_mismatch(
        {"max_lr": 1e-3, "min_lr": 0.0, "lr_warmup_steps": 0, "lr_decay_steps": 4, "lr_decay_style": "cosine"},
        LRSchedule(lr_decay_style="cosine").scheduler_config(1e-3, 8),
    ) == ["--lr-decay-iters 4 in the checkpoint, 8 now"]


def test_iteration_line_and_progress():
    rec = {
        "iteration": 3,
        "loss": 4.5,
        "step_time_s": 0.5,
        "consumed_samples": 24,
        "lr": 1e-3,
        "grad_norm": 0.25,
        "tokens": 256,
    }
    line = format_line(10, [rec], 8)
    assert line.startswith(" iteration    3/10 | lm loss 4.500000 | consumed samples: 24 |")
    assert "learning rate: 1.000000E-03 | grad norm: 0.2500 | tokens per second: 512.0 |" in line
    out = []
    log = IterationLog(out.append, 4, 8, interval=2, progress=True)
    for i in range(1, 5):
        log.record(dict(rec, iteration=i))
    log.close()
    assert out[0].startswith("\r[") and " 1/4 " in out[0]
    assert out[1].startswith("\r\033[K iteration    2/4") and out[1].endswith("\n")
    assert out[3].startswith("\r\033[K iteration    4/4")


@pytest.mark.timeout(300)
def test_warmup_cosine_rates_and_resume_with_schedule(tmp_path, megatron_compat):
    sched = LRSchedule(lr_warmup_iters=2, lr_decay_style="cosine", lr_decay_iters=5, min_lr=1e-4)
    job = JobConfig(train_iters=6, schedule=sched, optim=OptimConfig(lr=2e-3))
    per_rank = run_job(COLOC, 2, job)
    recs = per_rank[0]["records"]
    want = [expected_lr(i, 2e-3, 2, 5, "cosine", 1e-4) for i in range(6)]
    assert [r["lr"] for r in recs] == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert recs[0]["lr"] == 0.0 and recs[2]["lr"] == pytest.approx(2e-3) and recs[5]["lr"] == pytest.approx(1e-4)
    assert all(r["grad_norm"] > 0 and set(r["grad_norm_per_module"]) == {"vision", "language"} for r in recs)
    for r in recs:  # the whole model's norm combines the modules'
        assert r["grad_norm"] == pytest.approx(math.hypot(*r["grad_norm_per_module"].values()), rel=1e-12)
    # interrupted at 3, resumed under another layout: the scheduler continues from its saved step
    root = tmp_path / "ck"
    run_job(
        COLOC,
        2,
        dataclasses.replace(job, train_iters=3, save=str(root), save_interval=3, schedule=dataclasses.replace(sched)),
    )
    other = {"placement": "disjoint", "modules": {"vision": {}, "language": {}}, "edges": ["vision -> language"]}
    resumed = run_job(other, 2, dataclasses.replace(job, load=str(root)))
    assert [r["lr"] for r in resumed[0]["records"]] == pytest.approx(want[3:], rel=1e-12)
    assert max_loss_rel_diff(losses(resumed), losses(per_rank)[3:]) <= 1e-5
    # a different schedule is refused before training, unless overridden
    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.training.setup import JobDraft, validate_job

    changed = dataclasses.replace(job, load=str(root), schedule=dataclasses.replace(sched, lr_warmup_iters=1))
    with pytest.raises(
        ValueError, match="--lr-warmup-iters 2 in the checkpoint, 1 now.*--override-opt-param-scheduler"
    ):
        validate_job(JobDraft(layout_from_dict(COLOC, world_size=2), changed))
    validate_job(
        JobDraft(layout_from_dict(COLOC, world_size=2), dataclasses.replace(changed, override_opt_param_scheduler=True))
    )


@pytest.mark.timeout(300)
def test_clip_grad_by_the_global_norm_same_in_every_layout(megatron_compat):
    """--clip-grad clips by the norm over every module's gradients (one Megatron optimizer's
    semantics): the same training whatever the modules' layouts, and different from unclipped
    training."""
    clipped = JobConfig(train_iters=3, optim=OptimConfig(optimizer="sgd", lr=0.5, clip_grad=0.05))
    het = run_job(COLOC, 2, clipped)
    ref = run_job(world1_doc(clipped), 1, clipped)
    assert max_loss_rel_diff(losses(het), losses(ref)) <= 1e-5
    recs = het[0]["records"]
    assert all(r["grad_norm"] > 0.05 for r in recs)  # so the clip is active
    for r, w in zip(recs, ref[0]["records"]):
        assert r["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5)
        assert r["grad_norm"] == pytest.approx(math.sqrt(sum(v**2 for v in r["grad_norm_per_module"].values())))
    plain = run_job(COLOC, 2, dataclasses.replace(clipped, optim=OptimConfig(optimizer="sgd", lr=0.5)))
    assert losses(plain)[2] != pytest.approx(losses(het)[2], rel=1e-4)


def _initial_params(doc: dict, world: int, job: JobConfig) -> list[dict]:
    """The parameters every run of `job` starts from: the trainer with no iteration to run."""
    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.runtime.launcher import run_ranks
    from megatron_hetero.training.setup import JobDraft, validate_job
    from megatron_hetero.training.trainer import train_rank

    one = dataclasses.replace(job, train_iters=1, schedule=LRSchedule(lr_decay_iters=1))
    validated = validate_job(JobDraft(layout_from_dict(doc, world_size=world), one))  # --train-iters 0 is refused
    none = dataclasses.replace(validated, config=dataclasses.replace(one, train_iters=0))
    return run_ranks(world, train_rank, none, collect_params=True, timeout=180)


DISJ = {
    "placement": "disjoint",
    "modules": {"vision": {"dp": 1}, "language": {"dp": 1}},
    "edges": ["vision -> language"],
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("doc", [COLOC, DISJ], ids=["colocated", "disjoint"])
def test_clipping_scales_every_module_by_clip_over_the_global_norm(doc, megatron_compat):
    """SGD, one step, clipping engaged: every module's update is the unclipped update times the same
    factor clip / global norm (the global norm: over both modules' gradients, as the unclipped run
    logs it), not each module's clip / own norm."""
    clip = 1e-3
    job = JobConfig(train_iters=1, optim=OptimConfig(optimizer="sgd", lr=0.5))
    start = full_params(_initial_params(doc, 2, job))
    plain_run = run_job(doc, 2, job)
    plain = full_params(plain_run)
    clipped = full_params(
        run_job(doc, 2, dataclasses.replace(job, optim=dataclasses.replace(job.optim, clip_grad=clip)))
    )
    rec = plain_run[0]["records"][0]
    total, per_module = rec["grad_norm"], rec["grad_norm_per_module"]
    want = clip / (total + 1e-6)
    assert total > clip and set(per_module) == {"vision", "language"}
    for m in ("vision", "language"):
        assert abs(clip / per_module[m] - want) > 0.05 * want  # the per-module rule would differ
        num = sum(float(((clipped[m][n] - start[m][n]) * (plain[m][n] - start[m][n])).sum()) for n in start[m])
        den = sum(float(((plain[m][n] - start[m][n]) ** 2).sum()) for n in start[m])
        scale = num / den  # least-squares factor: update_clipped = scale * update_plain
        assert scale == pytest.approx(want, rel=1e-4), m
        resid = max(
            float((clipped[m][n] - start[m][n] - scale * (plain[m][n] - start[m][n])).abs().max()) for n in start[m]
        )
        biggest = max(float((plain[m][n] - start[m][n]).abs().max()) for n in start[m])
        # the whole update is scaled, element by element (to 1% of the clipped update: the differences
        # of fp32 parameters of size ~1 carry ~1e-7 of rounding)
        assert resid <= 1e-2 * biggest * want, m

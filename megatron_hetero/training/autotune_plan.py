"""Rank 0's part of a `train --hetero-autotune` round (`plan_switch`, pure: no collective): the cost
model fitted to the measuring window's trace (`calibrated`), the layouts this job can run ranked
under the run's constraints, and the decision to broadcast (`Plan`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.planner import autotune as A
from megatron_hetero.config.autotune import parse_fix
from megatron_hetero.training.autotune_checks import (
    base_profile,
    carry_settings,
    encoder_names,
    job_on,
    module_names,
    workload_of,
)
from megatron_hetero.config.job import Job, JobDraft
from megatron_hetero.planner.search_space import SearchSpace
from megatron_hetero.planner.layout_cost import candidate_for


@dataclasses.dataclass(frozen=True)
class Plan:
    """Rank 0's decision of one round, as broadcast: the `decision` (its `target` a candidate), the
    target's layout (None on a stay), the `record` of autotune.json, the window's step noise
    `noise_s` (`StepTimes.noise_s`) and the `calibration` (autotune.json's)."""

    decision: A.Decision
    record: A.AutotuneRecord
    noise_s: float
    calibration: dict[str, Any]
    layout: Optional[HeteroLayout] = None


def calibrated(doc: dict[str, Any], run: Job, timings=None, shared: bool = False):
    """(the window's steps without the warm-up, the cost model fitted to them) of the running job
    `run` (validated; `doc`: the trace of its measuring window): the base profile
    (`base_profile`); with `timings` (`training.autotune_layers.LayerTimings`) on ranks that share a
    CPU (`shared`: gloo) its cores as the timings measured them; calibrated to the window
    (`planner.autotune.calibrate`); with `timings`, their layers folded into that (the measured TP/CP
    costs and layer models) and calibrated once more, so the measured layers are taken at the run's
    speed and the communication factor of the first pass does not scale the measured in-layer costs."""

    job = run.config
    wl = workload_of(run)
    current = candidate_for(run.layout, job.spec, job.offload_encoder)
    prof = base_profile(job.autotune)
    if timings is not None and shared:
        from megatron_hetero.profiling.run import cpu_cores

        prof = timings.shared_profile(prof, cpu_cores())
    steps = A.step_times_from_trace(doc).drop(1)
    calib = A.calibrate(steps, current, wl, prof)
    if timings is not None:
        prof = calib.profile
        for module, cases in timings.cases.items():
            if cases:
                prof = A.fold_layer_measurements(prof, wl, module, cases)
        calib = A.calibrate(steps, current, wl, prof)
    return steps, calib


def plan_switch(
    doc: dict[str, Any],
    run: Job,
    iteration: int,
    world: int,
    timings=None,
    shared: bool = False,
    tried: tuple = (),
    check: Optional[Callable[[JobDraft], object]] = None,
) -> Plan:
    """Rank 0's round (pure; no collective): the cost model fitted to the trace `doc` of the measuring
    window of the running job `run` (validated: its layout and config; `calibrated`), the layouts
    this job can run ranked under its constraints, and the decision taken at `iteration`. `tried`: (candidate, trace of its measuring window) of
    the layouts tried already and gone back from; they are left out, and the model is fitted to
    each of their windows too: every candidate is priced by the slowest of the fits (what a tried
    layout showed the model to underestimate counts against the layouts like it). `check(draft)`:
    ValueError for a candidate the run cannot train (a `JobDraft`: the candidate's layout under the
    run's config, `job_on`), its value unused here (default: `train`'s
    `validate_job`; a patched Megatron-LM script passes its own `candidate_check`)."""
    from megatron_hetero.training.setup import validate_job

    layout, job = run.layout, run.config
    tune, spec = job.autotune, job.spec
    wl = workload_of(run)
    current = candidate_for(layout, spec, job.offload_encoder)
    steps, calib = calibrated(doc, run, timings, shared)
    enc, llm = module_names(layout, spec)
    extra = encoder_names(layout, spec)[1:]
    try:
        space = SearchSpace(runtime=True, offload=(job.offload_encoder,))  # offloading is the user's memory choice
        ranked = A.rank_calibrated(
            calib,
            wl,
            world,
            parse_fix(tune.autotune_fix),
            space=space,
            top=10 * (1 + 3 * len(tried)),  # room to re-rank by the tried layouts' fits
            encoder_name=enc,
            llm_name=llm,
            extra_names=extra,
        )
    except ValueError as exc:  # nothing fits the constraints: stay
        ranked, why = [], str(exc)
    else:
        why = ""
    fits = [A.calibrate(A.step_times_from_trace(d).drop(1), c, wl, calib.profile) for c, d in tried]
    if fits:
        ranked = sorted(((c, max([t] + [f.predict(c, wl) for f in fits])) for c, t in ranked), key=lambda ct: ct[1])
    priced = [(c, t) for c, t in ranked if t > 0 and math.isfinite(t)]
    unpriced, ranked = len(ranked) - len(priced), priced  # a fit gone wrong must not pick a layout
    gone_back = {c.describe() for c, _ in tried}
    runnable, layouts = [], {}
    for cand, t in ranked:
        if cand.describe() in gone_back:
            continue
        try:
            lay = carry_settings(layout, cand.to_layout(enc, llm, extra), spec)  # frozen modules stay frozen
            (check or validate_job)(job_on(run, lay, wl, load=None))  # the checkpoint is written on a switch
        except ValueError:
            continue  # e.g. its micro-batches do not split over a module's DP
        runnable.append((cand, t))
        layouts[id(cand)] = lay
    d = A.decide(steps.step_s, steps.noise_s, current, runnable, tune.autotune_min_gain)
    if not runnable and why:
        d = dataclasses.replace(d, reason=f"stay: no candidate layout fits the run's constraints ({why})")
    if tried:
        d = dataclasses.replace(
            d, reason=d.reason + f" (not counting {len(tried)} layout(s) tried and measured no faster)"
        )
    if unpriced:
        d = dataclasses.replace(
            d, reason=d.reason + f" ({unpriced} candidate(s) left out: the fitted model priced them at <= 0 s)"
        )
    rec = A.record_of(iteration, current, d, steps.step_s)
    cal = {
        "iteration": iteration,
        "reason": d.reason,
        "factors": dict(calib.factors),
        "notes": list(calib.notes),
        "measured_step_s": steps.step_s,
        "noise_s": steps.noise_s,
        "range_s": steps.spread_s,
        "steps_measured": len(steps.wall_s),
        "predicted_current_s": calib.predict(current, wl),
    }
    return Plan(d, rec, steps.noise_s, cal, layouts.get(id(d.target)) if d.switch else None)


def stay_at_end(doc, run: Job, iteration: int) -> Plan:
    """The round of the running job `run` (validated) when fewer than --autotune-steps steps are left
    after `iteration`: a new layout could not be measured (and gone back from), so the run stays."""
    job = run.config
    left = job.train_iters - iteration
    return stay_because(
        doc,
        run,
        iteration,
        f"stay: {left} step(s) left after iteration {iteration}, fewer than the --autotune-steps "
        f"{job.autotune.autotune_steps} a new layout would be measured in",
    )


def stay_because(doc, run: Job, iteration: int, reason: str) -> Plan:
    """A round that stays on the running job `run`'s layout (`run` validated) at `iteration` for
    `reason` (a line starting 'stay: '): the window's measured step recorded, no prediction."""

    steps = A.step_times_from_trace(doc).drop(1)
    current = candidate_for(run.layout, run.config.spec, run.config.offload_encoder)
    d = A.Decision(False, reason)
    cal = {"iteration": iteration, "reason": d.reason}
    return Plan(d, A.record_of(iteration, current, d, steps.step_s), steps.noise_s, cal)

"""`train --hetero-autotune`: a run that measures itself, re-plans and moves to a faster layout in the
same processes, without losing a step. The decisions are pure (`planner/autotune.py`); this file
runs them on the ranks (`train_autotuned`, called by `training.trainer.train_rank`).

One round, on every rank (the world never changes; only global rank 0 decides):

1. `--autotune-steps` K steps of the current layout with a recording tracer (a `training.session.Session` whose
   schedule records spans; the job's own --trace is refused with --hetero-autotune); the window's
   trace is gathered on rank 0 and the tracer stops recording;
2. unless --autotune-skip-layers: one layer of each module timed in-process at the other TP/CP
   degrees (`training/autotune_layers.py`, collective);
3. rank 0 fits the cost model to the window (`plan_switch`: the base profile, the layer timings
   folded in, `calibrate` on the window's steps without the first), searches under the run's
   constraints (world size, --autotune-fix, the profile's memory; layouts this job cannot run, e.g.
   a global batch that does not split, are dropped) and decides (`decide`: more than
   --autotune-min-gain and more than the step noise); the decision is broadcast over the world and
   rank 0 prints it in one line;
4. on a switch: a checkpoint of the iteration reached (unless --save-interval just wrote it) under
   --save, the session destroyed (its process groups), a new one built under the chosen layout
   from that checkpoint, K more steps measured; unless their median step is faster than the old
   layout's, a checkpoint of that iteration and back to the old layout from it (no
   step is lost either way), and steps 3-4 again with the next best layout not tried yet, up to
   --autotune-rounds layouts tried (the measurement of the first window is kept);
5. rank 0 writes `autotune.json` (the decisions, and the calibration: predicted against measured
   step of the chosen layout, next to the steps' noise) and `autotune-layout.yaml` (the layout the
   run goes on with) into --save, and the run trains on to --train-iters.

What goes over the wire besides training: the trace gather (`runtime.trace.gather_trace`), the
layer timings' all-gather, and one object broadcast from rank 0 per decision; each names itself
when it fails (`runtime.step.run_collective`, the world's --hetero-comm-timeout).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Optional

import torch.distributed as dist

from megatron_hetero.planner import autotune as A
from megatron_hetero.runtime.step import run_collective
from megatron_hetero.runtime.trace import Tracer, gather_trace, recording_tracer
from megatron_hetero.training.autotune_checks import job_on, workload_of
from megatron_hetero.training.autotune_plan import Plan, plan_switch, stay_at_end, stay_because
from megatron_hetero.config.job import Job, JobDraft
from megatron_hetero.training.autotune_layers import measure_layer_cases


def _broadcast(obj: Any, what: str) -> Any:
    """`obj` of rank 0 on every rank (one pickled object over the world)."""
    box = [obj]
    run_collective(
        f"autotune: {what} broadcast from rank 0 over the world", dist.get_rank(), dist.broadcast_object_list, box, 0
    )
    return box[0]


def _window(session, start: int, end: int, stop, log, writers, tracer: Tracer):
    """Iterations [start, end) of `session` traced by `tracer`: (loop outcome, rank 0's trace)."""
    from megatron_hetero.training.loop import run_loop

    out = run_loop(
        session.loop_schedule(),
        session.schedulers,
        session.loop_spec(start, end, final_save=end >= session.job.train_iters),
        session.front,
        stop,
        write=log.write,
        writers=writers,
    )
    doc = gather_trace(tracer)
    tracer.stop()
    return out, doc


def _move(
    holder: list,
    iteration: int,
    draft: JobDraft,
    make_job: Callable[[JobDraft], Job],
    make_session: Callable,
    log,
    step_hook: Optional[Callable],
    tracer=None,
    saved=False,
):
    """The run at `iteration` moved from the session in `holder` (taken out of it: the caller keeps
    no reference, so the old session can be collected) to `draft` (`job_on`: a layout under the
    run's config, resuming the switch checkpoint): a checkpoint of `iteration` under
    --save (unless --save-interval just wrote it, or `saved`: it is the one this session resumed), `session` destroyed (its process groups, then its
    modules, optimizers and the groups' threads and sockets, collected), and the session of the `Job`
    `make_job(draft)` (validated now that the checkpoint exists) resumed from that checkpoint
    (the draft's `config.load`). Collective."""
    import gc

    session = holder.pop()
    old = session.job
    if not saved and not (old.save_interval and iteration % old.save_interval == 0):
        session.front.save(iteration)
    session.destroy()
    del session
    gc.collect()  # the old modules and optimizers hold the destroyed groups until they are collected
    new = make_session(make_job(draft), log, step_hook, tracer=tracer)
    if new.start != iteration:
        new.destroy()
        raise RuntimeError(f"autotune: the checkpoint of iteration {iteration} resumed at iteration {new.start}")
    return new


def train_autotuned(
    start: Job,
    log,
    stop,
    writers,
    make_session: Callable,
    step_hook: Optional[Callable] = None,
    check: Optional[Callable[[JobDraft], Job]] = None,
):
    """Train the validated job `start` from its layout with one autotune round (module docstring);
    returns (the session the run ended on, every iteration's record). `make_session(job, log,
    step_hook, tracer=None)`: the `training.session.Session` of a `Job` (`training.trainer.train_session`,
    or a patched Megatron-LM script's, `megatron_lm/autotune.py`); the rounds use its `start`, `job`,
    `front`, `schedulers`, `loop_schedule()`, `loop_spec(start, end, final_save)` and `destroy()`.
    `check(draft)`: the `Job` of a `JobDraft` (a layout under the run's config, `job_on`), ValueError
    for a candidate layout the run cannot train (default `training.setup.validate_job`); it makes the
    Job of every layout the run moves to. Collective over the world."""
    from megatron_hetero.training.loop import run_loop
    from megatron_hetero.training.setup import validate_job

    make_job = check or validate_job
    layout, job = start.layout, start.config
    tune, rank, world = job.autotune, dist.get_rank(), dist.get_world_size()
    say = (lambda text: log.write(text + "\n")) if (log.write is not None) else (lambda text: None)
    tracer = recording_tracer(rank)
    session = make_session(start, log, step_hook, tracer=tracer)
    records: list[dict[str, Any]] = []
    decisions: list[A.AutotuneRecord] = []
    calibrations: list[dict[str, Any]] = []
    chosen = layout
    try:
        it = session.start
        if it >= job.train_iters:  # resumed at the end: nothing to measure or train
            return session, records
        end = min(it + tune.autotune_steps, job.train_iters)
        out, doc = _window(session, it, end, stop, log, writers, tracer)
        records += out.records
        if out.stopped is not None:
            return session, records
        it = end
        spent: dict[str, float] = {}  # rank 0's seconds per part of the round, into autotune.json
        t0 = time.perf_counter()
        timings = None
        if it < job.train_iters and not tune.autotune_skip_layers:
            wl = workload_of(start)
            timings = measure_layer_cases(wl, wl.micro_batch * wl.images_per_sample)
        spent["layer_timings_s"], t0 = time.perf_counter() - t0, time.perf_counter()
        tried: tuple = ()  # rank 0: (candidate, trace of its window) of the layouts gone back from
        for round_ in range(tune.autotune_rounds):
            plan: Optional[Plan] = None
            if rank == 0:
                if job.train_iters - it < tune.autotune_steps:  # no room to measure a new layout
                    plan = stay_at_end(doc, start, it)
                else:
                    shared = dist.get_backend() == "gloo"  # CPU ranks of one machine share its cores
                    try:
                        plan = plan_switch(doc, start, it, world, timings, shared, tried, make_job)
                    except ValueError as exc:  # the fit or the search refused what it was given: train on
                        plan = stay_because(doc, start, it, f"stay: the cost model could not price this run ({exc})")
            plan = _broadcast(plan, "decision")
            spent[f"decision_s_{round_}"], t0 = time.perf_counter() - t0, time.perf_counter()
            say(f"autotune: {plan.decision.reason}")
            rec = plan.record
            calibrations.append({**plan.calibration, "overhead_s": spent})
            if not (plan.decision.switch and plan.layout is not None):
                decisions.append(rec)
                break
            tracer = recording_tracer(rank)
            holder, session = [session], None
            session = _move(
                holder,
                it,
                job_on(start, plan.layout, workload_of(start), load=job.save),
                make_job,
                make_session,
                log,
                step_hook,
                tracer,
                saved=round_ > 0,  # after a revert: the checkpoint of `it` is the one just resumed
            )
            spent[f"switch_s_{round_}"] = time.perf_counter() - t0
            end = min(it + tune.autotune_steps, job.train_iters)
            out, after_doc = _window(session, it, end, stop, log, writers, tracer)
            records += out.records
            if out.stopped is not None:
                decisions.append(rec)
                return session, records
            after = None
            if rank == 0:
                steps = A.step_times_from_trace(after_doc)
                after = (
                    (steps.drop(1).step_s, steps.drop(1).noise_s) if end - it >= 2 else (steps.step_s, steps.noise_s)
                )
            after = _broadcast(after, "measurement after the switch")
            rec = rec.settle(after[0], math.hypot(plan.noise_s, after[1]))  # the noise of the two medians' difference
            decisions.append(rec)
            calibrations[-1].update(
                chosen_predicted_s=rec.predicted_step_s,
                chosen_measured_s=after[0],
                chosen_noise_s=after[1],
                prediction_error=(rec.predicted_step_s / after[0] - 1.0) if rec.predicted_step_s else None,
            )
            say(rec.line())
            it = end
            if rec.kept:
                chosen = plan.layout
                break
            if it >= job.train_iters:  # not faster, at the last step: the old layout is the one to go on with
                break
            t0 = time.perf_counter()
            holder, session = [session], None
            session = _move(
                holder,
                it,
                job_on(start, layout, workload_of(start), load=job.save),
                make_job,
                make_session,
                log,
                step_hook,
            )
            spent[f"revert_s_{round_}"], t0 = time.perf_counter() - t0, time.perf_counter()
            tried += ((plan.decision.target, after_doc),)
        if rank == 0:
            paths = A.write_autotune(job.save, decisions, chosen, calibration=calibrations)
            say(f"autotune: decisions in {paths['json']}, the layout the run goes on with in {paths['layout']}")
        if it < job.train_iters:
            out = run_loop(
                session.loop_schedule(),
                session.schedulers,
                session.loop_spec(it, job.train_iters),
                session.front,
                stop,
                write=log.write,
                writers=writers,
            )
            records += out.records
        return session, records
    except BaseException:
        if session is not None:
            session.destroy()
        raise

"""What tracing costs: on vs off in the same run (`python -m megatron_hetero.bench.trace_overhead LAYOUT`).

Every rank builds two schedules over the same modules, one recording spans (`runtime.trace.Tracer`)
and one with `NULL_TRACER`, and alternates them step by step (off, on, on, off, ...: each pair's
order is swapped so that neither mode always runs first). A step's wall time is the slowest rank's;
CPU time is summed over the ranks (the tracer's cost is CPU work, and CPU time is less disturbed than
wall time when other processes share the cores). It also reports the recording cost of one span
(best of several repetitions) times the spans per rank and step, as a bound that does not depend on
the noise. The first step of each mode is dropped (warm-up).

    python -m megatron_hetero.bench.trace_overhead LAYOUT.yaml [--steps 40] [--global-batch-size 8] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from typing import Any
from megatron_hetero.runtime.trace import NULL_TRACER, Tracer


def _span_cost_s(reps: int = 5, n: int = 20000) -> float:
    """Best-of-`reps` time of one recorded span minus one null span (the tracer's own cost)."""

    def per_span(tr) -> float:
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(n):
                with tr.span("wait", lambda: "x", lambda: {"a": 1}):
                    pass
            best = min(best, (time.perf_counter() - t0) / n)
        return best

    return max(per_span(Tracer(0)) - per_span(NULL_TRACER), 0.0)


def step_modes(steps: int) -> list[str]:
    """The mode of each step: off, on, on, off, off, on, ... (each pair's order swapped, so that neither
    mode always runs first)."""
    return [(("off", "on") if (it // 2) % 2 == 0 else ("on", "off"))[it % 2] for it in range(steps)]


def _rank(job, steps: int) -> dict[str, Any]:
    import torch.distributed as dist

    from megatron_hetero.runtime.schedules import schedule_for
    from megatron_hetero.training.trainer import prepare_rank, train_session

    prepare_rank(job.config)
    # off: the session `train` builds, untraced; on: a second schedule over the same modules and runner
    session = train_session(job, log=None, tracer=NULL_TRACER)
    try:
        topo, off = session.topo, session.schedule
        tracer = Tracer(topo.rank)
        on = schedule_for(session.plan, replace(off.config, tracer=tracer), topo, session.states, session.runner)
        schedules = {"off": off, "on": on}
        wall: dict[str, list[float]] = {"off": [], "on": []}
        cpu: dict[str, list[float]] = {"off": [], "on": []}
        spans: list[int] = []
        for it, mode in enumerate(step_modes(steps)):
            dist.barrier()
            n0 = len(tracer.spans)
            t0, c0 = time.perf_counter(), time.process_time()
            schedules[mode].step(it)
            wall[mode].append(time.perf_counter() - t0)
            cpu[mode].append(time.process_time() - c0)
            if mode == "on":
                spans.append(len(tracer.spans) - n0)
        dist.barrier()
        return {"wall": wall, "cpu": cpu, "spans": spans, "span_cost_s": _span_cost_s() if topo.rank == 0 else None}
    finally:
        session.destroy()


def measure(job, steps: int = 40, timeout: float = 900.0) -> dict[str, Any]:
    """Fork the ranks of the validated `job` (`config.job.Job`), alternate traced and untraced
    steps, return the comparison."""
    from megatron_hetero.compat import default_backend, require_compat
    from megatron_hetero.runtime.launcher import run_ranks

    require_compat("bench.trace_overhead.measure")
    per_rank = run_ranks(job.layout.world_size, _rank, job, steps, timeout=timeout, backend=default_backend())
    return summarize(per_rank)


def summarize(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The comparison of the ranks' step times (`_rank`'s records): per mode, the steps both modes ran
    (an odd --steps leaves one mode a step more; that step is left out), the first of each dropped."""
    n = min(len(per_rank[0]["wall"][m]) for m in ("off", "on"))
    if n < 2:
        raise ValueError(f"the trace overhead needs two steps of each mode (the first dropped), got {n}: --steps >= 4")
    wall = {m: [max(r["wall"][m][i] for r in per_rank) for i in range(n)][1:] for m in ("off", "on")}
    cpu = {m: [sum(r["cpu"][m][i] for r in per_rank) for i in range(n)][1:] for m in ("off", "on")}
    med = {k: {m: statistics.median(v[m]) for m in v} for k, v in (("wall", wall), ("cpu", cpu))}
    spans = max(max(r["spans"]) for r in per_rank)
    cost = per_rank[0]["span_cost_s"]
    return {
        "steps_per_mode": n - 1,
        "wall_median_ms": {m: v * 1e3 for m, v in med["wall"].items()},
        "wall_overhead": med["wall"]["on"] / med["wall"]["off"] - 1,
        "cpu_median_ms": {m: v * 1e3 for m, v in med["cpu"].items()},
        "cpu_overhead": med["cpu"]["on"] / med["cpu"]["off"] - 1,
        "spans_per_rank_step": spans,
        "span_cost_us": cost * 1e6,
        "span_bound": spans * cost / med["wall"]["off"],
    }


def main(argv=None) -> int:
    from megatron_hetero.layout.yaml_io import load_layout
    from megatron_hetero.config.model import spec_on_layout
    from megatron_hetero.config.job import JobConfig
    from megatron_hetero.training.job import default_micro_batch_size, quiet_upstream_warnings
    from megatron_hetero.training.setup import JobDraft, validate_job

    p = argparse.ArgumentParser(prog="python -m megatron_hetero.bench.trace_overhead")
    p.add_argument("layout")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--out", default=None, help="also write the JSON document to this file")
    args = p.parse_args(argv)
    if args.steps < 4:
        p.error(f"--steps must be >= 4 (two steps per mode, the first of each dropped), got {args.steps}")
    quiet_upstream_warnings()
    from megatron_hetero.compat import apply_compat

    apply_compat()  # this module run as a script is an entry point
    layout = load_layout(args.layout, None)
    job = JobConfig(
        spec=spec_on_layout(layout),
        global_batch_size=args.global_batch_size,
        micro_batch_size=default_micro_batch_size(layout, args.global_batch_size),
        comm_timeout_s=120.0,
    )
    validated = validate_job(JobDraft(layout, job))  # this bench's door: validated once
    text = json.dumps({"layout": args.layout, **measure(validated, args.steps)}, indent=1)
    print(text)
    if args.out:
        from pathlib import Path

        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

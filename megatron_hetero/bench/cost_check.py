"""The cost model against traces, term by term (`python -m megatron_hetero.bench.cost_check`).

For each configuration of the planner benchmark (`bench/planner_configs.py` CONFIGS) at one world
size, the tiny model is trained with tracing on (`runtime/trace.py`, the job's `trace` file) for
`warmup + iters` steps; each rank's spans are cut into steps at its optimizer spans and reduced to
*exclusive* time per kind (a span's time minus the spans nested in it: the colocated boundary's
backward holds the encoder's backward, the language phase holds the micro-batches). Measured terms,
mean over ranks, median over the kept steps:

    compute   encoder-forward/backward + llm-forward/backward (TP and CP collectives run inside)
    boundary  colocated boundary calls
    pipeline  wait + comm: pipeline sends/receives, disjoint communication batches, idle waits
    dp        grad-reduce (+ loss-reduce)
    optimizer optimizer
    other     the step's time outside every span (Python, data, memory snapshots, Megatron's
              schedule bookkeeping)

against the model's (`planner.cost.evaluate`; on a shared-core profile its parts are the mean rank's
busy time): compute + tp_comm + cp_comm, boundary, pp_comm + bubble, dp_comm, optimizer, and 0 for
other. Per term: error = (model - measured) / measured step time (its share of the total's error), and
the mean absolute value over configurations. The profile is measured in the same run (or read from
`--profile`, a `megatron-hetero profile` JSON).

    python -m megatron_hetero.bench.cost_check --world 4 [--iters 3] [--profile P.json] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any, Optional
from megatron_hetero.bench.common import markdown_table
from megatron_hetero.planner import layout_cost as CA
from megatron_hetero.bench import planner_configs as PC
from megatron_hetero.planner.model import workload
from megatron_hetero.training.job import quiet_upstream_warnings

TERMS = ("compute", "boundary", "pipeline", "dp", "optimizer", "other")
MEASURED = {
    "encoder-forward": "compute",
    "encoder-backward": "compute",
    "llm-forward": "compute",
    "llm-backward": "compute",
    "boundary": "boundary",
    "wait": "pipeline",
    "comm": "pipeline",
    "grad-reduce": "dp",
    "loss-reduce": "dp",
    "optimizer": "optimizer",
    "offload": "other",
    "schedule": "other",
}


def exclusive(events: list[dict]) -> list[tuple[float, float, str]]:
    """(start us, exclusive duration us, kind) of one rank's complete events: each span's duration
    minus that of the spans directly nested in it."""
    evs = sorted((e for e in events if e.get("ph") == "X"), key=lambda e: (e["ts"], -e["dur"]))
    child = [0.0] * len(evs)
    stack: list[int] = []
    for i, e in enumerate(evs):
        while stack and evs[stack[-1]]["ts"] + evs[stack[-1]]["dur"] <= e["ts"]:
            stack.pop()
        if stack:
            child[stack[-1]] += e["dur"]
        stack.append(i)
    return [(e["ts"], max(e["dur"] - c, 0.0), e["cat"]) for e, c in zip(evs, child)]


def measured_terms(trace: dict, step_times: list[float], warmup: int) -> dict[str, float]:
    """Per term: the mean over ranks of the exclusive span time per step (s), median over the steps
    after `warmup`; `other` = step time - the traced terms (from `step_times`, the slowest rank's)."""
    steps = len(step_times)
    by_rank: dict[int, list[dict]] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            by_rank.setdefault(e["pid"], []).append(e)
    per_step = [{t: 0.0 for t in TERMS} for _ in range(steps)]
    for events in by_rank.values():
        ends = sorted(e["ts"] + e["dur"] for e in events if e["cat"] == "optimizer")
        if len(ends) % steps:
            raise ValueError(f"{len(ends)} optimizer spans on a rank do not split into {steps} steps")
        k = len(ends) // steps
        cuts = [ends[(s + 1) * k - 1] for s in range(steps)]
        for ts, dur, kind in exclusive(events):
            s = next((i for i, c in enumerate(cuts) if ts < c), None)
            if s is not None and kind in MEASURED:
                per_step[s][MEASURED[kind]] += dur / 1e6 / len(by_rank)
    out = {}
    for t in TERMS[:-1]:
        out[t] = float(statistics.median(p[t] for p in per_step[warmup:]))
    traced = [sum(p[t] for t in TERMS if t != "other") for p in per_step]
    # the untraced rest (it holds the exclusive time of 'schedule' / 'offload' spans too)
    out["other"] = float(statistics.median(max(st - tr, 0.0) for st, tr in zip(step_times[warmup:], traced[warmup:])))
    out["step"] = float(statistics.median(step_times[warmup:]))
    return out


def model_terms(bd) -> dict[str, float]:
    """The cost breakdown's terms grouped as the measured ones (`CostBreakdown`)."""
    return {
        "compute": bd.compute + bd.tp_comm + bd.cp_comm,
        "boundary": bd.boundary,
        "pipeline": bd.pp_comm + bd.bubble,
        "dp": bd.dp_comm,
        "optimizer": bd.optimizer + bd.offload,
        "other": 0.0,
        "step": bd.total,
    }


def traced_run(layout, model, steps: int, micro_batch_size: int, timeout: float = 900.0) -> tuple[dict, list[float]]:
    """Train `steps` steps with tracing on: (merged trace, per-step slowest-rank step times)."""
    import dataclasses

    from megatron_hetero.compat import default_backend
    from megatron_hetero.runtime.launcher import run_ranks
    from megatron_hetero.training.setup import JobDraft, validate_job
    from megatron_hetero.training.trainer import train_rank

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        job = dataclasses.replace(model.job(steps), micro_batch_size=micro_batch_size, trace=path)
        per_rank = run_ranks(
            layout.world_size,
            train_rank,
            validate_job(JobDraft(layout, job)),
            timeout=timeout,
            backend=default_backend(),
        )
        trace = json.loads(Path(path).read_text())
    return trace, [max(r["records"][i]["step_time_s"] for r in per_rank) for i in range(steps)]


def run(world: int, iters: int = 3, warmup: int = 1, profile=None, configs: Optional[list] = None) -> dict[str, Any]:
    """Measure the configurations of `world` with traces, compare term by term (module docstring)."""
    from megatron_hetero.bench import planner as PL
    from megatron_hetero.compat import require_compat
    from megatron_hetero.planner import cost as C
    from megatron_hetero.planner import profile_fit as F
    from megatron_hetero.profiling import run as T

    quiet_upstream_warnings()
    require_compat("bench.cost_check.run")
    model = PC.BenchModel()
    spec = model.spec
    if profile is None:
        profile = F.fit_profile(T.measure(world, PL.bench_grid(), rounds=1, quiet_wait_s=0.0, tries=1))
    rows = []
    for w, doc in configs if configs is not None else PC.CONFIGS:
        if w != world:
            continue
        lay = PC.resolve(doc, w)
        trace, times = traced_run(lay, model, warmup + iters, model.micro_batch_size)
        meas = measured_terms(trace, times, warmup)
        wl = workload(spec, model.global_batch_size, CA.cost_micro_batch(lay, spec, model.micro_batch_size))
        mod = model_terms(C.evaluate(CA.candidate_for(lay, spec), wl, profile))
        rows.append(
            {
                "layout": PC.describe(lay),
                "kind": CA.kind_of(lay, spec),
                "measured": meas,
                "model": mod,
                "error": {t: (mod[t] - meas[t]) / meas["step"] for t in TERMS},
                "total_error": mod["step"] / meas["step"] - 1.0,
            }
        )
    mape = {t: sum(abs(r["error"][t]) for r in rows) / len(rows) for t in TERMS}
    mape["total"] = sum(abs(r["total_error"]) for r in rows) / len(rows)
    return {"world": world, "iters": iters, "warmup": warmup, "rows": rows, "mean_abs_error_share": mape}


def table(doc: dict[str, Any]) -> str:
    head = ["configuration", "step meas/model"] + [f"{t} meas/model" for t in TERMS]
    rows = []
    for r in doc["rows"]:
        m, e = r["measured"], r["model"]
        rows.append(
            [r["layout"], f"{m['step'] * 1e3:.0f}/{e['step'] * 1e3:.0f} ({r['total_error']:+.0%})"]
            + [f"{m[t] * 1e3:.0f}/{e[t] * 1e3:.0f}" for t in TERMS]
        )
    mape = doc["mean_abs_error_share"]
    return (
        markdown_table(head, rows)
        + "\n\nmean |model - measured| / step time per term: "
        + ", ".join(f"{t} {mape[t]:.1%}" for t in TERMS)
        + f"; total MAPE {mape['total']:.1%}"
    )


def main(argv=None) -> int:
    from megatron_hetero.planner.hardware import Profile

    p = argparse.ArgumentParser(prog="python -m megatron_hetero.bench.cost_check")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--profile", default=None, help="a profile JSON (`megatron-hetero profile --out`)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    from megatron_hetero.compat import apply_compat

    quiet_upstream_warnings()
    apply_compat()  # this module run as a script is an entry point
    prof = Profile.load(a.profile) if a.profile else None
    doc = run(a.world, a.iters, profile=prof)
    print(table(doc))
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`megatron-hetero bench zb`: the disjoint schedule's zero-bubble tables (`--hetero-schedule zb`)
against its 1F1B tables, on the layouts of `bench schedule` (chain, join, LLM segments, PP on both
sides).

For each layout both schedules train the same model from the same seed on the same samples, in
alternating runs (1F1B, zb, then zb, 1F1B: `rounds` pairs), `steps` steps each (the first is dropped).
Reported per schedule: the losses of every step (they must be equal: the weight pass computes the same
gradients the joint backward did, `losses_equal` compares them exactly), the step time (median over
kept steps of the slowest rank's step), the measured bubble (1 - sum of compute busy time of the
timing ranks / (makespan x stages), compute = Forward, Backward and WeightGrad spans on the rank at
(tp0, cp0, dp0) of each stage), and the checker's predicted bubble for the same tables with each
module's measured per-pass times (rendezvous mode). Writes DIR/zb.json and DIR/zb.png.

On this runtime a weight pass is a second backward through the stage's graph restricted to its
parameters (`torch.autograd.backward(..., inputs=params)`), so a zb step computes more than a 1F1B
step: it re-runs the backward's non-weight parts, Megatron's TP collectives on that path included.
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import Any


from megatron_hetero.bench.common import bar_plot, markdown_table, write_json
from megatron_hetero.bench.timed_disjoint import run_timed
from megatron_hetero.bench.schedule import CASES
from megatron_hetero.compat import require_compat
from megatron_hetero.layout import layout_from_dict
from megatron_hetero.models.llava import LlavaSpec
from megatron_hetero.plan.rank_plan import step_micro_batching
from megatron_hetero.plan.schedule import build_tables
from megatron_hetero.plan.schedule_check import check_tables
from megatron_hetero.config.optim import OptimConfig
from megatron_hetero.training.setup import JobConfig, validate_job, JobDraft

SCHEDULES = ("1f1b", "zb")


def _one(doc: dict, job: JobConfig, steps: int) -> dict[str, Any]:
    per_rank = run_timed(doc, job, steps)
    timers = {tuple(r["stage"]): r for r in per_rank if r["timer"]}
    bubbles, times, per_pass = [], [], {}
    for it in range(1, steps):
        spans = {st: r["steps"][it]["spans"] for st, r in timers.items()}
        start = min(s[2] for v in spans.values() for s in v)
        end = max(s[3] for v in spans.values() for s in v)
        busy = sum(s[3] - s[2] for v in spans.values() for s in v)
        bubbles.append(1.0 - busy / ((end - start) * len(spans)))
        times.append(max(r["steps"][it]["t1"] - r["steps"][it]["t0"] for r in per_rank))
        for (module, _), v in spans.items():
            for s in v:
                per_pass.setdefault(module, {}).setdefault(s[0], []).append(s[3] - s[2])
    return {
        "losses": [s["loss"] for s in per_rank[0]["steps"]],
        "bubbles": bubbles,
        "step_times_s": times,
        "per_pass_s": {m: {k: statistics.mean(v) for k, v in d.items()} for m, d in per_pass.items()},
    }


def _predicted(layout, micro_batches: int, per_pass: dict, schedule: str) -> float:
    """The checker's bubble of `schedule`'s tables with the measured per-pass times (rendezvous)."""
    costs, frac = {}, 0.0
    for m, d in per_pass.items():
        b = d["B"] + d.get("W", 0.0)
        costs[m] = (d["F"], b)
        if schedule == "zb" and b > 0:
            frac = d.get("W", 0.0) / b  # one split for all modules: the tables carry one fraction
    tables = build_tables(layout, micro_batches, stage_costs=costs, schedule=schedule, weight_fraction=frac)
    return check_tables(tables, layout=layout, mode="rendezvous").bubble_fraction


def run(out_dir: Path, steps: int = 4, rounds: int = 2) -> dict[str, Any]:
    """Every layout of `bench schedule` under both schedules (module docstring); writes zb.json/zb.png."""
    require_compat("bench.zb.run")
    if steps < 2:
        raise ValueError(f"bench zb needs at least 2 steps per run (the first is dropped), got {steps}")
    rows = []
    for name, doc, encoders, layers, gbs, mbs in CASES:
        spec = LlavaSpec(num_layers=layers, encoders=encoders)
        base = JobConfig(
            spec=spec,
            global_batch_size=gbs,
            micro_batch_size=mbs,
            train_iters=steps,
            optim=OptimConfig(optimizer="sgd", lr=0.1),
        )
        layout = layout_from_dict(doc)
        validate_job(JobDraft(layout, base))
        got: dict[str, list[dict[str, Any]]] = {s: [] for s in SCHEDULES}
        for r in range(rounds):
            for s in SCHEDULES if r % 2 == 0 else tuple(reversed(SCHEDULES)):
                got[s].append(_one(doc, dataclasses.replace(base, hetero_schedule=s), steps))
        m = step_micro_batching(layout, gbs, mbs).count
        row: dict[str, Any] = {"case": name, "micro_batches": m}
        for s in SCHEDULES:
            runs = got[s]
            per_pass = {
                mod: {k: statistics.mean(r["per_pass_s"][mod][k] for r in runs) for k in runs[0]["per_pass_s"][mod]}
                for mod in runs[0]["per_pass_s"]
            }
            row[s] = {
                "step_time_s": statistics.median(t for r in runs for t in r["step_times_s"]),
                "measured_bubble": statistics.median(b for r in runs for b in r["bubbles"]),
                "predicted_bubble": _predicted(layout, m, per_pass, s),
                "per_pass_s": per_pass,
                "losses": runs[0]["losses"],
            }
        row["losses_equal"] = all(r["losses"] == got["1f1b"][0]["losses"] for s in SCHEDULES for r in got[s])
        row["zb_over_1f1b_step_time"] = row["zb"]["step_time_s"] / row["1f1b"]["step_time_s"]
        rows.append(row)
    doc_out = {"benchmark": "zb", "steps": steps, "rounds": rounds, "cases": rows}
    write_json(out_dir / "zb.json", doc_out)
    bar_plot(
        out_dir / "zb.png",
        [r["case"] for r in rows],
        {
            "1f1b measured bubble": [r["1f1b"]["measured_bubble"] for r in rows],
            "zb measured bubble": [r["zb"]["measured_bubble"] for r in rows],
            "1f1b predicted": [r["1f1b"]["predicted_bubble"] for r in rows],
            "zb predicted": [r["zb"]["predicted_bubble"] for r in rows],
        },
        "bubble fraction",
        "disjoint schedule: zero-bubble tables vs 1F1B",
    )
    return doc_out


def table(doc: dict[str, Any]) -> str:
    rows = [
        [
            r["case"],
            r["micro_batches"],
            f"{1e3 * r['1f1b']['step_time_s']:.1f}",
            f"{1e3 * r['zb']['step_time_s']:.1f}",
            f"{r['zb_over_1f1b_step_time']:.2f}",
            f"{r['1f1b']['measured_bubble']:.3f} / {r['1f1b']['predicted_bubble']:.3f}",
            f"{r['zb']['measured_bubble']:.3f} / {r['zb']['predicted_bubble']:.3f}",
            "yes" if r["losses_equal"] else "NO",
        ]
        for r in doc["cases"]
    ]
    return markdown_table(
        [
            "case",
            "M",
            "1f1b step ms",
            "zb step ms",
            "zb / 1f1b",
            "1f1b bubble measured / predicted",
            "zb bubble measured / predicted",
            "losses equal",
        ],
        rows,
    )

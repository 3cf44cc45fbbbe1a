"""`megatron-hetero bench schedule`: measured bubble fraction of disjoint runs vs the checker's prediction.

For each layout, the graph-aware 1F1B tables run for a few steps (the first is discarded). Every
Forward and Backward is timed on the rank at (tp0, cp0, dp0) of its stage, against one monotonic
clock shared by the forked ranks. Measured bubble = 1 - sum of stage busy time / (step makespan x
stages). Predicted bubble = the checker's simulation of the same tables with each module's measured
mean forward and backward time per stage (communication at zero cost), so the difference is what
the model leaves out: waiting on the wire and, on a CPU host, ranks sharing its cores.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any


from megatron_hetero.bench.common import bar_plot, markdown_table, write_json
from megatron_hetero.bench.timed_disjoint import run_timed
from megatron_hetero.compat import require_compat
from megatron_hetero.layout import layout_from_dict
from megatron_hetero.models.llava import EncoderSpec, LlavaSpec
from megatron_hetero.plan.schedule import build_tables
from megatron_hetero.plan.schedule_check import check_tables
from megatron_hetero.plan.rank_plan import step_micro_batching
from megatron_hetero.config.optim import OptimConfig
from megatron_hetero.training.setup import JobConfig, validate_job, JobDraft

TWO = {"vision": EncoderSpec(offset=1), "audio": EncoderSpec(tokens=4, feature_dim=12, offset=10)}
# (name, layout document, encoders, language layers, global batch, micro-batch size)
CASES: list[tuple[str, dict, dict, int, int, int]] = [
    (
        "chain: vision@0 -> language PP3@1-3",
        {"placement": "disjoint", "modules": {"vision": {}, "language": {"pp": 3}}, "edges": ["vision -> language"]},
        {"vision": EncoderSpec()},
        3,
        8,
        1,
    ),
    (
        "join: vision@0 + audio@1 -> language PP2@2-3",
        {
            "placement": "disjoint",
            "modules": {"vision": {}, "audio": {}, "language": {"pp": 2}},
            "edges": ["vision -> language", "audio -> language"],
        },
        TWO,
        2,
        8,
        1,
    ),
    (
        "segments: vision@0 -> layers 0-1 @1 -> layers 2-3 PP2@2-3",
        {
            "placement": "disjoint",
            "modules": {"vision": {}, "language_a": {"layers": "0-1"}, "language_b": {"pp": 2, "layers": "2-3"}},
            "edges": ["vision -> language_a", "language_a -> language_b"],
        },
        {"vision": EncoderSpec()},
        4,
        8,
        1,
    ),
    (
        "vision PP2@0-1 -> language PP2@2-3",
        {
            "placement": "disjoint",
            "modules": {"vision": {"pp": 2}, "language": {"pp": 2}},
            "edges": ["vision -> language"],
        },
        {"vision": EncoderSpec()},
        2,
        4,
        1,
    ),
]


def _measure(name: str, doc: dict, encoders: dict, layers: int, gbs: int, mbs: int, steps: int) -> dict[str, Any]:
    require_compat("bench.schedule._measure")
    spec = LlavaSpec(num_layers=layers, encoders=encoders)
    job = JobConfig(
        spec=spec,
        global_batch_size=gbs,
        micro_batch_size=mbs,
        train_iters=steps,
        optim=OptimConfig(optimizer="sgd", lr=0.1),
    )
    layout = layout_from_dict(doc)
    validate_job(JobDraft(layout, job))
    per_rank = run_timed(doc, job, steps)
    timers = {tuple(r["stage"]): r for r in per_rank if r["timer"]}
    measured, fwd, bwd = [], {}, {}
    for it in range(1, steps):  # the first step warms up connections and allocations
        spans = {st: r["steps"][it]["spans"] for st, r in timers.items()}
        start = min(s[2] for v in spans.values() for s in v)
        end = max(s[3] for v in spans.values() for s in v)
        busy = sum(s[3] - s[2] for v in spans.values() for s in v)
        measured.append(1.0 - busy / ((end - start) * len(spans)))
        for (module, _), v in spans.items():
            fwd.setdefault(module, []).extend(s[3] - s[2] for s in v if s[0] == "F")
            bwd.setdefault(module, []).extend(s[3] - s[2] for s in v if s[0] == "B")
    costs = {m: (statistics.mean(fwd[m]), statistics.mean(bwd[m])) for m in fwd}
    micro_batches = step_micro_batching(layout, job.global_batch_size, job.micro_batch_size).count
    tables = build_tables(layout, micro_batches, stage_costs=costs)
    report = check_tables(tables, layout=layout, mode="rendezvous")  # what the runtime's batches do
    buffered = check_tables(tables, layout=layout)  # with sends that never wait
    return {
        "case": name,
        "stages": len(timers),
        "micro_batches": micro_batches,
        "measured_bubble": statistics.median(measured),
        "predicted_bubble": report.bubble_fraction,
        "predicted_bubble_buffered": buffered.bubble_fraction,
        "stage_costs_s": {m: {"forward": f, "backward": b} for m, (f, b) in costs.items()},
    }


def run(out_dir: Path, steps: int = 4) -> dict[str, Any]:
    """Run every case; write schedule.json (+ schedule.png); return the document."""
    rows = [_measure(*case, steps=steps) for case in CASES]
    doc = {"benchmark": "schedule", "steps": steps, "cases": rows}
    write_json(out_dir / "schedule.json", doc)
    bar_plot(
        out_dir / "schedule.png",
        [r["case"] for r in rows],
        {
            "measured bubble": [r["measured_bubble"] for r in rows],
            "checker prediction": [r["predicted_bubble"] for r in rows],
        },
        "bubble fraction",
        "graph-aware 1F1B: measured vs predicted bubble",
    )
    return doc


def table(doc: dict[str, Any]) -> str:
    rows = [
        [
            r["case"],
            r["stages"],
            r["micro_batches"],
            f"{r['measured_bubble']:.3f}",
            f"{r['predicted_bubble']:.3f}",
            f"{r['measured_bubble'] / max(r['predicted_bubble'], 1e-9):.2f}",
        ]
        for r in doc["cases"]
    ]
    return markdown_table(
        ["layout (disjoint)", "stages", "micro-batches", "measured bubble", "predicted bubble", "measured / predicted"],
        rows,
    )

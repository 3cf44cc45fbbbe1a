"""`megatron-hetero bench e2e`: is a step faster with a heterogeneous layout than with the homogeneous
one, and what does the plugin itself cost? Everything measured in one run, in one process tree.

Two workloads of the tiny LLaVA family on WORLD ranks (`WORKLOADS`, `bench/e2e_workloads.py`):
  inherited-tp: the language model's layout is fixed at TP2 (the workload's constraint: on a real
      cluster its parameters and optimizer state would not fit one device; here the constraint is
      imposed on the search space) and the encoder is sizeable (many image tokens); in the
      homogeneous layout the encoder inherits TP2.
  long-context: the language model needs CP2 for its long sequence while the encoder's sequences are
      short. The runtime's encoders take no CP (their sequence is bounded by the image), so the
      homogeneous layout gives the encoder the language model's 2-way model-parallel group as TP.
For each: a profile of the local host is taken in the same run (`profiling.run.measure`, fitted by
`planner.profile_fit`), `planner.search` (restricted to the workload's constraint, runtime layouts only)
picks the best colocated layout other than the homogeneous one and the best disjoint layout (and its
overall pick is reported: `search_best`), and the three layouts are trained side by side
(`side_by_side`): one set of forked ranks builds all three (topologies, models, schedules) and runs
step k of each in turn (order rotated every step), `warmup + iters` steps; `rounds` such runs per
workload, the workloads alternating. A case's step time is the median over its kept steps (all rounds)
of the slowest rank's step; `speedup_per_round` gives the ratio of each round's medians and
`speedup_paired_median` the median over steps of (homogeneous step k / this case's step k), steps that
ran next to each other. Loss equality: every case
trains on the same samples from the same initial weights, so its per-step losses must match the
homogeneous layout's (`loss_max_rel_diff`).

Plugin overhead (`bench/plain_megatron.py`): the inherited-tp workload's homogeneous layout through our
schedule against Megatron-core's own forward-backward function, alternated step by step; `overhead_vs_megatron`
against Megatron-core with the encoder per micro-batch (Megatron-LM's LLaVA), `overhead_vs_megatron_batched`
against Megatron-core with the encoder once per step (our batching: only the plugin's code differs).

Writes DIR/e2e.json and DIR/e2e.png (step time per workload and layout, speed-up labels).
`peak_memory_bytes`: the largest resident state (parameters, gradient buffers, optimizer state) of
any rank in any phase, as the schedules report it (activations not included).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any, Optional

from megatron_hetero.bench.common import markdown_table, save_figure, write_json
from megatron_hetero.planner.layout_cost import candidate_for, cost_micro_batch
from megatron_hetero.bench.planner_configs import describe, resolve
from megatron_hetero.planner import cost as C, profile_fit as F, search as S
from megatron_hetero.planner.model import workload
from megatron_hetero.bench.e2e_workloads import WORLD, E2EWorkload, WORKLOADS, quick_workloads
from megatron_hetero.planner.profile_fit import ProfileGrid
from megatron_hetero.config.job import JobDraft
from megatron_hetero.training.job import quiet_upstream_warnings


def quick_grid():
    return ProfileGrid(
        layer_shapes={"llm": ((64, 4, 32, 1), (64, 4, 64, 2)), "encoder": ((64, 4, 16, 1), (64, 4, 32, 2))},
        module_shapes={"llm": ((64, 4, 32, 2, 128),), "encoder": ((64, 4, 16, 2, 64),)},
        tp=(1, 2),
        cp=(1, 2),
        sizes=(1 << 10, 1 << 16),
        iters=1,
        warmup=1,
        reps=1,
    )


def e2e_grid():
    """The profile grid: shapes around the workloads' (hidden 64, up to 512 tokens per micro-batch)."""

    return ProfileGrid(
        layer_shapes={
            "llm": ((64, 4, 32, 1), (64, 4, 160, 2), (64, 4, 256, 1), (64, 4, 256, 2)),
            "encoder": ((64, 4, 16, 1), (64, 4, 64, 2), (64, 4, 64, 8), (64, 4, 128, 4)),
        },
        module_shapes={
            "llm": ((64, 4, 160, 2, 128), (64, 4, 256, 2, 128)),
            "encoder": ((64, 4, 64, 4, 64), (64, 4, 128, 4, 64)),
        },
        tp=(1, 2, 4),
        cp=(1, 2),
    )


# ---------------------------------------------------------------------------------------------
def _rank_side_by_side(jobs: list, steps: int) -> dict[str, Any]:
    """One rank of `side_by_side`: every validated job's session (`training.trainer.train_session`: topology,
    model and schedule) built on this rank, then `steps` steps of each case's schedule, step by step
    in a rotated order (no loop, no front end: the schedules only)."""
    import torch.distributed as dist

    from megatron_hetero.training.trainer import prepare_rank, train_session

    prepare_rank(jobs[0].config)
    sessions = []
    try:
        for job in jobs:  # every rank builds every case's groups in the same order
            sessions.append(train_session(job, log=None))
        scheds = [s.schedule for s in sessions]
        n = len(jobs)
        out = {"times": [[] for _ in jobs], "losses": [[] for _ in jobs], "peak": [0] * n}
        for it in range(steps):
            for i in [(it + j) % n for j in range(n)]:
                dist.barrier()
                t0 = time.perf_counter()
                res = scheds[i].step(it)
                out["times"][i].append(time.perf_counter() - t0)
                out["losses"][i].append(res.loss)
                for phase in (res.memory or {}).values():
                    out["peak"][i] = max(out["peak"][i], sum(phase.values()))
        dist.barrier()
        return out
    finally:
        for s in reversed(sessions):
            s.destroy()


def side_by_side(cases: list, steps: int, timeout: float = 1800.0) -> list[dict]:
    """Train the `cases` (`config.job.JobDraft`s of the same world size, validated here) in one set of forked ranks, alternating step
    by step (step k of every case, in an order rotated each step), so that every case sees the
    machine in the same periods. Per case: the slowest rank's time per step, the losses, and the
    largest resident state of any rank."""
    from megatron_hetero.compat import default_backend
    from megatron_hetero.runtime.launcher import run_ranks
    from megatron_hetero.training.setup import validate_job

    worlds = {c.layout.world_size for c in cases}
    if len(worlds) != 1:
        raise ValueError(f"side-by-side cases must share one world size, got {sorted(worlds)}")
    jobs = [validate_job(c) for c in cases]
    per_rank = run_ranks(worlds.pop(), _rank_side_by_side, jobs, steps, timeout=timeout, backend=default_backend())
    return [
        {
            "steps_s": [max(r["times"][i][k] for r in per_rank) for k in range(steps)],
            "losses": per_rank[0]["losses"][i],
            "peak_memory_bytes": int(max(r["peak"][i] for r in per_rank)),
        }
        for i in range(len(cases))
    ]


def _picks(w: E2EWorkload, prof) -> dict[str, Any]:
    """The search's best colocated layout other than the homogeneous one (the search ranks that as a
    colocated candidate with equal layouts) and its best disjoint layout for workload `w` under
    profile `prof`; `search_best`: the search's overall pick (it may be the homogeneous layout)."""
    import json

    m = w.model
    wl = workload(m.spec, m.global_batch_size, m.micro_batch_size)
    res = S.search(wl, prof, WORLD, memory_limit=float("inf"), space=w.space(), top=200)
    homo = json.dumps(resolve(w.homogeneous, WORLD).to_dict(), sort_keys=True)
    out: dict[str, Any] = {
        "search_best": res.best.candidate.describe(),
        "search_best_is_homogeneous": json.dumps(res.best.candidate.to_layout().to_dict(), sort_keys=True) == homo,
    }
    for kind in ("colocated", "disjoint"):
        for r in res.ranked:
            lay = r.candidate.to_layout()
            if r.candidate.placement != kind or json.dumps(lay.to_dict(), sort_keys=True) == homo:
                continue
            out[kind] = {
                "layout": lay,
                "mbs": S.train_micro_batch_size(r.candidate, wl),
                "estimate_s": r.breakdown.total,
                "describe": r.candidate.describe(),
            }
            break
    return out


def run(
    out_dir: Path,
    iters: int = 6,
    rounds: int = 3,
    warmup: int = 1,
    overhead_steps: int = 12,
    quick: bool = False,
    profile=None,
    plot: bool = True,
    profile_source: str = "measured in this run",
) -> dict[str, Any]:
    """Profile, search, train every case side by side, measure the plugin overhead; write e2e.json
    (+ e2e.png). quick: smaller models, a small profile grid, one round; `profile`: use this fitted
    profile instead of measuring one (tests)."""
    from megatron_hetero.compat import default_backend, require_compat
    from megatron_hetero.profiling import run as T

    from megatron_hetero.bench import plain_megatron as PM
    from megatron_hetero.training.setup import validate_job

    if iters < 1 or rounds < 1 or warmup < 0 or overhead_steps < 1:
        raise ValueError(
            f"iters, rounds and overhead steps must be >= 1, warmup >= 0; got {iters}, {rounds}, "
            f"{overhead_steps}, {warmup}"
        )
    quiet_upstream_warnings()
    require_compat("bench.e2e.run")
    t_start = time.perf_counter()
    workloads = quick_workloads() if quick else WORKLOADS
    if quick:
        overhead_steps = min(overhead_steps, 2)
    prof_doc = None
    if profile is None:
        # the full run waits for a quiet machine and retries a disturbed profile (up to 3 tries)
        raw = T.measure(
            WORLD,
            quick_grid() if quick else e2e_grid(),
            rounds=1,
            quiet_wait_s=0.0 if quick else 10.0,
            tries=1 if quick else 3,
        )
        profile = F.fit_profile(raw)
        prof_doc = F.profile_document(raw, profile)
    cases: list[dict[str, Any]] = []
    search_best: dict[str, Any] = {}
    for w in workloads:
        spec = w.model.spec
        picks = _picks(w, profile)
        search_best[w.name] = {k: picks.pop(k) for k in ("search_best", "search_best_is_homogeneous")}
        homo = resolve(w.homogeneous, WORLD)
        rows = [("homogeneous", homo, w.model.micro_batch_size, None)]
        for kind in ("colocated", "disjoint"):
            if kind in picks:
                p = picks[kind]
                rows.append((kind, p["layout"], p["mbs"], p["describe"]))
        for kind, lay, mbs, desc in rows:
            wl = workload(
                spec, w.model.global_batch_size, mbs if lay.placement != "disjoint" else _cost_mbs(lay, spec, mbs)
            )
            est = C.evaluate(candidate_for(lay, spec), wl, profile).total
            cases.append(
                {
                    "workload": w.name,
                    "kind": kind,
                    "layout_obj": lay,
                    "mbs": mbs,
                    "search": desc,
                    "estimate_s": est,
                    "model": w.model,
                    "rounds": [],
                }
            )
    # side by side: per workload, its cases in one process tree, alternating step by step; `rounds`
    # such process trees per workload, the workloads interleaved
    for _k in range(1 if quick else rounds):
        for w in workloads:
            mine = [c for c in cases if c["workload"] == w.name]
            jobs = [
                JobDraft(
                    c["layout_obj"], dataclasses.replace(c["model"].job(warmup + iters), micro_batch_size=c["mbs"])
                )
                for c in mine
            ]
            for c, r in zip(mine, side_by_side(jobs, warmup + iters)):
                c["rounds"].append(r)
    home = next(w for w in workloads if w.name == "inherited-tp")
    overhead = PM.measure(
        validate_job(JobDraft(resolve(home.homogeneous, WORLD), home.model.job(1))), steps=overhead_steps
    )
    doc_cases = []
    for c in cases:
        kept = [t for r in c["rounds"] for t in r["steps_s"][warmup:]]
        c["step_time_s"] = float(statistics.median(kept))
        c["round_medians_s"] = [float(statistics.median(r["steps_s"][warmup:])) for r in c["rounds"]]
    for c in cases:
        base = next(b for b in cases if b["workload"] == c["workload"] and b["kind"] == "homogeneous")
        m = c["model"]
        losses, ref = c["rounds"][0]["losses"], base["rounds"][0]["losses"]
        doc_cases.append(
            {
                "workload": c["workload"],
                "kind": c["kind"],
                "layout": describe(c["layout_obj"]),
                "layout_doc": c["layout_obj"].to_dict(),
                "placement": c["layout_obj"].placement,
                "search": c["search"],
                "micro_batch_size": c["mbs"],
                "step_time_s": c["step_time_s"],
                "round_medians_s": c["round_medians_s"],
                "steps_s": [r["steps_s"] for r in c["rounds"]],
                "tokens_per_s": m.global_batch_size * m.spec.seq_length / c["step_time_s"],
                "peak_memory_bytes": max(r["peak_memory_bytes"] for r in c["rounds"]),
                "speedup_vs_homogeneous": base["step_time_s"] / c["step_time_s"],
                "speedup_per_round": [b / t for b, t in zip(base["round_medians_s"], c["round_medians_s"])],
                # step k of this case and of the homogeneous layout ran next to each other: the median of
                # their ratios is the least disturbed by load that changes over time
                "speedup_paired_median": float(
                    statistics.median(
                        hb / tc
                        for rb, rc in zip(base["rounds"], c["rounds"])
                        for hb, tc in zip(rb["steps_s"][warmup:], rc["steps_s"][warmup:])
                    )
                ),
                "estimate_s": c["estimate_s"],
                "losses": losses,
                "loss_max_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(losses, ref)),
            }
        )
    doc = {
        "benchmark": "e2e",
        "backend": default_backend(),
        "world_size": WORLD,
        "quick": quick,
        "iters": iters,
        "warmup": warmup,
        "rounds": 1 if quick else rounds,
        "workloads": {
            w.name: {
                "why": w.why,
                "model": w.model.to_dict(),
                "homogeneous": describe(resolve(w.homogeneous, WORLD)),
                **search_best[w.name],
            }
            for w in workloads
        },
        "cases": doc_cases,
        "overhead_vs_megatron": overhead["overhead_vs_megatron"],
        "overhead_vs_megatron_batched": overhead["overhead_vs_megatron_batched"],
        "overhead": {k: v for k, v in overhead.items() if k != "losses"}
        | {"layout": describe(resolve(home.homogeneous, WORLD)), "workload": home.name},
        "profile_source": profile_source,
        "profile": prof_doc,
        "seconds": time.perf_counter() - t_start,
    }
    write_json(Path(out_dir) / "e2e.json", doc)
    if plot:
        _plot(Path(out_dir) / "e2e.png", doc)
    return doc


def _cost_mbs(layout, spec, mbs: int) -> int:
    return cost_micro_batch(layout, spec, mbs)


def _plot(path: Path, doc: dict[str, Any]) -> Optional[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = list(doc["workloads"])
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 3.6), squeeze=False)
    colours = {"homogeneous": "#888888", "colocated": "#1f77b4", "disjoint": "#ff7f0e"}
    for ax, name in zip(axes[0], names):
        rows = [c for c in doc["cases"] if c["workload"] == name]
        y = list(range(len(rows)))
        ax.barh(y, [c["step_time_s"] * 1e3 for c in rows], color=[colours[c["kind"]] for c in rows])
        ax.set_yticks(y)
        ax.set_yticklabels([f"{c['kind']}\n{c['layout']}" for c in rows], fontsize=7)
        ax.invert_yaxis()
        for i, c in enumerate(rows):
            ax.text(c["step_time_s"] * 1e3, i, f" {c['speedup_vs_homogeneous']:.2f}x", va="center", fontsize=8)
        ax.set_xlabel("step time (ms, median)")
        ax.set_title(f"{name} (world {doc['world_size']})", fontsize=10)
        ax.set_xlim(0, max(c["step_time_s"] for c in rows) * 1e3 * 1.25)
    fig.suptitle(
        f"bench e2e: speed-up vs homogeneous; plugin step / Megatron-core step {doc['overhead_vs_megatron']:.3f} "
        f"(encoder per micro-batch), {doc['overhead_vs_megatron_batched']:.3f} (encoder once per step)",
        fontsize=10,
    )
    return save_figure(fig, path)


def table(doc: dict[str, Any]) -> str:
    rows = [
        [
            c["workload"],
            c["kind"],
            c["layout"],
            f"{c['step_time_s'] * 1e3:.1f} ms",
            f"{c['estimate_s'] * 1e3:.1f} ms",
            f"{c['tokens_per_s']:.0f}",
            f"{c['peak_memory_bytes'] / 2**20:.1f} MiB",
            f"{c['speedup_vs_homogeneous']:.2f}x",
            f"{c['speedup_paired_median']:.2f}x",
            f"{c['loss_max_rel_diff']:.1e}",
        ]
        for c in doc["cases"]
    ]
    text = markdown_table(
        [
            "workload",
            "kind",
            "layout",
            "step (median)",
            "estimate",
            "tokens/s",
            "peak state",
            "speed-up vs homogeneous",
            "paired",
            "loss rel. diff",
        ],
        rows,
    )
    o = doc["overhead"]
    t = o["step_time_s"]
    return (
        text + f"\n\nplugin overhead ({o['layout']}, median of {o['steps']} alternated steps each): ours "
        f"{t['ours'] * 1e3:.1f} ms; Megatron-core, encoder per micro-batch {t['megatron'] * 1e3:.1f} ms "
        f"(ours / it = {doc['overhead_vs_megatron']:.3f}); Megatron-core, encoder once per step "
        f"{t['megatron_batched'] * 1e3:.1f} ms (ours / it = {doc['overhead_vs_megatron_batched']:.3f}; median of "
        f"per-step ratios {o['step_ratio_medians']['megatron_batched']:.3f}; CPU time summed over ranks "
        f"{o['cpu_overhead_vs_megatron_batched']:.3f}); loss rel. diff {o['loss_max_rel_diff']:.1e}"
    )

"""`megatron-hetero bench planner`: the cost model against measured step times on the local host.

One run, one process tree:
  1. a profile is taken (`profiling.run`) at each world size of the benchmark (4 and 8), with
     that many ranks working at once (ranks share the host's cores as they do in training);
  2. each configuration (tiny LLaVA model: colocated heterogeneous, disjoint, and homogeneous, i.e.
     colocated with every module on the language model's layout) is trained for `warmup + iters`
     steps with `training.trainer.train_rank` on forked ranks; the measured step time is the median
     over the last `iters` steps of the slowest rank's step (the first `warmup` are discarded);
  3. the estimate of the same configuration is `planner.cost.evaluate(candidate, workload, profile)`
     with the profile of its world size (`candidate_for` / `planner.model.workload` map the layout
     and the model onto the cost model's `Candidate` and `Workload`);
  4. the search (`planner.search.search`) runs over the space of layouts the runtime accepts at each
     world size; its pick is measured too (if it is not one of the configurations) and compared
     with the fastest measured configuration of that world size.
Reported: per configuration measured / estimated / error, the mean absolute percentage error
(MAPE), and per world size the pick's measured time over the fastest measured time.
Writes planner.json and planner.png (measured vs estimated per configuration).

The machine may be shared with other jobs (another process only ever adds time): every measurement
(profile round, configuration round) is checked for CPU time used outside this process tree and
repeated when disturbed (`profiling.kernels.undisturbed`); with `rounds` > 1 each configuration keeps
its fastest round, as the profile keeps each case's fastest of `profile_rounds`.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_hetero.bench.common import markdown_table, save_figure, write_json
from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.planner import cost as C, profile_fit as F, search as S, search_space as SP
from megatron_hetero.planner.hardware import Profile
from megatron_hetero.planner.layout_cost import candidate_for, cost_micro_batch, kind_of
from megatron_hetero.bench.planner_configs import CONFIGS, WORLDS, BenchModel, describe, resolve
from megatron_hetero.planner.model import workload
from megatron_hetero.planner.profile_fit import ProfileGrid
from megatron_hetero.training.job import quiet_upstream_warnings


# ---------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------
def measure_step(
    layout: HeteroLayout,
    model: BenchModel,
    iters: int,
    warmup: int = 1,
    timeout: float = 600.0,
    micro_batch_size: Optional[int] = None,
) -> dict[str, Any]:
    """Median step time (slowest rank per step) over `iters` steps after `warmup` discarded ones."""
    from megatron_hetero.compat import default_backend
    from megatron_hetero.runtime.launcher import run_ranks
    from megatron_hetero.training.setup import JobDraft, validate_job
    from megatron_hetero.training.trainer import train_rank

    job = model.job(warmup + iters)
    if micro_batch_size is not None:
        job = dataclasses.replace(job, micro_batch_size=micro_batch_size)
    validated = validate_job(JobDraft(layout, job))
    t0 = time.perf_counter()
    per_rank = run_ranks(layout.world_size, train_rank, validated, timeout=timeout, backend=default_backend())
    steps = [max(r["records"][i]["step_time_s"] for r in per_rank) for i in range(job.train_iters)]
    kept = steps[warmup:]
    return {
        "step_s": float(statistics.median(kept)),
        "steps_s": steps,
        "loss": per_rank[0]["records"][-1]["loss"],
        "wall_s": time.perf_counter() - t0,
    }


def bench_grid():
    """The profile grid of the benchmark: the generic grid's shapes around the benchmark model's
    (hidden 32-128, up to 128 tokens per micro-batch), every TP/CP degree and collective."""

    return ProfileGrid(
        layer_shapes={
            "llm": ((64, 4, 32, 1), (64, 4, 32, 4), (128, 4, 64, 2)),
            "encoder": ((32, 4, 8, 1), (32, 4, 8, 8), (64, 4, 16, 4)),
        },
        module_shapes={
            "llm": ((64, 4, 32, 2, 128), (128, 4, 64, 2, 512)),
            "encoder": ((32, 4, 8, 2, 64), (64, 4, 16, 4, 128)),
        },
    )


def runtime_space(world: int, model: BenchModel) -> SP.SearchSpace:
    """The search space of the benchmark: the degrees the tiny model allows, layouts the runtime runs."""
    tps = tuple(t for t in (1, 2, 4, 8) if t <= world and model.spec.num_attention_heads % t == 0)
    return SP.SearchSpace(
        placements=("colocated", "disjoint"),
        tp=tps,
        cp=(1, 2),
        pp=(1, 2, 4),
        encoder_tp=tuple(t for t in tps if model.encoder.num_attention_heads % t == 0),
        encoder_cp=(1,),
        encoder_pp=(1, 2),
        offload=(False,),
        runtime=True,
    )


def _key(layout: HeteroLayout) -> str:
    import json

    return json.dumps(layout.to_dict(), sort_keys=True)


def search_pick(world: int, model: BenchModel, prof: Profile, top: int = 5) -> SP.SearchResult:
    """The search over the runtime's layouts of the benchmark model at `world` ranks."""
    wl = workload(model.spec, model.global_batch_size, model.micro_batch_size)
    return S.search(wl, prof, world, memory_limit=float("inf"), space=runtime_space(world, model), top=top)


def run(
    out_dir: Path,
    iters: int = 6,
    worlds: Sequence[int] = WORLDS,
    configs: Optional[list] = None,
    rounds: int = 3,
    warmup: int = 2,
    grid=None,
    profile_rounds: int = 3,
    model: BenchModel = BenchModel(),
    plot: bool = True,
    quiet_wait_s: float = 10.0,
    retries: int = 3,
) -> dict[str, Any]:
    """Profile, search, measure every configuration, compare; write planner.json (+ planner.png).

    iters: measured steps per configuration and round (after `warmup` discarded ones); rounds: each
    configuration is measured `rounds` times (interleaved with the others) and keeps its fastest
    round; profile_rounds: the same for the profile; retries: re-measurements of a round that
    another process disturbed; grid: the profile grid (default `bench_grid()`)."""
    from megatron_hetero.compat import default_backend, require_compat
    from megatron_hetero.profiling import kernels as P
    from megatron_hetero.profiling import run as T

    if iters < 1 or rounds < 1 or profile_rounds < 1 or warmup < 0 or retries < 0:
        raise ValueError(
            f"iters, rounds and profile_rounds must be >= 1, warmup and retries >= 0; got {iters}, "
            f"{rounds}, {profile_rounds}, {warmup}, {retries}"
        )
    quiet_upstream_warnings()
    require_compat("bench.planner.run")
    t_start = time.perf_counter()
    grid = grid or bench_grid()
    configs = list(CONFIGS if configs is None else configs)
    worlds = sorted({int(w) for w in worlds} | {w for w, _ in configs})
    spec = model.spec
    wl = workload(spec, model.global_batch_size, model.micro_batch_size)
    # 1. profiles (one per world size) and the configurations, measured in alternating rounds so that
    #    both see the machine in the same periods (another job on it adds time to either)
    rows: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    for w, doc in configs:
        lay = resolve(doc, w)
        seen[_key(lay)] = len(rows)
        rows.append(
            {
                "world": w,
                "layout": lay,
                "source": "config",
                "mbs": model.micro_batch_size,
                "rounds_s": [],
                "steps_s": [],
                "external_load": [],
                "tries": [],
            }
        )

    def measure_row(r: dict[str, Any]) -> None:
        P.wait_quiet(quiet_wait_s)
        m, load, tries = P.undisturbed(
            lambda: measure_step(r["layout"], model, iters, warmup, micro_batch_size=r["mbs"]),
            tries=retries + 1,
            quiet_wait_s=quiet_wait_s,
        )
        r["external_load"].append(load)
        r["tries"].append(tries)
        r["rounds_s"].append(m["step_s"])
        r["steps_s"].append(m["steps_s"])
        r["loss"] = m["loss"]

    raws: dict[int, list] = {w: [] for w in worlds}
    for k in range(max(rounds, profile_rounds)):
        if k < profile_rounds:
            for w in worlds:
                raws[w].append(T.measure(w, grid, rounds=1, quiet_wait_s=quiet_wait_s, tries=retries + 1))
        if k < rounds:  # each round starts elsewhere in the list: a slow spell of the machine spreads
            off = k * len(rows) // rounds
            for r in rows[off:] + rows[:off]:
                measure_row(r)
    profiles, profile_docs = {}, {}
    for w in worlds:
        raw = F.combine_rounds(raws[w])
        profiles[w] = F.fit_profile(raw)
        profile_docs[w] = F.profile_document(raw, profiles[w])
    # 2. the search's pick per world size, measured too (now, if it is not a configuration)
    picks = {}
    for w in worlds:
        res = search_pick(w, model, profiles[w])
        lay = res.best.candidate.to_layout()
        k = _key(lay)
        if k not in seen:
            seen[k] = len(rows)
            rows.append(
                {
                    "world": w,
                    "layout": lay,
                    "source": "search pick",
                    "mbs": S.train_micro_batch_size(res.best.candidate, wl),
                    "rounds_s": [],
                    "steps_s": [],
                    "external_load": [],
                    "tries": [],
                }
            )
            for _ in range(rounds):
                measure_row(rows[-1])
        picks[w] = {
            "index": seen[k],
            "describe": res.best.candidate.describe(),
            "estimate_s": res.best.breakdown.total,
            "space_size": res.space_size,
        }
    # 4. estimates
    out_rows = []
    for i, r in enumerate(rows):
        lay = r["layout"]
        cand = candidate_for(lay, spec)
        wl_r = workload(spec, model.global_batch_size, cost_micro_batch(lay, spec, r["mbs"]))
        bd = C.evaluate(cand, wl_r, profiles[r["world"]])
        measured = min(r["rounds_s"])
        out_rows.append(
            {
                "index": i,
                "world": r["world"],
                "kind": kind_of(lay, spec),
                "source": r["source"],
                "layout": describe(lay),
                "layout_doc": lay.to_dict(),
                "candidate": cand.to_dict(),
                "micro_batch_size": r["mbs"],
                "measured_s": measured,
                "rounds_s": r["rounds_s"],
                "steps_s": r["steps_s"],
                "external_load": r["external_load"],
                "tries": r["tries"],
                "estimate_s": bd.total,
                "error": bd.total / measured - 1.0,
                "breakdown": bd.to_dict(),
                "loss": r["loss"],
            }
        )
    errs = [abs(r["error"]) for r in out_rows]
    summary_pick = {}
    for w in worlds:
        mine = [r for r in out_rows if r["world"] == w]
        fastest = min(mine, key=lambda r: r["measured_s"])
        pick = out_rows[picks[w]["index"]]
        summary_pick[str(w)] = {
            **picks[w],
            "measured_s": pick["measured_s"],
            "layout": pick["layout"],
            "fastest_index": fastest["index"],
            "fastest_layout": fastest["layout"],
            "fastest_s": fastest["measured_s"],
            "pick_over_fastest": pick["measured_s"] / fastest["measured_s"] - 1.0,
            "mape": sum(abs(r["error"]) for r in mine) / len(mine),
        }
    doc = {
        "benchmark": "planner",
        "backend": default_backend(),
        "worlds": list(worlds),
        "model": model.to_dict(),
        "iters": iters,
        "warmup": warmup,
        "rounds": rounds,
        "profile_rounds": profile_rounds,
        "configurations": out_rows,
        "mape": sum(errs) / len(errs),
        "max_abs_error": max(errs),
        **round_noise(out_rows),
        "picks": summary_pick,
        "profiles": {str(w): profile_docs[w] for w in worlds},
        "seconds": time.perf_counter() - t_start,
    }
    write_json(Path(out_dir) / "planner.json", doc)
    if plot:
        _plot(Path(out_dir) / "planner.png", doc)
    return doc


def round_noise(rows: list[dict[str, Any]]) -> dict[str, Optional[float]]:
    """How far the measurements themselves move: `round_mape`, the mean over configurations and
    rounds of |round / kept - 1| (what an exact model would score against one round), and
    `round_spread`, the median over configurations of slowest round / fastest round - 1 (None with
    one round)."""
    rounds = [r["rounds_s"] for r in rows if len(r["rounds_s"]) > 1]
    if not rounds:
        return {"round_mape": None, "round_spread": None}
    dev = [abs(x / min(rs) - 1.0) for rs in rounds for x in rs]
    return {
        "round_mape": sum(dev) / len(dev),
        "round_spread": statistics.median(max(rs) / min(rs) - 1.0 for rs in rounds),
    }


def _plot(path: Path, doc: dict[str, Any]) -> Optional[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = doc["configurations"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 0.32 * len(rows) + 2), gridspec_kw={"width_ratios": [3, 2]})
    labels = [f"W{r['world']} {r['kind'][:4]} {r['layout']}" for r in rows]
    y = list(range(len(rows)))
    ax.barh([v - 0.2 for v in y], [r["measured_s"] * 1e3 for r in rows], height=0.4, label="measured (median step)")
    ax.barh([v + 0.2 for v in y], [r["estimate_s"] * 1e3 for r in rows], height=0.4, label="estimate (cost model)")
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("step time (ms)")
    ax.legend(fontsize=8)
    ax.set_title(f"planner: MAPE {doc['mape']:.1%} over {len(rows)} configurations")
    lim = max(max(r["measured_s"], r["estimate_s"]) for r in rows) * 1e3 * 1.05
    for w in doc["worlds"]:
        sel = [r for r in rows if r["world"] == w]
        bx.scatter([r["measured_s"] * 1e3 for r in sel], [r["estimate_s"] * 1e3 for r in sel], label=f"world {w}", s=18)
    bx.plot([0, lim], [0, lim], "k--", lw=0.8)
    bx.plot([0, lim], [0, lim * 1.1], "k:", lw=0.6)
    bx.plot([0, lim], [0, lim * 0.9], "k:", lw=0.6)
    bx.set_xlim(0, lim)
    bx.set_ylim(0, lim)
    bx.set_xlabel("measured (ms)")
    bx.set_ylabel("estimated (ms)")
    bx.legend(fontsize=8)
    return save_figure(fig, path)


def table(doc: dict[str, Any]) -> str:
    rows = [
        [
            r["world"],
            r["kind"] + (" (search pick)" if r["source"] == "search pick" else ""),
            r["layout"],
            f"{r['measured_s'] * 1e3:.1f} ms",
            f"{r['estimate_s'] * 1e3:.1f} ms",
            f"{r['error']:+.1%}",
        ]
        for r in doc["configurations"]
    ]
    text = markdown_table(["world", "kind", "configuration", "measured", "estimate", "error"], rows)
    lines = [
        text,
        "",
        f"MAPE over {len(doc['configurations'])} configurations: {doc['mape']:.1%} "
        f"(largest |error| {doc['max_abs_error']:.1%})",
    ]
    if doc.get("round_mape") is not None:
        lines.append(
            f"measurement noise: a round against the kept (fastest) round {doc['round_mape']:.1%} on average; "
            f"slowest / fastest round - 1, median over configurations {doc['round_spread']:.1%}"
        )
    for w, p in doc["picks"].items():
        lines.append(
            f"world {w}: MAPE {p['mape']:.1%}; search pick {p['describe']} measured "
            f"{p['measured_s'] * 1e3:.1f} ms; fastest measured {p['fastest_layout']} {p['fastest_s'] * 1e3:.1f} ms; "
            f"pick / fastest - 1 = {p['pick_over_fastest']:+.1%}"
        )
    return "\n".join(lines)

"""`megatron-hetero bench soak`: does a long run leak? Resident memory, process groups, threads and open
file descriptors of every rank over N training steps (default 300) at world 8, for a heterogeneous
colocated layout and a disjoint one (fork launcher, gloo, the tiny default model, Adam).

Every rank samples itself after chosen steps (the trainer's `step_hook`): RSS from /proc/self/statm,
live process groups (torch.distributed's registry of this process: the world group and every group
Megatron-core and the topology created), threads (/proc/self/task) and open file descriptors
(/proc/self/fd). Pass: on every rank, RSS after the last step is less than 2% above RSS after step
`warmup` (default 50: allocator pools, optimizer state and gloo buffers are in place by then), and the
counts at every sample from step `warmup` on equal those after step `warmup`. `run` writes OUT/soak.json and
returns the document; `passed(doc)` says whether every layout passed (the CLI exits 1 when not).
"""

from __future__ import annotations

import gc
import os
import threading
from pathlib import Path
from typing import Any, Optional

from megatron_hetero.bench.common import markdown_table, write_json

WORLD = 8
MAX_RSS_GROWTH = 0.02
# name -> layout document at world 8 (heterogeneous: each module its own TP/DP/PP)
LAYOUTS: dict[str, dict] = {
    "colocated: vision DP8, language TP2 DP4 (all 8 ranks)": {
        "placement": "colocated",
        "modules": {"vision": {"dp": 8}, "language": {"tp": 2, "dp": 4}},
        "edges": ["vision -> language"],
    },
    "disjoint: vision DP4 @0-3 -> language TP2 PP2 @4-7": {
        "placement": "disjoint",
        "modules": {"vision": {"dp": 4}, "language": {"tp": 2, "pp": 2}},
        "edges": ["vision -> language"],
    },
}


def sample_steps(steps: int, warmup: int, points: int = 4) -> list[int]:
    """Step 1, `warmup`, `points` evenly spaced steps after it, and the last step."""
    if not 1 <= warmup < steps:
        raise ValueError(f"warm-up step {warmup} must be in [1, steps) with steps={steps}")
    between = [warmup + (steps - warmup) * k // (points + 1) for k in range(1, points + 1)]
    return sorted({1, warmup, *between, steps})


def probe() -> dict[str, int]:
    """This process now: RSS bytes, live process groups, threads, open file descriptors."""
    import torch.distributed as dist

    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = len(world.pg_map) if world is not None else -1  # torch's registry of live groups
    fds: dict[str, int] = {}  # by kind (socket, pipe, anon_inode, a path), to tell which kind changed
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
        kind = target.split(":")[0] if ":" in target and not target.startswith("/") else target
        fds[kind] = fds.get(kind, 0) + 1
    return {
        "rss_bytes": rss,
        "process_groups": groups,
        "threads": len(os.listdir("/proc/self/task")),
        "python_threads": threading.active_count(),
        "open_fds": sum(fds.values()),
        "fds_by_kind": fds,
    }


class _Prober:
    """The step hook: a probe after each step of `at`, None otherwise (picklable: forked into ranks)."""

    def __init__(self, at: list[int]) -> None:
        self.at = set(at)

    def __call__(self, iteration: int) -> Optional[dict[str, int]]:
        return probe() if iteration in self.at else None


def run_layout(doc: dict, steps: int, warmup: int, world: int = WORLD, timeout: float = 3600.0) -> dict[str, Any]:
    """Train `steps` steps of `doc` on `world` forked ranks; the samples by rank and the verdict."""
    import time

    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.runtime.launcher import run_ranks
    from megatron_hetero.training.job import default_micro_batch_size, quiet_upstream_warnings
    from megatron_hetero.training.setup import JobConfig, JobDraft, validate_job
    from megatron_hetero.training.trainer import train_rank

    quiet_upstream_warnings()
    layout = layout_from_dict(doc, world_size=world)
    job = JobConfig(train_iters=steps, micro_batch_size=default_micro_batch_size(layout, JobConfig.global_batch_size))
    validated = validate_job(JobDraft(layout, job))
    at = sample_steps(steps, warmup)
    # garbage of an earlier run in this process (its pipes) would be inherited by the forked ranks and
    # closed there by a later collection, showing as fewer descriptors: collect it before forking
    gc.collect()
    t0 = time.perf_counter()
    per_rank = run_ranks(world, train_rank, validated, timeout=timeout, step_hook=_Prober(at))
    wall = time.perf_counter() - t0
    ranks = [
        rank_summary(rank, {r["iteration"]: r["probe"] for r in res["records"] if r.get("probe")}, warmup, steps)
        for rank, res in enumerate(per_rank)
    ]
    losses = [r["loss"] for r in per_rank[0]["records"]]
    return {
        "steps": steps,
        "warmup": warmup,
        "world": world,
        "sampled_steps": at,
        "wall_s": wall,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "ranks": ranks,
        "max_rss_growth": max(r["rss_growth"] for r in ranks),
        "passed": all(r["passed"] for r in ranks),
    }


def rank_summary(rank: int, samples: dict[int, dict], warmup: int, steps: int) -> dict[str, Any]:
    """One rank's verdict: RSS growth from step `warmup` to step `steps` below MAX_RSS_GROWTH, process
    groups and threads the same at every sample from `warmup` on, and open descriptors never above
    their count at `warmup` (a leak grows; one closed, as a CI run once saw on one rank at its last
    step, is not a leak: `counts_constant` still says whether every count stayed the same)."""
    warm, end = samples[warmup], samples[steps]
    growth = (end["rss_bytes"] - warm["rss_bytes"]) / warm["rss_bytes"]
    later = [s for it, s in samples.items() if it >= warmup]
    same = all(s[k] == warm[k] for s in later for k in ("process_groups", "threads", "python_threads"))
    fds_held = all(s["open_fds"] <= warm["open_fds"] for s in later)
    constant = same and all(s["open_fds"] == warm["open_fds"] for s in later)
    return {
        "rank": rank,
        "samples": {str(k): v for k, v in sorted(samples.items())},
        "rss_growth": growth,
        "counts_constant": constant,
        "passed": growth < MAX_RSS_GROWTH and same and fds_held,
    }


def run(
    out: Path, steps: int = 300, warmup: int = 50, world: int = WORLD, layouts: Optional[dict[str, dict]] = None
) -> dict[str, Any]:
    """Every layout of `layouts` (default LAYOUTS) for `steps` steps; writes OUT/soak.json."""
    from megatron_hetero.compat import require_compat

    require_compat("bench.soak.run")
    doc = {
        "benchmark": "soak",
        "max_rss_growth_allowed": MAX_RSS_GROWTH,
        "layouts": {name: run_layout(d, steps, warmup, world) for name, d in (layouts or LAYOUTS).items()},
    }
    doc["passed"] = all(v["passed"] for v in doc["layouts"].values())
    write_json(Path(out) / "soak.json", doc)
    return doc


def passed(doc: dict[str, Any]) -> bool:
    return bool(doc.get("passed"))


def table(doc: dict[str, Any]) -> str:
    """Per layout: one row per rank with RSS at the warm-up step and at the end, growth, and the counts."""
    parts = []
    for name, lay in doc["layouts"].items():
        w, e = str(lay["warmup"]), str(lay["steps"])
        rows = []
        for r in lay["ranks"]:
            a, b = r["samples"][w], r["samples"][e]
            rows.append(
                [
                    r["rank"],
                    f"{a['rss_bytes'] / 2**20:.1f}",
                    f"{b['rss_bytes'] / 2**20:.1f}",
                    f"{100 * r['rss_growth']:+.2f}%",
                    f"{a['process_groups']} -> {b['process_groups']}",
                    f"{a['threads']} -> {b['threads']}",
                    f"{a['open_fds']} -> {b['open_fds']}",
                    "ok" if r["counts_constant"] else "CHANGED",
                ]
            )
        verdict = "PASS" if lay["passed"] else "FAIL"
        parts.append(
            f"{name}: {lay['steps']} steps at world {lay['world']} in {lay['wall_s']:.0f} s, loss "
            f"{lay['first_loss']:.3f} -> {lay['last_loss']:.3f}; max RSS growth after step {w}: "
            f"{100 * lay['max_rss_growth']:+.2f}% (limit {100 * doc['max_rss_growth_allowed']:.0f}%): "
            f"{verdict}\n"
            + markdown_table(
                ["rank", f"RSS MiB @{w}", f"RSS MiB @{e}", "growth", "process groups", "threads", "open fds", "counts"],
                rows,
            )
        )
    return "\n\n".join(parts)

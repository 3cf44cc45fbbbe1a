"""`search --segments`: the heteropipe DP against brute force over every configuration (layer cuts x
per-segment TP/DP), on the problems `search --segments N` builds (planner/segments.py) for train's
model with more layers, on the h100_80gb preset. For each (layers, ranks, segments): each one's
choice, its predicted step, and the wall time of each. Writes docs/img/segments_dp.png and prints
the markdown table of docs/planner.md.

    PYTHONPATH=. python scripts/segments_vs_brute.py [--out docs/img/segments_dp.png]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import search_reference as R  # noqa: E402

from megatron_hetero import cli  # noqa: E402
from megatron_hetero.cli import search as cli_search  # noqa: E402
from megatron_hetero.planner.hardware import Profile  # noqa: E402
from megatron_hetero.planner.hardware_presets import load_hardware  # noqa: E402
from megatron_hetero.planner.heteropipe import enumerate_pipelines  # noqa: E402
from megatron_hetero.planner.segments import plan_segments, segments_problems  # noqa: E402

CASES = [(8, 4, 2), (12, 8, 2), (16, 8, 3), (24, 8, 3), (32, 16, 3)]


def one(layers: int, world: int, segments: int, prof: Profile) -> dict:
    args = cli.build_parser().parse_args(
        ["search", "--world-size", str(world), "--num-layers", str(layers), "--global-batch-size", "64"]
    )
    wl = cli_search.workload_from_args(args)
    problems = segments_problems(wl, prof, world, segments)
    t0 = time.perf_counter()
    _, plan = plan_segments(problems)
    dp_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    best, confs = None, 0
    for p in problems:
        confs += sum(1 for _ in enumerate_pipelines(p.num_layers, p.world_size, p.num_segments, p.strategies))
        try:
            ref = R.heteropipe_brute_force(
                p.num_layers, p.world_size, p.num_segments, p.strategies, p.stage_cost, p.num_microbatches
            )
        except ValueError:
            continue
        if best is None or ref.objective < best.objective:
            best = ref
    bf_s = time.perf_counter() - t0
    assert best is not None and abs(plan.objective - best.objective) <= 1e-12 * best.objective, (plan, best)
    return {
        "case": f"L{layers} W{world} S{segments}",
        "configurations": confs,
        "dp": plan.describe().replace(" | ", "; "),
        "brute": best.describe().replace(" | ", "; "),
        "step_ms": plan.objective * 1e3,
        "dp_s": dp_s,
        "brute_s": bf_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/img/segments_dp.png")
    a = ap.parse_args()
    prof = Profile.from_hardware(load_hardware("h100_80gb"))
    rows = [one(*c, prof) for c in CASES]
    print(
        "| layers, ranks, segments | configurations | DP's choice | brute force's choice | step (ms) | DP (s) | brute force (s) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['case']} | {r['configurations']:,} | {r['dp']} | {r['brute']} | {r['step_ms']:.3f} | "
            f"{r['dp_s']:.3f} | {r['brute_s']:.3f} |"
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["dp_s"] for r in rows], 0.4, label="heteropipe DP")
    ax.bar([i + 0.2 for i in x], [r["brute_s"] for r in rows], 0.4, label="brute force")
    ax.set_yscale("log")
    ax.set_xticks(list(x), [f"{r['case']}\n{r['configurations']:,} conf." for r in rows], fontsize=8)
    ax.set_ylabel("wall time (s)")
    ax.set_title("search --segments: the same optimum in every case (h100_80gb preset)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"(figure: {a.out})")


if __name__ == "__main__":
    main()

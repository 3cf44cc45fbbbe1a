"""Draw the package's floors (docs/architecture.md) as docs/img/floors.png.

    python scripts/draw_floors.py [--out docs/img/floors.png]

Each floor imports only the floors below it (tests/test_imports.py checks it); compat/ stands beside
them. Needs matplotlib (the `bench` extra).
"""

from __future__ import annotations

import argparse
from pathlib import Path

# top to bottom: (folders, what they hold, pure?)
FLOORS = [
    ("cli/   bench/", "one file per `megatron-hetero` subcommand; the benchmarks", False),
    ("report/", "plan report (text, JSON), rank-map / schedule / timeline drawings", False),
    ("megatron_lm/", "driver of Megatron-LM's pretrain_vlm.py / pretrain_gpt.py", False),
    (
        "training/  checkpoint/\nlaunch/  convert/\nprofiling/",
        "the loop (trainer, job, lr schedule, logs, signals); checkpoints, safe unpickling,\n"
        "pretrained weights; torchrun/srun rank env, SLURM sbatch; Hugging Face weights\n"
        "in/out; the `profile` measurement",
        False,
    ),
    ("models/", "LLaVA-style model from Megatron-core parts, CLIP encoder, data, stage runners, HF names", False),
    (
        "runtime/",
        "topology on HyperCommGrid, boundary autograd op, wire, colocated / disjoint schedules,\n"
        "module state, fork launcher, trace, faults, offload",
        False,
    ),
    ("planner/", "cost model + terms, hardware presets, workload, heteropipe DP, profile fit, search", True),
    ("plan/", "per-rank plans: batch, blocks, placement, boundary, route, schedule tables + check, roles", True),
    ("layout/", "YAML file or --hetero-* flags  ->  validated HeteroLayout", True),
]


def draw(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    n = len(FLOORS)
    h, gap, width, left = 0.86, 0.22, 10.0, 3.1
    fig, ax = plt.subplots(figsize=(12.5, 8.6))
    top = n * (h + gap)
    for i, (name, what, pure) in enumerate(FLOORS):
        y = top - (i + 1) * (h + gap)
        face = "#dbe9f6" if pure else "#f6e7d2"
        ax.add_patch(
            FancyBboxPatch(
                (0, y),
                width,
                h,
                boxstyle="round,pad=0.02,rounding_size=0.08",
                facecolor=face,
                edgecolor="#333333",
                linewidth=1.0,
            )
        )
        ax.text(
            0.15,
            y + h / 2,
            name,
            va="center",
            ha="left",
            fontsize=10.5 if "\n" in name else 11,
            fontweight="bold",
            family="monospace",
            linespacing=1.1,
        )
        ax.text(left, y + h / 2, what, va="center", ha="left", fontsize=8.5, color="#222222", linespacing=1.15)
        if i < n - 1:
            ax.add_patch(
                FancyArrowPatch(
                    (width * 0.5, y - 0.01),
                    (width * 0.5, y - gap + 0.01),
                    arrowstyle="-|>",
                    mutation_scale=10,
                    color="#555555",
                )
            )
    # compat beside the floors it serves (runtime up to megatron_lm)
    lo = top - 6 * (h + gap)
    hi = top - 2 * (h + gap) - gap
    ax.add_patch(
        FancyBboxPatch(
            (width + 0.35, lo),
            1.55,
            hi - lo,
            boxstyle="round,pad=0.02,rounding_size=0.08",
            facecolor="#e4f2dc",
            edgecolor="#333333",
            linewidth=1.0,
        )
    )
    ax.text(
        width + 1.125,
        (lo + hi) / 2,
        "compat/\n\nMegatron-core\non CPU / gloo;\nno CUDA calls\noutside it",
        va="center",
        ha="center",
        fontsize=9,
        family="monospace",
    )
    ax.text(
        0,
        top + 0.12,
        "imports point down: a floor uses only the floors below it (tests/test_imports.py)",
        fontsize=9.5,
        color="#444444",
    )
    ax.text(
        0,
        -0.25,
        "blue: pure (no torch.distributed; a 1024-rank plan is computed on a laptop)   sand: side effects",
        fontsize=8.5,
        color="#444444",
        va="top",
    )
    ax.set_xlim(-0.2, width + 2.1)
    ax.set_ylim(-0.6, top + 0.45)
    ax.axis("off")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "docs" / "img" / "floors.png")
    draw(p.parse_args().out)


if __name__ == "__main__":
    main()

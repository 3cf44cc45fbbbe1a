"""Plot the main job (scripts/llava_digits.sh): training loss of both stages and stage 2's held-out
answer accuracy, from the runs' --log-jsonl files; writes a PNG and a JSON summary. Stage 2 starts
from stage 1's weights at its own iteration 0 (--pretrained-checkpoint); the plot puts it after stage 1.

    python scripts/plot_llava_digits.py bench-results/llava-digits --out docs/benchmarks/llava_digits
Needs matplotlib (the `bench` extra).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", type=Path, help="the output folder of scripts/llava_digits.sh")
    ap.add_argument("--out", type=Path, required=True, help="output path without suffix (.png and .json)")
    a = ap.parse_args()
    s1, s2 = load(a.run / "stage1.jsonl"), load(a.run / "stage2.jsonl")
    shift = len(s1) if s2 and s2[0]["iteration"] == 1 else 0  # stage 2 counts from 0 (--finetune)
    wall = json.loads((a.run / "wall.json").read_text()) if (a.run / "wall.json").exists() else {}
    evals = [
        {
            "stage": st,
            "iteration": r["iteration"],
            "eval_loss": r["eval_loss"],
            "eval_accuracy": r["eval_accuracy"],
            "accuracy": r.get("eval_accuracy_name", "caption accuracy"),
        }
        for st, recs in ((1, s1), (2, s2))
        for r in recs
        if "eval_loss" in r
    ]
    summary = {
        "job": "LLaVA-style two-stage run on the digits (scripts/llava_digits.sh): 4 CPU ranks, colocated, "
        "vision DP4 (frozen trunk), language TP2·DP2; stage 1 projector only on captions, stage 2 projector + "
        "LLM on conversations (variable image tiles)",
        "stage1_iterations": len(s1),
        "stage2_iterations": len(s2),
        "loss": {"first": s1[0]["loss"], "end_of_stage1": s1[-1]["loss"], "last": s2[-1]["loss"]},
        "evaluations": evals,
        "final_heldout_accuracy": evals[-1]["eval_accuracy"],
        "final_heldout_loss": evals[-1]["eval_loss"],
        "mean_step_time_s": {
            "stage1": sum(r["step_time_s"] for r in s1) / len(s1),
            "stage2": sum(r["step_time_s"] for r in s2) / len(s2),
        },
        "wall_time_s": wall,
        "train_loss": [[r["iteration"], r["loss"]] for r in s1 + s2],
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({k: v for k, v in summary.items() if k != "train_loss"}, indent=1)
    rows = ",\n  ".join(json.dumps([i, round(x, 6)]) for i, x in summary["train_loss"])
    a.out.with_suffix(".json").write_text(text[:-2] + ',\n "train_loss": [\n  ' + rows + "\n ]\n}\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    ax.plot(
        [r["iteration"] for r in s1],
        [r["loss"] for r in s1],
        color="tab:gray",
        lw=1,
        label="train loss, stage 1 (projector only)",
    )
    ax.plot(
        [r["iteration"] + shift for r in s2],
        [r["loss"] for r in s2],
        color="tab:blue",
        lw=1,
        label="train loss, stage 2 (projector + LLM)",
    )
    at = [e["iteration"] + (shift if e["stage"] == 2 else 0) for e in evals]
    ax.plot(
        at,
        [e["eval_loss"] for e in evals],
        "o--",
        color="tab:blue",
        ms=3,
        label="held-out loss",
    )
    ax.set_yscale("log")
    ax.set_xlabel("iteration (stage 1, then stage 2)")
    ax.set_ylabel("loss per loss token")
    ax.axvspan(0, len(s1), color="0.9")
    ax2 = ax.twinx()
    ax2.plot(
        at,
        [100 * (e["eval_accuracy"] or 0.0) for e in evals],
        "s-",
        color="tab:red",
        ms=4,
        label=f"held-out {evals[-1]['accuracy']}",
    )
    ax2.axhline(10, color="tab:red", lw=0.6, ls=":")
    ax2.set_ylim(0, 100)
    ax2.set_ylabel(f"held-out {evals[-1]['accuracy']} (%)", color="tab:red")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="center right", fontsize=8)
    ax.set_title("LLaVA-style run on the digits: vision DP4 + language TP2·DP2 (colocated, 4 CPU ranks)", fontsize=9)
    fig.tight_layout()
    fig.savefig(a.out.with_suffix(".png"), dpi=110)
    print(
        f"wrote {a.out.with_suffix('.png')} and {a.out.with_suffix('.json')}: final held-out accuracy "
        f"{summary['final_heldout_accuracy']:.3f}"
    )


if __name__ == "__main__":
    main()

"""Plot the Qwen2.5-VL digits run (scripts/qwen_vl_digits.sh): training loss, held-out loss and held-out
caption accuracy from its --log-jsonl file; writes a PNG and a JSON summary.

    python scripts/plot_qwen_vl_digits.py bench-results/qwen-vl-digits --out docs/benchmarks/qwen_vl_digits_600
Needs matplotlib (the `bench` extra).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", type=Path, help="the output folder of scripts/qwen_vl_digits.sh")
    ap.add_argument("--out", type=Path, required=True, help="output path without suffix (.png and .json)")
    a = ap.parse_args()
    recs = [json.loads(x) for x in (a.run / "qwen.jsonl").read_text().splitlines() if x.strip()]
    train = [r for r in recs if "loss" in r and "eval_loss" not in r]
    evals = [r for r in recs if "eval_loss" in r]
    wall = json.loads((a.run / "wall.json").read_text()) if (a.run / "wall.json").exists() else {}
    summary = {
        "job": "Qwen2.5-VL tower + M-RoPE language model on the digits captions (scripts/qwen_vl_digits.sh): "
        "2 CPU ranks, colocated, vision DP2, language TP2, from scratch",
        "iterations": len(train),
        "loss": {"first": train[0]["loss"], "last": train[-1]["loss"]},
        "evaluations": [
            {"iteration": r["iteration"], "eval_loss": r["eval_loss"], "eval_accuracy": r["eval_accuracy"]}
            for r in evals
        ],
        "final_heldout_accuracy": evals[-1]["eval_accuracy"],
        "final_heldout_loss": evals[-1]["eval_loss"],
        "mean_step_time_s": sum(r["step_time_s"] for r in train) / len(train),
        "wall_time_s": wall,
        "train_loss": [[r["iteration"], round(r["loss"], 6)] for r in train],
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    ax.plot([r["iteration"] for r in train], [r["loss"] for r in train], color="tab:blue", lw=1, label="train loss")
    at = [r["iteration"] for r in evals]
    ax.plot(at, [r["eval_loss"] for r in evals], "o--", color="tab:blue", ms=3, label="held-out loss")
    ax.set_yscale("log")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss per loss token")
    ax2 = ax.twinx()
    ax2.plot(
        at,
        [100 * (r["eval_accuracy"] or 0.0) for r in evals],
        "s-",
        color="tab:red",
        ms=4,
        label="held-out caption accuracy",
    )
    ax2.axhline(10, color="tab:red", lw=0.6, ls=":")
    ax2.set_ylim(0, 100)
    ax2.set_ylabel("held-out caption accuracy (%)", color="tab:red")
    h1, h2 = ax.get_legend_handles_labels(), ax2.get_legend_handles_labels()
    ax.legend(h1[0] + h2[0], h1[1] + h2[1], loc="center right", fontsize=8)
    ax.set_title(
        "Qwen2.5-VL tower + M-RoPE LM on the digits: vision DP2 + language TP2 (colocated, 2 CPU ranks)", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(a.out.with_suffix(".png"), dpi=110)
    print(f"wrote {a.out.with_suffix('.png')}: final held-out accuracy {summary['final_heldout_accuracy']:.3f}")


if __name__ == "__main__":
    main()

"""Plot the audio-visual run (scripts/audio_visual.sh): training loss and the held-out accuracy of
each modality (digit shown, digit said) and of whole answers, from the run's --log-jsonl; writes a
PNG and a JSON summary.

    python scripts/plot_audio_visual.py bench-results/audio-visual/run.jsonl --out docs/benchmarks/audio_visual
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
    ap.add_argument("log", type=Path, help="the run's --log-jsonl file")
    ap.add_argument("--out", type=Path, required=True, help="output path without suffix (.png and .json)")
    ap.add_argument("--job", default="", help="a line that says what ran (kept in the JSON)")
    a = ap.parse_args()
    recs = load(a.log)
    evals = [
        {
            "iteration": r["iteration"],
            "eval_loss": r["eval_loss"],
            "answer_accuracy": r.get("eval_accuracy"),
            "answers": r.get("eval_samples"),
            **{p: v["accuracy"] for p, v in (r.get("eval_parts") or {}).items()},
            **{f"{p} answers": v["answers"] for p, v in (r.get("eval_parts") or {}).items()},
        }
        for r in recs
        if "eval_loss" in r
    ]
    summary = {
        "job": a.job,
        "iterations": len(recs),
        "loss": {"first": recs[0]["loss"], "last": recs[-1]["loss"]},
        "evaluations": evals,
        "mean_step_time_s": sum(r["step_time_s"] for r in recs) / len(recs),
        "train_loss": [[r["iteration"], r["loss"]] for r in recs],
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({k: v for k, v in summary.items() if k != "train_loss"}, indent=1)
    rows = ",\n  ".join(json.dumps([i, round(x, 6)]) for i, x in summary["train_loss"])
    a.out.with_suffix(".json").write_text(text[:-2] + ',\n "train_loss": [\n  ' + rows + "\n ]\n}\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    ax.plot([r["iteration"] for r in recs], [r["loss"] for r in recs], color="tab:blue", lw=1, label="train loss")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss per answer token")
    ax.set_yscale("log")
    acc = ax.twinx()
    its = [e["iteration"] for e in evals]
    for key, color in (("digit shown", "tab:green"), ("digit said", "tab:red"), ("answer_accuracy", "tab:gray")):
        acc.plot(its, [e.get(key) for e in evals], "o-", color=color, label=f"held-out {key.replace('_', ' ')}")
    acc.axhline(0.1, color="black", lw=0.6, ls=":", label="chance for a digit (10%)")
    acc.set_ylabel("held-out accuracy")
    acc.set_ylim(0, 1)
    lines = ax.get_legend_handles_labels()[0] + acc.get_legend_handles_labels()[0]
    labels = ax.get_legend_handles_labels()[1] + acc.get_legend_handles_labels()[1]
    ax.legend(lines, labels, loc="upper right", fontsize=8, ncol=2)
    ax.set_title("Audio-visual run on the spoken digits (vision DP2, audio TP2, language TP2)")
    fig.tight_layout()
    fig.savefig(a.out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()

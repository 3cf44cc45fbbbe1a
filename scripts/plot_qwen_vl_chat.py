"""Plot the Qwen2.5-VL conversations run (scripts/qwen_vl_chat.sh): training loss, held-out loss, held-out
answer accuracy and the accuracy on the answers that read the images ("What digit is this?", "What are
the two digits?"), from its --log-jsonl file; writes a PNG and a JSON summary, with the accuracy a
model blind to the images could reach at best on the held-out conversations (`blind_ceiling`).

    python scripts/plot_qwen_vl_chat.py bench-results/qwen-vl-chat --out docs/benchmarks/qwen_vl_chat_800
The two-stage run (scripts/qwen_vl_two_stage.sh) plots its stage 2, with stage 1's held-out caption
accuracy in the JSON:
    python scripts/plot_qwen_vl_chat.py bench-results/qwen-vl-two-stage --log stage2.jsonl --out ...
Needs matplotlib (the `bench` extra).
"""

from __future__ import annotations

import argparse
import json
import tarfile
from pathlib import Path

from megatron_hetero.data.digits_chat import DIGIT_NAMED, TWO_NAMED

STRAIGHT_SUM = "What is the sum of the two digits?"


def blind_ceiling(chat: Path) -> dict:
    """Over the held-out conversations (OUT/chat/val), the best expected answer accuracy of a model that
    never looks at the images, teacher-forced: a follow-up ("Is it odd or even?") and a text-only
    answer can be derived from the reference text before it, so it may be right every time; naming
    one digit is right 1 time in 10 at best, two digits 1 in 100, a sum asked straight away (no digits
    named before it) 1 in 10 (nine, the likeliest sum). Whole conversations, not cut at --seq-length."""
    recs = []
    for tar in sorted((chat / "val").glob("shard-*.tar")):
        with tarfile.open(tar) as tf:
            for m in sorted(tf.getmembers(), key=lambda m: m.name):
                if m.name.endswith(".json"):
                    recs.append(json.loads(tf.extractfile(m).read()))
    answers = expected = 0.0
    for rec in recs:
        question = ""
        for turn in rec["conversation"]:
            if turn["role"] == "user":
                question = turn["content"]
                continue
            if turn["role"] != "assistant":
                continue
            answers += 1
            if DIGIT_NAMED in question:
                expected += 0.1
            elif TWO_NAMED in question:
                expected += 0.01
            elif STRAIGHT_SUM in question and "<image>" in question:
                expected += 0.1
            else:
                expected += 1.0
    return {"conversations": len(recs), "answers": int(answers), "accuracy": expected / answers}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", type=Path, help="the output folder of scripts/qwen_vl_chat.sh")
    ap.add_argument("--out", type=Path, required=True, help="output path without suffix (.png and .json)")
    ap.add_argument("--log", default="run.jsonl", help="the run's --log-jsonl file in RUN (stage2.jsonl: two stages)")
    a = ap.parse_args()
    recs = [json.loads(x) for x in (a.run / a.log).read_text().splitlines() if x.strip()]
    two_stage = a.log == "stage2.jsonl"
    train = [r for r in recs if "loss" in r and "eval_loss" not in r]
    evals = [r for r in recs if "eval_loss" in r]
    wall = json.loads((a.run / "wall.json").read_text()) if (a.run / "wall.json").exists() else {}
    blind = blind_ceiling(a.run / "chat")
    job = (
        "Qwen2.5-VL tower + M-RoPE language model on the digits conversations at native resolution "
        "(scripts/qwen_vl_chat.sh): 2 CPU ranks, colocated, vision DP2, language TP2, from scratch"
    )
    if two_stage:
        job = job.replace("scripts/qwen_vl_chat.sh", "scripts/qwen_vl_two_stage.sh, stage 2").replace(
            "from scratch", "from stage 1's weights (the digits captions, everything trained from scratch)"
        )
    summary = {
        "job": job,
        "iterations": max(r["iteration"] for r in recs),
        "loss": {"first": train[0]["loss"], "last": train[-1]["loss"]},
        "evaluations": [
            {
                "iteration": r["iteration"],
                "eval_loss": r["eval_loss"],
                "answer_accuracy": r["eval_accuracy"],
                "answers": r.get("eval_samples"),
                "parts": r.get("eval_parts", {}),
            }
            for r in evals
        ],
        "final": {
            "heldout_loss": evals[-1]["eval_loss"],
            "answer_accuracy": evals[-1]["eval_accuracy"],
            "parts": evals[-1].get("eval_parts", {}),
        },
        "chance": {"digit named": 0.1, "two digits named": 0.01, "answer accuracy, blind to the images": blind},
        "mean_step_time_s": sum(r["step_time_s"] for r in train) / len(train),
        "wall_time_s": wall,
        "train_loss": [[r["iteration"], round(r["loss"], 6)] for r in train],
    }
    if two_stage:
        s1 = [json.loads(x) for x in (a.run / "stage1.jsonl").read_text().splitlines() if x.strip()]
        s1_train = [r for r in s1 if "loss" in r and "eval_loss" not in r]
        summary["stage1"] = {
            "iterations": max(r["iteration"] for r in s1),
            "loss": {"first": s1_train[0]["loss"], "last": s1_train[-1]["loss"]},
            "evaluations": [
                {"iteration": r["iteration"], "eval_loss": r["eval_loss"], "caption_accuracy": r["eval_accuracy"]}
                for r in s1
                if "eval_loss" in r
            ],
            "mean_step_time_s": sum(r["step_time_s"] for r in s1_train) / len(s1_train),
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
    ax.set_ylabel("loss per answer token")
    ax2 = ax.twinx()
    ax2.plot(
        at, [100 * (r["eval_accuracy"] or 0.0) for r in evals], "s-", color="tab:red", ms=4, label="answer accuracy"
    )
    for part, colour in (("digit named", "tab:green"), ("two digits named", "tab:purple")):
        got = [((r.get("eval_parts") or {}).get(part) or {}).get("accuracy") for r in evals]
        ax2.plot(at, [100 * (g or 0.0) for g in got], "^-", color=colour, ms=4, label=f'"{part}" accuracy')
    ax2.axhline(100 * blind["accuracy"], color="tab:red", lw=0.6, ls=":", label="answer accuracy, blind best")
    ax2.axhline(10, color="tab:green", lw=0.6, ls=":", label="digit named, chance")
    ax2.set_ylim(0, 100)
    ax2.set_ylabel("held-out accuracy (%)")
    h1, h2 = ax.get_legend_handles_labels(), ax2.get_legend_handles_labels()
    ax.legend(h1[0] + h2[0], h1[1] + h2[1], loc="upper right", fontsize=7)
    title = (
        "Qwen2.5-VL tower + M-RoPE LM, digits conversations at native resolution: vision DP2 + language TP2 "
        "(colocated, 2 CPU ranks)"
    )
    if two_stage:
        title = (
            "Qwen2.5-VL tower + M-RoPE LM, stage 2: digits conversations from the caption stage's weights\n"
            "native resolution, vision DP2 + language TP2 (colocated, 2 CPU ranks)"
        )
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out.with_suffix(".png"), dpi=110)
    final = summary["final"]
    print(
        f"wrote {a.out.with_suffix('.png')}: final answer accuracy {final['answer_accuracy']:.3f}, parts {final['parts']}"
    )


if __name__ == "__main__":
    main()

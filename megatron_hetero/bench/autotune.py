"""`megatron-hetero bench autotune`: does `train --hetero-autotune` pay for itself? The two workloads of
`bench e2e` (`bench/e2e_workloads.py`, WORLD ranks, the language model's degrees fixed with
`--autotune-fix`), each started from its homogeneous layout, in one process tree, one run after the
other:

  plain     N steps of the homogeneous layout;
  autotune  N steps with `--hetero-autotune --autotune-steps K` from the same layout: it measures,
            times layers in-process, decides, switches (checkpoint, new process groups, resume),
            measures again and goes on (or back);
  resume    the checkpoint of the last layout change (a kept switch, or a revert) loaded under the
            layout the autotune went on with, trained to N: the autotune's losses from there must
            equal these (<= 1e-6 relative; runs that differ in an earlier window drift apart over
            a hundred steps by fp32 reduction order, as any two layouts do);
  stay      `--hetero-autotune` started from the chosen layout: it should stay, saying why.

Figures per workload: `train_s` (rank 0, from the start of step 1 to the end of step N: the
measuring, the layer timings, the checkpoint and the rebuild included; process start and the first
model build, the same in both runs, excluded), `wall_speedup` = plain train_s / autotune train_s,
`step_speedup_after` = plain median step / autotune median step over the iterations after the
autotune's second window (both runs at the same iterations), and the `bench e2e` figure for the
chosen layout (`e2e_reference`: its speed-up and round-to-round range measured in this run by
e2e's own side-by-side method, `e2e_figure`; `e2e_committed`: the figure of the committed
docs/benchmarks/e2e.json or an e2e.json in --out, where e2e ran that layout). Writes
OUT/autotune.json and OUT/autotune.png.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from megatron_hetero.bench.common import markdown_table, save_figure, write_json
from megatron_hetero.bench.e2e_workloads import WORLD, E2EWorkload, WORKLOADS, quick_workloads
from megatron_hetero.bench.planner_configs import describe, resolve
from megatron_hetero.checkpoint.files import STATE_FILE, TRACKER
from megatron_hetero.layout import load_layout
from megatron_hetero.config.autotune import AutotuneConfig
from megatron_hetero.training.job import quiet_upstream_warnings
from megatron_hetero.config.job import JobDraft

#: the autotune's measuring window in the full run (one warm-up step and seven measured)
STEPS = 8
#: steps per run in the full run
ITERS = 150
LOSS_TOL = 1e-6


def _fix(w: E2EWorkload) -> str:
    """The workload's constraint as --autotune-fix."""
    return f"language.tp={w.llm_tp},language.cp={w.llm_cp}"


def _rank(job) -> dict[str, Any]:
    """One rank of a run: its records and, timed by the step hook, the training time."""
    from megatron_hetero.training.trainer import train_rank

    marks: dict[int, float] = {}

    def hook(iteration: int) -> None:
        marks[iteration] = time.perf_counter()

    out = train_rank(job, step_hook=hook)
    recs = out["records"]
    first, last = recs[0]["iteration"], recs[-1]["iteration"]
    return {
        "iterations": [r["iteration"] for r in recs],
        "losses": [r["loss"] for r in recs],
        "step_s": [r["step_time_s"] for r in recs],
        "train_s": marks[last] - marks[first] + recs[0]["step_time_s"],
    }


def _run(draft, timeout: float) -> dict[str, Any]:
    """Train the job `draft` (a `config.job.JobDraft`, validated here: this run's door) on
    forked ranks; rank 0's iterations, losses and times."""
    from megatron_hetero.compat import default_backend
    from megatron_hetero.runtime.launcher import run_ranks
    from megatron_hetero.training.setup import validate_job

    return run_ranks(WORLD, _rank, validate_job(draft), timeout=timeout, backend=default_backend())[0]


def checkpoint_at(save: Path, iteration: int, dest: Path) -> Path:
    """A copy of `save` whose tracker points at `iteration` (what --load resumes)."""

    shutil.copytree(save, dest)
    digest = hashlib.sha256((dest / f"iter_{iteration:07d}" / STATE_FILE).read_bytes()).hexdigest()
    (dest / TRACKER).write_text(f"{iteration}\nsha256 {digest}\n")
    return dest


def e2e_reference(e2e: Optional[dict], workload: str, layout_text: str) -> Optional[dict[str, Any]]:
    """`bench e2e`'s figure for `layout_text` (its `describe`) of `workload`: speed-up vs the
    homogeneous layout, its per-round values and their range; None when e2e did not run it."""
    for c in (e2e or {}).get("cases", []):
        if c["workload"] == workload and c["layout"] == layout_text:
            rounds = c.get("speedup_per_round") or [c["speedup_vs_homogeneous"]]
            return {
                "speedup": c["speedup_vs_homogeneous"],
                "per_round": rounds,
                "range": [min(rounds), max(rounds)],
            }
    return None


def e2e_figure(homo, chosen, job, mbs: int, rounds: int = 3, iters: int = 6) -> dict[str, Any]:
    """`bench e2e`'s figure for `chosen` measured here by e2e's own method (`bench.e2e.side_by_side`:
    the homogeneous and the chosen layout in one process tree, step by step, `rounds` trees of one
    warm-up and `iters` steps): the speed-up of the median step, the per-round speed-ups and their
    range."""
    from megatron_hetero.bench.e2e import side_by_side

    per_round = []
    cases = [
        JobDraft(homo, dataclasses.replace(job, train_iters=iters + 1)),
        JobDraft(chosen, dataclasses.replace(job, train_iters=iters + 1, micro_batch_size=mbs)),
    ]
    all_h, all_c = [], []
    for _ in range(rounds):
        h, c = side_by_side(cases, iters + 1)
        all_h += h["steps_s"][1:]
        all_c += c["steps_s"][1:]
        per_round.append(statistics.median(h["steps_s"][1:]) / statistics.median(c["steps_s"][1:]))
    return {
        "speedup": statistics.median(all_h) / statistics.median(all_c),
        "per_round": per_round,
        "range": [min(per_round), max(per_round)],
        "method": f"bench e2e's side_by_side, {rounds} rounds of 1 + {iters} steps, measured in this run",
    }


def within_noise(ours: float, ours_noise: float, ref: Optional[dict]) -> Optional[bool]:
    """Whether our step speed-up agrees with e2e's: |ours - e2e| <= e2e's round range + our noise."""
    if ref is None:
        return None
    lo, hi = ref["range"]
    return bool(lo - ours_noise <= ours <= hi + ours_noise)


def _median_ratio(plain: list[float], tuned: list[float]) -> tuple[float, float]:
    """(median plain / median tuned, its noise: the ratio's relative standard error from both medians)."""
    mp, mt = statistics.median(plain), statistics.median(tuned)

    def se(xs: list[float]) -> float:
        m = statistics.median(xs)
        return 1.2533 * 1.4826 * statistics.median(abs(x - m) for x in xs) / len(xs) ** 0.5

    r = mp / mt
    return r, r * ((se(plain) / mp) ** 2 + (se(tuned) / mt) ** 2) ** 0.5


def run_workload(
    w: E2EWorkload, iters: int, steps: int, e2e: Optional[dict], tmp: Path, timeout: float
) -> dict[str, Any]:
    """The four runs of one workload (module docstring) and its figures."""

    homo = resolve(w.homogeneous, WORLD)
    base = w.model.job(iters)
    plain = _run(JobDraft(homo, base), timeout)
    save = tmp / f"{w.name}-autotune"
    tune = AutotuneConfig(hetero_autotune=True, autotune_steps=steps, autotune_fix=_fix(w))
    tuned = _run(JobDraft(homo, dataclasses.replace(base, save=str(save), autotune=tune)), timeout)
    doc = json.loads((save / "autotune.json").read_text())
    decisions, cals = doc["decisions"], doc["calibration"]
    dec, cal = decisions[-1], cals[-1]  # the last decision: where the run went on
    chosen = load_layout(save / "autotune-layout.yaml", world_size=WORLD)
    switched = dec["from_layout"] != dec["to_layout"]  # the last decision was a switch
    out: dict[str, Any] = {
        "workload": w.name,
        "iters": iters,
        "autotune_steps": steps,
        "autotune_fix": _fix(w),
        "homogeneous": describe(homo),
        "decision": dec,
        "calibration": cal,
        "decisions": decisions,
        "calibrations": cals,
        "switched": any(d["from_layout"] != d["to_layout"] for d in decisions),
        "kept": describe(chosen) != describe(homo),
        "chosen_layout": describe(chosen),
        "chosen_is_heterogeneous": describe(chosen) != describe(homo),
        "train_s": {"plain": plain["train_s"], "autotune": tuned["train_s"]},
        "wall_speedup": plain["train_s"] / tuned["train_s"],
        "losses": {"plain": plain["losses"], "autotune": tuned["losses"]},
        "step_s": {"plain": plain["step_s"], "autotune": tuned["step_s"]},
    }
    after_from = dec["iteration"] + (steps if switched else 0)  # past the measuring window(s)
    keep = [i for i, it in enumerate(tuned["iterations"]) if it > after_from]
    if keep:
        ratio, noise = _median_ratio([plain["step_s"][i] for i in keep], [tuned["step_s"][i] for i in keep])
        out["step_speedup_after"], out["step_speedup_noise"] = ratio, noise
        out["steps_after"] = len(keep)
        out["e2e_committed"] = e2e_reference(e2e, w.name, describe(chosen))  # docs/benchmarks/e2e.json
        ref = None
        if out["chosen_is_heterogeneous"]:
            ref = e2e_figure(homo, chosen, base, tuned_micro_batch(homo, chosen, base))
        out["e2e_reference"] = ref
        out["within_e2e_noise"] = within_noise(ratio, noise, ref)
    # the last layout change (a kept switch, or the revert K steps after one): from its checkpoint, a
    # run resuming under the layout the autotune went on with must give the same losses
    changes = [d["iteration"] + (0 if d["kept"] else steps) for d in decisions if d["from_layout"] != d["to_layout"]]
    if changes:
        at = max(changes)
        ref_dir = checkpoint_at(save, at, tmp / f"{w.name}-resume")
        mbs = tuned_micro_batch(homo, chosen, base)
        resume = _run(JobDraft(chosen, dataclasses.replace(base, micro_batch_size=mbs, load=str(ref_dir))), timeout)
        after = tuned["losses"][at:]
        out["resume_from_iteration"] = at
        out["resume_losses"] = resume["losses"]
        out["loss_max_rel_diff_vs_resume"] = max(abs(a - b) / abs(b) for a, b in zip(after, resume["losses"]))
        out["loss_equal_after_switch"] = out["loss_max_rel_diff_vs_resume"] <= LOSS_TOL
    stay_save = tmp / f"{w.name}-stay"
    stay_iters = (tune.autotune_rounds + 1) * steps + 2  # room to measure every layout it may try
    stay_job = dataclasses.replace(
        base,
        micro_batch_size=tuned_micro_batch(homo, chosen, base),
        train_iters=stay_iters,
        save=str(stay_save),
        autotune=tune,
    )
    _run(JobDraft(chosen, stay_job), timeout)
    sdoc = json.loads((stay_save / "autotune.json").read_text())
    went_on = load_layout(stay_save / "autotune-layout.yaml", world_size=WORLD)
    out["stay"] = {
        "layout": describe(chosen),
        "stayed": describe(went_on) == describe(chosen),
        "decisions": sdoc["decisions"],
        "reasons": [c["reason"] for c in sdoc["calibration"]],
        "reason": sdoc["calibration"][0]["reason"],
    }
    return out


def tuned_micro_batch(homo, chosen, job) -> int:
    """train's --micro-batch-size of `job` (a `JobConfig` run on `homo`) on `chosen` (the autotune's
    own translation)."""
    from megatron_hetero.training.autotune_checks import job_on, workload_of

    run = JobDraft(homo, job)
    return job_on(run, chosen, workload_of(run), load=None).config.micro_batch_size


def _e2e_doc(out_dir: Path) -> tuple[Optional[dict], Optional[str]]:
    for p in (out_dir / "e2e.json", Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "e2e.json"):
        if p.is_file():
            return json.loads(p.read_text()), str(p)
    return None, None


def run(out_dir: Path, iters: int = ITERS, steps: int = STEPS, quick: bool = False, plot: bool = True) -> dict:
    """Every workload's four runs; writes OUT/autotune.json (+ autotune.png) and returns the document."""
    from megatron_hetero.compat import default_backend, require_compat

    if steps < 2 or iters < 2 * steps + 2:
        raise ValueError(f"bench autotune needs --autotune-steps >= 2 and iters >= 2 x steps + 2; got {steps}, {iters}")
    quiet_upstream_warnings()
    require_compat("bench.autotune.run")
    t0 = time.perf_counter()
    e2e, e2e_path = _e2e_doc(Path(out_dir))
    workloads = quick_workloads() if quick else WORKLOADS
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-autotune-") as tmp:
        for w in workloads:
            rows.append(run_workload(w, iters, steps, e2e, Path(tmp), timeout=1800.0))
            write_json(Path(out_dir) / "autotune.partial.json", {"workloads": rows})  # a later failure keeps these
    doc = {
        "benchmark": "autotune",
        "backend": default_backend(),
        "world_size": WORLD,
        "quick": quick,
        "e2e_reference_file": e2e_path,
        "workloads": rows,
        "seconds": time.perf_counter() - t0,
    }
    out = Path(out_dir)
    write_json(out / "autotune.json", doc)
    if plot:
        _plot(out / "autotune.png", doc)
    return doc


def _plot(path: Path, doc: dict[str, Any]) -> Optional[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = doc["workloads"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.6))
    names = [r["workload"] for r in rows]
    y = range(len(rows))
    ax = axes[0]
    ax.barh([i - 0.2 for i in y], [r["train_s"]["plain"] for r in rows], 0.4, label="homogeneous", color="#888888")
    ax.barh([i + 0.2 for i in y], [r["train_s"]["autotune"] for r in rows], 0.4, label="--hetero-autotune")
    ax.set_yticks(list(y))
    ax.set_yticklabels(names)
    ax.invert_yaxis()
    ax.set_xlabel(f"seconds for {rows[0]['iters']} steps (measuring and switch included)")
    ax.legend(fontsize=8)
    ax = axes[1]
    ours = [r.get("step_speedup_after", float("nan")) for r in rows]
    err = [r.get("step_speedup_noise", 0.0) for r in rows]
    ax.errorbar(ours, [i - 0.1 for i in y], xerr=err, fmt="o", label="autotune, after the switch")
    for i, r in enumerate(rows):
        ref = r.get("e2e_reference")
        if ref:
            lo, hi = ref["range"]
            ax.errorbar(
                [ref["speedup"]],
                [i + 0.1],
                xerr=[[max(0.0, ref["speedup"] - lo)], [max(0.0, hi - ref["speedup"])]],
                fmt="s",
                color="k",
            )
    ax.plot([], [], "s", color="k", label="bench e2e, same layout (rounds' range)")
    ax.axvline(1.0, color="k", lw=0.8, ls="--")
    ax.set_yticks(list(y))
    ax.set_yticklabels([f"{r['workload']}\n{r['chosen_layout']}" for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("step speed-up vs homogeneous")
    ax.legend(fontsize=8)
    fig.suptitle(f"bench autotune: world {doc['world_size']} ({doc['backend']})", fontsize=10)
    return save_figure(fig, path)


def table(doc: dict[str, Any]) -> str:
    rows = []
    for r in doc["workloads"]:
        ref = r.get("e2e_reference")
        rows.append(
            [
                r["workload"],
                r["homogeneous"],
                r["chosen_layout"] + ("" if r["kept"] or not r["switched"] else " (reverted)"),
                f"{r['calibration'].get('measured_step_s', float('nan')) * 1e3:.0f} ms",
                f"{(r['decision']['predicted_step_s'] or float('nan')) * 1e3:.0f} ms",
                f"{(r['decision']['measured_after_s'] or float('nan')) * 1e3:.0f} ms",
                f"{r['train_s']['plain']:.1f} s / {r['train_s']['autotune']:.1f} s = {r['wall_speedup']:.2f}x",
                f"{r.get('step_speedup_after', float('nan')):.2f}x ± {r.get('step_speedup_noise', 0.0):.2f}",
                f"{ref['speedup']:.2f}x ({ref['range'][0]:.2f}-{ref['range'][1]:.2f})" if ref else "n/a",
                f"{r.get('loss_max_rel_diff_vs_resume', float('nan')):.1e}",
                "stayed" if r["stay"]["stayed"] else "moved",
            ]
        )
    text = markdown_table(
        [
            "workload",
            "from",
            "chosen",
            "measured",
            "predicted",
            "measured after",
            "N steps: homogeneous / autotune",
            "step speed-up after",
            "bench e2e, same layout",
            "loss vs resume",
            "rerun from chosen",
        ],
        rows,
    )
    reasons = "\n".join(
        f"- {r['workload']}, rerun from the chosen layout: " + "; then ".join(r["stay"]["reasons"])
        for r in doc["workloads"]
    )
    return text + "\n\n" + reasons

"""`megatron-hetero bench scale`: a rank's setup of 1,024- to 65,536-rank jobs on one machine.

For each world W and the two layouts of `bench/scale_probe.py` (colocated: vision DP=W, language
TP8·PP4·DP=W/32; disjoint: vision DP=W/2 on the first half, language TP8·PP4 on the second), in one
run:
  1. `megatron-hetero dryrun` (a subprocess, exactly the user's command) on torch's fake process
     group: per sampled rank `plugin_s` (the plugin's own planning), `groups_s` (its process groups
     through Megatron's grids), `megatron_baseline_s` (the same grids created by Megatron's MIMO
     example, in the same process) and the groups it creates and belongs to; the default sample up
     to `full_sample_max` ranks, ranks 0 and N-1 above;
  2. the plugin's planning probe (`scale_probe.py`) in this tree, and with `before_tree` in that
     (older) checkout, each in a subprocess, one step after the other on the same machine: rank 0's
     validation, rank plan and boundary plan, their sum as that tree's `train` ran them, and the
     `plan` CLI.
Reported: the per-rank figures, `plugin_s / megatron_baseline_s` per sampled rank, the growth
exponent of each figure from the second-largest world to the largest one at or below 16,384
(log(ratio)/log(world ratio): 1 is linear), and before/after. Writes scale.json and scale.png.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_hetero.bench.common import markdown_table, save_figure, write_json
from megatron_hetero.bench.scale_probe import KINDS, batch_of, layout_doc

WORLDS = (1024, 4096, 16384, 65536)
QUICK_WORLDS = (64, 256)
#: the tiny model every rank builds on the meta device (TP8 needs 8 heads; PP4 needs 4 layers)
MODEL_FLAGS = ["--num-attention-heads", "8", "--num-layers", "4"]
PROBE = Path(__file__).with_name("scale_probe.py")


def _dryrun(world: int, kind: str, ranks: Optional[str], tmp: Path, timeout_s: float) -> dict[str, Any]:
    """`megatron-hetero dryrun` of layout `kind` at `world` ranks in a subprocess; its JSON document
    (with `cmd` and `wall_s`), or {"error": ...}."""
    import yaml

    layout = tmp / f"{kind}-{world}.yaml"
    layout.write_text(yaml.safe_dump(layout_doc(world, kind)))
    g, mbs = batch_of(world, kind)
    out = tmp / f"{kind}-{world}.json"
    cmd = ["dryrun", str(layout), "--global-batch-size", str(g), "--micro-batch-size", str(mbs), *MODEL_FLAGS]
    cmd += ["--json", str(out)] + (["--ranks", ranks] if ranks else [])
    t0 = time.perf_counter()
    try:
        p = subprocess.run(
            [sys.executable, "-m", "megatron_hetero", *cmd], capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return {"error": f"dryrun ran past {timeout_s:.0f} s", "cmd": "megatron-hetero " + " ".join(cmd)}
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["?"])[-1], "cmd": "megatron-hetero " + " ".join(cmd)}
    doc = json.loads(out.read_text())
    for r in doc["ranks"]:  # the per-group member lists and digests are for tests, not for the report
        for k in ("group_members", "plan_digest", "boundaries"):
            r.pop(k, None)
    doc["cmd"] = "megatron-hetero " + " ".join(cmd)
    doc["wall_s"] = time.perf_counter() - t0
    return doc


def _probe(tree: Optional[str], world: int, kind: str, timeout_s: int) -> dict[str, Any]:
    """`scale_probe.py` with `tree` first on the path (None: this tree)."""
    env = dict(os.environ)
    root = tree or str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    p = subprocess.run(
        [sys.executable, str(PROBE), str(world), kind, str(timeout_s)],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=6 * timeout_s + 120,
    )
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def _git_head(tree: str) -> str:
    try:
        return subprocess.run(
            ["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "?"


def growth(worlds: Sequence[int], values: Sequence[Optional[float]]) -> Optional[float]:
    """log(v_b / v_a) / log(w_b / w_a) between the two largest worlds <= 16,384 with values (None
    when fewer than two)."""
    pts = [(w, v) for w, v in zip(worlds, values) if w <= 16384 and isinstance(v, (int, float)) and v > 0]
    if len(pts) < 2:
        return None
    (wa, va), (wb, vb) = pts[-2], pts[-1]
    return math.log(vb / va) / math.log(wb / wa)


def _summary(doc: dict[str, Any]) -> dict[str, Any]:
    """Max over the sampled ranks of each figure of a dryrun document."""
    ranks = doc.get("ranks", [])
    if not ranks:
        return {}

    def mx(key: str) -> Optional[float]:
        vals = [r[key] for r in ranks if isinstance(r.get(key), (int, float))]
        return max(vals) if vals else None

    ratios = [r["plugin_s"] / r["megatron_baseline_s"] for r in ranks if r.get("megatron_baseline_s")]
    homog = [r.get("baseline", {}).get("homogeneous", {}) for r in ranks]
    return {
        "sampled": [r["rank"] for r in ranks],
        "plugin_s": mx("plugin_s"),
        "groups_s": mx("groups_s"),
        "megatron_baseline_s": mx("megatron_baseline_s"),
        "plugin_over_baseline_max": max(ratios) if ratios else None,
        "groups_created": mx("groups_created"),
        "groups_member": [min(r["groups_member"] for r in ranks), max(r["groups_member"] for r in ranks)],
        "homogeneous_groups_created": max((h.get("groups_created") or 0) for h in homog) or None,
        "homogeneous_groups_member": max((h.get("groups_member") or 0) for h in homog) or None,
    }


def run(
    out_dir: Path,
    worlds: Sequence[int] = WORLDS,
    before_tree: Optional[str] = None,
    full_sample_max: int = 16384,
    timeout_s: int = 300,
    dryrun_timeout_s: float = 3600.0,
) -> dict[str, Any]:
    """Run every (world, layout) case (module docstring); write scale.json (+ scale.png)."""
    if before_tree is not None and not (Path(before_tree) / "megatron_hetero").is_dir():
        raise ValueError(f"--before-tree {before_tree}: no megatron_hetero package in that folder")
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in worlds:
            for kind in KINDS:
                ranks = None if world <= full_sample_max else "0,N-1"
                case: dict[str, Any] = {"world": world, "layout": kind}
                case["after"] = _probe(None, world, kind, timeout_s)
                if before_tree is not None:
                    # the old route is quadratic: past 16,384 ranks one boundary plan takes hours
                    case["before"] = _probe(before_tree, world, kind, timeout_s if world <= 16384 else 60)
                dr = _dryrun(world, kind, ranks, Path(tmp), dryrun_timeout_s)
                case["dryrun"] = dr
                case["summary"] = _summary(dr)
                cases.append(case)
                print(f"bench scale: {kind} {world}: {json.dumps(case['summary'])}", file=sys.stderr, flush=True)
    doc: dict[str, Any] = {
        "benchmark": "scale",
        "worlds": list(worlds),
        "after_tree": _git_head(str(Path(__file__).resolve().parents[2])),
        "before_tree": _git_head(before_tree) if before_tree else None,
        "cases": cases,
        "growth": {},
    }
    for kind in KINDS:
        rows = [c for c in cases if c["layout"] == kind]
        ws = [c["world"] for c in rows]
        g = {
            k: growth(ws, [c["summary"].get(k) for c in rows]) for k in ("plugin_s", "groups_s", "megatron_baseline_s")
        }
        g["plan_cli_s"] = growth(ws, [c["after"].get("plan_cli_s") for c in rows])
        if before_tree is not None:
            g["before_plugin_s"] = growth(ws, [c["before"].get("plugin_s") for c in rows])
        doc["growth"][kind] = g
    write_json(out_dir / "scale.json", doc)
    _plot(doc, out_dir / "scale.png")
    return doc


def _num(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) else None


def _plot(doc: dict[str, Any], path: Path) -> Optional[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    for ax, kind in zip(axes[:2], KINDS):
        rows = [c for c in doc["cases"] if c["layout"] == kind]
        ws = [c["world"] for c in rows]
        series = {
            "plugin_s (max of sampled ranks)": [_num(c["summary"].get("plugin_s")) for c in rows],
            "groups_s": [_num(c["summary"].get("groups_s")) for c in rows],
            "megatron_baseline_s (MIMO grids)": [_num(c["summary"].get("megatron_baseline_s")) for c in rows],
        }
        if doc.get("before_tree"):
            series["plugin_s before (rank 0, estimated from its functions)"] = [
                _num(c["before"].get("plugin_s")) for c in rows
            ]
        for name, vals in series.items():
            pts = [(w, v) for w, v in zip(ws, vals) if v]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name, ls="--" if "before" in name else "-")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("world size (ranks)")
        ax.set_ylabel("seconds per rank")
        ax.set_title(f"{kind}: a rank's setup")
        ax.legend(fontsize=7)
    ax = axes[2]
    for kind in KINDS:
        rows = [c for c in doc["cases"] if c["layout"] == kind]
        for label, key in (("after", "after"), ("before", "before")):
            pts = [(c["world"], _num(c.get(key, {}).get("plan_cli_s"))) for c in rows]
            pts = [(w, v) for w, v in pts if v]
            if pts:
                ax.plot(*zip(*pts), marker="o", ls="--" if key == "before" else "-", label=f"{kind} {label}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("world size (ranks)")
    ax.set_ylabel("seconds")
    ax.set_title("megatron-hetero plan LAYOUT")
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, list):
        return "-".join(str(x) for x in v)
    return "-" if v is None else str(v)


def table(doc: dict[str, Any]) -> str:
    """Per (world, layout): the sampled ranks' maxima, the ratio to Megatron's grids, groups, and
    the planning probe before/after."""
    rows = []
    for c in doc["cases"]:
        s, a, b = c["summary"], c["after"], c.get("before", {})
        rows.append(
            [
                c["world"],
                c["layout"],
                len(s.get("sampled", [])) or c["dryrun"].get("error", "-"),
                _fmt(s.get("plugin_s")),
                _fmt(s.get("groups_s")),
                _fmt(s.get("megatron_baseline_s")),
                _fmt(s.get("plugin_over_baseline_max")),
                f"{_fmt(s.get('groups_created'))} / {_fmt(s.get('groups_member'))}",
                f"{_fmt(s.get('homogeneous_groups_created'))} / {_fmt(s.get('homogeneous_groups_member'))}",
                f"{_fmt(b.get('plugin_s'))} -> {_fmt(a.get('plugin_s'))}",
                f"{_fmt(b.get('plan_cli_s'))} -> {_fmt(a.get('plan_cli_s'))}",
            ]
        )
    head = [
        "world",
        "layout",
        "ranks sampled",
        "plugin_s",
        "groups_s",
        "megatron_baseline_s",
        "plugin/baseline",
        "groups created / member",
        "homogeneous grid",
        "rank 0 planning s, before -> after",
        "plan CLI s, before -> after",
    ]
    lines = [markdown_table(head, rows), "", "growth exponent (second-largest to largest world <= 16,384; 1 = linear):"]
    for kind, g in doc["growth"].items():
        lines.append(f"- {kind}: " + ", ".join(f"{k} {_fmt(v)}" for k, v in g.items()))
    return "\n".join(lines)

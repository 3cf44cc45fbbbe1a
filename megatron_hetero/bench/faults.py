"""`megatron-hetero bench faults`: the fault matrix. One rank raises, or is killed with SIGKILL, at each
phase of `runtime.faults.PHASES`, for a colocated and a disjoint layout (world 4, the LLM in two
pipeline stages, so the language model runs 1F1B), under the fork launcher (`training.job.run_local`)
and under torchrun (two emulated nodes of 2 ranks each: `torchrun --nnodes 2` twice on one host,
so the ranks of the node without the failing rank must notice on their own, as on a cluster).

Every cell trains 4 iterations of the tiny model with `--save DIR --save-interval 2` and a short
`--hetero-comm-timeout`, with MEGATRON_HETERO_FAULT set to fail one rank at iteration 3 (the save of
iteration 4 for `ckpt-save`; before iteration 1 for `pg-create`), and checks:

  * the job fails: the fork launcher raises RankFailure, every torchrun exits non-zero;
  * every process has exited within the communication timeout plus `MARGIN_S`, counted from the
    moment the fault fired (the failing rank writes that moment to MEGATRON_HETERO_FAULT_LOG);
  * the failure names the failing rank (its own report: the injected exception, or the launcher's
    "rank R died ... SIGKILL" / torchrun's "rank: R ... exitcode: -9"), and every message of a
    surviving rank names the edge, link or group it waited on (`NAMED`);
  * the checkpoint marker points at the last complete checkpoint (iteration 2; none for pg-create),
    and resuming from it gives iteration 3's loss of an uninterrupted run of the same layout (within
    `LOSS_RTOL`; it is bitwise in practice).

`run(out, quick=False)` runs the matrix (`QUICK`: a covering subset) and writes OUT/faults.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megatron_hetero.runtime.faults import FAULT_ENV, FAULT_LOG_ENV, KINDS, PHASES
from megatron_hetero.bench.common import write_json
from megatron_hetero.checkpoint.files import read_tracker, select_checkpoint

LAYOUTS: dict[str, dict] = {
    "colocated": {
        "placement": "colocated",
        "modules": {"vision": {"dp": 4}, "language": {"pp": 2, "dp": 2}},
        "edges": ["vision -> language"],
    },
    "disjoint": {
        "placement": "disjoint",
        "modules": {"vision": {"dp": 2}, "language": {"pp": 2}},
        "edges": ["vision -> language"],
    },
}
#: micro-batch size per layout: 4 micro-batches of the language model per step in both.
MICRO_BATCH = {"colocated": 1, "disjoint": 2}
#: the rank that fails, per (layout, phase): one that takes part in the phase; spread over both
#: emulated nodes (ranks 0-1 and 2-3) so that either node's survivors must notice on their own.
#: colocated: vision DP on 0-3, language PP stage 0 on 0-1 (receives the boundary), stage 1 on 2-3;
#: disjoint: vision on 0-1 (sends the boundary), language stage 0 on 2 and stage 1 on 3.
FAILING_RANK: dict[tuple[str, str], int] = {
    ("colocated", "pg-create"): 1,
    ("colocated", "encoder-forward"): 1,
    ("colocated", "boundary-send"): 2,
    ("colocated", "boundary-recv"): 1,
    ("colocated", "llm-1f1b"): 3,
    ("colocated", "grad-reduce"): 2,
    ("colocated", "optimizer"): 1,
    ("colocated", "ckpt-save"): 1,
    ("disjoint", "pg-create"): 2,
    ("disjoint", "encoder-forward"): 1,
    ("disjoint", "boundary-send"): 1,
    ("disjoint", "boundary-recv"): 2,
    ("disjoint", "llm-1f1b"): 2,
    ("disjoint", "grad-reduce"): 3,
    ("disjoint", "optimizer"): 0,
    ("disjoint", "ckpt-save"): 2,
}
LAUNCHERS = ("fork", "torchrun")
TRAIN_ITERS, SAVE_INTERVAL, FAULT_ITERATION = 4, 2, 3
COMM_TIMEOUT_S = 15.0
#: seconds allowed beyond the communication timeout for every process to be gone (fork launcher:
#: its 5 s grace after the first failure; torchrun: the agents' teardown, slow on a loaded machine).
MARGIN_S = 30.0
LOSS_RTOL = 1e-6
#: what a surviving rank's message must contain: the edge, pipeline link or group it waited on.
NAMED = re.compile(
    r"edge \S+->\S+|pipeline link|stage link|group \(ranks|group, ranks|process groups \S+"
    r"|over the world|groups? \["
)


@dataclass(frozen=True)
class Cell:
    phase: str
    kind: str
    layout: str
    launcher: str

    @property
    def rank(self) -> int:
        return FAILING_RANK[(self.layout, self.phase)]

    @property
    def iteration(self) -> Optional[int]:
        return {"pg-create": None, "ckpt-save": TRAIN_ITERS}.get(self.phase, FAULT_ITERATION)

    @property
    def spec(self) -> str:
        return f"{self.phase}:{self.rank}:{self.kind}" + (f":{self.iteration}" if self.iteration else "")

    @property
    def expected_checkpoint(self) -> Optional[int]:
        return None if self.phase == "pg-create" else SAVE_INTERVAL

    def __str__(self) -> str:
        return f"{self.phase} {self.kind} {self.layout} {self.launcher}"


def full_matrix() -> list[Cell]:
    """Every cell, launcher by launcher, in rounds of one cell per phase whose (kind, layout) rotates:
    any prefix of a launcher's cells covers the phases evenly (a run cut short is still a spread)."""
    combos = [(k, lay) for k in KINDS for lay in LAYOUTS]
    return [
        Cell(p, *combos[(i + r) % len(combos)], la)
        for la in LAUNCHERS
        for r in range(len(combos))
        for i, p in enumerate(PHASES)
    ]


#: A covering subset: every phase at least once under each launcher, each kind, layout and launcher
#: in several cells, both nodes' survivors under torchrun.
QUICK: tuple[Cell, ...] = (
    Cell("pg-create", "kill", "colocated", "fork"),
    Cell("encoder-forward", "raise", "disjoint", "fork"),
    Cell("boundary-send", "kill", "disjoint", "fork"),
    Cell("boundary-recv", "raise", "colocated", "fork"),
    Cell("llm-1f1b", "kill", "colocated", "fork"),
    Cell("grad-reduce", "raise", "disjoint", "fork"),
    Cell("optimizer", "kill", "colocated", "fork"),
    Cell("ckpt-save", "kill", "disjoint", "fork"),
    Cell("ckpt-save", "raise", "colocated", "fork"),
    Cell("boundary-recv", "kill", "disjoint", "torchrun"),
    Cell("grad-reduce", "raise", "colocated", "torchrun"),
)


def job_for(
    layout: str,
    save: Optional[str],
    comm_timeout_s: float,
    train_iters: int = TRAIN_ITERS,
    load: Optional[str] = None,
    load_fallback: bool = False,
):
    """The layout and `JobConfig` of a cell (the same job `train`'s flags of `cli_flags` build)."""
    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.training.setup import JobConfig

    lay = layout_from_dict(LAYOUTS[layout], world_size=4)
    job = JobConfig(
        train_iters=train_iters,
        micro_batch_size=MICRO_BATCH[layout],
        comm_timeout_s=comm_timeout_s,
        save=save,
        save_interval=SAVE_INTERVAL if save else 0,
        load=load,
        load_fallback=load_fallback,
    )
    return lay, job


def cli_flags(layout_file: Path, layout: str, save: Path, comm_timeout_s: float) -> list[str]:
    return [
        "--hetero-layout",
        str(layout_file),
        "--train-iters",
        str(TRAIN_ITERS),
        "--micro-batch-size",
        str(MICRO_BATCH[layout]),
        "--hetero-comm-timeout",
        f"{comm_timeout_s:g}",
        "--save",
        str(save),
        "--save-interval",
        str(SAVE_INTERVAL),
    ]


def reference_losses(layout: str, comm_timeout_s: float = COMM_TIMEOUT_S) -> list[float]:
    """The per-iteration losses of an uninterrupted run of `layout` (FAULT_ITERATION iterations)."""
    from megatron_hetero.training.job import run_local
    from megatron_hetero.training.setup import JobDraft, validate_job

    lay, job = job_for(layout, None, comm_timeout_s, train_iters=FAULT_ITERATION)
    return [r["loss"] for r in run_local(validate_job(JobDraft(lay, job)), timeout=600)]


def _fault_time(log: Path) -> Optional[float]:
    if not log.is_file():
        return None
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    return min(x["time"] for x in lines) if lines else None


def _last_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return lines[-1] if lines else ""


def _run_fork(cell: Cell, work: Path, comm_timeout_s: float) -> dict[str, Any]:
    """Run the cell's job on forked ranks; returns the failure facts (see `run_cell`)."""
    from megatron_hetero.runtime.launcher import RankFailure, RankTimeout
    from megatron_hetero.training.job import run_local
    from megatron_hetero.training.setup import JobDraft, validate_job

    lay, job = job_for(cell.layout, str(work / "ckpt"), comm_timeout_s)
    saved = {k: os.environ.get(k) for k in (FAULT_ENV, FAULT_LOG_ENV)}
    os.environ[FAULT_ENV], os.environ[FAULT_LOG_ENV] = cell.spec, str(work / "fault.jsonl")
    failed, messages = False, {}
    try:
        run_local(validate_job(JobDraft(lay, job)), timeout=comm_timeout_s * 4 + 120)
    except RankFailure as exc:
        failed = True
        messages = {r: _last_line(t) for r, t in exc.failures}
    except RankTimeout as exc:
        messages = {r: f"hung past the launcher's deadline: {exc}" for r in exc.hung}
    finally:
        end = time.time()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    own = messages.get(cell.rank, "")
    failing_named = (
        ("injected fault" in own) if cell.kind == "raise" else (f"rank {cell.rank} died" in own and "SIGKILL" in own)
    )
    return {
        "failed": failed,
        "end": end,
        "failing_named": failing_named,
        "survivors": {r: m for r, m in messages.items() if r != cell.rank},
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun_env(cell: Cell, work: Path) -> dict[str, str]:
    drop = (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
    )
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}
    repo = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    env[FAULT_ENV], env[FAULT_LOG_ENV] = cell.spec, str(work / "fault.jsonl")
    return env


#: torchrun's summary of a failed worker: "rank: 1 (local_rank: 1)" ... "exitcode: -9".
_TORCHRUN_ROOT = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")
#: Each failing rank's line; two ranks of one node write to the same log, and a long line can be cut by
#: the other rank's (seen in CI: rank 0's message, then rank 1's whole line, then the rest of rank 0's),
#: so a message also ends where the next rank's line starts.
_OUR_FAILURE = re.compile(
    r"megatron-hetero train: failed: rank (\d+) on \S+ \(local rank \d+\): (.*?)(?=megatron-hetero train: failed: rank |$)",
    re.M,
)


def _run_torchrun(cell: Cell, work: Path, comm_timeout_s: float) -> dict[str, Any]:
    """Two `torchrun --nnodes 2 --nproc-per-node 2` processes (node 0: ranks 0-1, node 1: ranks 2-3)."""
    layout_file = work / "layout.json"
    layout_file.write_text(json.dumps(LAYOUTS[cell.layout]))
    flags = cli_flags(layout_file, cell.layout, work / "ckpt", comm_timeout_s)
    port, env = _free_port(), _torchrun_env(cell, work)
    procs = []
    for node in (0, 1):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--node-rank",
            str(node),
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "-m",
            "megatron_hetero",
            "train",
            *flags,
        ]
        out = (work / f"node{node}.log").open("w")
        procs.append((subprocess.Popen(cmd, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT), out))
    deadline = time.time() + comm_timeout_s * 4 + 300
    end = 0.0
    while any(p.poll() is None for p, _ in procs) and time.time() < deadline:
        time.sleep(0.2)
    hung = [n for n, (p, _) in enumerate(procs) if p.poll() is None]
    for p, out in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
        out.close()
    end = time.time()  # within 0.2 s of the last exit (polling)
    text = "\n".join((work / f"node{n}.log").read_text() for n in (0, 1))
    ours = {int(r): msg for r, msg in _OUR_FAILURE.findall(text)}
    roots = {int(r): int(code) for r, code in _TORCHRUN_ROOT.findall(text)}
    if cell.kind == "raise":
        failing_named = "injected fault" in ours.get(cell.rank, "")
    else:
        failing_named = roots.get(cell.rank) == -9
    survivors = {r: m for r, m in ours.items() if r != cell.rank}
    for n in hung:
        survivors[-1 - n] = f"node {n}'s torchrun did not exit within the deadline"
    return {
        "failed": all(p.returncode != 0 for p, _ in procs) and not hung,
        "end": end,
        "failing_named": failing_named,
        "survivors": survivors,
        "exit_codes": [p.returncode for p, _ in procs],
    }


def _latest(root: Path) -> Optional[int]:
    try:
        return read_tracker(root)
    except ValueError:
        return None


def _refuses_without_fallback(root: Path) -> Optional[bool]:
    """None when no save under `root` was cut short; else whether `--load` alone refuses to resume."""

    if not any(p.name.endswith(".saving") for p in root.iterdir()):
        return None
    try:
        select_checkpoint(root)
    except ValueError as exc:
        return "--load-fallback" in str(exc)
    return False


def run_cell(
    cell: Cell, reference: list[float], work: Path, comm_timeout_s: float = COMM_TIMEOUT_S, resume: bool = True
) -> dict[str, Any]:
    """Run one cell in `work` (an empty folder); returns its record with `passed` and the `checks`."""
    from megatron_hetero.training.job import run_local
    from megatron_hetero.training.setup import JobDraft, validate_job

    work.mkdir(parents=True, exist_ok=True)
    run = _run_fork if cell.launcher == "fork" else _run_torchrun
    facts = run(cell, work, comm_timeout_s)
    fired = _fault_time(work / "fault.jsonl")
    exit_s = None if fired is None else facts["end"] - fired
    unnamed = {r: m for r, m in facts["survivors"].items() if not NAMED.search(m)}
    latest = _latest(work / "ckpt")
    checks = {
        "fault fired": fired is not None,
        "job failed": facts["failed"],
        f"exit within {comm_timeout_s:g}+{MARGIN_S:g} s": exit_s is not None and exit_s <= comm_timeout_s + MARGIN_S,
        "failing rank named": facts["failing_named"],
        "survivors name edge/group": not unnamed,
        "last complete checkpoint": latest == cell.expected_checkpoint,
    }
    rec: dict[str, Any] = {
        "cell": dataclasses.asdict(cell),
        "spec": cell.spec,
        "exit_s": exit_s,
        "survivor_messages": {str(r): m[:400] for r, m in sorted(facts["survivors"].items())},
        "unnamed": {str(r): m[:400] for r, m in unnamed.items()},
        "latest_checkpoint": latest,
    }
    if "exit_codes" in facts:
        rec["exit_codes"] = facts["exit_codes"]
    if resume and latest is not None:
        # a save cut short leaves iter_N.saving: `--load` alone refuses it (exit 2), `--load-fallback` resumes
        # from the marker's checkpoint, as a user would after reading that message
        half_written = _refuses_without_fallback(work / "ckpt")
        if half_written is not None:
            checks["half-written save refused without --load-fallback"] = half_written
        lay, job = job_for(
            cell.layout, None, comm_timeout_s, train_iters=latest + 1, load=str(work / "ckpt"), load_fallback=True
        )
        loss = run_local(validate_job(JobDraft(lay, job)), timeout=600)[0]["loss"]
        want = reference[latest]
        rec["resume_loss"], rec["reference_loss"] = loss, want
        checks["resumed loss matches"] = abs(loss - want) <= LOSS_RTOL * abs(want)
    rec["checks"] = checks
    rec["passed"] = all(checks.values())
    return rec


def run(
    out: Path, quick: bool = False, comm_timeout_s: float = COMM_TIMEOUT_S, cells: Optional[list[Cell]] = None
) -> dict[str, Any]:
    """Run the matrix (or QUICK, or `cells`); write OUT/faults.json; return the document."""
    from megatron_hetero.compat import require_compat
    from megatron_hetero.training.job import quiet_upstream_warnings

    require_compat("bench.faults.run")
    quiet_upstream_warnings()
    cells = list(cells if cells is not None else (QUICK if quick else full_matrix()))
    t0 = time.time()
    refs = {lay: reference_losses(lay, comm_timeout_s) for lay in sorted({c.layout for c in cells})}

    records: list[dict[str, Any]] = []

    def document() -> dict[str, Any]:
        return {
            "comm_timeout_s": comm_timeout_s,
            "margin_s": MARGIN_S,
            "world": 4,
            "train_iters": TRAIN_ITERS,
            "save_interval": SAVE_INTERVAL,
            "fault_iteration": FAULT_ITERATION,
            "layouts": LAYOUTS,
            "failing_rank": {f"{lay} {ph}": r for (lay, ph), r in FAILING_RANK.items()},
            "reference_losses": refs,
            "quick": quick,
            "passed": sum(r["passed"] for r in records),
            "total": len(records),
            "planned": len(cells),
            "wall_s": time.time() - t0,
            "cells": records,
        }

    with tempfile.TemporaryDirectory(prefix="faults-") as tmp:
        for i, cell in enumerate(cells):
            rec = run_cell(cell, refs[cell.layout], Path(tmp) / f"cell{i}", comm_timeout_s)
            records.append(rec)
            shutil.rmtree(Path(tmp) / f"cell{i}", ignore_errors=True)
            write_json(Path(out) / "faults.json", document())  # after every cell: a partial run is usable
            print(
                f"  [{i + 1}/{len(cells)}] {cell}: {'pass' if rec['passed'] else 'FAIL'} "
                f"(exit {rec['exit_s'] if rec['exit_s'] is None else round(rec['exit_s'], 1)} s)",
                flush=True,
            )
    doc = document()
    write_json(Path(out) / "faults.json", doc)
    return doc


def table(doc: dict[str, Any]) -> str:
    """Cells passed / total, then one row per cell: time to exit and the checks that failed."""
    lines = [
        f"fault matrix: {doc['passed']}/{doc['total']} cells passed (comm timeout {doc['comm_timeout_s']:g} s, "
        f"bound {doc['comm_timeout_s'] + doc['margin_s']:g} s; world 4, fault at iteration "
        f"{doc['fault_iteration']}, checkpoint every {doc['save_interval']})",
        "",
        "| phase | kind | layout | launcher | rank | exit (s) | checkpoint | resumed loss | result |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in doc["cells"]:
        c = r["cell"]
        bad = [k for k, ok in r["checks"].items() if not ok]
        ex = "-" if r["exit_s"] is None else f"{r['exit_s']:.1f}"
        res = (
            "-"
            if "resume_loss" not in r
            else (
                "same"
                if r["checks"]["resumed loss matches"]
                else f"{r['resume_loss']:.6f} vs {r['reference_loss']:.6f}"
            )
        )
        rank = FAILING_RANK[(c["layout"], c["phase"])]
        ckpt = r["latest_checkpoint"] if r["latest_checkpoint"] is not None else "none"
        lines.append(
            f"| {c['phase']} | {c['kind']} | {c['layout']} | {c['launcher']} | {rank} | {ex} | {ckpt} | {res} "
            f"| {'pass' if not bad else 'FAIL: ' + ', '.join(bad)} |"
        )
    return "\n".join(lines)

"""Fault injection (`runtime/faults.py`) and the fault matrix (`bench/faults.py`) on CPU/gloo, world 4.

Pure: the MEGATRON_HETERO_FAULT spec parser, when a fault point fires, the naming decorator.
Multi-rank: a covering subset of the matrix (`bench.faults.QUICK`'s fork cells: every phase once,
both kinds and layouts) under the fork launcher, and one cell under torchrun on two emulated nodes
where the failing rank's node is not the one whose ranks must notice. Each cell asserts what the
bench does: the job fails, every process is gone within the communication timeout plus a margin,
the failing rank is named, every surviving rank's message names the edge/link/group it waited on,
and the checkpoint marker is on the last complete checkpoint; two cells (one per layout, both
killed in the middle of a save, so a half-written iteration folder exists) also resume from it and
must give the uninterrupted run's loss of the next iteration.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal

import pytest

from megatron_hetero.runtime import faults
from megatron_hetero.runtime.faults import FAULT_ENV, FAULT_LOG_ENV, FaultSpec, InjectedFault, fault_point, parse_fault


@pytest.mark.parametrize(
    "text,want",
    [
        ("boundary-send:2:kill:3", FaultSpec("boundary-send", 2, "kill", 3)),
        ("pg-create:0:raise", FaultSpec("pg-create", 0, "raise", None)),
        (" ckpt-save:11:raise:4 ", FaultSpec("ckpt-save", 11, "raise", 4)),
    ],
)
def test_parse_fault(text, want):
    assert parse_fault(text) == want
    assert parse_fault(str(want)) == want  # str() is the spec again


@pytest.mark.parametrize(
    "text",
    [
        "",
        "boundary-send:2",
        "warp-core:1:raise",
        "optimizer:x:raise",
        "optimizer:1:explode",
        "optimizer:1:raise:0",
        "optimizer:1:raise:3:4",
        "pg-create:1:kill:2",
        "optimizer:-1:raise",
    ],
)
def test_bad_specs_raise_value_error_naming_the_variable(text):
    with pytest.raises(ValueError, match=FAULT_ENV):
        parse_fault(text)


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(faults, "_fired", set())
    return monkeypatch


def test_fault_point_fires_once_at_its_rank_and_iteration(fresh, tmp_path):
    log = tmp_path / "fault.jsonl"
    fresh.setenv(FAULT_ENV, "grad-reduce:1:raise:3")
    fresh.setenv(FAULT_LOG_ENV, str(log))
    fault_point("grad-reduce", 0, 3)  # another rank
    fault_point("grad-reduce", 1, 2)  # another iteration
    fault_point("optimizer", 1, 3)  # another phase
    fault_point("grad-reduce", 1, 3, when=False)
    assert not log.exists()
    with pytest.raises(InjectedFault, match=r"grad-reduce on rank 1, iteration 3"):
        fault_point("grad-reduce", 1, 3)
    fault_point("grad-reduce", 1, 3)  # once per process
    (line,) = log.read_text().splitlines()
    assert {k: v for k, v in json.loads(line).items() if k != "time"} == {
        "phase": "grad-reduce",
        "rank": 1,
        "kind": "raise",
        "iteration": 3,
    }
    with pytest.raises(ValueError, match="unknown fault phase"):
        fault_point("nowhere", 1, 3)


def test_no_variable_no_fault(fresh):
    fresh.delenv(FAULT_ENV, raising=False)
    for phase in faults.PHASES:
        fault_point(phase, 0, 1)


def _kill_child(log: str) -> None:
    os.environ[FAULT_ENV] = "optimizer:5:kill"
    os.environ[FAULT_LOG_ENV] = log
    fault_point("optimizer", 5, 7)
    os._exit(0)  # not reached


def test_kill_is_sigkill_of_the_rank_itself(tmp_path):
    log = tmp_path / "fault.jsonl"
    proc = multiprocessing.get_context("fork").Process(target=_kill_child, args=(str(log),))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    assert json.loads(log.read_text())["iteration"] == 7


def test_named_collective_names_the_collective_and_passes_named_errors():
    from megatron_hetero.runtime.step import CollectiveError

    @faults.named_collective(lambda root, it, *_: f"checkpoint save of iteration {it} under {root} (over the world)")
    def save(root, it, exc):
        raise exc

    with pytest.raises(
        CollectiveError,
        match=r"checkpoint save of iteration 4 under /ck \(over the world\): rank 0 "
        r"failed: RuntimeError: Connection closed by peer",
    ):
        save("/ck", 4, RuntimeError("Connection closed by peer\nmore"))
    with pytest.raises(InjectedFault):
        save("/ck", 4, InjectedFault("x"))


# -- the matrix -------------------------------------------------------------------------------------

COMM_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def references(megatron_compat):
    from megatron_hetero.bench import faults as bench

    return {lay: bench.reference_losses(lay, COMM_TIMEOUT_S) for lay in bench.LAYOUTS}


def _fork_cells():
    from megatron_hetero.bench.faults import QUICK

    return [c for c in QUICK if c.launcher == "fork"]


def test_the_fork_cells_cover_every_phase_kind_and_layout():
    from megatron_hetero.bench.faults import PHASES, QUICK

    cells = _fork_cells()
    assert {c.phase for c in cells} == set(PHASES)
    assert {c.kind for c in cells} == {"raise", "kill"} and {c.layout for c in cells} == {"colocated", "disjoint"}
    assert {c.launcher for c in QUICK} == {"fork", "torchrun"}


RESUMED = {("ckpt-save", "kill", "disjoint"), ("ckpt-save", "raise", "colocated")}


def _check(rec, cell):
    detail = json.dumps({k: rec[k] for k in ("spec", "exit_s", "checks", "survivor_messages", "unnamed")}, indent=1)
    assert rec["passed"], detail
    if cell.phase != "pg-create":  # survivors notice the dead peer at once and say where they waited
        assert rec["survivor_messages"], detail
    return detail


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cell", _fork_cells(), ids=str)
def test_fork_cell(cell, references, tmp_path):
    from megatron_hetero.bench.faults import run_cell

    resume = (cell.phase, cell.kind, cell.layout) in RESUMED
    rec = run_cell(cell, references[cell.layout], tmp_path / "w", COMM_TIMEOUT_S, resume=resume)
    detail = _check(rec, cell)
    if resume:  # the half-written iteration 4 is left as iter_0000004.saving; the marker and the resume use
        # iteration 2: `--load` alone refuses (it names --load-fallback), `--load-fallback` resumes
        assert (tmp_path / "w" / "ckpt" / "iter_0000004.saving").is_dir(), detail
        assert not (tmp_path / "w" / "ckpt" / "iter_0000004").exists(), detail
        assert rec["checks"]["half-written save refused without --load-fallback"], detail
        assert rec["checks"]["resumed loss matches"] and rec["resume_loss"] == rec["reference_loss"], detail


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_torchrun_two_nodes_cell(references, tmp_path):
    """Rank 2 (node 1) is killed in the disjoint boundary's receive: node 1's agent stops rank 3,
    node 0's ranks 0-1 must fail on their own, naming the edge, and every torchrun exits non-zero."""
    from megatron_hetero.bench.faults import Cell, run_cell

    cell = Cell("boundary-recv", "kill", "disjoint", "torchrun")
    rec = run_cell(cell, references[cell.layout], tmp_path / "w", COMM_TIMEOUT_S, resume=False)
    detail = _check(rec, cell)
    assert all(code != 0 for code in rec["exit_codes"]), detail
    assert {"0", "1"} <= set(rec["survivor_messages"]), detail  # the other node's ranks reported themselves
    assert all("vision->language" in rec["survivor_messages"][r] for r in ("0", "1")), detail


def test_posting_on_a_dead_connection_names_edge_rank_and_peer():
    """gloo raises when an isend/irecv is posted on the connection of a peer that already died (before
    any wait): the wire names the edge, this rank and the peer then too."""
    from megatron_hetero.runtime.wire import BoundaryTimeout, _post

    def dead(*args, **kwargs):
        raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1\nmore")

    with pytest.raises(
        BoundaryTimeout,
        match=r"^edge vision->language: rank 3 could not post the forward boundary "
        r"payload to rank 1 \(its connection failed\): \[pair.cc:553\] "
        r"Connection closed by peer",
    ):
        _post(dead, "forward boundary payload to", "vision->language", 3, 1)


def test_failure_lines_cut_by_another_ranks_line_are_each_read():
    """Two ranks of one node share the log: rank 0's line cut by rank 1's whole line (as seen in CI)
    still gives both ranks' messages."""
    from megatron_hetero.bench.faults import _OUR_FAILURE

    text = (
        "megatron-hetero train: failed: rank 0 on n0 (local rank 0): BoundaryTimeout: edge vision->language: "
        "gloo said bugs in the applica"
        "megatron-hetero train: failed: rank 1 on n0 (local rank 1): BoundaryTimeout: edge vision->language\n"
        "tion code\n"
        "megatron-hetero train: failed: rank 3 on n1 (local rank 1): BoundaryTimeout: pipeline link\n"
    )
    assert dict(_OUR_FAILURE.findall(text)) == {
        "0": "BoundaryTimeout: edge vision->language: gloo said bugs in the applica",
        "1": "BoundaryTimeout: edge vision->language",
        "3": "BoundaryTimeout: pipeline link",
    }

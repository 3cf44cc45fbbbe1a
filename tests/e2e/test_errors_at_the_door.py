"""Every failure a user can cause or meet ends with one line on stderr naming the cause and what to
do, then a non-zero exit; the tracebacks go to `megatron-hetero-error.log` (the run's --save
directory, else a temporary file) or, with --debug, to stderr (cli/__init__.py, cli/failure.py).

Cases: bad flags (argparse, exit 2), a full disk during a checkpoint save (a monkeypatched write that
raises OSError(ENOSPC), inherited by the forked ranks), a rank that dies (SIGKILL by fault injection),
an unexpected exception. A refused dataset: tests/e2e/test_dataset_trust.py (exit 2, last line)."""

from __future__ import annotations

import errno
import re

import pytest

from megatron_hetero import cli
from megatron_hetero.checkpoint import files
from megatron_hetero.cli.failure import LOG_NAME, rank_failure_line, root_cause
from megatron_hetero.runtime.faults import FAULT_ENV

TRAIN = [
    "train",
    "--hetero-module",
    "vision:dp=2",
    "--hetero-module",
    "language:dp=2",
    "--hetero-edge",
    "vision->language",
    "--nproc-per-node",
    "2",
    "--train-iters",
    "1",
]


def _err_lines(err: str) -> list[str]:
    """stderr without the torch/Megatron warnings a run prints on its way."""
    return [x for x in err.splitlines() if x.strip() and not re.match(r"^(W\d{4}|WARNING:|\s)", x)]


def test_bad_flag_exits_2(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main([*TRAIN, "--train-iterz", "1"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.strip().splitlines()[-1].endswith("unrecognized arguments: --train-iterz 1")
    assert "Traceback" not in err


def _enospc(path, text):
    raise OSError(errno.ENOSPC, "No space left on device", str(path))


@pytest.mark.timeout(300)
def test_disk_full_during_save_is_one_line(tmp_path, capfd, monkeypatch) -> None:
    """ENOSPC while rank 0 writes the checkpoint: exit 1, the last stderr line names the rank, the
    error and what to do; no traceback on the terminal; the log file holds them. With --debug the
    tracebacks come before the line."""
    save = tmp_path / "ckpt"
    monkeypatch.setattr(files, "atomic_write", _enospc)
    rc = cli.main([*TRAIN, "--save", str(save), "--save-interval", "1"])
    err = capfd.readouterr().err
    assert rc == 1
    assert "Traceback" not in err, err[-3000:]
    last = _err_lines(err)[-1]
    assert last.startswith("megatron-hetero train: failed: checkpoint save of iteration 1 under"), last
    assert "rank 0 failed: OSError: [Errno 28] No space left on device" in last
    assert "free space on the file system" in last and "--save" in last and "--debug" in last
    log = save / LOG_NAME
    assert f"[tracebacks: {log}; or rerun with --debug]" in last
    text = log.read_text()
    assert text.count("Traceback (most recent call last)") >= 2 and "--- rank 1 ---" in text
    rc = cli.main(["--debug", *TRAIN, "--save", str(save), "--save-interval", "1"])
    err = capfd.readouterr().err
    assert rc == 1 and "Traceback (most recent call last)" in err
    assert _err_lines(err)[-1].startswith("megatron-hetero train: failed: checkpoint save") and "tracebacks:" not in err


@pytest.mark.timeout(300)
def test_dead_rank_is_one_line(tmp_path, capfd, monkeypatch) -> None:
    """Rank 1 dies (SIGKILL) in the optimizer step: exit 1, one line naming the rank, its exit and
    what to do; the other rank's broken connection is not the line's cause."""
    monkeypatch.setenv(FAULT_ENV, "optimizer:1:kill")
    rc = cli.main([*TRAIN, "--log-jsonl", str(tmp_path / "log.jsonl")])
    err = capfd.readouterr().err
    assert rc == 1 and "Traceback" not in err, err[-3000:]
    last = _err_lines(err)[-1]
    assert last.startswith("megatron-hetero train: failed: rank 1 died without reporting a result: "), last
    assert "signal SIGKILL" in last and "out-of-memory" in last
    assert f"[tracebacks: {tmp_path / LOG_NAME}; or rerun with --debug]" in last


def test_unexpected_exception_is_one_line(capsys, monkeypatch, tmp_path) -> None:
    """A bug (any exception but ValueError/CommandFailed) prints one line, exit 1; traceback in the log."""
    from megatron_hetero.cli import plan

    def bug(args):
        raise KeyError("boom")

    monkeypatch.setattr(plan, "run", bug)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    rc = cli.main(["plan", "examples/layouts/homogeneous.yaml"])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1, err
    assert err.startswith("megatron-hetero plan: internal error: KeyError: 'boom' [tracebacks: ")
    path = err.split("[tracebacks: ")[1].split(";")[0]
    assert "KeyError: 'boom'" in open(path).read()


def test_root_cause_skips_the_consequences() -> None:
    failures = [
        (2, "Traceback ...\nRuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1"),
        (0, "Traceback ...\nmegatron_hetero.runtime.step.CollectiveError: save: rank 0 failed: OSError: disk"),
        (1, "rank 1 died without reporting a result: exit code -9 (signal SIGKILL)"),
    ]
    assert root_cause(failures) == (0, "save: rank 0 failed: OSError: disk")
    assert root_cause(failures[:1]) == (2, "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1")
    line = rank_failure_line(failures[2:] + failures[:1], [3], None)
    assert line.startswith("rank 1 died without reporting a result: exit code -9 (signal SIGKILL) (ranks [2] stopped")
    assert "ranks [3] were killed" in line


def test_rank_failure_of_any_command_is_one_line(capsys, monkeypatch, tmp_path) -> None:
    """A RankFailure that reaches `run_command` from any subcommand reads as the root rank's line."""
    from megatron_hetero.cli import plan
    from megatron_hetero.runtime.launcher import RankFailure

    def ranks_fail(args):
        raise RankFailure(
            [(1, "Traceback ...\nRuntimeError: Connection closed by peer"), (0, "Traceback ...\nOSError: x")], []
        )

    monkeypatch.setattr(plan, "run", ranks_fail)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    rc = cli.main(["plan", "examples/layouts/homogeneous.yaml"])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1, err
    assert err.startswith("megatron-hetero plan: failed: rank 0: OSError: x (ranks [1] stopped after it) [tracebacks: ")

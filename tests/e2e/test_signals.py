"""--exit-signal-handler (`training/signals.py`): SIGTERM that reaches one rank stops every rank after the
same step with a checkpoint of it, the run resumes from it with the losses of an uninterrupted run, and a
SIGTERM to `megatron-hetero train`'s own process (the fork launcher) reaches its ranks, which save and exit 0.
fp32, tiny model, world 2."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from parity import losses, run_job
from megatron_hetero.layout import layout_from_dict
from megatron_hetero.runtime.launcher import run_ranks
from megatron_hetero.checkpoint.files import read_tracker
from megatron_hetero.training.setup import JobConfig, JobDraft, validate_job
from megatron_hetero.training.trainer import train_rank

ROOT = Path(__file__).resolve().parents[2]
# heterogeneous colocated: the encoder DP2, the language model TP2, on 2 ranks
COLOC = {
    "placement": "colocated",
    "modules": {"vision": {"dp": 2}, "language": {"tp": 2}},
    "edges": ["vision -> language"],
}
JOB = JobConfig(train_iters=6)


def _term_self_at(rank: int, iteration: int):
    """A step hook that sends SIGTERM to this rank's own process after `iteration`, on `rank` only."""

    def hook(it: int) -> None:
        if it == iteration and int(os.environ["RANK"]) == rank:
            os.kill(os.getpid(), signal.SIGTERM)

    return hook


def _sigterm_after_iteration_2(proc: subprocess.Popen) -> tuple[str, int]:
    """Send SIGTERM once `proc` logs iteration 2; its whole output and exit code (killed if it hangs)."""
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if re.search(r"iteration\s+2/", line):
                proc.send_signal(signal.SIGTERM)
                break
        out = "".join(lines) + proc.stdout.read()
        rc = proc.wait(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return out, rc


@pytest.mark.timeout(400)
def test_sigterm_on_one_rank_stops_all_at_the_same_step_and_resume_is_exact(tmp_path, capfd, megatron_compat):
    full = losses(run_job(COLOC, 2, JOB))
    save, marker = tmp_path / "ckpt", tmp_path / "marker"
    job = dataclasses.replace(JOB, save=str(save), exit_signal_handler=True)
    layout = layout_from_dict(COLOC, world_size=2)
    per_rank = run_ranks(
        2,
        train_rank,
        validate_job(JobDraft(layout, job)),
        timeout=300,
        env={"MH_EXIT_SIGNAL_MARKER": str(marker)},
        step_hook=_term_self_at(rank=1, iteration=3),
    )
    # rank 1 alone got the signal in iteration 3; both ranks ended after iteration 3 with the same losses
    assert [[r["iteration"] for r in pr["records"]] for pr in per_rank] == [[1, 2, 3], [1, 2, 3]]
    assert [r["loss"] for r in per_rank[0]["records"]] == full[:3]
    assert read_tracker(save) == 3  # saved at the stop, not at --train-iters
    assert not (save / "iter_0000006").exists()
    assert marker.read_text() == f"3 {save}\n"
    assert "received SIGTERM: stopped after iteration 3; checkpoint of iteration 3 saved in" in capfd.readouterr().out
    resumed = losses(run_job(COLOC, 2, dataclasses.replace(JOB, load=str(save))))
    assert resumed == full[3:]  # the same next-step losses as the uninterrupted run (bitwise)


@pytest.mark.timeout(300)
def test_without_the_flag_sigterm_is_not_caught(tmp_path, megatron_compat):
    from megatron_hetero.runtime.launcher import RankFailure

    layout = layout_from_dict(COLOC, world_size=2)
    with pytest.raises(RankFailure, match="SIGTERM"):
        run_ranks(
            2,
            train_rank,
            validate_job(JobDraft(layout, dataclasses.replace(JOB, save=str(tmp_path / "c")))),
            timeout=200,
            step_hook=_term_self_at(rank=0, iteration=2),
        )
    assert not (tmp_path / "c" / "latest_checkpointed_iteration.txt").exists()


@pytest.mark.timeout(400)
def test_sigterm_to_the_train_command_saves_and_exits_0(tmp_path):
    """The user's view: SIGTERM to `megatron-hetero train` (the fork launcher's parent) mid-run."""
    save, layout = tmp_path / "ckpt", tmp_path / "layout.yaml"
    layout.write_text(
        "placement: colocated\nmodules:\n  vision: {dp: 2}\n  language: {tp: 2}\nedges:\n  - vision -> language\n"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "megatron_hetero.cli",
            "train",
            "--hetero-layout",
            str(layout),
            "--train-iters",
            "1000",
            "--save",
            str(save),
            "--exit-signal-handler",
            "--log-interval",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    out, rc = _sigterm_after_iteration_2(proc)
    assert rc == 0, out
    m = re.search(r"received SIGTERM: stopped after iteration (\d+); checkpoint of iteration \1 saved", out)
    assert m, out
    stopped = int(m.group(1))
    assert 2 <= stopped < 1000
    assert read_tracker(save) == stopped
    assert f"checkpoints in {save} (latest: iteration {stopped})" in out


@pytest.mark.timeout(400)
def test_sigterm_to_torchrun_reaches_its_ranks_which_save_and_mark(tmp_path):
    """torchrun (what the sbatch script runs on each node) passes SIGTERM on to its workers: both ranks stop
    after the same step with a checkpoint, rank 0 writes the stop marker; torchrun itself then exits non-zero
    (it re-raises the signal), which is why the batch script reads the marker instead of the exit status."""
    import socket

    save, marker, layout = tmp_path / "ckpt", tmp_path / "marker", tmp_path / "layout.yaml"
    layout.write_text(
        "placement: colocated\nmodules:\n  vision: {dp: 2}\n  language: {tp: 2}\nedges:\n  - vision -> language\n"
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
            "TORCHELASTIC_RUN_ID",
        )
        and not k.startswith("SLURM_")
    }
    env.update(PYTHONPATH=str(ROOT), MH_EXIT_SIGNAL_MARKER=str(marker))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "-m",
            "megatron_hetero",
            "train",
            "--hetero-layout",
            str(layout),
            "--train-iters",
            "1000",
            "--save",
            str(save),
            "--exit-signal-handler",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    out, rc = _sigterm_after_iteration_2(proc)
    m = re.search(r"received SIGTERM: stopped after iteration (\d+); checkpoint of iteration \1 saved", out)
    assert m, out[-4000:]
    stopped = int(m.group(1))
    assert 2 <= stopped < 1000 and rc != 0
    assert read_tracker(save) == stopped
    assert marker.read_text() == f"{stopped} {save}\n"

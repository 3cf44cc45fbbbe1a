"""Tier 4: a real SLURM cluster on the test host (scripts/slurm-local-up.sh: slurmctld + two emulated nodes
node1/node2), real sbatch jobs. Marked `slurm`; the cluster is started once for the module and always
stopped in teardown (scripts/slurm-local-down.sh), whatever the tests did.

Skips (with the script's reason) only when the cluster cannot run here: not root, Debian packages not
installable. A daemon that fails to start is a test failure, not a skip.

Jobs run with the test's python (MH_PYTHON=sys.executable), from the repository root, with PYTHONPATH set
to it, so the ranks import this checkout.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatron_hetero.launch.sbatch import sbatch_script
from megatron_hetero.launch.slurm import add_arguments, run

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]
UP, DOWN = ROOT / "scripts" / "slurm-local-up.sh", ROOT / "scripts" / "slurm-local-down.sh"
TERMINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}

# 4 ranks, colocated: vision DP4, language TP2·DP2 (a fan-in boundary on every step)
LAYOUT_4 = """\
placement: colocated
modules:
  vision:   {tp: 1, dp: 4}
  language: {tp: 2, dp: 2}
edges:
  - vision -> language
"""
# 8 ranks: cannot run on 2 nodes x 2 ranks
LAYOUT_8 = LAYOUT_4.replace("dp: 4", "dp: 8").replace("dp: 2}", "dp: 4}")
# an edge to a module that does not exist: `train` rejects it before any process group exists
LAYOUT_BAD = LAYOUT_4.replace("vision -> language", "vision -> nosuch")


class Cluster:
    def __init__(self, directory: Path, work: Path) -> None:
        self.dir = directory
        self.work = work  # job scripts, outputs, layouts
        # the submitting environment minus anything that describes another job or rank (this session may
        # itself run under SLURM or torchrun) or overrides the generated script
        launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
        base = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "MH_", "TORCHELASTIC_")) and k not in launcher
        }
        self.env = {
            **base,
            "SLURM_CONF": str(directory / "slurm.conf"),
            "MH_PYTHON": sys.executable,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }

    def submit(self, name: str, script: str) -> int:
        path = self.work / f"{name}.sbatch"
        path.write_text(script)
        proc = subprocess.run(
            ["sbatch", "--parsable", f"--chdir={ROOT}", str(path)],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, f"sbatch failed: {proc.stderr}"
        return int(proc.stdout.strip().split(";")[0])

    def wait(self, job_id: int, timeout: float) -> dict[str, str]:
        """Poll `scontrol show job` (faster than sbatch --wait) until the job ends; its fields."""
        deadline = time.monotonic() + timeout
        fields: dict[str, str] = {}
        while time.monotonic() < deadline:
            proc = subprocess.run(
                ["scontrol", "show", "job", str(job_id)], env=self.env, capture_output=True, text=True, timeout=30
            )
            fields = dict(re.findall(r"(\w+)=(\S*)", proc.stdout))
            if fields.get("JobState") in TERMINAL:
                return fields
            time.sleep(0.5)
        subprocess.run(["scancel", str(job_id)], env=self.env, capture_output=True, timeout=30)
        pytest.fail(f"job {job_id} not finished after {timeout:.0f} s (last state {fields.get('JobState')}); cancelled")

    def output(self, name: str) -> str:
        path = self.work / f"{name}.out"
        return path.read_text(errors="replace") if path.exists() else f"(no output file {path})"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    directory = tmp_path_factory.mktemp("slurm-cluster")
    work = tmp_path_factory.mktemp("slurm-jobs")
    env = {**os.environ, "MH_SLURM_DIR": str(directory)}

    def down() -> None:
        if (directory / "slurm.conf").exists():
            subprocess.run(
                ["bash", str(DOWN), str(directory)], env={**env, "MH_SLURM_KEEP": "1"}, capture_output=True, timeout=120
            )

    atexit.register(down)  # also when the session is interrupted before fixture teardown
    start = time.monotonic()
    proc = subprocess.run(["bash", str(UP)], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode == 3:
        down()
        pytest.skip(f"no local SLURM cluster: {proc.stderr.strip().splitlines()[-1]}")
    if proc.returncode != 0:
        down()
        pytest.fail(f"scripts/slurm-local-up.sh failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    print(f"local SLURM cluster up in {time.monotonic() - start:.1f} s ({directory})")
    try:
        yield Cluster(directory, work)
    finally:
        down()


def test_a_trivial_two_node_job(cluster):
    out = cluster.work / "trivial.out"
    job = cluster.submit(
        "trivial",
        textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --nodes=2
        #SBATCH --ntasks-per-node=1
        #SBATCH --output={out}
        set -euo pipefail
        srun --label hostname
        srun printenv SLURMD_NODENAME
        """),
    )
    fields = cluster.wait(job, 60)
    log = cluster.output("trivial")
    assert fields["JobState"] == "COMPLETED", (fields, log)
    assert fields["NodeList"] == "node[1-2]", fields
    names = set(re.findall(r"^(node\d)$", log, re.MULTILINE))
    assert names == {"node1", "node2"}, log
    assert re.search(r"^0: \S+$", log, re.MULTILINE) and re.search(r"^1: \S+$", log, re.MULTILINE), log


def test_submit_gpu_script_through_the_command(cluster, monkeypatch, capsys):
    """`slurm --submit` end to end against real sbatch: the #SBATCH lines of a GPU job (the cluster's nodes
    have 4 fake GPUs each) are accepted, the job id is printed, and the job holds 4 GPUs per node. MH_DRY_RUN=1
    makes the job print its srun command line instead of starting torchrun on GPUs that are not there."""
    for key in list(os.environ):
        if key.startswith(("MH_", "SLURM_")):
            monkeypatch.delenv(key)
    for key in ("SLURM_CONF", "MH_PYTHON", "PYTHONPATH"):
        monkeypatch.setenv(key, cluster.env[key])
    monkeypatch.setenv("MH_DRY_RUN", "1")
    monkeypatch.chdir(cluster.work)
    layout = ROOT / "examples" / "layouts" / "colocated_fan_in.yaml"  # world 8 = 2 nodes x 4 GPUs
    out = cluster.work / "gpu-%j.out"
    parser = add_arguments(argparse.ArgumentParser(prog="megatron-hetero slurm"))
    rc = run(
        parser.parse_args(
            [
                "--nodes",
                "2",
                "--gpus-per-node",
                "4",
                "--hetero-layout",
                str(layout),
                "--partition",
                "debug",
                "--time",
                "00:05:00",
                "--job-name",
                "gpu-dry",
                "--output",
                str(out),
                "--submit",
                "--script-file",
                "gpu.sbatch",
                "--",
                "--train-iters",
                "2",
                "--log-jsonl",
                "a b.jsonl",
            ]
        )
    )
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    job = int(cap.out.strip())
    fields = cluster.wait(job, 60)
    log = cluster.output(f"gpu-{job}")
    assert fields["JobState"] == "COMPLETED", (fields, log)
    assert (fields["JobName"], fields["Partition"], fields["TimeLimit"]) == ("gpu-dry", "debug", "00:05:00"), fields
    assert fields["TresPerNode"] == "gres:gpu:4", fields  # #SBATCH --gpus-per-node=4
    line = log.strip().splitlines()[-1]
    assert line.startswith("srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=1 "), log
    assert (
        f"--nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=node1:{20000 + job % 20000} "
        f"--rdzv-id={job} -m megatron_hetero train --hetero-layout {layout} --train-iters 2 "
        f"--log-jsonl a\\ b.jsonl"
    ) in line, line


PROBE = '''\
"""Stands in for `megatron_hetero.cli`: one rank (a torchrun worker or an srun task) reads its place with
rank_env, joins the others through env:// and all-reduces its rank."""
import json, os, sys
import torch
import torch.distributed as dist
from megatron_hetero.launch.rank_env import apply_rank_env, rank_env

env = rank_env(os.environ)
apply_rank_env(env)
dist.init_process_group("gloo", init_method="env://")
t = torch.tensor([float(env.rank)])
dist.all_reduce(t)
with open(os.path.join(os.environ["PROBE_DIR"], f"rank{env.rank}.json"), "w") as f:
    json.dump({"env": env.__dict__, "sum": t.item(), "argv": sys.argv[1:], "node": os.environ["SLURMD_NODENAME"],
               "master": [os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]]}, f)
dist.destroy_process_group()
'''


def test_generated_script_rendezvous_across_two_nodes(cluster):
    """The generated script as-is (srun -> torchrun -> c10d rendezvous on node1), the CLI replaced by a
    probe (MH_ENTRY_MODULE): 4 ranks on 2 nodes find each other and read their place with rank_env."""
    probe_dir = cluster.work / "probe"
    probe_dir.mkdir()
    (probe_dir / "mh_probe.py").write_text(PROBE)
    script = sbatch_script(
        nodes=2,
        ranks_per_node=2,
        gpus_per_node=0,
        layout="l.yaml",
        train_args=["--train-iters", "3", "--log-jsonl=$(touch x)"],
        output=str(cluster.work / "probe.out"),
        job_name="probe",
    )
    env = dict(cluster.env)
    cluster.env.update(
        MH_ENTRY_MODULE="mh_probe",
        PROBE_DIR=str(probe_dir),
        PYTHONPATH=os.pathsep.join([str(probe_dir), env["PYTHONPATH"]]),
    )
    try:
        job = cluster.submit("probe", script)
    finally:
        cluster.env = env
    fields = cluster.wait(job, 180)
    log = cluster.output("probe")
    assert fields["JobState"] == "COMPLETED", (fields, log)
    results = [json.loads((probe_dir / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["sum"] for r in results] == [6.0] * 4
    assert {r["node"] for r in results} == {"node1", "node2"}
    for r, res in enumerate(results):
        e = res["env"]
        assert (e["rank"], e["world_size"], e["local_world_size"], e["launcher"]) == (r, 4, 2, "torchrun")
        assert res["argv"] == ["train", "--hetero-layout", "l.yaml", "--train-iters", "3", "--log-jsonl=$(touch x)"]
    assert not (ROOT / "x").exists()
    assert f"rendezvous node1:{20000 + job % 20000}" in log, log


def test_srun_tasks_without_torchrun_find_each_other(cluster):
    """rank_env's srun path on a real job step: 2 nodes x 2 srun tasks, no torchrun, no MASTER_* given:
    the address is the step's first node, the port comes from the job id."""
    probe_dir = cluster.work / "probe_srun"
    probe_dir.mkdir()
    (probe_dir / "mh_probe.py").write_text(PROBE)
    out = cluster.work / "probe_srun.out"
    env = dict(cluster.env)
    cluster.env.update(PROBE_DIR=str(probe_dir))
    try:
        job = cluster.submit(
            "probe_srun",
            textwrap.dedent(f"""\
            #!/bin/bash
            #SBATCH --nodes=2
            #SBATCH --ntasks-per-node=2
            #SBATCH --output={out}
            set -euo pipefail
            srun "$MH_PYTHON" {probe_dir / "mh_probe.py"} a "b c"
            """),
        )
    finally:
        cluster.env = env
    fields = cluster.wait(job, 180)
    log = cluster.output("probe_srun")
    assert fields["JobState"] == "COMPLETED", (fields, log)
    results = [json.loads((probe_dir / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["sum"] for r in results] == [6.0] * 4
    assert [r["node"] for r in results] == ["node1", "node1", "node2", "node2"]  # block distribution
    for r, res in enumerate(results):
        e = res["env"]
        assert (e["rank"], e["world_size"], e["local_rank"], e["local_world_size"], e["node_rank"], e["launcher"]) == (
            r,
            4,
            r % 2,
            2,
            r // 2,
            "srun",
        ), e
        assert res["master"] == ["node1", str(20000 + job % 20000)] and res["argv"] == ["a", "b c"]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _cpu_job(cluster: Cluster, name: str, layout_text: str, *train_args: str) -> tuple[dict[str, str], str]:
    layout = cluster.work / f"{name}.yaml"
    layout.write_text(layout_text)
    script = sbatch_script(
        nodes=2,
        ranks_per_node=2,
        gpus_per_node=0,
        layout=str(layout),
        job_name=name,
        train_args=list(train_args),
        output=str(cluster.work / f"{name}.out"),
    )
    job = cluster.submit(name, script)
    return cluster.wait(job, 300), cluster.output(name)


def _forked_train(layout: Path, *argv: str) -> int:
    """The same layout on 4 ranks forked from this process (`megatron-hetero train`'s own launcher,
    through the CLI entry: no second interpreter start-up): the reference the cluster runs match."""
    from megatron_hetero.cli import main

    return main(["train", "--hetero-layout", str(layout), "--nproc-per-node", "4", *argv])


@pytest.mark.timeout(900)
def test_b_two_node_cpu_run_matches_forked_run(cluster):
    log_slurm = cluster.work / "b_slurm.jsonl"
    fields, log = _cpu_job(cluster, "b_train", LAYOUT_4, "--train-iters", "3", "--log-jsonl", str(log_slurm))
    assert fields["JobState"] == "COMPLETED", (fields, log[-4000:])
    log_fork = cluster.work / "b_fork.jsonl"
    rc = _forked_train(cluster.work / "b_train.yaml", "--train-iters", "3", "--log-jsonl", str(log_fork))
    assert rc == 0, "the forked run failed (its output is above)"
    slurm, fork = _records(log_slurm), _records(log_fork)
    assert [r["iteration"] for r in slurm] == [r["iteration"] for r in fork] == [1, 2, 3], (slurm, fork)
    for a, b in zip(slurm, fork):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["loss"], b["loss"])


def test_c_invalid_layout_job_fails_with_our_message(cluster):
    fields, log = _cpu_job(cluster, "c_bad", LAYOUT_BAD, "--train-iters", "1")
    assert fields["JobState"] == "FAILED", (fields, log[-4000:])
    assert not fields["ExitCode"].startswith("0:"), fields
    assert "megatron-hetero train: invalid input" in log and "nosuch" in log, log[-4000:]


@pytest.mark.timeout(600)
def test_c_world_size_mismatch_job_fails_with_our_message(cluster):
    """A world-8 layout on 2 nodes x 2 ranks (the generator's check bypassed by calling sbatch_script)."""
    fields, log = _cpu_job(cluster, "c_world", LAYOUT_8, "--train-iters", "1")
    assert fields["JobState"] == "FAILED", (fields, log[-4000:])
    # check_world_size's message (the CLI may prefix it and wrap lines)
    flat = " ".join(log.split())
    assert "WORLD_SIZE=4 ranks = 2 nodes x 2 ranks per node" in flat and "uses 8 ranks (8 != 4)" in flat, log[-4000:]


@pytest.mark.timeout(1200)
def test_d_sigterm_saves_requeues_and_resumes(cluster):
    """SIGTERM to the batch shell (`scancel --batch --signal=TERM`: what `#SBATCH --signal=B:TERM@S` does S
    seconds before the time limit) mid-run: every rank stops after the same step and saves, the job requeues
    itself, and the requeued job (the same job id, Restarts=1) resumes from that checkpoint to the end with
    the loss an uninterrupted run has at the next step."""
    name = "d_signal"
    layout, save, jsonl = cluster.work / f"{name}.yaml", cluster.work / "d_ckpt", cluster.work / "d.jsonl"
    layout.write_text(LAYOUT_4)
    script = sbatch_script(
        nodes=2,
        ranks_per_node=2,
        gpus_per_node=0,
        layout=str(layout),
        job_name=name,
        train_args=["--save", str(save), "--train-iters", "30", "--log-jsonl", str(jsonl)],
        output=str(cluster.work / f"{name}.out"),
        signal_seconds=60,
        save_dir=str(save),
    )
    assert "#SBATCH --signal=B:TERM@60" in script and "#SBATCH --requeue" in script
    job = cluster.submit(name, script)
    deadline = time.monotonic() + 300
    while "iteration    2/30" not in cluster.output(name):
        assert time.monotonic() < deadline, f"no iteration 2 within 300 s:\n{cluster.output(name)[-4000:]}"
        time.sleep(0.5)
    subprocess.run(["scancel", "--batch", "--signal=TERM", str(job)], env=cluster.env, check=True, timeout=30)
    fields = cluster.wait(job, 900)
    log = cluster.output(name)
    assert (fields["JobState"], fields["Restarts"]) == ("COMPLETED", "1"), (fields, log[-6000:])
    m = re.search(r"received SIGTERM: stopped after iteration (\d+); checkpoint of iteration \1 saved in (\S+)", log)
    assert m and m.group(2) == str(save), log[-6000:]
    stopped = int(m.group(1))
    assert 2 <= stopped < 30
    assert f"stopped on SIGTERM after iteration {stopped} with a checkpoint in {save}" in log and "requeueing" in log
    assert f"(restart 1): resuming from iteration {stopped} in {save}" in log
    assert (save / "latest_checkpointed_iteration.txt").read_text().splitlines()[0] == "30"
    resumed = _records(jsonl)  # written by the requeued run
    assert [r["iteration"] for r in resumed] == list(range(stopped + 1, 31))
    # the uninterrupted run to the first resumed step, forked here
    fork = cluster.work / "d_fork.jsonl"
    rc = _forked_train(layout, "--train-iters", str(stopped + 1), "--log-jsonl", str(fork))
    assert rc == 0, "the forked run failed (its output is above)"
    want = _records(fork)[-1]
    assert want["iteration"] == stopped + 1
    assert abs(resumed[0]["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), (resumed[0]["loss"], want["loss"])

"""Ranks started by torchrun on two emulated nodes (two `torchrun --nnodes 2 --node-rank {0,1}`
processes on one host, rendezvous on 127.0.0.1) train a colocated and a disjoint layout and give
the same per-step losses as the forked run of the same layout; only global rank 0 writes the log.
A world size that differs from the layout's exits 2 on every rank with the arithmetic."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAYOUTS = {
    "colocated": "placement: colocated\nmodules:\n  vision: {dp: 4}\n  language: {tp: 2, dp: 2}\n"
    "edges: ['vision -> language']\n",
    "disjoint": "placement: disjoint\nmodules:\n  vision: {dp: 2}\n  language: {tp: 2}\n"
    "edges: ['vision -> language']\n",
}
LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines() if line.strip()]


def _torchrun(
    tmp_path: Path, layout: Path, log: Path, nproc: int = 2, *extra: str
) -> list[subprocess.CompletedProcess]:
    port = _free_port()
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
            str(nproc),
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
            "3",
            "--log-jsonl",
            str(log),
            "--hetero-comm-timeout",
            "120",
            *extra,
        ]
        out = (tmp_path / f"node{node}.log").open("w")
        procs.append((subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=out, stderr=subprocess.STDOUT), out))
    done = []
    for p, out in procs:
        try:
            rc = p.wait(timeout=400)
        finally:
            if p.poll() is None:
                p.kill()
            out.close()
        done.append(subprocess.CompletedProcess(p.args, rc, (tmp_path / f"node{len(done)}.log").read_text(), ""))
    return done


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("placement", ["colocated", "disjoint"])
def test_two_emulated_nodes_match_the_forked_run(tmp_path, placement):
    layout = tmp_path / f"{placement}.yaml"
    layout.write_text(LAYOUTS[placement])
    forked = tmp_path / "forked.jsonl"
    from megatron_hetero.cli import main  # the forked run: the CLI's own launcher, from this process

    rc = main(["train", "--hetero-layout", str(layout), "--train-iters", "3", "--log-jsonl", str(forked)])
    assert rc == 0, "the forked run failed (its output is above)"
    log = tmp_path / "torchrun.jsonl"
    nodes = _torchrun(tmp_path, layout, log)
    for n, p in enumerate(nodes):
        assert p.returncode == 0, f"node {n}:\n{p.stdout[-4000:]}"
    want, got = _losses(forked), _losses(log)
    assert len(want) == len(got) == 3, (want, got)
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-6 * abs(b), (got, want)
    # only global rank 0 (node 0) prints the iteration lines
    assert nodes[0].stdout.count("iteration    3/3") == 1 and "iteration" not in nodes[1].stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_world_size_mismatch_exits_2_on_every_rank(tmp_path):
    layout = tmp_path / "colocated.yaml"
    layout.write_text(LAYOUTS["colocated"])  # world 4, launched as 2 nodes x 1 rank
    nodes = _torchrun(tmp_path, layout, tmp_path / "never.jsonl", 1)
    for n, p in enumerate(nodes):
        assert p.returncode != 0, p.stdout
        assert "invalid input" in p.stdout and "WORLD_SIZE" in p.stdout, f"node {n}:\n{p.stdout[-3000:]}"
    assert not (tmp_path / "never.jsonl").exists()

"""scripts/gpu_check.sh on a machine without CUDA: every check says `skipped: no CUDA` (decided without starting Python), exit 0, the
JSON summary is written; bad arguments exit 2; the script parses (`bash -n`). The checks themselves
need a GPU (`bash scripts/gpu_check.sh` on one)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
CHECKS = ["te_train", "offload", "tflops", "preset", "calibrate"]


def _no_cuda() -> bool:
    """No NVIDIA driver on this machine (the script's own first test, without starting Python)."""
    return shutil.which("nvidia-smi") is None and not Path("/proc/driver/nvidia").exists()


def _run(*args: str, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "GPU_CHECK_PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60)


def test_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


@pytest.mark.timeout(120)
def test_dry_run_without_cuda_skips_every_check(tmp_path):
    if not _no_cuda():
        pytest.skip("this machine has a CUDA GPU: run the script itself")
    for args, names in [(("--dry-run",), CHECKS), (("offload",), ["offload"])]:
        proc = _run(*args, out=tmp_path)
        assert proc.returncode == 0, proc.stderr
        lines = [line for line in proc.stdout.splitlines() if not line.startswith("gpu_check: summary")]
        assert [line.split(":")[1].strip() for line in lines] == names, proc.stdout
        assert all(": skipped: no CUDA" in line for line in lines), proc.stdout
        doc = json.loads((tmp_path / "gpu_check.json").read_text())
        assert list(doc["checks"]) == names and doc["failed"] == 0
        assert {c["status"] for c in doc["checks"].values()} == {"skipped"}


def test_unknown_argument_exits_2(tmp_path):
    proc = _run("--bogus", out=tmp_path)
    assert proc.returncode == 2 and "unknown argument '--bogus'" in proc.stderr

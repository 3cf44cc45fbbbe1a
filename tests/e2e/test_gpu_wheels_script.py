"""scripts/gpu_wheels.sh: `install` puts a folder's wheels into a target offline (what gpu_check.sh
does on a GPU machine that reaches no registry) and prints the target; no wheel exits 3, no target 2;
`fetch --dry-run` names the pinned megatron-core for CPython 3.12 on x86-64 Linux."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_wheels.sh"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120)


def _wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel of a package `mh_fake_pkg` whose module holds VALUE = 42."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "mh_fake_pkg-0.1-py3-none-any.whl"
    info = "mh_fake_pkg-0.1.dist-info"
    files = {
        "mh_fake_pkg/__init__.py": "VALUE = 42\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: mh-fake-pkg\nVersion: 0.1\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr(f"{info}/RECORD", record)
    return path


def test_install_puts_the_wheels_into_the_target_offline(tmp_path):
    _wheel(tmp_path / "whl")
    target = tmp_path / "site"
    proc = _run("install", str(target), str(tmp_path / "whl"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(target)
    got = subprocess.run(
        [sys.executable, "-c", "import mh_fake_pkg; print(mh_fake_pkg.VALUE)"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(target)},
    )
    assert got.stdout.strip() == "42", got.stderr


def test_install_without_wheels_or_target_says_why(tmp_path):
    proc = _run("install", str(tmp_path / "site"), str(tmp_path / "empty"))
    assert proc.returncode == 3 and "no wheel in" in proc.stderr
    proc = _run("install")
    assert proc.returncode == 2 and "needs a TARGET" in proc.stderr
    assert _run("bogus").returncode == 2


def test_fetch_dry_run_names_install_sh_megatron_core_for_the_gpu_image():
    (pin,) = set(re.findall(r'"(megatron-core==[0-9.]+)"', (ROOT / "scripts" / "install.sh").read_text()))
    proc = _run("fetch", "--dry-run", "/tmp/x")
    assert proc.returncode == 0, proc.stderr
    cmd = proc.stdout.split()
    assert pin in cmd and "--python-version" in cmd and cmd[cmd.index("--python-version") + 1] == "3.12"
    assert "--no-deps" in cmd and cmd[cmd.index("-d") + 1] == "/tmp/x"
    assert any(p.endswith("x86_64") for p in cmd)

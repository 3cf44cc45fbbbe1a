"""The command in a fresh process (`python -m megatron_hetero` and `python -m megatron_hetero.cli`): the
exit code, stdout and the one-line stderr a user sees. What each subcommand says is checked in-process
(`cli.main`) in tests/pure/test_cli_plan.py and tests/pure/test_cli_search.py; these are the smokes
of the process itself."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_hetero import cli

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("module", ["megatron_hetero", "megatron_hetero.cli"])
def test_python_dash_m_entry_points(module) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", module, "search", "--world-size", "4", "--hardware", "nowhere"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("megatron-hetero search: invalid input: unknown hardware preset 'nowhere'")
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and all(name in proc.stdout for name in cli.subcommand_modules())


@pytest.mark.timeout(300)
def test_subprocess_exit_2_prints_message_on_stderr(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(
        textwrap.dedent("""\
            placement: colocated
            modules:
              vision:   {tp: 1, dp: 8}
              language: {tp: 2, pp: 2, dp: 3}
        """)
    )
    message = "module language: tp(2)*cp(1)*pp(2)*dp(3)=12 != ranks 0-7 (8)"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_hetero.cli", "plan", str(path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert f"megatron-hetero plan: invalid input: layout file {str(path)!r}: {message}" in proc.stderr
    assert "Traceback" not in proc.stderr

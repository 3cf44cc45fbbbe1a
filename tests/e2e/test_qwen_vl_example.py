"""examples/qwen_vl: the Qwen2.5-VL recipe cannot go stale.

- its CPU twin (cpu_twin.sh: the recipe's placement scaled to 4 CPU ranks, vision TP2·DP2 and
  language CP2·PP2, a tiny Qwen2.5-VL-shaped model on the digit captions) runs, saves, and the loss
  falls;
- the committed H100 layout, search ranking and sbatch script are what generate.sh (`search --out
  --encoder qwen2.5-vl` and `slurm` with the recipe's arguments) writes today, and the README quotes
  the ranking's pick.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "qwen_vl"
GENERATED = ["qwen_vl.yaml", "search.txt", "train.sbatch"]
ITERS = 4


def _env() -> dict:
    return dict(
        os.environ,
        MEGATRON_HETERO=f"{sys.executable} -m megatron_hetero",
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )


@pytest.mark.timeout(300)
def test_cpu_twin_runs_and_learns(tmp_path):
    from megatron_hetero.data.digits import write_digits_dataset

    digits = tmp_path / "digits"
    write_digits_dataset(digits)
    out = tmp_path / "twin"
    env = dict(_env(), DIGITS=str(digits), ITERS=str(ITERS))
    run = subprocess.run(
        ["bash", str(EXAMPLE / "cpu_twin.sh"), str(out)], env=env, capture_output=True, text=True, timeout=280
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    recs = [json.loads(x) for x in (out / "run.jsonl").read_text().splitlines() if x.strip()]
    loss = [r["loss"] for r in recs if "loss" in r and "eval_loss" not in r]
    assert len(loss) == ITERS and loss[-1] < loss[0] - 0.05, loss
    assert (out / "run" / "latest_checkpointed_iteration.txt").read_text().split()[0] == str(ITERS)
    twin, h100 = (yaml.safe_load((EXAMPLE / n).read_text()) for n in ("twin.yaml", "qwen_vl.yaml"))
    assert twin["placement"] == h100["placement"] and twin["edges"] == h100["edges"]


def test_committed_h100_files_are_what_search_and_slurm_write_today(tmp_path):
    out = tmp_path / "gen"
    run = subprocess.run(
        ["bash", str(EXAMPLE / "generate.sh"), str(out)], env=_env(), capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for name in GENERATED:
        assert (out / name).read_text() == (EXAMPLE / name).read_text(), (
            f"examples/qwen_vl/{name} is stale: rerun examples/qwen_vl/generate.sh"
        )
    layout = yaml.safe_load((EXAMPLE / "qwen_vl.yaml").read_text())
    assert layout["modules"]["vision"]["pp"] == 1  # the tower on one stage: what train runs
    best = next(x for x in (EXAMPLE / "search.txt").read_text().splitlines() if x.startswith("| 1 |"))
    assert best in (EXAMPLE / "README.md").read_text(), "README.md quotes another ranking than generate.sh prints"

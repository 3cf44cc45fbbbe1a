"""A fresh process that applies the compat set (what every CLI subcommand that builds Megatron models,
every torchrun/srun rank and the Megatron-LM launcher do first) has imported Megatron-core without
torch's compiler stack: `compat.startup` defers Megatron's `torch.compile` decorations to the first
call (about 2.5 s of CPU per process on these machines). And the other way round: the modules that plan,
price, search and parse the command line load no torch at all in a fresh process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CHECK = """
import sys
from megatron_hetero.compat import apply_compat
apply_compat()
import megatron.core.models.gpt, megatron.core.models.vision.clip_vit_model, megatron.core.jit as jit
import torch
assert "megatron.core" in sys.modules
assert "torch._dynamo" not in sys.modules, "Megatron-core's import compiled something"
assert torch.compile.__module__ == "torch", torch.compile  # the real one, restored
assert jit.jit_fuser.__module__ == "megatron_hetero.compat.startup", jit.jit_fuser
print("ok")
"""


@pytest.mark.timeout(120)
def test_fresh_process_imports_megatron_without_the_compiler():
    r = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=110)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


INSPECT = """
import sys
from megatron_hetero.cli import main
code = main(["checkpoint", "inspect", sys.argv[1]])
assert code == 2, code  # no checkpoint there: refused after the readers were imported
assert "megatron.core.dist_checkpointing" in sys.modules
assert "torch._dynamo" not in sys.modules, "checkpoint inspect imported torch's compiler stack"
print("ok")
"""


@pytest.mark.timeout(120)
def test_checkpoint_inspect_reads_without_the_compiler(tmp_path):
    """`checkpoint inspect` (no model built) imports Megatron-core's checkpoint readers without torch's
    compiler stack too: 8 s instead of 14 s a call, measured here."""
    r = subprocess.run(
        [sys.executable, "-c", INSPECT, str(tmp_path / "none")], capture_output=True, text=True, timeout=110
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout[-2000:] + r.stderr[-3000:]


#: Modules that plan, price, search and parse the command line without torch, above the pure floors
#: too (cli/, training's flags); imported together in one fresh process
TORCH_FREE = (
    "megatron_hetero.cli",
    "megatron_hetero.cli.search",
    "megatron_hetero.cli.schedule",
    "megatron_hetero.config.job",
    "megatron_hetero.planner.model",
    "megatron_hetero.planner.hardware_presets",
    "megatron_hetero.planner.cost",
    "megatron_hetero.planner.search",
    "megatron_hetero.planner.heteropipe",
    "megatron_hetero.planner.presets",
    "megatron_hetero.planner.profile_fit",
    "megatron_hetero.plan.schedule",
    "megatron_hetero.plan.schedule_check",
)


@pytest.mark.timeout(120)
def test_fresh_process_plans_without_torch():
    """What the static walk cannot see: importing these (and building the command's parser) in a fresh
    interpreter loads no torch module at all, function-level imports of the files above excluded."""
    code = (
        f"import sys, importlib; [importlib.import_module(m) for m in {TORCH_FREE!r}]; "
        "import megatron_hetero.cli as c; c.build_parser(); "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]; assert not bad, bad"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]

"""`--bf16` and `--fp16` in Megatron-LM's patched scripts with a layout, against the UNPATCHED scripts
(one model, one optimizer: Megatron's `Float16Module` and mixed-precision optimizer).

Needs a Megatron-LM tree (`MEGATRON_LM`, as tests/e2e/test_megatron_lm.py, whose flags and helpers
this file reuses); skipped with the reason otherwise. Every run: CPU/gloo, 3 iterations, dropout 0,
`--clip-grad 0`, `--use-cpu-initialization`; all runs of the file go through ONE process that imports
torch, Megatron-core and the tree's training package once and forks each run's ranks
(`tests/megatron_fork_batch.py`), one run after the other.

bf16: the spread of two homogeneous runs that differ only in TP (the unpatched script at TP1 and at
TP2: their largest relative difference over the training and validation lines) bounds the layout
runs' difference from the TP1 run (they start from its weights): colocated vision DP2 + language TP2
(`pretrain_vlm.py`, 2 ranks), disjoint vision @0 -> language @1 (`pretrain_vlm.py`, 2 ranks: the image embeddings cross
the islands in bf16) and
one GPT cut into segments, layers 0-1 TP2 @0-1 -> layers 2-3 DP2 @2-3 (`pretrain_gpt.py`, 4 ranks).
Megatron's TP2 run does not start from the TP1 run's weights (its first loss differs by ~1e-2, in
fp32 too), so that spread is wide; the layout runs are also held to `BF16_RTOL`.

fp16: colocated vision DP2 + language TP2 against the unpatched fp16 run at TP2 with a dynamic loss
scale that overflows at iteration 1 (`--initial-loss-scale 786432 --hysteresis 1`; iteration 3 overflows at 524288, so the
halved 393216 holds from iteration 2 on, with `NO_COMPILE`'s weights) and a warm-up
(`--lr-warmup-iters 2`): the same loss scale, skipped-iteration counts and learning rates in every log
line (the schedule does not advance on the skipped iteration), the losses within `BF16_RTOL`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Optional

import pytest

from test_megatron_lm import EDGE, GPT, GPT_SEGMENTS, ITERS, NO_COMPILE, REPO, TAG, TREE_ENV, VLM, Run, trees  # noqa: F401

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not TREE_ENV, reason=f"set MEGATRON_LM to a Megatron-LM tree at {TAG} to run these"),
]

#: every run of this file starts from Megatron's CPU initialisation
BASE = ["--use-cpu-initialization"] + ITERS
TP2 = ["--tensor-model-parallel-size", "2"]
#: floor of the TP spread, and the bound for a layout run that starts from the reference's weights
SPREAD_FLOOR = 1e-3
BF16_RTOL = 1e-3
#: --fp16 with a dynamic loss scale that overflows at iteration 1 (and then not), and a warm-up: on the
#: unpatched script at TP2 (DP1; the layout run starts from that reference layout's weights, as its
#: Megatron flags say). DP1: Megatron's default loss normalisation divides each rank's loss by its own
#: tokens (DP2 doubles the per-token gradients of DP1 before the reduction averages them), the layout
#: runs' by the global batch's tokens, so the scale at which fp16 gradients overflow is DP1's.
FP16 = ["--fp16", "--initial-loss-scale", "786432", "--hysteresis", "1", "--lr-warmup-iters", "2"] + TP2
COLOCATED = ["--hetero-module", "vision:dp=2", "--hetero-module", "language:tp=2"] + EDGE
# world 2 (Megatron's own checks need the reference's DP to divide the batch: world 3 is refused)
DISJOINT = ["--hetero-placement", "disjoint", "--hetero-module", "vision:dp=1", "--hetero-module", "language:dp=1"]
DISJOINT += EDGE

#: name -> (tree, script, ranks, flags)
RUNS = {
    "vlm_tp1": ("pristine", "pretrain_vlm.py", 2, VLM + ["--bf16"]),
    "vlm_tp2": ("pristine", "pretrain_vlm.py", 2, VLM + ["--bf16"] + TP2),
    "vlm_colocated": ("patched", "pretrain_vlm.py", 2, VLM + ["--bf16"] + COLOCATED),
    "vlm_disjoint": ("patched", "pretrain_vlm.py", 2, VLM + ["--bf16"] + DISJOINT),
    "gpt_tp1": ("pristine", "pretrain_gpt.py", 2, GPT + ["--bf16"]),
    "gpt_tp2": ("pristine", "pretrain_gpt.py", 2, GPT + ["--bf16"] + TP2),
    "gpt_segments": ("patched", "pretrain_gpt.py", 4, GPT + ["--bf16"] + GPT_SEGMENTS),
    "fp16_reference": ("pristine", "pretrain_vlm.py", 2, VLM + FP16),
    "fp16_colocated": ("patched", "pretrain_vlm.py", 2, VLM + FP16 + COLOCATED),
}


@pytest.fixture(scope="module")
def runs(trees, tmp_path_factory) -> dict[str, Run]:  # noqa: F811 - the fixture imported above
    """Every run of `RUNS`, one after the other from one forking process."""
    base = tmp_path_factory.mktemp("precision-runs")
    spec = [
        dict(nproc=n, script=str(trees[tree] / script), args=flags + BASE, out=str(base / f"{name}.log"))
        for name, (tree, script, n, flags) in RUNS.items()
    ]
    (base / "runs.json").write_text(json.dumps(spec))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    env.update(NO_COMPILE)
    cmd = [sys.executable, str(REPO / "tests" / "megatron_fork_batch.py"), str(base / "runs.json")]
    batch = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    print(batch.stdout)
    out = {}
    for i, name in enumerate(RUNS):
        text = (base / f"{name}.log").read_text() if (base / f"{name}.log").exists() else ""
        rc = 0 if f"run {i}: rc 0 " in batch.stdout else 1
        out[name] = Run(subprocess.CompletedProcess(cmd, rc, stdout=text, stderr=""))
    return out


def _lines(run: Run) -> dict[str, float]:
    """Every loss the run logged: training lines by iteration, validation lines by their label."""
    return {**{f"train {i}": v for i, v in run.losses.items()}, **{f"validation {k}": v for k, v in run.valid.items()}}


def largest_relative(run: Run, ref: Run) -> float:
    a, b = _lines(run), _lines(ref)
    assert sorted(a) == sorted(b), f"logged lines {sorted(a)} vs {sorted(b)}\n{run.tail()}"
    return max(abs(a[k] - b[k]) / abs(b[k]) for k in b)


def _ok(run: Run, what: str, n_lines: Optional[int] = 6) -> None:
    assert run.rc == 0, f"{what} failed:\n{run.tail()}"
    assert n_lines is None or len(_lines(run)) == n_lines, f"{what}: {_lines(run)}\n{run.tail()}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "script, cases",
    [("vlm", ("vlm_colocated", "vlm_disjoint")), ("gpt", ("gpt_segments",))],
    ids=["pretrain_vlm", "pretrain_gpt"],
)
def test_bf16_layouts_within_the_spread_of_tp1_and_tp2(runs, script, cases):
    ref, tp2 = runs[f"{script}_tp1"], runs[f"{script}_tp2"]
    _ok(ref, f"unpatched {script} TP1 --bf16")
    _ok(tp2, f"unpatched {script} TP2 --bf16")
    assert "loss scale: 1.0 |" in ref.out
    spread = largest_relative(tp2, ref)
    bound = max(spread, SPREAD_FLOOR)
    print(f"{script} --bf16: unpatched TP1 {_lines(ref)}; TP2 {_lines(tp2)}: spread {spread:.2e}, bound {bound:.2e}")
    for name in cases:
        run = runs[name]
        _ok(run, name)
        worst = largest_relative(run, ref)
        worst_abs = max(abs(_lines(run)[k] - v) for k, v in _lines(ref).items())
        print(f"{name} --bf16: {_lines(run)}: largest relative {worst:.2e} (absolute {worst_abs:.2e}) vs TP1")
        assert worst <= bound, f"{name}: {worst:.2e} > max(TP spread {spread:.2e}, {SPREAD_FLOOR})"
        assert worst <= BF16_RTOL, f"{name}: {worst:.2e} > {BF16_RTOL} from the weights it starts from"
        assert "loss scale: 1.0 |" in run.out and "number of skipped iterations:   0 |" in run.out


def _fields(run: Run, field: str) -> dict[int, str]:
    import re

    pat = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| " + re.escape(field) + r": ([^|]+) \|")
    return {int(m.group(1)): m.group(2).strip() for m in pat.finditer(run.out)}


@pytest.mark.timeout(900)
def test_fp16_loss_scale_skips_and_schedule_match_unpatched(runs):
    ref, run = runs["fp16_reference"], runs["fp16_colocated"]
    _ok(ref, "unpatched pretrain_vlm.py --fp16", None)
    _ok(run, "fp16 colocated vision DP2 + language TP2", None)
    scales, skipped, lrs = (_fields(ref, f) for f in ("loss scale", "number of skipped iterations", "learning rate"))
    # the reference overflows at iteration 1 (skipped: no lm loss, the scale halves, the rate stays 0)
    assert scales == {1: "393216.0", 2: "393216.0", 3: "393216.0"}, ref.tail()
    assert skipped == {1: "1", 2: "1", 3: "0"} and lrs[1] == "0.000000E+00", ref.tail()
    assert sorted(ref.losses) == [2, 3], ref.tail()
    assert _fields(run, "loss scale") == scales
    assert _fields(run, "number of skipped iterations") == skipped
    assert _fields(run, "learning rate") == lrs
    worst = largest_relative(run, ref)
    print(
        f"--fp16 colocated: loss scales {scales}, skipped {skipped}, learning rates {lrs}; losses {_lines(run)} vs "
        f"{_lines(ref)}: largest relative {worst:.2e}"
    )
    assert worst <= BF16_RTOL

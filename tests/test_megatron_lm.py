"""Megatron-LM's own training scripts (tag core_v0.16.1) with the plugin's patches (issue 12).

Needs a Megatron-LM tree: `MEGATRON_LM=/path/to/Megatron-LM` (the parts its scripts import are
enough, e.g. the vendored `shared/vendor/megatron-lm-core_v0.16.1`); skipped with the reason
otherwise. The tree is copied to a temporary folder and patched there (the patches must apply and
reverse cleanly); every run is a real `torchrun` on CPU/gloo, 2 ranks, 3 iterations of a tiny LLaVA
(fp32, no dropout, constant learning rate, --clip-grad 0), each script through
`python -m megatron_hetero.megatron_lm.run` (the CPU redirections for Megatron-LM).

Compared: the "lm loss" of Megatron's own log lines (6 significant digits; Megatron averages the
second line over iterations 1-2 because its first line does not reset the accumulators, and the
plugin's lines do the same). Reference: the unpatched pretrain_vlm.py at TP1·DP2.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

REPO = Path(__file__).resolve().parents[1]
TAG = "core_v0.16.1"
PATCHES = sorted((REPO / "patches" / "megatron-lm" / TAG).glob("*.patch"))
TREE_ENV = os.environ.get("MEGATRON_LM")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not TREE_ENV, reason="set MEGATRON_LM to a Megatron-LM tree at core_v0.16.1 to run these"),
]
if TREE_ENV and not (Path(TREE_ENV) / "pretrain_vlm.py").is_file():
    pytestmark.append(pytest.mark.skip(reason=f"MEGATRON_LM={TREE_ENV} holds no pretrain_vlm.py"))

COMMON = (
    "--hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 64 "
    "--micro-batch-size 1 --global-batch-size 4 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 "
    "--make-vocab-size-divisible-by 32 --transformer-impl local --no-gradient-accumulation-fusion "
    "--no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-persist-layer-norm "
    "--distributed-backend gloo --lr 1e-3 --lr-decay-style constant --lr-decay-iters 10 --log-interval 1 "
    "--eval-iters 0 --eval-interval 1000 --hidden-dropout 0 --attention-dropout 0 --clip-grad 0"
).split()
VLM = COMMON + ("--encoder-num-layers 1 --decoder-num-layers 2 --img-h 32 --img-w 32 --patch-dim 16 "
                "--ckpt-format torch").split()
GPT = COMMON + "--num-layers 2".split()
ITERS = ["--train-iters", "3"]
EDGE = ["--hetero-edge", "vision->language"]
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.Ee+-]+) \|")
RTOL = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Run:
    def __init__(self, proc: subprocess.CompletedProcess) -> None:
        self.rc, self.out = proc.returncode, proc.stdout + proc.stderr
        self.losses = {int(m.group(1)): float(m.group(2)) for m in LOSS.finditer(self.out)}

    def tail(self) -> str:
        return self.out[-4000:]


def torchrun(script: Path, args: list[str], nproc: int = 2, timeout: int = 400) -> Run:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # Megatron asserts it with TP > 1 (its examples set it)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(_free_port()), "-m", "megatron_hetero.megatron_lm.run",
           str(script), *args]
    return Run(subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout))


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _patch(tree: Path, patch: Path, *flags: str) -> subprocess.CompletedProcess:
    """`patch -p1` (or `git apply` where `patch` is not installed) in `tree`."""
    if shutil.which("patch"):
        cmd = ["patch", "-p1", "--batch", "-i", str(patch), *flags]
    else:
        cmd = ["git", "apply", *(["--check"] if "--dry-run" in flags else []), *(["-R"] if "-R" in flags else []),
               str(patch)]
    return subprocess.run(cmd, cwd=tree, capture_output=True, text=True)


@pytest.fixture(scope="module")
def trees(tmp_path_factory) -> dict[str, Path]:
    """{'pristine': copy of the tree, 'patched': copy with the patches applied}."""
    src = Path(TREE_ENV)
    base = tmp_path_factory.mktemp("megatron-lm")
    out = {}
    for name in ("pristine", "patched"):
        out[name] = base / name
        shutil.copytree(src, out[name], ignore=shutil.ignore_patterns("__pycache__", ".git"))
    for p in PATCHES:
        r = _patch(out["patched"], p)
        assert r.returncode == 0, f"{p.name} does not apply: {r.stdout}{r.stderr}"
    return out


def _close(a: float, b: float, rtol: float = RTOL) -> bool:
    return abs(a - b) <= rtol * abs(b)


def assert_losses(run: Run, ref: dict[int, float], rtol: float, what: str) -> float:
    assert run.rc == 0, f"{what} failed (rc {run.rc}):\n{run.tail()}"
    assert sorted(run.losses) == sorted(ref), f"{what}: iterations {sorted(run.losses)} vs {sorted(ref)}\n{run.tail()}"
    worst = max(abs(run.losses[i] - ref[i]) / abs(ref[i]) for i in ref)
    assert worst <= rtol, f"{what}: losses {run.losses} vs reference {ref} (largest rel. diff {worst:.2e})"
    print(f"{what}: largest relative loss difference {worst:.2e} over iterations {sorted(ref)}")
    return worst


@pytest.fixture(scope="module")
def reference(trees) -> dict[int, float]:
    """Per-iteration losses of the unpatched pretrain_vlm.py, TP1·DP2."""
    run = torchrun(trees["pristine"] / "pretrain_vlm.py", VLM + ITERS)
    assert run.rc == 0, run.tail()
    assert sorted(run.losses) == [1, 2, 3], run.tail()
    return run.losses


# -- patches and the check command (no torchrun) --------------------------------------------------
def test_patches_apply_and_reverse_cleanly(tmp_path):
    assert PATCHES, "no patch files"
    tree = tmp_path / "tree"
    shutil.copytree(TREE_ENV, tree, ignore=shutil.ignore_patterns("__pycache__", ".git"))
    before = {f: _sha(tree / f) for f in ("pretrain_vlm.py", "pretrain_gpt.py")}
    for p in PATCHES:  # `patch -p1` and `git apply` both accept them
        assert _patch(tree, p, "--dry-run").returncode == 0, p.name
        if shutil.which("git"):
            r = subprocess.run(["git", "apply", "--check", str(p)], cwd=tree, capture_output=True, text=True)
            assert r.returncode == 0, f"git apply --check {p.name}: {r.stderr}"
    for p in PATCHES:
        r = _patch(tree, p)
        assert r.returncode == 0 and "fuzz" not in r.stdout.lower() and "offset" not in r.stdout.lower(), r.stdout
    assert all(_sha(tree / f) != h for f, h in before.items())
    for p in reversed(PATCHES):
        r = _patch(tree, p, "-R")
        assert r.returncode == 0 and "fuzz" not in r.stdout.lower(), r.stdout
    assert {f: _sha(tree / f) for f in before} == before


def test_check_command_reports_and_applies(tmp_path):
    from megatron_hetero.cli import main

    tree = tmp_path / "tree"
    shutil.copytree(TREE_ENV, tree, ignore=shutil.ignore_patterns("__pycache__", ".git"))
    assert main(["megatron-lm", "check", str(tree)]) == 2  # supported, patches not applied
    assert main(["megatron-lm", "check", str(tree), "--apply"]) == 0
    assert main(["megatron-lm", "check", str(tree)]) == 0
    assert main(["megatron-lm", "check", str(tree), "--apply"]) == 0  # idempotent
    assert main(["megatron-lm", "check", str(tree), "--revert"]) == 0
    assert main(["megatron-lm", "check", str(tmp_path)]) == 2  # not a Megatron-LM tree
    with open(tree / "pretrain_vlm.py", "a") as f:
        f.write("# local change\n")
    assert main(["megatron-lm", "check", str(tree), "--apply"]) == 2
    assert _sha(tree / "pretrain_gpt.py") == _sha(Path(TREE_ENV) / "pretrain_gpt.py")  # nothing half-applied


# -- end to end: torchrun on CPU ---------------------------------------------------------------------
def test_patched_scripts_without_hetero_flags_are_upstream(trees, reference):
    run = torchrun(trees["patched"] / "pretrain_vlm.py", VLM + ITERS)
    assert run.rc == 0 and run.losses == reference, f"patched VLM {run.losses} vs {reference}\n{run.tail()}"
    gpt = {k: torchrun(trees[k] / "pretrain_gpt.py", GPT + ITERS + ["--tensor-model-parallel-size", "2"])
           for k in ("pristine", "patched")}
    for k, r in gpt.items():
        assert r.rc == 0 and sorted(r.losses) == [1, 2, 3], f"{k} pretrain_gpt.py:\n{r.tail()}"
    assert gpt["patched"].losses == gpt["pristine"].losses


def test_homogeneous_layout_as_flags_matches_unpatched(trees, reference):
    run = torchrun(trees["patched"] / "pretrain_vlm.py",
                   VLM + ITERS + ["--hetero-module", "vision:dp=2", "--hetero-module", "language:dp=2"] + EDGE)
    assert "training with colocated layout" in run.out, run.tail()
    assert_losses(run, reference, 1e-6, "homogeneous layout as --hetero-* flags")


@pytest.mark.parametrize("language", ["tp=2", "pp=2"])
def test_colocated_heterogeneous_layout_matches(trees, reference, language):
    run = torchrun(trees["patched"] / "pretrain_vlm.py",
                   VLM + ITERS + ["--hetero-module", "vision:dp=2", "--hetero-module", f"language:{language}"] + EDGE)
    assert_losses(run, reference, RTOL, f"colocated vision DP2 + language {language.upper()}")


def test_disjoint_layout_matches(trees, reference, tmp_path):
    layout = tmp_path / "disjoint.yaml"
    layout.write_text("placement: disjoint\nmodules:\n  vision: {dp: 1, ranks: '0-0'}\n"
                      "  language: {tp: 1, ranks: '1-1'}\nedges:\n  - vision -> language\n")
    run = torchrun(trees["patched"] / "pretrain_vlm.py", VLM + ITERS + ["--hetero-layout", str(layout)])
    assert "training with disjoint layout" in run.out, run.tail()
    assert_losses(run, reference, RTOL, "disjoint vision @0 -> language @1")


def test_disjoint_fan_in_at_world_4_matches(trees):
    """vision DP2 on ranks 0-1 -> language TP2 on ranks 2-3 (global batch 8, micro-batch size 2: 4
    micro-batches of 2 samples, one per vision DP rank, joined on the language side), against the
    unpatched TP1·DP2 run of the same batch."""
    args = [a for a in VLM]
    args[args.index("--micro-batch-size") + 1] = "2"
    args[args.index("--global-batch-size") + 1] = "8"
    ref = torchrun(trees["pristine"] / "pretrain_vlm.py", args + ITERS)
    assert ref.rc == 0 and sorted(ref.losses) == [1, 2, 3], ref.tail()
    run = torchrun(trees["patched"] / "pretrain_vlm.py",
                   args + ITERS + ["--hetero-placement", "disjoint", "--hetero-module", "vision:dp=2",
                                   "--hetero-module", "language:tp=2"] + EDGE, nproc=4)
    assert "vision tp1·pp1·dp2@0-1, language tp2·pp1·dp1@2-3" in run.out, run.tail()
    assert_losses(run, ref.losses, RTOL, "disjoint vision DP2 @0-1 -> language TP2 @2-3")


def test_broken_layout_exits_2_before_any_model(trees):
    run = torchrun(trees["patched"] / "pretrain_vlm.py",
                   VLM + ITERS + ["--hetero-module", "vision:dp=2", "--hetero-module", "language:tp=2,dp=2"] + EDGE)
    assert run.rc != 0
    assert "megatron-hetero megatron-lm: invalid input: module language: tp(2)" in run.out, run.tail()
    assert "building a multimodal model" not in run.out and "iteration " not in run.out
    refused = torchrun(trees["patched"] / "pretrain_vlm.py",
                       VLM + ITERS + ["--hetero-module", "vision:pp=2", "--hetero-module", "language:dp=2"] + EDGE)
    assert refused.rc != 0 and "module vision: pp=2" in refused.out, refused.tail()
    gpt = torchrun(trees["patched"] / "pretrain_gpt.py", GPT + ITERS + ["--hetero-module", "language:dp=2"])
    assert gpt.rc != 0 and "pretrain_gpt.py trains one model on one layout" in gpt.out, gpt.tail()


def test_checkpoint_of_unpatched_run_resumes_in_a_layout(trees, tmp_path):
    """A TP2 torch-format checkpoint of the unpatched script (2 files: mp_rank_00, mp_rank_01) resumes
    with vision DP2 + language TP1·DP2 (every tensor resharded, Adam state included) with the losses
    of the unpatched run resumed from it; and a checkpoint saved by a layout's run resumes in the
    unpatched script the same way."""
    ckpt = tmp_path / "ckpt"
    tp2 = ["--tensor-model-parallel-size", "2"]
    saved = torchrun(trees["pristine"] / "pretrain_vlm.py",
                     VLM + tp2 + ["--train-iters", "1", "--save", str(ckpt), "--save-interval", "1"])
    assert saved.rc == 0, saved.tail()
    assert sorted(p.name for p in (ckpt / "iter_0000001").iterdir()) == ["mp_rank_00", "mp_rank_01"]
    resume = VLM + tp2 + ["--train-iters", "4", "--load", str(ckpt), "--override-opt_param-scheduler"]
    upstream = torchrun(trees["pristine"] / "pretrain_vlm.py", resume)
    assert upstream.rc == 0 and sorted(upstream.losses) == [2, 3, 4], upstream.tail()
    hetero = torchrun(trees["patched"] / "pretrain_vlm.py",
                      resume + ["--hetero-module", "vision:dp=2", "--hetero-module", "language:dp=2"] + EDGE)
    assert "from iteration 1" in hetero.out, hetero.tail()
    assert _close(hetero.losses.get(2, float("nan")), upstream.losses[2]), (hetero.losses, upstream.losses)
    assert_losses(hetero, upstream.losses, RTOL, "resumed in vision DP2 + language DP2")

    # And back: a layout's run saves a TP2 torch checkpoint (Megatron's own save_checkpoint on the
    # reference layout) that the unpatched script resumes from with the same losses.
    ckpt_h = tmp_path / "ckpt-hetero"
    saved_h = torchrun(
        trees["patched"] / "pretrain_vlm.py",
        VLM + tp2 + ["--train-iters", "1", "--save", str(ckpt_h), "--save-interval", "1",
                     "--hetero-module", "vision:dp=2", "--hetero-module", "language:tp=2"] + EDGE)
    assert saved_h.rc == 0, saved_h.tail()
    assert sorted(p.name for p in (ckpt_h / "iter_0000001").iterdir()) == ["mp_rank_00", "mp_rank_01"]
    back = torchrun(trees["pristine"] / "pretrain_vlm.py",
                    VLM + tp2 + ["--train-iters", "4", "--load", str(ckpt_h), "--override-opt_param-scheduler"])
    assert_losses(back, upstream.losses, RTOL, "unpatched run resumed from a layout's checkpoint")

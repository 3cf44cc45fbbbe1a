"""Megatron-LM's own training scripts (tag core_v0.19.0) with the plugin's patches (docs/megatron-lm.md).

Needs a Megatron-LM tree: `MEGATRON_LM=/path/to/Megatron-LM` (the parts its scripts import are
enough, e.g. the vendored `shared/vendor/megatron-lm-core_v0.19.0`); skipped with the reason
otherwise. The tree is copied to a temporary folder and patched there (the patches must apply and
reverse cleanly); every run is on CPU/gloo, 2 ranks (4 where the layout needs them), forked from one
process by `tests/megatron_fork.py` with torchrun's environment (one test runs torchrun itself), 3
iterations of a tiny LLaVA or GPT (fp32, no dropout, constant learning rate, --clip-grad 0), each
script through `python -m megatron_hetero.megatron_lm.run` (the CPU redirections for Megatron-LM),
with `torch.compile` off (`NO_COMPILE`) in every run.

Compared: the "lm loss" of Megatron's own log lines (6 significant digits; Megatron averages the
second line over iterations 1-2 because its first line does not reset the accumulators, and the
plugin's lines do the same) and of its validation lines (`--eval-iters 1 --eval-interval 2`: at
iteration 2, then after training on the validation and the test set). References: the unpatched
pretrain_vlm.py / pretrain_gpt.py at TP1·DP2. The three layout cases (colocated, disjoint fan-in,
GPT segments) run with Megatron's default --clip-grad 1.0 (engaged: the reference's grad norm exceeds
1.0), --swiglu and full activation recompute, in the reference and the layout run alike.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import re
import select
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import pytest

REPO = Path(__file__).resolve().parents[2]
TAG = "core_v0.19.0"
PATCHES = sorted((REPO / "patches" / "megatron-lm" / TAG).glob("*.patch"))
TREE_ENV = os.environ.get("MEGATRON_LM")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not TREE_ENV, reason=f"set MEGATRON_LM to a Megatron-LM tree at {TAG} to run these"),
]
if TREE_ENV and not (Path(TREE_ENV) / "pretrain_vlm.py").is_file():
    pytestmark.append(pytest.mark.skip(reason=f"MEGATRON_LM={TREE_ENV} holds no pretrain_vlm.py"))

COMMON = (
    "--hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 64 "
    "--micro-batch-size 1 --global-batch-size 4 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 "
    "--make-vocab-size-divisible-by 32 --transformer-impl local --no-gradient-accumulation-fusion "
    "--no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-persist-layer-norm "
    "--distributed-backend gloo --lr 1e-3 --lr-decay-style constant --lr-decay-iters 10 --log-interval 1 "
    "--eval-iters 1 --eval-interval 2 --hidden-dropout 0 --attention-dropout 0 --clip-grad 0"
).split()


def _with(args: list[str], **values: str) -> list[str]:
    """`args` with the values of some flags replaced (`micro_batch_size="2"` -> --micro-batch-size 2)."""
    out = list(args)
    for k, v in values.items():
        out[out.index("--" + k.replace("_", "-")) + 1] = v
    return out


VLM = (
    COMMON
    + ("--encoder-num-layers 1 --decoder-num-layers 2 --img-h 32 --img-w 32 --patch-dim 16 --ckpt-format torch").split()
)

# GPT: 4 layers (two segments of 2), untied embeddings (a layout with several stages needs them),
# 8 samples per step in micro-batches of 2.
GPT = (
    _with(COMMON, micro_batch_size="2", global_batch_size="8")
    + ("--num-layers 4 --untie-embeddings-and-output-weights").split()
)
ITERS = ["--train-iters", "3"]
EDGE = ["--hetero-edge", "vision->language"]
# one GPT cut into two segments on disjoint islands: layers 0-1 TP2 on ranks 0-1, layers 2-3 DP2 on ranks 2-3
GPT_SEGMENTS = [
    "--hetero-placement",
    "disjoint",
    "--hetero-module",
    "language_a:tp=2,layers=0-1",
    "--hetero-module",
    "language_b:dp=2,layers=2-3",
    "--hetero-edge",
    "language_a->language_b",
]
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.Ee+-]+) \|")
VALID = re.compile(r"validation loss at (iteration \d+(?: on \w+ set)?) \| lm loss value: ([0-9.Ee+-]+) \|")
RTOL = 1e-5
#: every run of the Megatron-LM test files, reference and layout run alike: `torch.compile` off.
#: `initialize_megatron` warms Megatron's `jit_fuser` (torch.compile) kernels in every rank of every run;
#: on CPU that is inductor compiling C++ (~18 s of CPU per 2-rank run with a warm inductor cache, minutes
#: per new dtype on a fresh machine) for kernels these flags mostly never train with (the fusions are
#: off; with --swiglu that function trains uncompiled). The compiled warm-up also draws from the RNG differently, so a run with and one
#: without the compiler start from other weights: never mix them in a comparison.
NO_COMPILE = {"TORCH_COMPILE_DISABLE": "1"}  # docs/megatron-lm.md#tests


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Run:
    def __init__(self, proc: subprocess.CompletedProcess) -> None:
        self.rc, self.out = proc.returncode, proc.stdout + proc.stderr
        self.losses = {int(m.group(1)): float(m.group(2)) for m in LOSS.finditer(self.out)}
        self.valid = {m.group(1): float(m.group(2)) for m in VALID.finditer(self.out)}

    def tail(self) -> str:
        return self.out[-4000:]


class ForkServer:
    """One `tests/megatron_fork_batch.py --serve` process for every forked script run of the test
    session (the Megatron-LM test files share it through `torchrun`): it imports torch, Megatron-core,
    the tree's training package and the tokenizers once, and forks each run's ranks from that state
    (each rank gets the run's own environment), instead of one fresh `megatron_fork.py` per run (about
    8 s of CPU each on the 2-core machines). A run past its timeout kills the server (the next run
    starts a new one) and raises `subprocess.TimeoutExpired`, as `subprocess.run` would."""

    def __init__(self) -> None:
        self.proc: Optional[subprocess.Popen] = None
        self.errors: Optional[Path] = None

    def _start(self, env: dict) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            fd, name = tempfile.mkstemp(prefix="megatron-fork-server-", suffix=".err")
            self.errors = Path(name)
            self.proc = subprocess.Popen(
                [sys.executable, str(REPO / "tests" / "megatron_fork_batch.py"), "--serve"],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=fd,
                text=True,
                start_new_session=True,
            )
            os.close(fd)
            atexit.register(self.stop)
        return self.proc

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def run(self, nproc: int, script: Path, args: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
        proc = self._start(env)
        fd, out = tempfile.mkstemp(prefix="megatron-fork-run-", suffix=".log")
        os.close(fd)
        request = {"nproc": nproc, "script": str(script), "args": [str(a) for a in args], "out": out, "env": env}
        cmd = ["megatron_fork_batch --serve", str(nproc), str(script), *map(str, args)]
        try:
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.flush()
            ready, _, _ = select.select([proc.stdout], [], [], timeout)
            if not ready:
                self.stop()
                raise subprocess.TimeoutExpired(cmd, timeout, output=Path(out).read_text(errors="replace"))
            line = proc.stdout.readline()
            text = Path(out).read_text(errors="replace")
        finally:
            Path(out).unlink(missing_ok=True)
        if not line:  # the server itself died: its own error output says why
            self.stop()
            return subprocess.CompletedProcess(cmd, 1, text, self.errors.read_text(errors="replace"))
        return subprocess.CompletedProcess(cmd, int(json.loads(line)["rc"]), text, "")


FORK_SERVER = ForkServer()


def torchrun(
    script: Path,
    args: list[str],
    nproc: int = 2,
    timeout: int = 400,
    real: bool = False,
    extra_env: Optional[dict] = None,
) -> Run:
    """`script` with `args` on `nproc` CPU ranks through `megatron_hetero.megatron_lm.run`: forked from
    the session's fork server, which imported everything once (`ForkServer`: the same rendezvous
    environment and the same launcher code per rank as `tests/megatron_fork.py`, minutes less of
    start-up over the suite), or with `real`, under torchrun itself; `extra_env`: added to the ranks'
    environment (e.g. `MEGATRON_FORK_PROBE`, forked runs only)."""
    env = {**os.environ, **(extra_env or {})}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # Megatron asserts it with TP > 1 (its examples set it)
    env.update(NO_COMPILE)
    for _ in range(3):  # another process may take the free port before the store binds it: a new port
        if real:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                str(nproc),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(_free_port()),
                "-m",
                "megatron_hetero.megatron_lm.run",
            ]
            cmd += [str(script), *args]
            run = Run(subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout))
        else:
            run = Run(FORK_SERVER.run(nproc, script, args, env, timeout))
        if run.rc == 0 or "EADDRINUSE" not in run.out:
            break
    return run


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _patch(tree: Path, patch: Path, *flags: str) -> subprocess.CompletedProcess:
    """`patch -p1` (or `git apply` where `patch` is not installed) in `tree`."""
    if shutil.which("patch"):
        cmd = ["patch", "-p1", "--batch", "-i", str(patch), *flags]
    else:
        cmd = [
            "git",
            "apply",
            *(["--check"] if "--dry-run" in flags else []),
            *(["-R"] if "-R" in flags else []),
            str(patch),
        ]
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


def assert_losses(
    run: Run, ref: dict[int, float], rtol: float, what: str, ref_valid: Optional[dict[str, float]] = None
) -> float:
    """Training losses (and with `ref_valid` Megatron's validation lines) within `rtol` of the reference."""
    assert run.rc == 0, f"{what} failed (rc {run.rc}):\n{run.tail()}"
    assert sorted(run.losses) == sorted(ref), f"{what}: iterations {sorted(run.losses)} vs {sorted(ref)}\n{run.tail()}"
    worst = max(abs(run.losses[i] - ref[i]) / abs(ref[i]) for i in ref)
    worst_abs = max(abs(run.losses[i] - ref[i]) for i in ref)
    assert worst <= rtol, f"{what}: losses {run.losses} vs reference {ref} (largest rel. diff {worst:.2e})"
    if ref_valid is not None:
        assert sorted(run.valid) == sorted(ref_valid), f"{what}: validation {run.valid} vs {ref_valid}\n{run.tail()}"
        worst_v = max(abs(run.valid[k] - ref_valid[k]) / abs(ref_valid[k]) for k in ref_valid)
        assert worst_v <= rtol, f"{what}: validation {run.valid} vs reference {ref_valid} ({worst_v:.2e})"
        worst = max(worst, worst_v)
        worst_abs = max(worst_abs, max(abs(run.valid[k] - ref_valid[k]) for k in ref_valid))
    print(
        f"{what}: largest relative loss difference {worst:.2e} (absolute {worst_abs:.2e}) over iterations "
        f"{sorted(ref)}" + (f" and {len(ref_valid)} validation lines" if ref_valid else "") + f"; losses {run.losses}"
    )
    return worst


def _unpatched(trees, script: str, args: list[str]) -> Run:
    """A reference run of the unpatched `script`: 3 iterations, validation at 2 and after training."""
    run = torchrun(trees["pristine"] / script, args + ITERS)
    assert run.rc == 0, run.tail()
    assert sorted(run.losses) == [1, 2, 3], run.tail()
    assert sorted(run.valid) == ["iteration 2", "iteration 3 on test set", "iteration 3 on validation set"], run.tail()
    return run


@pytest.fixture(scope="module")
def reference(trees) -> Run:
    """The unpatched pretrain_vlm.py, TP1·DP2."""
    return _unpatched(trees, "pretrain_vlm.py", VLM)


@pytest.fixture(scope="module")
def gpt_reference(trees) -> Run:
    """The unpatched pretrain_gpt.py, TP1·DP2."""
    return _unpatched(trees, "pretrain_gpt.py", GPT)


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
    run = torchrun(trees["patched"] / "pretrain_vlm.py", VLM + ITERS, real=True)  # torchrun itself, once
    assert run.rc == 0 and (run.losses, run.valid) == (reference.losses, reference.valid), (
        f"patched VLM {run.losses} vs {reference.losses}\n{run.tail()}"
    )


def test_patched_gpt_without_hetero_flags_is_upstream(trees, gpt_reference):
    gpt = torchrun(trees["patched"] / "pretrain_gpt.py", GPT + ITERS)
    assert gpt.rc == 0 and sorted(gpt.losses) == [1, 2, 3], f"patched pretrain_gpt.py:\n{gpt.tail()}"
    assert (gpt.losses, gpt.valid) == (gpt_reference.losses, gpt_reference.valid)


def test_gpt_segments_with_their_own_tp_dp_match(trees, clip_references):
    """One GPT cut into two segments on disjoint islands: layers 0-1 TP2 on ranks 0-1, layers 2-3 DP2
    on ranks 2-3 (4 micro-batches of 2 samples, split over language_b's DP ranks), against the
    unpatched TP1·DP2 run, with Megatron's default --clip-grad 1.0 engaged: training and validation
    losses and the logged grad norm (the norm over both segments' gradients)."""
    ref = clip_references("pretrain_gpt.py")
    run = torchrun(
        trees["patched"] / "pretrain_gpt.py", _default_clip_args("pretrain_gpt.py") + ITERS + GPT_SEGMENTS, nproc=4
    )
    assert "language_a tp2·pp1·dp1@0-1, language_b tp1·pp1·dp2@2-3" in run.out, run.tail()
    assert_losses(
        run,
        ref.losses,
        RTOL,
        "GPT: segments TP2 @0-1 -> DP2 @2-3, --swiglu, recompute, default --clip-grad 1.0",
        ref.valid,
    )
    assert_grad_norms(run, ref)


#: counts each rank's parameter all-gathers by where they were dispatched (`tests/megatron_fork.py`)
PARAM_GATHER_PROBE = {"MEGATRON_FORK_PROBE": str(REPO / "tests" / "e2e" / "param_gather_probe.py")}
PROBE_LINE = re.compile(r"param-gather probe rank (\d+): (\{[^}]*\})")


def _gathers(run: Run) -> dict[int, dict[str, int]]:
    """rank -> the probe's counts of parameter all-gathers (hook, step, forced, other)."""
    return {int(m.group(1)): json.loads(m.group(2)) for m in PROBE_LINE.finditer(run.out)}


def test_gpt_segments_with_overlap_grad_reduce_and_param_gather_match(trees):
    """The segments case with the distributed optimizer, --overlap-grad-reduce (buckets of 20,000
    parameters: several per module, each reduced during the module's last backward of the step,
    `runtime/module_state.py`) and --overlap-param-gather (the optimizer step all-gathers nothing;
    each bucket's updated parameters are all-gathered by DDP's forward pre-hooks in the next forward;
    before each evaluation and at the end synchronously) against the unpatched script with the same
    flags: the same training and validation losses and grad norms. The probe counts every rank's
    all-gathers: none in the optimizer step, several in forward pre-hooks, and forced ones (the
    evaluations), in the layout run as in the unpatched one; the flag dropped, they would all be in the
    optimizer step."""
    overlap = ["--overlap-grad-reduce", "--ddp-bucket-size", "20000", "--overlap-param-gather"]
    args = _default_clip_args("pretrain_gpt.py") + overlap + ITERS
    ref = torchrun(trees["pristine"] / "pretrain_gpt.py", args, extra_env=PARAM_GATHER_PROBE)
    assert ref.rc == 0 and sorted(ref.losses) == [1, 2, 3] and len(ref.valid) == 3, ref.tail()
    run = torchrun(trees["patched"] / "pretrain_gpt.py", args + GPT_SEGMENTS, nproc=4, extra_env=PARAM_GATHER_PROBE)
    assert_losses(run, ref.losses, RTOL, "GPT: segments with --overlap-grad-reduce --overlap-param-gather", ref.valid)
    assert_grad_norms(run, ref)
    for what, r, world in (("unpatched", ref, 2), ("layout", run, 4)):
        counts = _gathers(r)
        print(f"{what}: parameter all-gathers per rank {counts}")
        assert sorted(counts) == list(range(world)), r.tail()
        for rank, c in counts.items():
            assert c["step"] == 0 and c["other"] == 0, (what, rank, c)  # not in the optimizer step
            # from the pre-hooks of the next forwards (steps 2 and 3 or the evaluation: >= 2 buckets
            # each), and synchronously before the evaluations
            assert c["hook"] >= 4 and c["forced"] >= 2, (what, rank, c)


def test_gpt_uneven_pipeline_split_matches(trees, clip_references):
    """One module `language:pp=2` with --decoder-first-pipeline-num-layers 1: Megatron's uneven split
    of the module's own pipeline (stage 0 layer 0, stage 1 layers 1-3, as Megatron's TransformerConfig
    num_layers_in_first_pipeline_stage builds it; the reference layout stays PP 1), each stage's
    weights copied from the reference at the offset Megatron gave its layers, against the unpatched
    TP1·DP2 run: training and validation losses and grad norms (the production flags and the
    reference of the segments case)."""
    ref = clip_references("pretrain_gpt.py")
    uneven = ["--decoder-first-pipeline-num-layers", "1", "--hetero-module", "language:pp=2"]
    run = torchrun(trees["patched"] / "pretrain_gpt.py", _default_clip_args("pretrain_gpt.py") + ITERS + uneven)
    assert "module language: pipeline stages hold [1, 3] layers" in run.out, run.tail()
    for stage, layers in ((0, "0-0"), (1, "1-3")):
        assert f"module language: pipeline stage {stage} holds layers {layers}" in run.out, run.tail()
    assert_losses(run, ref.losses, RTOL, "GPT: language PP2 split 1 + 3 layers", ref.valid)
    assert_grad_norms(run, ref)


def test_homogeneous_layout_as_flags_matches_unpatched(trees, reference):
    run = torchrun(
        trees["patched"] / "pretrain_vlm.py",
        VLM + ITERS + ["--hetero-module", "vision:dp=2", "--hetero-module", "language:dp=2"] + EDGE,
    )
    assert "training with colocated layout" in run.out, run.tail()
    assert_losses(run, reference.losses, 1e-6, "homogeneous layout as --hetero-* flags", reference.valid)


def test_colocated_heterogeneous_layout_matches(trees, clip_references):
    """vision DP2 + language TP2 colocated on 2 ranks, Megatron's default --clip-grad 1.0 engaged:
    losses, validation and the logged grad norm of the unpatched TP1·DP2 run."""
    ref = clip_references("pretrain_vlm.py")
    extra = ["--hetero-module", "vision:dp=2", "--hetero-module", "language:tp=2"] + EDGE
    run = torchrun(trees["patched"] / "pretrain_vlm.py", _default_clip_args("pretrain_vlm.py") + ITERS + extra)
    assert_losses(
        run,
        ref.losses,
        RTOL,
        "colocated vision DP2 + language TP2, --swiglu, recompute, default --clip-grad 1.0",
        ref.valid,
    )
    assert_grad_norms(run, ref)


@pytest.mark.parametrize("mode", ["direct", "hierarchical"])
def test_disjoint_fan_in_at_world_4_matches(trees, clip_references, mode):
    """vision DP2 on ranks 0-1 -> language TP2 on ranks 2-3 (global batch 8, micro-batch size 2: 4
    micro-batches of 2 samples, one per vision DP rank, joined on the language side), against the
    unpatched TP1·DP2 run of the same batch, with Megatron's default --clip-grad 1.0 engaged (the two
    islands clip by one norm over both modules' gradients); in both boundary modes (hierarchical: the
    leader route, `--hetero-boundary-mode`)."""
    ref = clip_references("pretrain_vlm.py")
    run = torchrun(
        trees["patched"] / "pretrain_vlm.py",
        _default_clip_args("pretrain_vlm.py")
        + ITERS
        + ["--hetero-placement", "disjoint", "--hetero-module", "vision:dp=2", "--hetero-module", "language:tp=2"]
        + ["--hetero-boundary-mode", mode]
        + EDGE,
        nproc=4,
    )
    assert "vision tp1·pp1·dp2@0-1, language tp2·pp1·dp1@2-3" in run.out, run.tail()
    assert_losses(
        run, ref.losses, RTOL, "disjoint vision DP2 @0-1 -> language TP2 @2-3, --swiglu, recompute, clip 1.0", ref.valid
    )
    assert_grad_norms(run, ref)


GRAD_NORM = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| grad norm: ([0-9.Ee+-]+) \|")


def _default_clip(args: list[str]) -> list[str]:
    """`args` without `--clip-grad 0`: Megatron's default --clip-grad 1.0."""
    i = args.index("--clip-grad")
    return args[:i] + args[i + 2 :]


#: Production flags the three layout cases and their unpatched references take as well: the gated
#: MLP (the language side is TP2 there and starts from the TP1 reference's weights, so each TP rank's
#: linear_fc1 must get its own gate and up rows, weights.py; with a plain chunk of [gate; up] the
#: colocated case misses by 3.5e-4) and full activation recompute (changes memory, never the losses).
PRODUCTION = (
    "--use-distributed-optimizer --swiglu --recompute-granularity full --recompute-method uniform "
    "--recompute-num-layers 1"
).split()


def _default_clip_args(script: str) -> list[str]:
    """The layout cases' flags: global batch 8 in micro-batches of 2, Megatron's default --clip-grad
    1.0, and `PRODUCTION`."""
    base = VLM if script == "pretrain_vlm.py" else GPT
    return _default_clip(_with(base, micro_batch_size="2", global_batch_size="8")) + PRODUCTION


@pytest.fixture(scope="module")
def clip_references(trees):
    """script -> the unpatched script with Megatron's default clipping, run once per script on first use."""
    cache: dict[str, Run] = {}

    def get(script: str) -> Run:
        if script not in cache:
            cache[script] = _unpatched(trees, script, _default_clip_args(script))
        return cache[script]

    return get


def assert_grad_norms(run: Run, ref: Run, clip: float = 1.0) -> None:
    """The layout run logs the unpatched run's grad norm at every iteration (to the log line's 3
    decimals), and that norm exceeds `clip` (the runs' --clip-grad, Megatron's default 1.0)
    everywhere: the clipping is engaged."""
    ref_norms = {int(m.group(1)): float(m.group(2)) for m in GRAD_NORM.finditer(ref.out)}
    assert sorted(ref_norms) == [1, 2, 3] and min(ref_norms.values()) > clip, ref_norms  # clipping engaged
    norms = {int(m.group(1)): float(m.group(2)) for m in GRAD_NORM.finditer(run.out)}
    assert norms.keys() == ref_norms.keys() and all(abs(norms[i] - ref_norms[i]) <= 2e-3 for i in norms), (
        norms,
        ref_norms,
    )
    print(f"grad norms: layout {norms}, unpatched {ref_norms}")


def test_broken_layout_exits_2_before_any_model(trees):
    run = torchrun(
        trees["patched"] / "pretrain_vlm.py",
        VLM + ITERS + ["--hetero-module", "vision:dp=2", "--hetero-module", "language:tp=2,dp=2"] + EDGE,
    )
    assert run.rc != 0
    assert "megatron-hetero megatron-lm: invalid input: module language: tp(2)" in run.out, run.tail()
    assert "building a multimodal model" not in run.out and "iteration " not in run.out
    gpt = torchrun(
        trees["patched"] / "pretrain_gpt.py",
        GPT
        + ITERS
        + [
            "--hetero-placement",
            "disjoint",
            "--hetero-module",
            "language_a:layers=0-1",
            "--hetero-module",
            "language_b:layers=3-3",
            "--hetero-edge",
            "language_a->language_b",
        ],
    )
    assert gpt.rc != 0
    assert (
        "megatron-hetero megatron-lm: invalid input: language segments must cover their layers in order from 0; "
        "language_b starts at layer 3, expected 2"
    ) in gpt.out, gpt.tail()
    assert "building GPT model" not in gpt.out and "iteration " not in gpt.out


def test_gpt_data_whose_index_cache_unpickles_exits_2(trees, tmp_path):
    """`--data-path PREFIX` whose index cache holds a pickle (Megatron reads it with
    numpy.load(allow_pickle=True)): refused with a layout (exit 2, naming the file and
    --trust-dataset-code) before any rank reads data; the pickle never runs."""
    import pickle

    marker = tmp_path / "marker"

    class RunsCode:
        def __reduce__(self):
            return eval, (f"__import__('pathlib').Path({str(marker)!r}).write_text('ran')",)

    cache = tmp_path / "corpus_text_document" / "cache" / "GPTDataset_indices"
    cache.mkdir(parents=True)
    (cache / "0123-GPTDataset-train-document_index.npy").write_bytes(pickle.dumps(RunsCode()))
    args = [a for a in GPT if a != "--mock-data"] + [
        "--data-path",
        str(tmp_path / "corpus_text_document"),
        "--split",
        "100,0,0",
    ]
    run = torchrun(trees["patched"] / "pretrain_gpt.py", args + ITERS + ["--hetero-module", "language:dp=2"])
    assert run.rc != 0
    assert "megatron-hetero megatron-lm: invalid input: the data flags --data-path" in run.out, run.tail()
    assert "document_index.npy" in run.out and "--trust-dataset-code" in run.out, run.tail()
    assert "building GPT model" not in run.out and not marker.exists()


def test_checkpoint_of_unpatched_run_resumes_in_a_layout(trees, tmp_path):
    """A TP2 torch-format checkpoint of the unpatched script (2 files: mp_rank_00, mp_rank_01) resumes
    with vision DP2 + language TP1·DP2 (every tensor resharded, Adam state included) with the losses
    of the unpatched run resumed from it; and a checkpoint saved by a layout's run resumes in the
    unpatched script the same way."""
    ckpt = tmp_path / "ckpt"
    tp2 = ["--tensor-model-parallel-size", "2"]
    saved = torchrun(
        trees["pristine"] / "pretrain_vlm.py",
        VLM + tp2 + ["--train-iters", "1", "--save", str(ckpt), "--save-interval", "1"],
    )
    assert saved.rc == 0, saved.tail()
    assert sorted(p.name for p in (ckpt / "iter_0000001").iterdir()) == ["mp_rank_00", "mp_rank_01"]
    resume = VLM + tp2 + ["--train-iters", "4", "--load", str(ckpt), "--override-opt_param-scheduler"]
    upstream = torchrun(trees["pristine"] / "pretrain_vlm.py", resume)
    assert upstream.rc == 0 and sorted(upstream.losses) == [2, 3, 4], upstream.tail()
    hetero = torchrun(
        trees["patched"] / "pretrain_vlm.py",
        resume + ["--hetero-module", "vision:dp=2", "--hetero-module", "language:dp=2"] + EDGE,
    )
    assert "from iteration 1" in hetero.out, hetero.tail()
    assert _close(hetero.losses.get(2, float("nan")), upstream.losses[2]), (hetero.losses, upstream.losses)
    assert_losses(hetero, upstream.losses, RTOL, "resumed in vision DP2 + language DP2", upstream.valid)

    # And back: a layout's run saves a TP2 torch checkpoint (Megatron's own save_checkpoint on the
    # reference layout) that the unpatched script resumes from with the same losses.
    ckpt_h = tmp_path / "ckpt-hetero"
    saved_h = torchrun(
        trees["patched"] / "pretrain_vlm.py",
        VLM
        + tp2
        + [
            "--train-iters",
            "1",
            "--save",
            str(ckpt_h),
            "--save-interval",
            "1",
            "--hetero-module",
            "vision:dp=2",
            "--hetero-module",
            "language:tp=2",
        ]
        + EDGE,
    )
    assert saved_h.rc == 0, saved_h.tail()
    assert sorted(p.name for p in (ckpt_h / "iter_0000001").iterdir()) == ["mp_rank_00", "mp_rank_01"]
    back = torchrun(
        trees["pristine"] / "pretrain_vlm.py",
        VLM + tp2 + ["--train-iters", "4", "--load", str(ckpt_h), "--override-opt_param-scheduler"],
    )
    assert_losses(back, upstream.losses, RTOL, "unpatched run resumed from a layout's checkpoint")

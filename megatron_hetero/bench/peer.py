"""`megatron-hetero bench peer`: ours against what a user would run instead, side by side in one run.

Peers, from the Megatron-LM tree at `$MEGATRON_LM` (tag core_v0.19.0, unpatched, run on CPU through
the project's launcher, `python -m megatron_hetero.megatron_lm.run`, under torchrun, WORLD ranks, gloo):
- `pretrain_vlm.py` (LLaVA: one layout for the whole model) at the homogeneous layouts of the world
  (TP1·DP4 and TP2·DP2; the best is the faster measured) and under the "language model needs TP2"
  constraint (TP2·DP2 is the only homogeneous layout that honours it);
- `examples/mimo/pretrain_mimo.py` (MIMO: encoder and language model on disjoint rank spans with their
  own TP/DP, `--encoder-tp/-dp`, `--llm-tp/-dp/-offset`) on two of its own layouts, through
  `bench/mimo_bringup.py` (the launcher plus the MIMO example's three GPU-only bring-up spots made
  CPU). Where it stops before training, the case records the error (`peer_error`) and only ours runs.
Ours: the same `pretrain_vlm.py` with the project's patches (a copy of the tree, patched) and
`--hetero-*` flags: the same layouts, and the layout the e2e bench's planner picks under the TP2
constraint (colocated vision DP4 + language TP2·DP2: the encoder does not inherit TP2). Every run of
`pretrain_vlm.py`, ours or not, has the same model, data (Megatron's mock multimodal data), seed and
batch; ours starts from the reference model's weights (`--hetero-init reference`, Megatron's own
parallel flags naming the reference: those of the peer it is compared with), so the losses must agree.

Measured per run: Megatron's own log lines (`lm loss`, `elapsed time per iteration (ms)`, one line per
iteration). A run's step time is the median over its iterations after `WARMUP`. `rounds` rounds, each
running every peer and every ours once, the order reversed every other round (peer first, then ours
first), so both see the machine in the same periods. A case's `ours_ms`/`peer_ms` is the median of its
per-round medians, `ratio` = peer_ms / ours_ms (> 1: ours is faster), `ratio_per_round` the ratio of each
round, `spread` (max - min) / median of the per-round medians. `losses_equal`: every round's
per-iteration losses of ours equal the peer's (relative 1e-5, the log line's 6 significant digits).

Writes DIR/peer.json (`cases: [{name, peer, layout, ours_ms, peer_ms, ratio, losses_equal, ...}]`) and
DIR/peer.png.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from megatron_hetero.bench.common import bar_plot, markdown_table, write_json
from megatron_hetero.megatron_lm.tree import apply_patches

WORLD = 4
WARMUP = 2  # iterations dropped from each run's step times (start-up, first allocations)
RTOL = 1e-5
TREE_ENV = "MEGATRON_LM"

#: the model and data of every pretrain_vlm.py run (tiny LLaVA; fp32, no dropout, constant lr, no clipping)
VLM = (
    "--hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 128 "
    "--micro-batch-size 2 --global-batch-size 16 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 "
    "--make-vocab-size-divisible-by 32 --transformer-impl local --no-gradient-accumulation-fusion "
    "--no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-persist-layer-norm "
    "--distributed-backend gloo --lr 1e-3 --lr-decay-style constant --lr-decay-iters 10 --log-interval 1 "
    "--eval-iters 0 --eval-interval 1000 --hidden-dropout 0 --attention-dropout 0 --clip-grad 0 "
    "--encoder-num-layers 2 --decoder-num-layers 2 --img-h 64 --img-w 64 --patch-dim 16 --ckpt-format torch"
).split()
EDGE = ["--hetero-edge", "vision->language"]
#: pretrain_mimo.py: its mock data, the same width and depth where its flags reach (its model provider
#: fixes the rest), micro-batch 2, the flags its CPU run needs
MIMO = (
    "--dataset-provider mock --num-layers 2 --hybrid-layer-pattern *- --hidden-size 64 --num-attention-heads 4 "
    "--seq-length 64 --max-position-embeddings 128 --vocab-size 128 --tokenizer-type NullTokenizer --lr 1e-3 "
    "--eval-iters 0 --eval-interval 1000 --log-interval 1 --use-distributed-optimizer --calculate-per-token-loss "
    "--distributed-backend gloo --position-embedding-type none --micro-batch-size 2 --no-gradient-accumulation-fusion "
    "--no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-persist-layer-norm"
).split()

LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.Ee+-]+) \|")
STEP_MS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| elapsed time per iteration \(ms\): ([0-9.]+) \|")


@dataclass(frozen=True)
class Case:
    """One comparison: `peer` (script) with `peer_args` against ours (patched pretrain_vlm.py) with
    `ours_args`; `layout` says both in words. `peer_key` names the peer run (cases sharing one share it)."""

    name: str
    peer: str
    layout: str
    peer_key: str
    peer_args: tuple[str, ...]
    ours_args: tuple[str, ...]


def _mods(*mods: str) -> list[str]:
    out: list[str] = []
    for m in mods:
        out += ["--hetero-module", m]
    return out


TP2 = ["--tensor-model-parallel-size", "2"]
DISJOINT = ["--hetero-placement", "disjoint"]


def _mimo(enc_tp: int, enc_dp: int, llm_tp: int, llm_dp: int) -> tuple[str, ...]:
    return tuple(
        MIMO
        + f"--global-batch-size {2 * llm_dp * 4} --encoder-tp {enc_tp} --encoder-dp {enc_dp} "
        f"--llm-offset {enc_tp * enc_dp} --llm-tp {llm_tp} --llm-dp {llm_dp}".split()
    )


def cases(quick: bool = False) -> list[Case]:
    """The comparisons at WORLD = 4 (`quick`: one pretrain_vlm case and one pretrain_mimo case)."""
    vlm = "pretrain_vlm.py"
    mimo = "examples/mimo/pretrain_mimo.py"
    out = [
        Case(
            "vlm homogeneous TP1·DP4",
            vlm,
            "vision and language TP1·DP4 (colocated)",
            "vlm-dp4",
            tuple(VLM),
            tuple(VLM + _mods("vision:dp=4", "language:dp=4") + EDGE),
        ),
        Case(
            "vlm homogeneous TP2·DP2 (language TP2)",
            vlm,
            "vision and language TP2·DP2 (colocated)",
            "vlm-tp2dp2",
            tuple(VLM + TP2),
            tuple(VLM + TP2 + _mods("vision:tp=2,dp=2", "language:tp=2,dp=2") + EDGE),
        ),
        Case(
            "vlm language TP2, our pick",
            vlm,
            "peer TP2·DP2; ours vision DP4 + language TP2·DP2 (colocated)",
            "vlm-tp2dp2",
            tuple(VLM + TP2),
            tuple(VLM + TP2 + _mods("vision:dp=4", "language:tp=2,dp=2") + EDGE),
        ),
        Case(
            "mimo encoder TP1·DP2, language TP2",
            mimo,
            "vision TP1·DP2 on ranks 0-1, language TP2 on ranks 2-3 (disjoint)",
            "mimo-a",
            _mimo(1, 2, 2, 1),
            tuple(VLM + DISJOINT + _mods("vision:dp=2", "language:tp=2") + EDGE),
        ),
        Case(
            "mimo encoder TP2, language DP2",
            mimo,
            "vision TP2 on ranks 0-1, language TP1·DP2 on ranks 2-3 (disjoint)",
            "mimo-b",
            _mimo(2, 1, 1, 2),
            tuple(VLM + DISJOINT + _mods("vision:tp=2", "language:dp=2") + EDGE),
        ),
    ]
    return [out[0], out[3]] if quick else out


@dataclass
class Run:
    """One script run: return code, per-iteration losses and step times, the output's tail."""

    rc: int
    losses: dict[int, float] = field(default_factory=dict)
    step_ms: dict[int, float] = field(default_factory=dict)
    error: Optional[str] = None

    def median_ms(self) -> Optional[float]:
        kept = [ms for it, ms in sorted(self.step_ms.items()) if it > WARMUP]
        return statistics.median(kept) if kept else None


def _error_of(text: str) -> str:
    """The exception a failed run ended with: the last `SomethingError: ...` line of its ranks (the
    one nearest the end), with the rank prefix stripped; else the last line."""
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", ln).strip() for ln in text.splitlines()]
    errs = [
        ln
        for ln in lines
        if re.match(r"^[A-Za-z_.]*(Error|Exception|StopIteration)\b", ln) and "ChildFailedError" not in ln
    ]
    return (errs[-1] if errs else (lines[-1] if lines else ""))[:400]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_script(module: str, script: Path, args: list[str], nproc: int, iters: int, timeout: float) -> Run:
    """`script` under torchrun on `nproc` CPU ranks through `module` (the launcher), `iters` iterations."""
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "TORCH_COMPILE_DISABLE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([repo] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    for _ in range(3):  # another process may take the free port first: a new port
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
        cmd += ["--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "-m", module, str(script)]
        cmd += [*args, "--train-iters", str(iters)]
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return Run(rc=124, error=f"timed out after {timeout:.0f} s")
        out = p.stdout + p.stderr
        if p.returncode == 0 or "EADDRINUSE" not in out:
            break
    run = Run(rc=p.returncode)
    run.losses = {int(m.group(1)): float(m.group(2)) for m in LOSS.finditer(out)}
    run.step_ms = {int(m.group(1)): float(m.group(2)) for m in STEP_MS.finditer(out)}
    if p.returncode != 0:
        run.error = _error_of(out)
    return run


def _trees(tree: Path, work: Path) -> dict[str, Path]:
    """{'pristine': the tree itself, 'patched': a copy under `work` with the project's patches}."""

    patched = work / "patched"
    shutil.copytree(tree, patched, ignore=shutil.ignore_patterns("__pycache__", ".git"))
    st = apply_patches(patched)
    if not st.applied:
        raise ValueError(f"the project's patches do not apply to a copy of {tree}: {st.reason}")
    return {"pristine": tree, "patched": patched}


def _losses_equal(a: dict[int, float], b: dict[int, float]) -> bool:
    return bool(a) and a.keys() == b.keys() and all(abs(a[i] - b[i]) <= RTOL * abs(b[i]) for i in a)


def _summary(values: list[float]) -> tuple[Optional[float], Optional[float]]:
    if not values:
        return None, None
    med = statistics.median(values)
    return med, (max(values) - min(values)) / med if med else None


def run(out: Path, iters: int = 8, rounds: int = 3, quick: bool = False, tree: Optional[str] = None) -> dict[str, Any]:
    """Run the peer comparison (module docstring); `tree`: the Megatron-LM tree (default `$MEGATRON_LM`)."""
    if iters <= WARMUP:
        raise ValueError(f"bench peer needs more than {WARMUP} iterations per run (the first {WARMUP} are dropped)")
    if rounds < 1:
        raise ValueError(f"bench peer needs at least one round, got {rounds}")
    tree = tree or os.environ.get(TREE_ENV)
    if not tree or not (Path(tree) / "pretrain_vlm.py").is_file():
        raise ValueError(f"bench peer needs ${TREE_ENV} set to a Megatron-LM tree at core_v0.19.0 (got {tree!r})")
    the_cases = cases(quick)
    timeout = 600.0
    with tempfile.TemporaryDirectory(prefix="bench-peer-") as work:
        trees = _trees(Path(tree), Path(work))
        # pretrain_mimo.py: tried once per layout first; a layout that stops before training is not timed
        peer_runs: dict[str, list[Run]] = {}
        for c in the_cases:
            if c.peer.endswith("pretrain_mimo.py") and c.peer_key not in peer_runs:
                first = run_script(
                    "megatron_hetero.bench.mimo_bringup",
                    trees["pristine"] / c.peer,
                    list(c.peer_args),
                    WORLD,
                    iters,
                    timeout,
                )
                peer_runs[c.peer_key] = [first]
        failed = {k for k, rs in peer_runs.items() if rs[0].rc != 0}
        ours_runs: dict[str, list[Run]] = {c.name: [] for c in the_cases}
        for r in range(rounds):
            peers_this_round = {c.peer_key: c for c in the_cases if c.peer_key not in failed}
            jobs: list[tuple[str, str]] = [("peer", k) for k in peers_this_round] + [
                ("ours", c.name) for c in the_cases
            ]
            for kind, key in jobs if r % 2 == 0 else list(reversed(jobs)):
                if kind == "peer":
                    c = peers_this_round[key]
                    module = (
                        "megatron_hetero.bench.mimo_bringup" if "mimo" in c.peer else "megatron_hetero.megatron_lm.run"
                    )
                    if r == 0 and key in peer_runs:
                        continue  # pretrain_mimo.py's first try was this round's run
                    res = run_script(module, trees["pristine"] / c.peer, list(c.peer_args), WORLD, iters, timeout)
                    peer_runs.setdefault(key, []).append(res)
                else:
                    c = next(c for c in the_cases if c.name == key)
                    res = run_script(
                        "megatron_hetero.megatron_lm.run",
                        trees["patched"] / "pretrain_vlm.py",
                        list(c.ours_args),
                        WORLD,
                        iters,
                        timeout,
                    )
                    if res.rc != 0:
                        raise RuntimeError(f"ours failed on {c.name}: {res.error}")
                    ours_runs[key].append(res)
    rows = []
    for c in the_cases:
        ours = ours_runs[c.name]
        peers = peer_runs.get(c.peer_key, [])
        ok_peers = [p for p in peers if p.rc == 0]
        ours_ms = [m for m in (o.median_ms() for o in ours) if m is not None]
        peer_ms = [m for m in (p.median_ms() for p in ok_peers) if m is not None]
        o_med, o_spread = _summary(ours_ms)
        p_med, p_spread = _summary(peer_ms)
        pairs = list(zip(peer_ms, ours_ms)) if len(peer_ms) == len(ours_ms) else []
        equal = None
        if ok_peers and len(ok_peers) == len(ours):
            equal = all(_losses_equal(o.losses, p.losses) for o, p in zip(ours, ok_peers))
        rows.append(
            {
                "name": c.name,
                "peer": Path(c.peer).name,
                "layout": c.layout,
                "ours_ms": o_med,
                "peer_ms": p_med,
                "ratio": (p_med / o_med) if (p_med and o_med) else None,
                "losses_equal": equal,
                "ratio_per_round": [p / o for p, o in pairs],
                "ours_ms_per_round": ours_ms,
                "peer_ms_per_round": peer_ms,
                "ours_spread": o_spread,
                "peer_spread": p_spread,
                "ours_losses": ours[0].losses if ours else {},
                "peer_losses": ok_peers[0].losses if ok_peers else {},
                "peer_error": next((p.error for p in peers if p.rc != 0), None),
                "peer_args": list(c.peer_args),
                "ours_args": list(c.ours_args),
            }
        )
    homog = [r for r in rows if r["name"].startswith("vlm homogeneous") and r["peer_ms"]]
    best = min(homog, key=lambda r: r["peer_ms"]) if homog else None
    doc = {
        "benchmark": "peer",
        "world_size": WORLD,
        "backend": "gloo",
        "iters": iters,
        "warmup": WARMUP,
        "rounds": rounds,
        "tree": str(tree),
        "best_homogeneous_peer": best["name"] if best else None,
        "cases": rows,
    }
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "peer.json", doc)
    labels = [r["name"] for r in rows]
    bar_plot(
        out / "peer.png",
        labels,
        {
            "ours": [r["ours_ms"] or 0.0 for r in rows],
            "peer (0: did not run)": [r["peer_ms"] or 0.0 for r in rows],
        },
        "step time, median of per-round medians (ms)",
        f"ours vs Megatron-LM's scripts, world {WORLD}, gloo on CPU",
    )
    return doc


def _f(v: Optional[float], fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def table(doc: dict[str, Any]) -> str:
    rows = [
        [
            r["name"],
            r["peer"],
            _f(r["ours_ms"]) + (f" (±{100 * r['ours_spread']:.0f}%)" if r["ours_spread"] is not None else ""),
            _f(r["peer_ms"]) + (f" (±{100 * r['peer_spread']:.0f}%)" if r["peer_spread"] is not None else ""),
            _f(r["ratio"], "{:.2f}"),
            ", ".join(f"{x:.2f}" for x in r["ratio_per_round"]) or "-",
            {True: "yes", False: "NO", None: "-"}[r["losses_equal"]],
            r["peer_error"] or "",
        ]
        for r in doc["cases"]
    ]
    return markdown_table(
        ["case", "peer", "ours ms", "peer ms", "peer / ours", "per round", "losses equal", "peer stopped with"], rows
    )

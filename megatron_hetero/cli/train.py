"""`megatron-hetero train`: run the LLaVA-style model locally on N ranks (forked; gloo on CPU, NCCL on GPU).

    megatron-hetero train --hetero-layout LAYOUT.yaml [--nproc-per-node N] [--train-iters I] [model flags]

Megatron-style flags for sizes (`cli.model_flags`), batch and optimizer; the layout from
`--hetero-layout FILE` or `--hetero-module ...`. The job is built by `training.job.job_from_args`
and validated (`training.setup.validate_job`) before any rank starts (exit 2 with the message).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_hetero.cli import CommandFailed
from megatron_hetero.cli.model_flags import add_model_flags

NAME = "train"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from megatron_hetero.layout.args import add_hetero_args

    p = sub.add_parser(NAME, help="train the tiny LLaVA-style model on a heterogeneous layout")
    add_model_flags(p)
    t = p.add_argument_group("training")
    t.add_argument("--train-iters", type=int, default=5)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--clip-grad", type=float, default=0.0)
    t.add_argument("--adam-beta1", type=float, default=0.9)
    t.add_argument("--adam-beta2", type=float, default=0.999)
    t.add_argument("--adam-eps", type=float, default=1e-8)
    t.add_argument("--seed", type=int, default=1234)
    r = p.add_argument_group("launch")
    r.add_argument("--nproc-per-node", type=int, default=None,
                   help="ranks to spawn on this machine (default: what the layout uses)")
    r.add_argument("--log-jsonl", type=str, default=None, help="one JSON object per iteration")
    r.add_argument("--launch-timeout", type=float, default=3600.0, help="seconds before hung ranks are killed")
    add_hetero_args(p)
    return p


def run(args: argparse.Namespace) -> int:
    from megatron_hetero.training.job import job_from_args, quiet_upstream_warnings, run_local

    quiet_upstream_warnings()
    from megatron_hetero.compat import default_backend
    from megatron_hetero.layout.args import layout_from_args
    from megatron_hetero.runtime.launcher import RankFailure, RankTimeout
    from megatron_hetero.training.setup import validate_job

    layout = layout_from_args(args, world_size=args.nproc_per_node)
    job = job_from_args(args, layout)
    validate_job(layout, job)  # before anything is printed or started
    print(f"megatron-hetero train: {layout.world_size} ranks ({default_backend()}), placement {layout.placement}: "
          + ", ".join(f"{m.name} {m.short()} @{m.ranks}" for m in layout.modules), flush=True)
    try:
        records = run_local(layout, job, timeout=args.launch_timeout)
    except (RankFailure, RankTimeout) as exc:
        raise CommandFailed(f"failed: {exc}") from None
    for r in records:
        print(f" iteration {r['iteration']:>4}/{job.train_iters} | lm loss {r['loss']:.6f} | "
              f"step time {r['step_time_s'] * 1e3:.1f} ms", flush=True)
    if layout.placement == "colocated" and records:
        mem = records[-1]["memory_bytes"]["0"]
        print("rank 0 module state resident per phase (bytes): " + "; ".join(
            f"{phase}: " + ", ".join(f"{m} {b}" for m, b in mods.items()) for phase, mods in mem.items()), flush=True)
    if args.log_jsonl:
        path = Path(args.log_jsonl)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    return 0

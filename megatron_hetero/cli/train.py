"""`megatron-hetero train`: train the LLaVA-style model on a layout (gloo on CPU, NCCL on GPU).

    megatron-hetero train --hetero-layout LAYOUT.yaml [--nproc-per-node N] [--train-iters I] [model flags]
    torchrun --nnodes 2 --nproc-per-node 4 ... -m megatron_hetero train --hetero-layout LAYOUT.yaml ...
    srun -N 2 --ntasks-per-node 4 python -m megatron_hetero train --hetero-layout LAYOUT.yaml ...

When the environment describes a rank (torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT; srun: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and a master address), this process is
that one rank: it checks WORLD_SIZE against the layout (exit 2 on every rank), binds its device from
the local rank, and only global rank 0 prints iteration lines and writes --log-jsonl. Otherwise it
forks the layout's ranks on the local host.

Iteration lines (Megatron-style, every --log-interval iterations: lm loss, consumed samples, step
time, learning rate, grad norm, tokens/s) are printed while training; a progress line in between
when stdout is a terminal. --lr-warmup-iters / --lr-decay-style / --lr-decay-iters / --min-lr set
Megatron's learning-rate schedule; --save DIR --save-interval N and --load DIR checkpoint and resume
(`checkpoint.save_load`: any layout of the same model can resume any other's checkpoint).

Megatron-style flags for sizes (`cli.model_flags`), architecture (`cli.arch_flags`: RMSNorm, swiglu,
rope, grouped-query attention, QKV bias, tied embeddings, a CLIP encoder), batch and optimizer;
`--load DIR` without size/architecture flags builds the model the checkpoint records (e.g. weights
converted by `megatron-hetero convert hf-to-checkpoint`, which start training at iteration 0); the layout from
`--hetero-layout FILE` or `--hetero-module ...`. The job is built by `training.job.job_from_args`
and validated (`training.setup.validate_job`) before any rank starts (exit 2 with the message).

`--trace FILE.json` records every rank's spans (`runtime.trace`: encoder and LLM forward/backward per
micro-batch, boundary calls with bytes, communication batches and waits, gradient reduction,
optimizer) and global rank 0 writes them as one Chrome/Perfetto trace (ui.perfetto.dev, or
`megatron-hetero timeline FILE.json --out FILE.png`); it is the job's `trace` field.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_hetero.cli import CommandFailed
from megatron_hetero.cli.model_flags import add_model_flags

NAME = "train"
USES_MEGATRON = True  # run_command applies megatron_hetero.compat first


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from megatron_hetero.layout.args import add_hetero_args

    p = sub.add_parser(NAME, help="train the tiny LLaVA-style model on a heterogeneous layout")
    add_model_flags(p)
    from megatron_hetero.cli.arch_flags import add_arch_flags

    add_arch_flags(p)
    from megatron_hetero.cli.data import add_train_data_flags

    add_train_data_flags(p)
    t = p.add_argument_group("training")
    t.add_argument("--train-iters", type=int, default=5)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--clip-grad", type=float, default=0.0)
    t.add_argument(
        "--bf16",
        action="store_true",
        help="bf16 parameters and compute, fp32 main weights in the optimizer (Megatron's mixed precision)",
    )
    t.add_argument("--adam-beta1", type=float, default=0.9)
    t.add_argument("--adam-beta2", type=float, default=0.999)
    t.add_argument("--adam-eps", type=float, default=1e-8)
    t.add_argument("--seed", type=int, default=1234)
    t.add_argument("--lr-warmup-iters", type=int, default=0, help="linear warm-up from 0 to --lr over these iterations")
    t.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="constant")
    t.add_argument("--lr-decay-iters", type=int, default=None, help="iterations to decay over (default: --train-iters)")
    t.add_argument("--min-lr", type=float, default=0.0, help="the rate a decay ends at")
    t.add_argument(
        "--override-opt-param-scheduler",
        action="store_true",
        help="on --load, use this job's learning-rate schedule instead of requiring the checkpoint's",
    )
    v = p.add_argument_group("evaluation (held-out split: `val` of --data-path; synthetic data: unseen samples)")
    v.add_argument(
        "--eval-interval",
        type=int,
        default=0,
        metavar="N",
        help="evaluate every N iterations and after the last one (default 0: never)",
    )
    v.add_argument(
        "--eval-iters",
        type=int,
        default=None,
        metavar="K",
        help="global batches per evaluation (default: the held-out split once, N // global batch; synthetic data: 1)",
    )
    c = p.add_argument_group("checkpoints (Megatron-core dist_checkpointing; movable between layouts)")
    c.add_argument(
        "--save", type=str, default=None, metavar="DIR", help="save checkpoints here (and after the last iteration)"
    )
    c.add_argument("--save-interval", type=int, default=0, metavar="N", help="save every N iterations")
    c.add_argument(
        "--exit-signal-handler",
        action="store_true",
        help="on SIGTERM (SLURM's warning before the time limit, scancel): every rank finishes the "
        "current step, saves a checkpoint (with --save) and exits 0 (Megatron-LM's flag)",
    )
    c.add_argument(
        "--load",
        type=str,
        default=None,
        metavar="DIR",
        help="resume from the latest checkpoint under DIR (any layout of the same model), or start "
        "from converted weights (convert hf-to-checkpoint); without model flags: the recorded model",
    )
    c.add_argument(
        "--load-fallback",
        action="store_true",
        help="if the newest save under --load is incomplete or damaged, resume from the newest complete "
        "checkpoint before it (and say so) instead of exiting 2",
    )
    e = p.add_argument_group("mixture of experts (language model; ep/expt_tp come from the layout)")
    e.add_argument("--num-experts", type=int, default=None, help="experts per MoE layer (default: dense MLPs)")
    e.add_argument("--moe-router-topk", type=int, default=2, help="experts per token (default 2)")
    e.add_argument("--moe-aux-loss-coeff", type=float, default=0.0, help="load-balancing loss weight (default 0)")
    e.add_argument(
        "--moe-ffn-hidden-size", type=int, default=None, help="expert MLP hidden size (default --ffn-hidden-size)"
    )
    r = p.add_argument_group("launch")
    r.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="ranks to spawn on the local host (default: what the layout uses)",
    )
    r.add_argument("--log-jsonl", type=str, default=None, help="one JSON object per iteration")
    r.add_argument("--log-interval", type=int, default=1, help="iteration lines every N iterations")
    r.add_argument("--launch-timeout", type=float, default=3600.0, help="seconds before hung ranks are killed")
    p.add_argument(
        "--trace",
        type=str,
        default=None,
        metavar="FILE.json",
        help="write a Chrome/Perfetto trace of every rank's spans (view: ui.perfetto.dev, or "
        "megatron-hetero timeline FILE.json --out FILE.png)",
    )
    add_hetero_args(p)
    return p


def run(args: argparse.Namespace) -> int:
    import os

    from megatron_hetero.training.job import job_from_args, quiet_upstream_warnings, run_as_rank, run_local
    from megatron_hetero.launch.rank_env import rank_env

    quiet_upstream_warnings()
    from megatron_hetero.compat import default_backend
    from megatron_hetero.layout.args import layout_from_args
    from megatron_hetero.runtime.launcher import RankFailure, RankTimeout
    from megatron_hetero.launch.rank_env import check_world_size
    from megatron_hetero.training.setup import validate_job

    env = rank_env(os.environ)
    if env is not None and args.nproc_per_node is not None:
        raise ValueError(
            f"--nproc-per-node {args.nproc_per_node}: this process is {env.describe()}; the launcher "
            f"starts the ranks (give --nproc-per-node to torchrun, not to train)"
        )
    import dataclasses
    import sys

    layout = layout_from_args(args, world_size=args.nproc_per_node)
    job = job_from_args(args, layout)
    job = dataclasses.replace(job, progress=bool(getattr(sys.stdout, "isatty", lambda: False)()))
    if env is not None:
        check_world_size(env, layout.world_size)
    validate_job(layout, job)  # before anything is printed or started
    if job.load and (env is None or env.rank == 0):
        from megatron_hetero.checkpoint.save_load import load_note

        note = load_note(job.load, job.load_fallback)  # --load-fallback took an earlier checkpoint, or a note
        if note:
            print(note, file=sys.stderr, flush=True)
    if env is None or env.rank == 0:
        print(
            f"megatron-hetero train: {layout.world_size} ranks ({default_backend()}"
            f"{', ' + env.launcher if env else ', forked here'}), placement {layout.placement}: "
            + ", ".join(f"{m.name} {m.short()} @{m.ranks}" for m in layout.modules),
            flush=True,
        )
    if env is not None:
        try:
            records = run_as_rank(layout, job, env, timeout_s=job.comm_timeout_s)
        except RuntimeError as exc:
            raise CommandFailed(f"failed: {exc}") from None
        if records is None:  # not global rank 0: nothing to print or write
            return 0
    else:
        try:
            records = run_local(layout, job, timeout=args.launch_timeout)
        except (RankFailure, RankTimeout) as exc:
            raise CommandFailed(f"failed: {exc}") from None
    # the iteration lines were printed by global rank 0 while it trained
    if job.save:
        latest = records[-1]["iteration"] if records else job.train_iters  # earlier: stopped on SIGTERM
        print(f"checkpoints in {job.save} (latest: iteration {latest})", flush=True)
    if layout.placement == "colocated" and records:
        mem = records[-1]["memory_bytes"]["0"]
        print(
            "rank 0 module state resident per phase (bytes): "
            + "; ".join(f"{phase}: " + ", ".join(f"{m} {b}" for m, b in mods.items()) for phase, mods in mem.items()),
            flush=True,
        )
    if args.log_jsonl:
        path = Path(args.log_jsonl)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    if args.trace:
        print(
            f"trace of {layout.world_size} ranks in {args.trace} (megatron-hetero timeline {args.trace} "
            f"--out TIMELINE.png)",
            flush=True,
        )
    return 0

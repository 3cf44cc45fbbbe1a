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
`--hetero-layout FILE` or `--hetero-module ...`. The job is built by `cli.train_door.job_from_args` (train's door: nothing below it reads the flags)
and validated (`training.setup.validate_job`) before any rank starts (exit 2 with the message).

`--trace FILE.json` records every rank's spans (`runtime.trace`: encoder and LLM forward/backward per
micro-batch, boundary calls with bytes, communication batches and waits, gradient reduction,
optimizer) and global rank 0 writes them as one Chrome/Perfetto trace (ui.perfetto.dev, or
`megatron-hetero timeline FILE.json --out FILE.png`); it is the job's `trace` field.

Logging (Megatron-LM's flags, `training.writers`, `training.run_stats`): `--tensorboard-dir DIR`
[--tensorboard-log-interval N] [--log-validation-ppl-to-tensorboard] and `--wandb-project P`
[--wandb-exp-name N] [--wandb-save-dir DIR] (offline unless WANDB_MODE says otherwise) write
Megatron's scalars from the last rank; `--log-throughput` adds TFLOP/s per rank (Megatron's formula,
per module: `training.throughput`) and `--log-memory` the resident state and activation peaks per
rank (`training.memory_log`) to the lines and the --log-jsonl records. A missing package or a
folder that cannot be made exits 2 before any rank starts.

`--hetero-autotune` (with `--save DIR`) measures the first `--autotune-steps` steps, fits the cost
model to them and to layers timed in-process, and moves the run to a layout predicted faster, in the
same processes, through a checkpoint (`training/autotune_run.py`; [docs/autotune.md]); it writes
`autotune.json` and `autotune-layout.yaml` into --save.

`--transformer-impl transformer_engine` (Megatron-LM's flag; default local) builds Megatron-core's
Transformer Engine layer specs for the language model and the encoders (`models.layer_specs`); on a
machine without CUDA or without the transformer_engine package it exits 2 with the reason.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_hetero.cli import CommandFailed
from megatron_hetero.cli.model_flags import add_model_flags
from megatron_hetero.checkpoint.loadable import load_note
from megatron_hetero.cli.arch_flags import add_arch_flags
from megatron_hetero.cli.data import add_train_data_flags
from megatron_hetero.cli.failure import advice, rank_failure_line
from megatron_hetero.cli.train_door import job_from_args
from megatron_hetero.launch.rank_env import check_world_size, rank_env
from megatron_hetero.layout.args import add_hetero_args, layout_from_args
from megatron_hetero.layout.flags import add_flags
from megatron_hetero.config.model import TRANSFORMER_IMPLS
from megatron_hetero.config.job import train_flag_fields, JobDraft
from megatron_hetero.training.job import quiet_upstream_warnings, run_as_rank, run_local

NAME = "train"
USES_MEGATRON = True  # run_command applies megatron_hetero.compat first


# argument groups of train's own flags (their fields' `group`), in --help order
GROUPS = {
    "training": "training",
    "evaluation": "evaluation (held-out split: `val` of --data-path; synthetic data: unseen samples)",
    "checkpoints": "checkpoints (Megatron-core dist_checkpointing; movable between layouts)",
    "moe": "mixture of experts (language model; ep/expt_tp come from the layout)",
    "launch": "launch",
    "logging": "logging (TensorBoard, W&B, throughput, memory; Megatron-LM's flags)",
    "autotune": "auto-layout (--hetero-autotune: measure, re-plan, move to a faster layout in the same processes)",
}


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """train's flags, generated from the fields that declare them (defaults and help live there):
    the model's (`cli.model_flags`), the architecture's (`cli.arch_flags`), the data's (`cli.data`),
    the job's (`config.job.train_flag_fields`) and the layout's (`layout.args.add_hetero_args`)."""

    p = sub.add_parser(NAME, help="train the tiny LLaVA-style model on a heterogeneous layout")
    add_train_flags(p)
    return p


def add_train_flags(p: argparse.ArgumentParser) -> None:
    """Every flag of train on parser `p` (`dryrun` takes the same ones)."""

    add_model_flags(p)
    add_arch_flags(p)
    add_train_data_flags(p)
    add_flags(p, train_flag_fields(), GROUPS)
    add_hetero_args(p)

    p.add_argument(
        "--transformer-impl",
        choices=TRANSFORMER_IMPLS,
        default="local",
        help="Megatron-core's layer implementation for the language model and the encoders: local "
        "(Megatron-core's own modules, the default) or transformer_engine (its Transformer Engine layer "
        "specs; needs a CUDA GPU and the transformer-engine package: the gpu extra)",
    )


def precheck(args: argparse.Namespace) -> None:
    """The layout read and checked before torch and Megatron-core are imported (`run_command`): a bad
    layout exits 2 within a second, on every rank under torchrun/srun, instead of after ~10 s of
    imports. `run` reads it again (the same pure call) with the rest of the job."""

    layout_from_args(args, world_size=args.nproc_per_node)


def run(args: argparse.Namespace) -> int:
    import os

    quiet_upstream_warnings()
    from megatron_hetero.compat import default_backend
    from megatron_hetero.runtime.launcher import RankFailure, RankTimeout
    from megatron_hetero.training.setup import validate_job

    env = rank_env(os.environ)
    if env is not None and args.nproc_per_node is not None:
        raise ValueError(
            f"--nproc-per-node {args.nproc_per_node}: this process is {env.describe()}; the launcher "
            f"starts the ranks (give --nproc-per-node to torchrun, not to train)"
        )
    import dataclasses
    import sys

    if args.transformer_impl != "local":
        from megatron_hetero.compat.device import transformer_engine_unavailable

        reason = transformer_engine_unavailable()
        if reason:
            raise ValueError(reason)  # exit 2 before any rank starts
    layout = layout_from_args(args, world_size=args.nproc_per_node)
    draft = job_from_args(args, layout)
    config = dataclasses.replace(draft.config, progress=bool(getattr(sys.stdout, "isatty", lambda: False)()))
    if env is not None:
        check_world_size(env, layout.world_size)
    job = validate_job(JobDraft(layout, config))  # once in this process, before anything is printed or started
    if config.load and (env is None or env.rank == 0):
        note = load_note(config.load, config.load_fallback)  # --load-fallback took an earlier checkpoint, or a note
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
            records = run_as_rank(job, env, timeout_s=config.comm_timeout_s)
        except RuntimeError as exc:
            import traceback

            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            todo = advice(str(exc), config.save)
            raise CommandFailed(f"failed: {first}" + (f"; {todo}" if todo else ""), traceback.format_exc()) from None
        if records is None:  # not global rank 0: nothing to print or write
            return 0
    else:
        try:
            records = run_local(job, timeout=args.launch_timeout)
        except RankFailure as exc:
            line = rank_failure_line(exc.failures, exc.killed, config.save)
            raise CommandFailed(f"failed: {line}", str(exc)) from None
        except RankTimeout as exc:
            raise CommandFailed(f"failed: {exc}") from None
    # the iteration lines were printed by global rank 0 while it trained
    if config.save:
        latest = records[-1]["iteration"] if records else config.train_iters  # earlier: stopped on SIGTERM
        print(f"checkpoints in {config.save} (latest: iteration {latest})", flush=True)
    if layout.placement == "colocated" and records:
        mem = records[-1]["resident_bytes"]["0"]
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

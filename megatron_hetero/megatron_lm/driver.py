"""The part of `pretrain_vlm.py --hetero-*` and `pretrain_gpt.py --hetero-*` they share.

What a patched script hands over (its dataset provider, model provider, extra arguments, argument
defaults, embedding-rank functions) and a `ScriptModel` (how that script's model is cut into the
layout's modules) go through, in order:
  1. parse Megatron's arguments (with the script's extra arguments and the `--hetero-*` flags),
     resolve and validate the layout against the world size and the Megatron features used (exit 2
     with the reason on every rank, before any process group or model exists);
  2. `parse_and_validate_args` and `initialize_megatron` as the script's `__main__` and `pretrain()`
     do (Megatron's global state: arguments, tokenizer, timers, seeds; its global parallel state
     follows Megatron's own `--tensor-model-parallel-size` etc., the *reference* layout), then
     `set_jit_fusion_options`;
  3. weights: `--hetero-init reference` (default) builds Megatron's own model with the script's
     model provider on the reference layout (exactly what the unpatched script would start from),
     gathers each parameter over the reference TP group and keeps this rank's shard of each module
     (`weights.py`); `--load DIR` (torch or torch_dist) loads Megatron's checkpoint into that model first;
     `--hetero-init module` keeps each module's own Megatron initialisation;
  4. per module, the script's parts built from Megatron's arguments on the module's own
     `ProcessGroupCollection` (`runtime.topology.Topology`), wrapped in Megatron DDP with its own
     Megatron optimizer (`runtime.module_state.ModuleState`) and Megatron's learning-rate schedule
     (`get_optimizer_param_scheduler`); with `--bf16`/`--fp16` in Megatron's precision, with one loss
     scaler per rank for every module (`precision.py`);
  5. the project's schedule (colocated three-phase or disjoint 1F1B) drives the script's stage runner
     over Megatron's own train dataset, and each iteration prints Megatron's log line
     (`iteration N/ M | consumed samples | ... | lm loss: X |`); with `--eval-iters N` every
     `--eval-interval` iterations (and after the last one) the same schedule runs N global batches of
     Megatron's validation dataset with `train=False` and prints Megatron's validation lines.

`--decoder-first/last-pipeline-num-layers` split the one language module's own pipeline (its `pp`
from the layout; Megatron's own pipeline stays PP 1, the reference's): `check_uneven_pipeline` checks
the arithmetic, the driver moves the flags to `hetero_*` before the reference model is built, and
`build.module_config` gives them to the module's config as Megatron's
`num_layers_in_first/last_pipeline_stage`; the weights follow the offsets Megatron gives the layers.

The loss is normalised per token over the global batch (Megatron's `--calculate-per-token-loss`);
Megatron's default (a mean per micro-batch, averaged) is the same number when every micro-batch has
the same count of loss tokens, as with mock data.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from megatron_hetero.layout.args import add_hetero_args, layout_from_args
from megatron_hetero.layout.spec import HeteroLayout, ModuleLayout
from megatron_hetero.megatron_lm.checks import (  # noqa: F401 - the checks' names, also from here
    CKPT_FORMATS,
    PIPELINE_REFUSED,
    REFUSED,
    UNEVEN_PP,
    check_common,
    check_uneven_pipeline,
    decoder_layers,
    pipeline_split,
    uneven_pp_flags,
)
from megatron_hetero.megatron_lm.data_check import check_script_data
from megatron_hetero.megatron_lm.log import print_last
from megatron_hetero.megatron_lm.session import PREFIX, script_session
from megatron_hetero.plan.rank_plan import check_rank_plans
from megatron_hetero.config.job import Job
from megatron_hetero.training.loop import run_loop
from megatron_hetero.training.signals import ExitSignal
from megatron_hetero.megatron_lm.autotune import add_autotune_args, check_script_autotune, train_autotuned_script


@dataclass(frozen=True)
class ScriptModel:
    """How one Megatron-LM script's model maps onto a layout.

    `check(args, layout)`: the script's own checks (ValueError naming the flag or module);
    `prepare(args)`: what the script's model provider sets on `args` before building (or None);
    `build(args, layout, m, pgs, model_provider)`: module `m`'s part on this rank (compute device);
    `first_layer(layout, m)`: the whole model's index of module `m`'s first decoder layer;
    `runner(args, plan, states, datasets_provider)`: the `StageRunner` (with `set_split`)."""

    script: str
    check: Callable[[Any, HeteroLayout], None]
    build: Callable[..., torch.nn.Module]
    runner: Callable[..., Any]
    prepare: Optional[Callable[[Any], None]] = None
    first_layer: Callable[[HeteroLayout, ModuleLayout], int] = lambda layout, m: 0


def add_megatron_lm_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The plugin's flags for Megatron-LM scripts: `add_hetero_args` plus `--hetero-init`."""
    add_hetero_args(parser)
    group = parser.add_argument_group(title="megatron-hetero with Megatron-LM scripts")
    group.add_argument(
        "--hetero-init",
        choices=["reference", "module"],
        default="reference",
        help="reference (default): start from the weights Megatron's own model would have on the "
        "layout given by Megatron's parallel flags (builds that model once); module: each "
        "module's own Megatron initialisation on its own layout. --load overrides both.",
    )
    group.add_argument(
        "--trust-dataset-code",
        action="store_true",
        help="let the data run the code it names (energon Python files and imports, pickled "
        "members, a pickled index cache); without it such data is refused (exit 2)",
    )

    return add_autotune_args(parser)


def chain(*providers: Optional[Callable]) -> Callable:
    def provider(parser):
        for p in providers:
            if p is not None:
                parser = p(parser)
        return parser

    return provider


def parse_and_validate(model: ScriptModel, extra_args_provider: Optional[Callable], args_defaults: dict):
    """Megatron's argument parsing with the plugin flags; (args, the validated `Job`: the layout and
    the rank plans' checked arithmetic, no `JobConfig`: Megatron's args are the script's). ValueError
    for bad input."""
    from megatron.training.arguments import parse_args

    args = parse_args(extra_args_provider=chain(extra_args_provider, add_megatron_lm_args))
    for k, v in (args_defaults or {}).items():  # what initialize_megatron applies, for the checks
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    layout = layout_from_args(args, world)
    model.check(args, layout)
    check_common(args, layout)

    check_script_autotune(model.script, args, layout)  # --hetero-autotune's settings and model
    check_script_data(args, int(os.environ.get("RANK", "0")))  # before any rank reads data
    # Batch arithmetic and schedule tables (ValueError with the arithmetic): module degrees, not ranks.
    checked = check_rank_plans(layout, args.global_batch_size, args.micro_batch_size, args.hetero_offload_encoder)
    return args, Job(layout, None, checked)


# -- the entry point the patches reach -------------------------------------------------------------
def pretrain_with_layout(
    model: ScriptModel,
    train_valid_test_datasets_provider: Callable,
    model_provider: Callable,
    extra_args_provider: Optional[Callable] = None,
    args_defaults: Optional[dict] = None,
    get_embedding_ranks: Optional[Callable] = None,
    get_position_embedding_ranks: Optional[Callable] = None,
) -> int:
    """Train the script's model with the layout of the `--hetero-*` flags; returns the exit code
    (2: invalid input, printed as one paragraph before any process group or model exists)."""
    try:
        given, job = parse_and_validate(model, extra_args_provider, args_defaults or {})
    except ValueError as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{PREFIX}: invalid input: {exc}", file=sys.stderr, flush=True)
        return 2
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.initialize import initialize_megatron, set_jit_fusion_options

    args = parse_and_validate_args(
        extra_args_provider=chain(extra_args_provider, add_megatron_lm_args), args_defaults=args_defaults or {}
    )
    initialize_megatron(
        get_embedding_ranks=get_embedding_ranks, get_position_embedding_ranks=get_position_embedding_ranks
    )
    set_jit_fusion_options(tp_size=args.tensor_model_parallel_size)
    args.hetero_sequence_parallel = bool(given.sequence_parallel)  # validation drops it at the world's tp 1
    # The uneven pipeline flags split the language module's own pipeline (build.module_config), not the
    # reference layout's (PP 1, where Megatron's TransformerConfig would refuse them).
    for attr in UNEVEN_PP:
        setattr(args, "hetero_" + attr, getattr(args, attr, None))
        setattr(args, attr, None)
    batch = (args.global_batch_size, args.micro_batch_size, args.hetero_offload_encoder)
    if batch != (given.global_batch_size, given.micro_batch_size, given.hetero_offload_encoder):
        # Megatron's validation derived the batch (e.g. --global-batch-size from the micro-batch and DP):
        # the rank plans' arithmetic of that batch (the layout is the door's: the same --hetero-* flags)
        job = Job(job.layout, None, check_rank_plans(job.layout, *batch))
    _train(model, args, job, train_valid_test_datasets_provider, model_provider)
    return 0


def _train(model: ScriptModel, args, job: Job, datasets_provider: Callable, model_provider: Callable) -> None:
    """The run on the validated `job`'s layout (one `training.session.Session` of the script's `ScriptSpec`), or with --hetero-autotune the run that measures
    itself and may move to another layout (`megatron_lm/autotune.py`). Collective over the world."""
    if getattr(args, "hetero_autotune", False):
        train_autotuned_script(model, args, job.layout, datasets_provider, model_provider)
        return
    session = script_session(model, args, job, datasets_provider, model_provider)
    try:
        if session.start and session.start >= args.train_iters:
            print_last(
                f"{PREFIX}: checkpoint iteration {session.start} >= --train-iters {args.train_iters}: nothing to do"
            )
            return
        session.announce()
        stop = ExitSignal(getattr(args, "exit_signal_handler", False)).install()
        try:
            run_loop(
                session.loop_schedule(),
                session.schedulers,
                session.loop_spec(session.start, args.train_iters),
                session.front,
                stop,
            )
        finally:
            stop.restore()
        session.finish()
    finally:
        session.destroy()

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
import torch.distributed as dist

from megatron_hetero.layout.args import add_hetero_args, layout_from_args
from megatron_hetero.layout.spec import HeteroLayout, ModuleLayout
from megatron_hetero.megatron_lm import checkpoints, precision
from megatron_hetero.megatron_lm import weights as weights_mod
from megatron_hetero.megatron_lm.data_check import check_script_data
from megatron_hetero.megatron_lm.front_end import ScriptFrontEnd
from megatron_hetero.megatron_lm.log import Evaluator, print_last
from megatron_hetero.plan.rank_plan import rank_plan, rank_plans
from megatron_hetero.runtime.config import RuntimeConfig
from megatron_hetero.runtime.schedules import schedule_for
from megatron_hetero.runtime.config import OptimConfig
from megatron_hetero.runtime.module_state import ModuleState
from megatron_hetero.training.loop import LoopSpec, run_loop
from megatron_hetero.training.signals import ExitSignal

PREFIX = "megatron-hetero megatron-lm"


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
    return parser


def chain(*providers: Optional[Callable]) -> Callable:
    def provider(parser):
        for p in providers:
            if p is not None:
                parser = p(parser)
        return parser

    return provider


# -- validation (pure on parsed arguments; before any group or model) ------------------------------
#: Megatron flags no layout supports yet (attribute -> flag).
REFUSED = {
    "virtual_pipeline_model_parallel_size": "--num-layers-per-virtual-pipeline-stage",
    "decoder_tp_comm_overlap": "--decoder-tp-comm-overlap",
    "use_legacy_models": "--use-legacy-models",
    "mtp_num_layers": "--mtp-num-layers",
}

#: Megatron's other pipeline-layout flags (attribute -> (flag, why a layout refuses it)); the uneven
#: split of `--decoder-first/last-pipeline-num-layers` is supported (`check_uneven_pipeline`)
PIPELINE_REFUSED = {
    "num_layers_per_virtual_pipeline_stage": (
        "--num-layers-per-virtual-pipeline-stage",
        "virtual (interleaved) pipeline stages: each module's pipeline stage holds one model chunk (the "
        "layout's schedules are 1F1B without interleaving)",
    ),
    "num_virtual_stages_per_pipeline_rank": (
        "--num-virtual-stages-per-pipeline-rank",
        "virtual (interleaved) pipeline stages: each module's pipeline stage holds one model chunk (the "
        "layout's schedules are 1F1B without interleaving)",
    ),
    "pipeline_model_parallel_layout": (
        "--pipeline-model-parallel-layout",
        "it lays out Megatron's own pipeline, which stays PP 1 with a layout; split the language module's "
        "own pipeline with --decoder-first/last-pipeline-num-layers, or cut GPT segments with `layers:`",
    ),
    "account_for_embedding_in_pipeline_split": (
        "--account-for-embedding-in-pipeline-split",
        "the embedding counted as a layer of Megatron's own pipeline split (PP 1 with a layout); use "
        "--decoder-first-pipeline-num-layers on the language module's own pipeline",
    ),
    "account_for_loss_in_pipeline_split": (
        "--account-for-loss-in-pipeline-split",
        "the loss counted as a layer of Megatron's own pipeline split (PP 1 with a layout); use "
        "--decoder-last-pipeline-num-layers on the language module's own pipeline",
    ),
}


#: the --ckpt-format values --load/--save take with a layout
CKPT_FORMATS = ("torch", "torch_dist")

#: Megatron's uneven pipeline split (attribute -> flag): with a layout, the language module's own
#: pipeline (Megatron's --pipeline-model-parallel-size stays 1, the reference layout's)
UNEVEN_PP = {
    "decoder_first_pipeline_num_layers": "--decoder-first-pipeline-num-layers",
    "decoder_last_pipeline_num_layers": "--decoder-last-pipeline-num-layers",
}


def uneven_pp_flags(args: Any) -> dict[str, int]:
    """The uneven pipeline flags given ({flag: layers}); the driver moves them off Megatron's
    arguments to `hetero_<attribute>` before the reference model is built (`pretrain_with_layout`)."""
    out = {}
    for attr, flag in UNEVEN_PP.items():
        value = getattr(args, attr, None)
        if value is None:
            value = getattr(args, "hetero_" + attr, None)
        if value is not None:
            out[flag] = value
    return out


def decoder_layers(args: Any) -> int:
    """The language model's decoder layers (`--decoder-num-layers`, else `--num-layers`)."""
    return args.decoder_num_layers if getattr(args, "decoder_num_layers", None) is not None else args.num_layers


def pipeline_split(num_layers: int, pp: int, first: Optional[int], last: Optional[int], who: str) -> list[int]:
    """Layers per pipeline stage of a module with `pp` stages and `num_layers` layers, as Megatron
    splits them (`TransformerConfig.num_layers_in_first_pipeline_stage` / `..._last_...`,
    `get_num_layers_to_build`): `first` layers on stage 0 and `last` on stage pp-1 where given, the
    rest evenly over the other (middle) stages. ValueError naming the flags, with the arithmetic."""
    flags = " ".join(
        f"{f} {v}"
        for f, v in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last))
        if v is not None
    )
    if first is None and last is None:
        if num_layers % pp:
            raise ValueError(f"{who}: {num_layers} layers do not split over pp({pp})")
        return [num_layers // pp] * pp
    if pp < 2:
        raise ValueError(
            f"{flags}: {who} has pp({pp}); the flags split its own pipeline, which needs pp > 1 (e.g. pp=2 "
            f"on the module; Megatron's --pipeline-model-parallel-size stays 1 with a layout)"
        )
    for flag, v in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)):
        if v is not None and v < 1:
            raise ValueError(f"{flag} {v}: a pipeline stage needs at least 1 layer")
    middle = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if rest < 0 or (middle == 0 and rest) or (middle and rest < middle):
        raise ValueError(
            f"{flags}: {who} has {num_layers} layers over pp({pp}): {rest} layers are left for its "
            f"{middle} other stage(s)" + (", which must get at least 1 each" if middle else ", which must be 0")
        )
    if middle and rest % middle:
        raise ValueError(
            f"{flags}: {who} has {num_layers} layers over pp({pp}): the remaining {rest} layers do not "
            f"split evenly over its {middle} middle stage(s) ({rest} % {middle} = {rest % middle})"
        )
    even = rest // middle if middle else 0
    return ([first] if first is not None else []) + [even] * middle + ([last] if last is not None else [])


def check_uneven_pipeline(args: Any, layout: HeteroLayout) -> Optional[tuple[str, list[int]]]:
    """--decoder-first/last-pipeline-num-layers with a layout: they split the one language module's
    own pipeline (`pipeline_split`); refused with GPT segments, whose `layers:` already say which
    layers each segment's pipeline holds (each segment splits its own evenly). Returns (module,
    layers per stage) when the flags are given, else None; ValueError naming the flag."""
    from megatron_hetero.plan.roles import language_modules

    given = uneven_pp_flags(args)
    if not given:
        return None
    flags = " ".join(f"{f} {v}" for f, v in given.items())
    langs = language_modules(layout)
    if len(langs) != 1 or langs[0].layers is not None:
        raise ValueError(
            f"{flags} is not supported with GPT segments: each segment's `layers:` already place the layers "
            f"(its own pipeline splits them evenly); cut the model into segments where the stages should be"
        )
    m = langs[0]
    split = pipeline_split(
        decoder_layers(args),
        m.pp,
        given.get("--decoder-first-pipeline-num-layers"),
        given.get("--decoder-last-pipeline-num-layers"),
        f"module {m.name}",
    )
    return m.name, split


def check_common(args: Any, layout: HeteroLayout) -> None:
    """Megatron features every script's layout run supports; ValueError naming the flag otherwise."""
    for m in layout.modules:
        if m.cp != 1:
            raise ValueError(
                f"module {m.name}: cp={m.cp}; context parallelism needs Transformer Engine attention "
                f"in Megatron-LM's models, not supported with a layout (use cp=1)"
            )
        if (m.ep != 1 or m.expt_tp != 1) and not getattr(args, "num_experts", None):
            raise ValueError(
                f"module {m.name}: ep={m.ep}, expt_tp={m.expt_tp}; expert parallelism needs a model with "
                f"experts (--num-experts, pretrain_gpt.py)"
            )
        if m.recompute is not None:
            raise ValueError(
                f"module {m.name}: a layout's own recompute is for megatron-hetero train; with "
                f"Megatron-LM's scripts recompute is the whole model's (--recompute-granularity, "
                f"--recompute-method, --recompute-num-layers)"
            )
        if args.num_attention_heads % m.tp:
            raise ValueError(
                f"module {m.name}: --num-attention-heads {args.num_attention_heads} is not divisible by tp({m.tp})"
            )
    for attr, flag in REFUSED.items():
        if getattr(args, attr, None):
            raise ValueError(f"{flag} is not supported with a layout (yet)")
    for attr, (flag, why) in PIPELINE_REFUSED.items():
        if getattr(args, attr, None):
            raise ValueError(f"{flag} is not supported with a layout: {why}")
    check_uneven_pipeline(args, layout)
    precision.check_precision(args)  # --loss-scale without --fp16
    if args.context_parallel_size != 1 or args.pipeline_model_parallel_size != 1:
        raise ValueError(
            "with a layout, Megatron's --context-parallel-size and --pipeline-model-parallel-size "
            "must stay 1 (they give the reference layout the weights start from; each module's "
            "own degrees come from the layout)"
        )
    if getattr(args, "overlap_param_gather", False) and not (
        getattr(args, "use_distributed_optimizer", False) and getattr(args, "overlap_grad_reduce", False)
    ):
        raise ValueError(
            "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce (as in Megatron: "
            "the parameters it all-gathers in the next forward are the distributed optimizer's shards)"
        )
    if getattr(args, "use_distributed_optimizer", False):
        if args.optimizer != "adam":
            raise ValueError(
                f"--use-distributed-optimizer needs --optimizer adam, got {args.optimizer} (Megatron's "
                f"DistributedOptimizer supports Adam-style optimizers only)"
            )
    if args.optimizer not in ("adam", "sgd"):
        raise ValueError(f"--optimizer {args.optimizer} is not supported with a layout (adam or sgd)")
    if (args.load or args.save) and args.ckpt_format not in CKPT_FORMATS:
        raise ValueError(
            f"--ckpt-format {args.ckpt_format} is not supported with a layout and --load/--save (torch or "
            f"torch_dist: Megatron's own load_checkpoint/save_checkpoint on the layout of Megatron's parallel flags)"
        )
    if args.save:
        if args.hetero_init != "reference":
            raise ValueError(
                "--save with a layout needs --hetero-init reference (the checkpoint is written "
                "through Megatron's own model on the reference layout)"
            )
    if args.eval_iters and args.eval_iters > 0 and getattr(args, "full_validation", False):
        raise ValueError("--full-validation is not supported with a layout (use --eval-iters N)")
    if getattr(args, "multiple_validation_sets", False):
        raise ValueError("--multiple-validation-sets is not supported with a layout")
    if args.train_iters is None:
        raise ValueError("--train-iters is required with a layout (--train-samples is not supported)")
    if args.rampup_batch_size:
        raise ValueError("--rampup-batch-size is not supported with a layout")


def parse_and_validate(model: ScriptModel, extra_args_provider: Optional[Callable], args_defaults: dict):
    """Megatron's argument parsing with the plugin flags; (args, layout). ValueError for bad input."""
    from megatron.training.arguments import parse_args

    args = parse_args(extra_args_provider=chain(extra_args_provider, add_megatron_lm_args))
    for k, v in (args_defaults or {}).items():  # what initialize_megatron applies, for the checks
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    layout = layout_from_args(args, world)
    model.check(args, layout)
    check_common(args, layout)
    check_script_data(args, int(os.environ.get("RANK", "0")))  # before any rank reads data
    # Batch arithmetic and schedule tables of every rank (ValueError with the arithmetic).
    rank_plans(layout, args.global_batch_size, args.micro_batch_size, args.hetero_offload_encoder)
    return args, layout


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
        given, _ = parse_and_validate(model, extra_args_provider, args_defaults or {})
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
    layout = layout_from_args(args, dist.get_world_size())
    _train(model, args, layout, train_valid_test_datasets_provider, model_provider)
    return 0


def _train(
    model: ScriptModel, args, layout: HeteroLayout, datasets_provider: Callable, model_provider: Callable
) -> None:
    from megatron.training.training import get_optimizer_param_scheduler

    from megatron_hetero.compat import ensure_global_memory_buffer
    from megatron_hetero.runtime.topology import Topology

    ensure_global_memory_buffer()
    source = None
    if args.load or args.hetero_init == "reference":
        source = weights_mod.ReferenceSource.build(model_provider, keep=bool(args.save))
    if model.prepare is not None:
        model.prepare(args)  # what the model provider sets on args, also without it
    topo = Topology.build(layout, timeout_s=args.hetero_comm_timeout)
    try:
        plan = rank_plan(layout, topo.rank, args.global_batch_size, args.micro_batch_size, args.hetero_offload_encoder)
        optim = OptimConfig(
            optimizer=args.optimizer,
            lr=args.lr,
            weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2,
            adam_eps=args.adam_eps,
            clip_grad=args.clip_grad,  # by the whole model's norm (runtime/optimizer_step.py)
            use_distributed_optimizer=bool(args.use_distributed_optimizer),  # per module's DP x CP group
            overlap_grad_reduce=bool(getattr(args, "overlap_grad_reduce", False)),  # DDP's bucket overlap
            # the all-gather of the updated parameters in the next forward (DDP's forward pre-hooks)
            overlap_param_gather=bool(getattr(args, "overlap_param_gather", False)),
            ddp_bucket_size=getattr(args, "ddp_bucket_size", None),
            **precision.optim_fields(args),  # --bf16, --fp16 and the loss-scale flags
        )
        scaler = precision.loss_scaler(optim)  # --fp16: one loss scale for every module of the rank
        if source is not None and args.load:  # --fp16: the checkpoint's loss scale (Megatron's grad_scaler)
            precision.restore_loss_scale(scaler, source.grad_scaler)
        states, schedulers = {}, {}
        split = check_uneven_pipeline(args, layout)  # (module, layers per stage) or None
        for m in layout.modules:
            if not topo.serves(m.name):
                continue
            pgs = topo.pg_collection(m.name)
            part = model.build(args, layout, m, pgs, model_provider)
            first = model.first_layer(layout, m)
            if split is not None and m.name == split[0] and pgs.tp.rank() == 0 and pgs.dp.rank() == 0:
                held = weights_mod.stage_layers(part, first)  # what Megatron built, the weights' offsets
                print(
                    f"{PREFIX}: module {m.name}: pipeline stage {pgs.pp.rank()} holds layers {held.start}-{held.stop - 1}",
                    flush=True,
                )
            if source is not None:
                weights_mod.copy_into(part, source, pgs, first_layer=first)
            states[m.name] = ModuleState(m.name, part, pgs, optim, loss_scaler=scaler)
            if source is not None and args.load:
                weights_mod.copy_optimizer_state(part, states[m.name].optimizer, source, pgs, first_layer=first)
        if source is not None:
            source.release()
        for name, s in states.items():
            if s.optimizer is not None:
                schedulers[name] = get_optimizer_param_scheduler(s.optimizer)
        start = source.iteration if source is not None else 0
        if start and start >= args.train_iters:
            print_last(f"{PREFIX}: checkpoint iteration {start} >= --train-iters {args.train_iters}: nothing to do")
            return
        for sched in schedulers.values():  # resume: the schedule where the saving run left it
            if start:
                sched.step(increment=start * args.global_batch_size)
        runner = model.runner(args, plan, states, datasets_provider)
        schedule = schedule_for(plan, RuntimeConfig(comm_timeout_s=args.hetero_comm_timeout), topo, states, runner)
        if split is not None:
            print_last(f"{PREFIX}: module {split[0]}: pipeline stages hold {split[1]} layers")
        print_last(
            f"{PREFIX}: training with {layout.placement} layout "
            + ", ".join(f"{m.name} tp{m.tp}·pp{m.pp}·dp{m.dp}@{m.ranks}" for m in layout.modules)
            + f", from iteration {start}"
        )
        save = None
        if source is not None and source.kept is not None:  # --save: Megatron's checkpoint of the reference model
            first = {m.name: model.first_layer(layout, m) for m in layout.modules}

            def save(iteration: int) -> None:
                checkpoints.save_reference_checkpoint(source, iteration, states, first)

            schedulers = {**schedulers, "<reference>": source.kept[2]}  # the reference scheduler follows
        front = ScriptFrontEnd(args, states, Evaluator(schedule, runner, states, args, start), save)
        stop = ExitSignal(getattr(args, "exit_signal_handler", False)).install()
        try:
            run_loop(
                schedule,
                schedulers,
                LoopSpec(
                    start=start,
                    train_iters=args.train_iters,
                    scheduler_increment=args.global_batch_size,  # Megatron-LM's schedulers count samples
                    save=args.save if save is not None else None,
                    save_interval=args.save_interval,
                    rank=topo.rank,
                ),
                front,
                stop,
            )
        finally:
            stop.restore()
        for state in states.values():  # --overlap-param-gather: the last step's parameters, gathered
            state.gather_params()
        if hasattr(schedule, "close"):
            schedule.close()
        dist.barrier()
    finally:
        topo.destroy()

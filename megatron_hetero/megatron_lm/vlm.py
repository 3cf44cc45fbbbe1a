"""`pretrain_vlm.py --hetero-*`: Megatron-LM's VLM script trained with per-module layouts.

What the patched `pretrain_vlm.py` hands over (its dataset provider, model provider and extra
arguments), and what this module does with them, in order:
  1. parse Megatron's arguments (with the script's extra arguments and the `--hetero-*` flags),
     resolve and validate the layout against the world size and the Megatron features used (exit 2
     with the reason on every rank, before any process group or model exists);
  2. `initialize_megatron` as `pretrain()` does (Megatron's global state: arguments, tokenizer,
     timers, seeds; its global parallel state follows Megatron's own `--tensor-model-parallel-size`
     etc., the *reference* layout), then `set_jit_fusion_options`;
  3. weights: `--hetero-init reference` (default) builds Megatron's own LLaVA model with the script's
     model provider on the reference layout (exactly what the unpatched script would start from),
     gathers each parameter over the reference TP group and keeps this rank's shard of each module;
     `--load DIR` (torch format, any TP of the saving run, PP 1) reads the per-rank files instead;
     `--hetero-init module` keeps each module's own Megatron initialisation;
  4. per module (`vision`: CLIP ViT + projector, `language`: GPT language model), Megatron's
     `LLaVAModel` with `add_encoder`/`add_decoder` split, built from Megatron's arguments on the
     module's own `ProcessGroupCollection` (`runtime.topology.Topology`), wrapped in Megatron DDP with
     its own Megatron optimizer (`runtime.module_state.ModuleState`) and Megatron's learning-rate
     schedule (`get_optimizer_param_scheduler`);
  5. the project's schedule (colocated three-phase or disjoint 1F1B) drives `MegatronVlmRunner`
     (the `StageRunner`) over Megatron's own train dataset (the script's provider; sample k of the
     run is dataset[k], as Megatron's sequential sampler reads it), and each iteration prints
     Megatron's log line (`iteration N/ M | consumed samples | ... | lm loss: X |`).

The loss is normalised per token over the global batch (Megatron's `--calculate-per-token-loss`);
Megatron's default (a mean per micro-batch, averaged) is the same number when every micro-batch has
the same count of loss tokens, as with mock data. Features a layout refuses are listed in
`check_args` (each with the flag named, exit 2 before any process group or model exists).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_hetero.layout.args import add_hetero_args, layout_from_args
from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.plan.rank_plan import rank_plan, rank_plans
from megatron_hetero.runtime.config import RuntimeConfig
from megatron_hetero.runtime.module_state import ModuleState, OptimConfig
from megatron_hetero.megatron_lm import weights as weights_mod
from megatron_hetero.megatron_lm.runner import MegatronVlmRunner

VISION, LANGUAGE = "vision", "language"
PREFIX = "megatron-hetero megatron-lm"


def add_megatron_lm_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The plugin's flags for Megatron-LM scripts: `add_hetero_args` plus `--hetero-init`."""
    add_hetero_args(parser)
    group = parser.add_argument_group(title="megatron-hetero with Megatron-LM scripts")
    group.add_argument("--hetero-init", choices=["reference", "module"], default="reference",
                       help="reference (default): start from the weights Megatron's own model would have on the "
                            "layout given by Megatron's parallel flags (builds that model once); module: each "
                            "module's own Megatron initialisation on its own layout. --load overrides both.")
    return parser


def chain(*providers: Optional[Callable]) -> Callable:
    def provider(parser):
        for p in providers:
            if p is not None:
                parser = p(parser)
        return parser

    return provider


# -- validation (pure on parsed arguments; before any group or model) ------------------------------
def check_args(args: Any, layout: HeteroLayout) -> None:
    """Megatron features a layout supports; ValueError naming the flag otherwise."""
    names = set(layout.names)
    if names != {VISION, LANGUAGE}:
        raise ValueError(f"pretrain_vlm.py with a layout needs exactly the modules 'vision' and 'language' "
                         f"(CLIP ViT + projector, GPT language model); the layout has {sorted(names)}")
    if [(e.src, e.dst) for e in layout.edges] != [(VISION, LANGUAGE)]:
        raise ValueError(f"pretrain_vlm.py needs exactly the edge 'vision -> language'; the layout has "
                         f"{[str(e) for e in layout.edges]}")
    vis, lang = layout.module(VISION), layout.module(LANGUAGE)
    for m in (vis, lang):
        if m.cp != 1:
            raise ValueError(f"module {m.name}: cp={m.cp}; LLaVA's context parallelism needs Transformer Engine "
                             f"attention and packed sequences, not supported with a layout (use cp=1)")
        if m.ep != 1 or m.layers is not None:
            raise ValueError(f"module {m.name}: ep/layers are not supported with pretrain_vlm.py")
    if vis.pp != 1:
        raise ValueError(f"module vision: pp={vis.pp}; Megatron's LLaVA vision encoder runs on one pipeline "
                         f"stage (pp=1)")
    refused = {
        "fp16": "--fp16", "bf16": "--bf16", "use_distributed_optimizer": "--use-distributed-optimizer",
        "sequence_parallel": "--sequence-parallel", "swiglu": "--swiglu",
        "virtual_pipeline_model_parallel_size": "--num-layers-per-virtual-pipeline-stage",
        "use_packed_sequence": "--use-packed-sequence", "decoder_tp_comm_overlap": "--decoder-tp-comm-overlap",
        "num_experts": "--num-experts", "pixel_shuffle": "--pixel-shuffle",
    }
    for attr, flag in refused.items():
        if getattr(args, attr, None):
            raise ValueError(f"{flag} is not supported with a layout (yet)")
    if getattr(args, "clip_grad", 0.0):
        raise ValueError(f"--clip-grad {args.clip_grad}: gradient clipping by the norm over all modules is not "
                         f"implemented with a layout (each module's optimizer would clip by its own norm); "
                         f"pass --clip-grad 0")
    if args.context_parallel_size != 1 or args.pipeline_model_parallel_size != 1:
        raise ValueError("with a layout, Megatron's --context-parallel-size and --pipeline-model-parallel-size "
                         "must stay 1 (they give the reference layout the weights start from; each module's "
                         "own degrees come from the layout)")
    if args.optimizer not in ("adam", "sgd"):
        raise ValueError(f"--optimizer {args.optimizer} is not supported with a layout (adam or sgd)")
    if args.save:
        if args.ckpt_format != "torch":
            raise ValueError(f"--save with a layout writes --ckpt-format torch checkpoints; got {args.ckpt_format}")
        if any(m.pp != 1 for m in (vis, lang)):
            raise ValueError("--save with a layout needs pp=1 in every module (the checkpoint is written on the "
                             "reference layout, Megatron's parallel flags)")
        if args.hetero_init != "reference":
            raise ValueError("--save with a layout needs --hetero-init reference (the checkpoint is written "
                             "through Megatron's own model on the reference layout)")
    if args.load and args.ckpt_format != "torch":
        raise ValueError(f"--load with a layout reads --ckpt-format torch checkpoints (Megatron's own "
                         f"load_checkpoint on the layout of Megatron's parallel flags); got {args.ckpt_format}")
    if args.eval_iters and args.eval_iters > 0:
        raise ValueError(f"--eval-iters {args.eval_iters}: evaluation is not implemented with a layout yet; "
                         f"pass --eval-iters 0")
    if args.train_iters is None:
        raise ValueError("--train-iters is required with a layout (--train-samples is not supported)")
    if args.rampup_batch_size:
        raise ValueError("--rampup-batch-size is not supported with a layout")
    heads = args.num_attention_heads
    for m in (vis, lang):
        if heads % m.tp:
            raise ValueError(f"module {m.name}: --num-attention-heads {heads} is not divisible by tp({m.tp})")
    dec_layers = args.decoder_num_layers if args.decoder_num_layers is not None else args.num_layers
    if dec_layers % lang.pp:
        raise ValueError(f"module language: {dec_layers} decoder layers do not split over pp({lang.pp})")
    # Batch arithmetic and schedule tables of every rank (ValueError with the arithmetic).
    rank_plans(layout, args.global_batch_size, args.micro_batch_size, args.hetero_offload_encoder)


def parse_and_validate(extra_args_provider: Optional[Callable], args_defaults: dict):
    """Megatron's argument parsing with the plugin flags; (args, layout). ValueError for bad input."""
    from megatron.training.arguments import parse_args

    args = parse_args(extra_args_provider=chain(extra_args_provider, add_megatron_lm_args))
    for k, v in (args_defaults or {}).items():  # what initialize_megatron applies, for the checks
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    layout = layout_from_args(args, world)
    check_args(args, layout)
    return args, layout


# -- the entry point the patch calls ---------------------------------------------------------------
def pretrain_vlm(train_valid_test_datasets_provider: Callable, model_provider: Callable,
                 extra_args_provider: Optional[Callable] = None, args_defaults: Optional[dict] = None,
                 get_embedding_ranks: Optional[Callable] = None,
                 get_position_embedding_ranks: Optional[Callable] = None) -> int:
    """Train Megatron-LM's VLM with the layout of the `--hetero-*` flags; returns the exit code
    (2: invalid input, printed as one paragraph)."""
    try:
        parse_and_validate(extra_args_provider, args_defaults or {})
    except ValueError as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{PREFIX}: invalid input: {exc}", file=sys.stderr, flush=True)
        return 2
    from megatron.training import get_args
    from megatron.training.initialize import initialize_megatron, set_jit_fusion_options

    initialize_megatron(extra_args_provider=chain(extra_args_provider, add_megatron_lm_args),
                        args_defaults=args_defaults or {}, get_embedding_ranks=get_embedding_ranks,
                        get_position_embedding_ranks=get_position_embedding_ranks)
    set_jit_fusion_options()
    args = get_args()
    layout = layout_from_args(args, dist.get_world_size())
    _train(args, layout, train_valid_test_datasets_provider, model_provider)
    return 0


def _train(args, layout: HeteroLayout, datasets_provider: Callable, model_provider: Callable) -> None:
    from megatron.training.training import get_optimizer_param_scheduler

    from megatron_hetero.compat import ensure_global_memory_buffer
    from megatron_hetero.runtime.topology import Topology

    ensure_global_memory_buffer()
    source = None
    if args.load or args.hetero_init == "reference":
        source = weights_mod.ReferenceSource.build(model_provider, keep=bool(args.save))
    from megatron_hetero.megatron_lm.build import build_vlm_module, vlm_sizes

    vlm_sizes(args)  # what the model provider sets on args (sequence lengths), also without it
    topo = Topology.build(layout, timeout_s=args.hetero_comm_timeout)
    try:
        plan = rank_plan(layout, topo.rank, args.global_batch_size, args.micro_batch_size,
                         args.hetero_offload_encoder)
        optim = OptimConfig(optimizer=args.optimizer, lr=args.lr, weight_decay=args.weight_decay,
                            adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                            clip_grad=0.0)
        states, schedulers = {}, {}
        for m in layout.modules:
            if not topo.serves(m.name):
                continue
            pgs = topo.pg_collection(m.name)
            model = build_vlm_module(args, m, pgs)
            if source is not None:
                weights_mod.copy_into(model, source, pgs)
            states[m.name] = ModuleState(m.name, model, pgs, optim)
            if source is not None and args.load:
                weights_mod.copy_optimizer_state(model, states[m.name].optimizer, source, pgs)
        if source is not None:
            source.release()
        for name, s in states.items():
            if s.optimizer is not None:
                schedulers[name] = get_optimizer_param_scheduler(s.optimizer)
        start = source.iteration if source is not None else 0
        if start and start >= args.train_iters:
            _print_last(f"{PREFIX}: checkpoint iteration {start} >= --train-iters {args.train_iters}: nothing to do")
            return
        for sched in schedulers.values():  # resume: the schedule where the saving run left it
            if start:
                sched.step(increment=start * args.global_batch_size)
        runner = MegatronVlmRunner(args, plan, states, datasets_provider)
        schedule = _schedule(plan, RuntimeConfig(comm_timeout_s=args.hetero_comm_timeout), topo, states, runner)
        _print_last(f"{PREFIX}: training with {layout.placement} layout "
                    + ", ".join(f"{m.name} tp{m.tp}·pp{m.pp}·dp{m.dp}@{m.ranks}" for m in layout.modules)
                    + f", from iteration {start}")
        log = _IntervalLog(args)
        for it in range(start, args.train_iters):
            dist.barrier()
            t0 = time.perf_counter()
            res = schedule.step(it)
            for sched in schedulers.values():
                sched.step(increment=args.global_batch_size)
            log.add(it + 1, res.loss, (time.perf_counter() - t0) * 1000.0, _current_lr(states))
            if source is not None and source.kept is not None:
                source.kept[2].step(increment=args.global_batch_size)  # the reference scheduler follows
                if (it + 1) % (args.save_interval or args.train_iters) == 0 or it + 1 == args.train_iters:
                    weights_mod.save_reference_checkpoint(source, it + 1, states, layout, topo)
        if hasattr(schedule, "close"):
            schedule.close()
        dist.barrier()
    finally:
        topo.destroy()


def _schedule(plan, config, topo, states, runner):
    if plan.layout.placement == "colocated":
        from megatron_hetero.runtime.colocated import ColocatedSchedule

        return ColocatedSchedule(plan, config, topo, states, runner)
    from megatron_hetero.runtime.disjoint import DisjointSchedule

    return DisjointSchedule(plan, config, topo, states, runner)


def _current_lr(states) -> float:
    """The learning rate the last step used (the language module's, else any trained module's);
    the same on every rank after an all-reduce of max (ranks without a trained module report 0)."""
    lr = 0.0
    for name in (LANGUAGE, VISION):
        s = states.get(name)
        if s is not None and s.optimizer is not None:
            lr = float(s.optimizer.param_groups[0]["lr"])
            break
    t = torch.tensor([lr], dtype=torch.float64)
    from megatron_hetero.compat.device import get_device

    t = t.to(get_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


class _IntervalLog:
    """Megatron's `training_log` accumulation: losses are averaged over the iterations since the last
    printed line; the first iteration of a run is printed without resetting the accumulators (so the
    next line averages from it too, as upstream does)."""

    def __init__(self, args) -> None:
        self.args, self.first = args, True
        self.loss_sum, self.iters, self.ms = 0.0, 0, 0.0

    def add(self, iteration: int, loss: float, ms: float, lr: float) -> None:
        self.loss_sum += loss
        self.iters += 1
        self.ms += ms
        if iteration % self.args.log_interval == 0 or self.first:
            _print_last(_log_line(iteration, self.args, self.ms / max(1, self.iters), lr,
                                  self.loss_sum / max(1, self.iters)))
            if not self.first:
                self.loss_sum, self.iters, self.ms = 0.0, 0, 0.0
        self.first = False


def _log_line(iteration: int, args, ms: float, lr: float, loss: float) -> str:
    """Megatron's `training_log` line (the fields this loop has)."""
    ts = time.strftime("%Y-%m-%d %H:%M:%S")
    s = f" [{ts}] iteration {iteration:8d}/{args.train_iters:8d} |"
    s += f" consumed samples: {iteration * args.global_batch_size:12d} |"
    s += f" elapsed time per iteration (ms): {ms:.1f} |"
    s += f" learning rate: {lr:.6E} |"
    s += f" global batch size: {args.global_batch_size:5d} |"
    s += f" lm loss: {loss:.6E} |"
    s += " loss scale: 1.0 |"
    s += " number of skipped iterations:   0 |"
    s += f" number of nan iterations: {0 if math.isfinite(loss) else 1:3d} |"
    return s


def _print_last(msg: str) -> None:
    if dist.get_rank() == dist.get_world_size() - 1:
        print(msg, flush=True)

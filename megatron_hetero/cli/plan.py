"""`megatron-hetero plan`: validate a layout and print the rank map and boundary plans (`--json`).

    megatron-hetero plan LAYOUT.yaml [--world-size N] [--json] [--summary | --full | --rank R] [--global-batch-size G]
        [--seq-length S] [--hidden-size H] [--dtype-bytes B] [--num-experts E]
        [--memory [train's model, batch and feature flags: --bf16, --use-distributed-optimizer, ...]]
    megatron-hetero plan --hetero-module NAME:tp=..,dp=.. ... [--hetero-edge 'A->B'] [--hetero-placement P]

The model flags give the shape crossing each edge (default: the smallest one every transform takes).
A world above `report.plan_summary.SUMMARY_ABOVE` ranks gets a summary (module grids, every edge's
transform, bytes and messages, sample ranks) unless --full; --rank R prints one rank's whole plan
(with its schedule table when --global-batch-size is given). Pure: no torch.
"""

from __future__ import annotations

import argparse
import json

from megatron_hetero.cli.model_flags import MODEL_FLAGS, add_model_flags
from megatron_hetero.layout.flags import add_flags, flags_of, value, values
from megatron_hetero.cli import CommandFailed
from megatron_hetero.cli.arch_flags import add_arch_flags
from megatron_hetero.cli.train_door import arch_flags, batch_from_args, model_flags
from megatron_hetero.layout.args import add_hetero_args, layout_from_args
from megatron_hetero.layout.validate import check_experts, check_recompute
from megatron_hetero.plan.rank_plan import rank_plan
from megatron_hetero.plan.roles import roles
from megatron_hetero.planner.memory import StateFeatures
from megatron_hetero.config.model import MOE_FLAGS, LlavaSpec, spec_from_flags
from megatron_hetero.report.draw import draw_layout
from megatron_hetero.report.memory import JOB_FLAGS, OPTIM_FLAGS, memory_rows, memory_text
from megatron_hetero.report.plan import default_shape, layout_json, layout_text
from megatron_hetero.report.plan_summary import SUMMARY_ABOVE, rank_json, rank_text, summary_json, summary_text
from megatron_hetero.config.optim import OptimConfig
from megatron_hetero.config.arch import apply_arch_flags
from megatron_hetero.config.job import JobConfig, job_recompute

NAME = "plan"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(NAME, help="validate a layout and print the rank map and boundary plans")
    p.add_argument("layout", nargs="?", default=None, help="layout YAML (or use --hetero-layout / --hetero-module)")
    p.add_argument("--world-size", type=int, default=None, help="total ranks (default: what the layout uses)")
    p.add_argument("--json", action="store_true", help="print a JSON document instead of tables")
    view = p.add_mutually_exclusive_group()
    view.add_argument(
        "--summary",
        action="store_true",
        help="module grids, every edge's transform, bytes and messages, and a few sample ranks instead of a "
        "line per rank (the default above 256 ranks)",
    )
    view.add_argument(
        "--full", action="store_true", help="the full report (a line per rank, every transfer) at any world size"
    )
    view.add_argument(
        "--rank",
        type=int,
        default=None,
        metavar="R",
        help="one rank's whole plan: its coordinates and pipeline peers, its part of every edge (both "
        "directions) and, with --global-batch-size, its schedule table",
    )
    add_model_flags(
        p,
        ("global_batch_size", "seq_length", "hidden_size"),
        help={
            "global_batch_size": "samples crossing each edge per step (default: lcm of the DP sizes)",
            "seq_length": "tokens per sample on each edge (default: 8 * lcm of 2*cp)",
            "hidden_size": "hidden size on each edge (default {default}: the model's)",
        },
    )
    p.add_argument("--dtype-bytes", type=int, default=4, help="bytes per element (4 fp32, 2 bf16)")
    p.add_argument(
        "--draw",
        default=None,
        metavar="FILE.png",
        help="also draw the layout: ranks as cells coloured by module with their coordinates, "
        "edges with their transform (needs matplotlib)",
    )
    add_flags(
        p,
        flags_of(LlavaSpec, ["num_experts"]),
        help={"num_experts": "experts per MoE layer of the language model: checks ep against it and prints them"},
    )
    _add_memory_flags(p)
    add_hetero_args(p)
    return p


def _add_memory_flags(p: argparse.ArgumentParser) -> None:
    """--memory and the flags of `train` that the memory model reads: the rest of the model's sizes,
    the batch, the architecture, MoE, precision, optimizer, distributed optimizer, SP and recompute."""

    p.add_argument(
        "--memory",
        action="store_true",
        help="also predict every rank's resident state and activation peak of a train step with these "
        "flags (the memory model train --log-memory checks; --json: predicted_state_bytes, "
        "predicted_activation_bytes per rank)",
    )
    add_model_flags(p, [n for n in MODEL_FLAGS if n not in ("global_batch_size", "seq_length", "hidden_size")])
    add_arch_flags(p)
    group = {"training": "train's features (for --memory)", "moe": "mixture of experts (for --memory)"}
    add_flags(p, [f for f in flags_of(LlavaSpec, MOE_FLAGS) if f.name != "num_experts"], group)
    add_flags(p, flags_of(OptimConfig, OPTIM_FLAGS) + flags_of(JobConfig, JOB_FLAGS), group)


def run(args: argparse.Namespace) -> int:
    if args.layout and args.hetero_layout:
        raise ValueError("give the layout file once: positional LAYOUT or --hetero-layout, not both")
    if args.layout:
        args.hetero_layout = args.layout

    layout = layout_from_args(args, world_size=args.world_size)
    experts = {}
    if args.num_experts is not None:  # ep > 1 on a dense module, ep not dividing --num-experts: exit 2
        experts = {n: args.num_experts for n in roles(layout).language}
        check_experts(layout, experts)
    hidden = value(args, MODEL_FLAGS["hidden_size"])  # the model's hidden size unless given
    shape = default_shape(layout, args.global_batch_size, args.seq_length, hidden, args.dtype_bytes)

    if args.rank is not None:
        return _rank(args, layout, shape, experts)
    if args.summary or (layout.world_size > SUMMARY_ABOVE and not args.full):
        return _summary(args, layout, shape, experts)
    memory = None
    if args.memory:
        memory = _memory_rows(args, layout)
    if args.json:
        doc = layout_json(layout, shape, experts)
        if memory is not None:
            for entry, row in zip(doc["ranks"], memory):
                entry.update({k: v for k, v in row.items() if k != "rank"})
        print(json.dumps(doc, indent=1))
    else:
        print(layout_text(layout, shape, experts))
        if memory is not None:
            print(memory_text(memory))
    if args.draw:
        _draw(layout, shape, args.draw, quiet=args.json)
    return 0


def _summary(args: argparse.Namespace, layout, shape, experts) -> int:
    doc = summary_json(layout, shape, experts)
    if args.memory:  # the memory model of the sample ranks only
        rows = _memory_rows(args, layout, [r["rank"] for r in doc["sample_ranks"]])
        for entry, row in zip(doc["sample_ranks"], rows):
            entry.update({k: v for k, v in row.items() if k != "rank"})
    print(json.dumps(doc, indent=1) if args.json else summary_text(doc))
    if args.memory and not args.json:
        print(memory_text(rows))
    if args.draw:
        _draw(layout, shape, args.draw, quiet=args.json)
    return 0


def _memory_rows(args: argparse.Namespace, layout, ranks=None) -> list[dict]:
    """`report.memory.memory_rows` for train's model, batch, optimizer and recompute flags in `args`
    (read here, at plan's door, as `train` reads them: `cli.train_door`). ValueError for bad sizes,
    batches or recompute flags."""
    import dataclasses

    global_batch, micro_batch = batch_from_args(args, layout)
    model = model_flags(args)
    spec = spec_from_flags(model, layout)
    spec = apply_arch_flags(arch_flags(args), dataclasses.replace(spec, **model.moe), model)
    o = values(OptimConfig, args, OPTIM_FLAGS)
    spec = dataclasses.replace(spec, bf16=bool(o["bf16"]), fp16=bool(o["fp16"]))
    j = values(JobConfig, args, JOB_FLAGS)
    recompute = job_recompute(JobConfig(spec=spec, **j))
    if recompute is not None:
        check_recompute(recompute, "--recompute-granularity/--recompute-method/--recompute-num-layers")
    features = StateFeatures(
        precision="bf16" if o["bf16"] else "fp16" if o["fp16"] else "fp32",
        optimizer=o["optimizer"],
        distributed_optimizer=bool(o["use_distributed_optimizer"]),
    )
    offload = bool(getattr(args, "hetero_offload_encoder", False))
    return memory_rows(
        layout, spec, global_batch, micro_batch, features, bool(j["sequence_parallel"]), recompute, offload, ranks
    )


def _schedule_lines(args: argparse.Namespace, layout, rank: int) -> list[str]:
    """The rank's schedule table for the batch flags (its colocated phases or its stage's 1F1B)."""

    g, mbs = batch_from_args(args, layout)
    plan = rank_plan(layout, rank, g, mbs, bool(getattr(args, "hetero_offload_encoder", False)))
    if plan.colocated is not None:
        return [line.strip() for line in plan.colocated.format().splitlines()[1:]]
    if plan.disjoint is None:
        return ["idle (no stage)"]
    return [f"stage {plan.disjoint.stage}: {plan.disjoint.compact()}"]


def _rank(args: argparse.Namespace, layout, shape, experts) -> int:
    if not 0 <= args.rank < layout.world_size:
        raise ValueError(f"--rank {args.rank} is outside the layout's world size {layout.world_size}")
    schedule = _schedule_lines(args, layout, args.rank) if args.global_batch_size is not None else None
    doc = rank_json(layout, shape, args.rank, experts, schedule)
    if args.memory:
        (row,) = _memory_rows(args, layout, [args.rank])
        doc.update({k: v for k, v in row.items() if k != "rank"})
    print(json.dumps(doc, indent=1) if args.json else rank_text(doc))
    if args.memory and not args.json:
        print(memory_text([row]))
    return 0


def _draw(layout, shape, out: str, quiet: bool) -> None:
    import sys

    try:
        summary = draw_layout(layout, out, shape)
    except ImportError as exc:
        raise CommandFailed(str(exc)) from None
    print(
        f"drew {summary['cells']} cells over {len(summary['ranks'])} ranks -> {out}",
        file=sys.stderr if quiet else sys.stdout,
    )

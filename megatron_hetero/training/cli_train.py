"""`megatron-hetero train`: run the LLaVA-style model locally on N ranks (forked; gloo on CPU, NCCL on GPU).

Megatron-style flags for sizes, batch and optimizer; the layout from `--hetero-layout FILE` or
`--hetero-module ...`. Which modules are encoders: every module except the language module(s) — the
sink of the module graph, or the modules that declare `layers` (pipeline segments). Each encoder
gets the `--encoder-*` sizes; their placeholder spans follow each other in the text from position 1.
Everything is validated before any rank starts (exit 2 with the message).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from megatron_hetero.layout.args import add_hetero_args, layout_from_args
from megatron_hetero.layout.spec import HeteroLayout


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train the tiny LLaVA-style model on a heterogeneous layout")
    g = p.add_argument_group("model (language model)")
    g.add_argument("--num-layers", type=int, default=None,
                   help="language-model layers (default: 2, or what the segments' `layers` cover)")
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=32)
    g.add_argument("--vocab-size", type=int, default=128)
    e = p.add_argument_group("model (each encoder)")
    e.add_argument("--encoder-num-layers", type=int, default=2)
    e.add_argument("--encoder-hidden-size", type=int, default=32)
    e.add_argument("--encoder-num-attention-heads", type=int, default=4)
    e.add_argument("--encoder-tokens", type=int, default=8, help="tokens per sample (image patches)")
    e.add_argument("--encoder-feature-dim", type=int, default=24, help="input features per token")
    t = p.add_argument_group("training")
    t.add_argument("--micro-batch-size", type=int, default=None,
                   help="samples per micro-batch on a rank of the (first) language module (default: 1, or for "
                        "disjoint layouts the smallest size whose micro-batches every module's DP divides)")
    t.add_argument("--global-batch-size", type=int, default=8)
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
    p.set_defaults(func=run_train)


def language_names(layout: HeteroLayout) -> list[str]:
    """The language modules: those with `layers`, else the sinks of the module graph."""
    with_layers = [m.name for m in layout.modules if m.layers is not None]
    if with_layers:
        return with_layers
    return [m.name for m in layout.modules if not layout.consumers(m.name)]


def default_micro_batch_size(layout: HeteroLayout, global_batch: int) -> int:
    """1 for colocated layouts; for disjoint ones the smallest micro-batch size b such that the
    micro-batches of G / (dp_first_language * b) samples split evenly over every module's DP."""
    if layout.placement == "colocated":
        return 1
    first = min((layout.module(n) for n in language_names(layout)),
                key=lambda m: m.layers.start if m.layers is not None else 0)
    dps = [m.dp for m in layout.modules]
    for b in range(1, max(global_batch // first.dp, 1) + 1):
        micro = global_batch // (first.dp * b)
        if micro >= 1 and global_batch % (first.dp * b) == 0 and all((global_batch // micro) % d == 0 for d in dps):
            return b
    return 1  # nothing fits: validation explains why with the arithmetic


def job_from_args(args: argparse.Namespace, layout: HeteroLayout):
    from megatron_hetero.models.llava import EncoderSpec, LlavaSpec
    from megatron_hetero.runtime.module_state import OptimConfig
    from megatron_hetero.training.setup import JobConfig

    langs = language_names(layout)
    if args.num_layers is None:
        ends = [layout.module(n).layers.end for n in langs if layout.module(n).layers is not None]
        args.num_layers = max(ends) + 1 if ends else 2
    if args.micro_batch_size is None:
        args.micro_batch_size = default_micro_batch_size(layout, args.global_batch_size)
    encoders, offset = {}, 1
    for m in layout.modules:
        if m.name in langs:
            continue
        encoders[m.name] = EncoderSpec(num_layers=args.encoder_num_layers, hidden_size=args.encoder_hidden_size,
                                       num_attention_heads=args.encoder_num_attention_heads,
                                       tokens=args.encoder_tokens, feature_dim=args.encoder_feature_dim, offset=offset)
        offset += args.encoder_tokens
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
                 "encoder_num_layers", "encoder_hidden_size", "encoder_num_attention_heads", "encoder_tokens",
                 "encoder_feature_dim"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.encoder_hidden_size % args.encoder_num_attention_heads:
        raise ValueError(f"--encoder-hidden-size {args.encoder_hidden_size} is not divisible by "
                         f"--encoder-num-attention-heads {args.encoder_num_attention_heads}")
    spec = LlavaSpec(num_layers=args.num_layers, hidden_size=args.hidden_size,
                     num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
                     vocab_size=args.vocab_size, seq_length=args.seq_length, encoders=encoders, seed=args.seed)
    optim = OptimConfig(optimizer=args.optimizer, lr=args.lr, weight_decay=args.weight_decay,
                        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                        clip_grad=args.clip_grad)
    return JobConfig(spec=spec, global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
                     train_iters=args.train_iters, optim=optim, offload_encoder=args.hetero_offload_encoder,
                     comm_timeout_s=args.hetero_comm_timeout)


def merge_records(per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per iteration: the global loss, the slowest rank's step time, per-rank memory."""
    out = []
    for i, rec in enumerate(per_rank[0]["records"]):
        out.append({
            "iteration": rec["iteration"],
            "loss": rec["loss"],
            "step_time_s": max(r["records"][i]["step_time_s"] for r in per_rank),
            "memory_bytes": {str(rank): r["records"][i]["memory"] for rank, r in enumerate(per_rank)},
        })
    return out


def quiet_upstream_warnings() -> None:
    """Megatron-core and torch.distributed warn on every rank about CUDA-only features (fusions, CUDA
    graphs, deprecated collective names); hide those in the launcher's ranks (inherited by fork)."""
    import warnings

    for module in (r"megatron\..*", r"torch\.distributed\..*"):
        warnings.filterwarnings("ignore", category=UserWarning, module=module)
        warnings.filterwarnings("ignore", category=FutureWarning, module=module)
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=module)


def run_train(args: argparse.Namespace) -> int:
    quiet_upstream_warnings()
    from megatron_hetero.compat import apply_compat, default_backend
    from megatron_hetero.runtime.launcher import RankFailure, RankTimeout, run_ranks
    from megatron_hetero.training.setup import validate_job
    from megatron_hetero.training.trainer import train_rank

    layout = layout_from_args(args, world_size=args.nproc_per_node)
    job = job_from_args(args, layout)
    validate_job(layout, job)
    apply_compat()
    world = layout.world_size
    print(f"megatron-hetero train: {world} ranks ({default_backend()}), placement {layout.placement}: "
          + ", ".join(f"{m.name} {m.short()} @{m.ranks}" for m in layout.modules), flush=True)
    try:
        per_rank = run_ranks(world, train_rank, layout, job, timeout=args.launch_timeout, backend=default_backend())
    except (RankFailure, RankTimeout) as exc:
        print(f"megatron-hetero train: failed: {exc}", file=sys.stderr)
        return 1
    records = merge_records(per_rank)
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

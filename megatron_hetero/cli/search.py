"""`megatron-hetero search`: rank heterogeneous layouts with the cost model (planner/cost.py, planner/search.py).

    megatron-hetero search --world-size 4 --profile profile.json --out best.yaml    (the model `train` runs)
    megatron-hetero train --hetero-layout best.yaml
    megatron-hetero search --world-size 64 --hardware h100_80gb \\
        --encoder 6B --llm 14B --seq-length 8192 --global-batch-size 512 --out best.yaml
    megatron-hetero search --regime-table [--hardware NAME|HARDWARE.json]

The model: `train`'s model flags (cli/model_flags.py) with `train`'s defaults, costed as `train` runs
it (fp32, Adam: `planner.model.workload`), so `search` plans what `train` with the same model
flags trains, and `--out` trains directly. `--encoder`/`--llm` choose a large preset instead, priced as
the production run train can run (the cost model's defaults: --bf16 --use-distributed-optimizer
--sequence-parallel --recompute-granularity selective; memory from `planner.memory_terms`, the terms
train's --log-memory prediction uses), whose sizes the model flags override; the printed train line
carries those flags.
Pure: no torch.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_hetero.cli.model_flags import add_model_flags
from megatron_hetero.cli.search_text import regime_markdown, result_text, time_unit, train_command
from megatron_hetero.cli.search_workload import workload_from_args
from megatron_hetero.layout.yaml_io import dump_layout
from megatron_hetero.planner.hardware import Profile
from megatron_hetero.planner.hardware_presets import DEFAULT_HARDWARE, hardware_names, load_hardware
from megatron_hetero.planner.heteropipe import strategy_label
from megatron_hetero.planner.presets import (
    ENCODER_PRESETS,
    LLM_PRESETS,
    SPEECH_PRESETS,
    TOWER_PRESETS,
    regime_table,
)
from megatron_hetero.planner.search import search, train_micro_batch_size
from megatron_hetero.planner.search_space import SearchSpace


NAME = "search"

# Spellings of earlier versions (hidden from --help): the same values as the shared model flags.
_OLD_FLAGS = {
    "--llm-layers": "num_layers",
    "--llm-hidden": "hidden_size",
    "--llm-ffn-hidden": "ffn_hidden_size",
    "--llm-heads": "num_attention_heads",
    "--encoder-layers": "encoder_num_layers",
    "--encoder-hidden": "encoder_hidden_size",
    "--encoder-heads": "encoder_num_attention_heads",
    "--encoder-ffn-hidden": "encoder_ffn_hidden_size",
    "--image-tokens": "encoder_tokens",
    "--simulate": "hardware",
}


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        NAME,
        help="rank per-module layouts and placements by predicted step time",
        description="Search per-module layouts (homogeneous, colocated, disjoint) with the cost model.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--profile", metavar="PROFILE.json", help="fitted cost profile (JSON, `megatron-hetero profile`)")
    src.add_argument(
        "--hardware",
        metavar="NAME|HARDWARE.json",
        help=f"build the cost profile from a hardware description: a preset name "
        f"({', '.join(hardware_names())}) or a JSON file with the same keys",
    )
    p.add_argument("--world-size", type=int, default=None, help="total ranks")
    add_model_flags(
        p,
        help={
            "micro_batch_size": "samples per micro-batch per replica of the largest language DP, as the cost model "
            "counts it (default 1); the train line written into --out converts it to train's "
            "(per rank of the first language module)",
            "global_batch_size": "samples per step (default: train's 8; with presets 4M tokens / --seq-length)",
            "seq_length": "tokens per sample (default: train's 32; with presets 8192)",
        },
    )
    m = p.add_argument_group(
        "preset models (instead of train's model)",
        "With --encoder or --llm, the model flags not given take the preset's sizes.",
    )
    m.add_argument(
        "--encoder",
        choices=list(ENCODER_PRESETS) + list(TOWER_PRESETS),
        default=None,
        help="encoder size preset (with --llm: default 1B); qwen2.5-vl: Qwen2.5-VL-7B's vision tower, "
        "--encoder-tokens its merged tokens (default 256: 448x448 pixels), priced with its windows",
    )
    m.add_argument(
        "--llm", choices=list(LLM_PRESETS), default=None, help="LLM size preset (with --encoder: default 14B)"
    )
    m.add_argument(
        "--encoder-ffn-hidden-size",
        type=int,
        default=None,
        help="encoder MLP hidden size (presets only; train's encoders use 4 * --encoder-hidden-size)",
    )
    m.add_argument(
        "--images-per-sample",
        type=int,
        default=None,
        help="encoder inputs of --encoder-tokens per sample (presets only; default 1)",
    )
    a = p.add_argument_group(
        "a second encoder",
        "A speech encoder beside the image encoder: the layout's `audio` module, with its own layout in every "
        "candidate (its own TP/PP/DP colocated, its own island disjoint).",
    )
    a.add_argument(
        "--audio-encoder",
        choices=["whisper", *SPEECH_PRESETS],
        default=None,
        help="whisper: train's Whisper encoder (`train --audio-model-type whisper`) with the --encoder-* sizes, "
        "--encoder-tokens tokens a chunk; whisper-*: Whisper's sizes, 1500 tokens a chunk (30 s; with the "
        "--encoder/--llm presets)",
    )
    a.add_argument(
        "--audio-chunks",
        type=int,
        default=None,
        metavar="K",
        help="chunks per sample's clip (default 1): the speech encoder runs K chunks a sample, so its tokens "
        "per sample follow the clip's length (K x tokens a chunk), not --seq-length",
    )
    for old, name in _OLD_FLAGS.items():
        (src if name == "hardware" else p).add_argument(
            old, dest=name, type=str if name == "hardware" else int, default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
    p.add_argument("--memory-limit-gb", type=float, default=None, help="per-rank limit (default 90%% of device memory)")
    p.add_argument("--placements", default="homogeneous,colocated,disjoint", help="comma-separated placements to try")
    p.add_argument("--max-segments", type=int, choices=[1, 2], default=2, help="LLM segments on a disjoint island")
    p.add_argument(
        "--segments",
        type=int,
        default=None,
        metavar="N",
        help="instead: cut the language model alone into N pipeline segments over the whole world, each with "
        "its own layers and TP x DP, by the exact heteropipe dynamic programme; prints (and --out writes) "
        "the disjoint layout language_0 -> ... -> language_{N-1}, which `train` runs as a text-only model",
    )
    p.add_argument(
        "--all-layouts",
        action="store_true",
        help="search the cost model's whole space, also layouts `megatron-hetero train` does not run "
        "(uneven pipeline stages, the encoder inside LLM stage 0, encoders with CP); "
        "default: only runnable layouts, so --out runs directly with `train`",
    )
    p.add_argument("--top", type=int, default=5, help="candidates to print (default 5)")
    p.add_argument("--out", metavar="best.yaml", default=None, help="write the best layout YAML here")
    p.add_argument("--json", action="store_true", help="print a JSON document")
    p.add_argument(
        "--regime-table",
        action="store_true",
        help=f"print the simulated regime table (encoder 1B-12B x LLM 14B-120B x 8K-128K) as markdown "
        f"(default hardware {DEFAULT_HARDWARE})",
    )
    return p


def _profile(args):
    if args.profile:
        return Profile.load(args.profile)
    if args.hardware:
        return Profile.from_hardware(load_hardware(args.hardware))
    if args.regime_table:
        return Profile.from_hardware(load_hardware(DEFAULT_HARDWARE))
    raise ValueError(
        "give the cost source: --profile PROFILE.json (fitted, `megatron-hetero profile`) or "
        f"--hardware NAME|HARDWARE.json (simulated; presets: {DEFAULT_HARDWARE})"
    )


def _space(args):
    placements = tuple(p.strip() for p in args.placements.split(",") if p.strip())
    runtime = not (args.all_layouts or args.regime_table)  # the regime table studies the whole space
    return SearchSpace(placements=placements, max_segments=args.max_segments, runtime=runtime)


def run(args: argparse.Namespace) -> int:
    prof = _profile(args)
    limit = None if args.memory_limit_gb is None else args.memory_limit_gb * 1e9
    if limit is not None and limit <= 0:
        raise ValueError(f"--memory-limit-gb must be positive, got {args.memory_limit_gb}")
    space = _space(args)
    if args.segments is not None and (args.regime_table or args.all_layouts):
        raise ValueError(
            f"--segments plans one language model's segments; drop {'--regime-table' if args.regime_table else '--all-layouts'}"
        )
    if getattr(args, "audio_encoder", None) and (args.regime_table or args.segments is not None):
        raise ValueError(
            f"--audio-encoder plans a second encoder's layout; {'--regime-table' if args.regime_table else '--segments'} "
            "plans one encoder (or the language model alone): drop one of them"
        )
    if args.regime_table:
        rows = regime_table(prof, memory_limit=limit, space=space)
        print(json.dumps(rows, indent=1) if args.json else regime_markdown(rows))
        return 0
    if args.world_size is None:
        raise ValueError("--world-size is required (or use --regime-table)")
    if args.out and args.all_layouts:
        raise ValueError(
            "--out writes a layout for `megatron-hetero train`, which runs only the default space; "
            "drop --all-layouts (or --out)"
        )
    if space.runtime and space.placements == ("homogeneous",):
        raise ValueError(
            "--placements homogeneous: the runtime runs a homogeneous layout as colocated with equal "
            "module layouts (searched under 'colocated'); use --all-layouts for the cost model's "
            "Megatron-LLaVA homogeneous placement"
        )
    wl = workload_from_args(args)
    if args.segments is not None:
        return _run_segments(args, wl, prof, limit)
    res = search(wl, prof, args.world_size, limit, space, top=args.top)
    layout = res.best_layout()
    text = dump_layout(layout)
    if args.out:
        best = res.best.breakdown.total
        unit, scale = time_unit(best)
        header = (
            f"# megatron-hetero search: best of {res.space_size} candidates on {res.world_size} ranks\n"
            f"# {res.best.candidate.describe()}\n# predicted step {best * scale:.3f} {unit}"
            + (f", {res.gain:+.1%} over the best homogeneous\n" if res.gain is not None else "\n")
            + f"# {train_command(args, args.out, wl, train_micro_batch_size(res.best.candidate, wl))}\n"
        )
        try:
            Path(args.out).write_text(header + text)
        except OSError as exc:
            raise ValueError(f"cannot write {args.out!r}: {exc.strerror}") from None
    if args.json:
        doc = res.to_dict()
        doc["best_layout"] = layout.to_dict()
        print(json.dumps(doc, indent=1))
    else:
        print(result_text(res, wl, prof))
        print("\nbest layout:\n" + text.rstrip())
        if args.out:
            print(f"(written to {args.out})")
    return 0


def _run_segments(args: argparse.Namespace, wl, prof, limit) -> int:
    """`search --segments N`: the heteropipe DP's layer partition x TP/DP of the language model."""
    import time

    from megatron_hetero.planner.segments import (
        plan_segments,
        segments_layout,
        segments_problems,
        train_micro_batch_size,
    )

    problems = segments_problems(wl, prof, args.world_size, args.segments, limit)
    t0 = time.perf_counter()
    problem, plan = plan_segments(problems)
    seconds = time.perf_counter() - t0
    layout = segments_layout(plan)
    text = dump_layout(layout)
    unit, scale = time_unit(plan.objective)
    summary = (
        f"language model {wl.llm.num_layers} layers in {args.segments} segments on {args.world_size} ranks, "
        f"{problem.num_microbatches} micro-batches of {problem.microbatch_samples} samples; strategies "
        f"{', '.join(strategy_label(s) for s in problem.strategies)}"
    )
    if args.out:
        header = (
            f"# megatron-hetero search --segments {args.segments}: the heteropipe DP's layer partition x TP/DP\n"
            f"# {plan.describe()}\n# predicted pipeline time {plan.objective * scale:.3f} {unit} "
            f"(sum of segment times + (B-1) x the slowest)\n"
            f"# {train_command(args, args.out, wl, train_micro_batch_size(problem, plan))}\n"
        )
        try:
            Path(args.out).write_text(header + text)
        except OSError as exc:
            raise ValueError(f"cannot write {args.out!r}: {exc.strerror}") from None
    if args.json:
        doc = {
            "segments": [
                {
                    "layers": [st.start, st.end - 1],
                    "tp": st.strategy.tp,
                    "dp": st.strategy.dp,
                    "time_s": st.cost,
                }
                for st in plan.stages
            ],
            "objective_s": plan.objective,
            "num_microbatches": problem.num_microbatches,
            "microbatch_samples": problem.microbatch_samples,
            "train_micro_batch_size": train_micro_batch_size(problem, plan),
            "seconds": seconds,
            "best_layout": layout.to_dict(),
        }
        print(json.dumps(doc, indent=1))
    else:
        print(summary)
        print(f"heteropipe DP: {plan.describe()}")
        print(
            f"predicted pipeline time {plan.objective * scale:.3f} {unit} (slowest segment "
            f"{plan.max_cost * scale:.3f} {unit}); found in {seconds:.3f} s"
        )
        print("\nbest layout:\n" + text.rstrip())
        if args.out:
            print(f"(written to {args.out})")
    return 0

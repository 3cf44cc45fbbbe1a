"""`megatron-hetero search`: rank heterogeneous layouts with the cost model (plan/cost.py, plan/search.py).

    megatron-hetero search --world-size 64 --simulate examples/hardware/h100_80gb.json \\
        --encoder 6B --llm 14B --seq-length 8192 --global-batch-size 512 --out best.yaml
    megatron-hetero search --regime-table [--simulate HARDWARE.json]

Register with `add_parser(subparsers)`; the handler raises ValueError for invalid input (exit 2).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

DEFAULT_HARDWARE = Path(__file__).resolve().parents[1] / "examples" / "hardware" / "h100_80gb.json"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from megatron_hetero.plan.search import ENCODER_PRESETS, LLM_PRESETS

    p = sub.add_parser("search", help="rank per-module layouts and placements by predicted step time",
                       description="Search per-module layouts (homogeneous, colocated, disjoint) with the cost model.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--profile", metavar="PROFILE.json", help="fitted cost profile (JSON)")
    src.add_argument("--simulate", metavar="HARDWARE.json",
                     help="build the cost profile from a hardware description (e.g. examples/hardware/h100_80gb.json)")
    p.add_argument("--world-size", type=int, default=None, help="total ranks")
    p.add_argument("--encoder", choices=list(ENCODER_PRESETS), default="1B", help="encoder size preset (default 1B)")
    p.add_argument("--llm", choices=list(LLM_PRESETS), default="14B", help="LLM size preset (default 14B)")
    for side in ("encoder", "llm"):
        p.add_argument(f"--{side}-layers", type=int, default=None)
        p.add_argument(f"--{side}-hidden", type=int, default=None)
        p.add_argument(f"--{side}-ffn-hidden", type=int, default=None)
        p.add_argument(f"--{side}-heads", type=int, default=None)
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--seq-length", type=int, default=8192, help="LLM context tokens per sample (default 8192)")
    p.add_argument("--image-tokens", type=int, default=None, help="encoder tokens (patches) per image (default 1024)")
    p.add_argument("--images-per-sample", type=int, default=1)
    p.add_argument("--global-batch-size", type=int, default=None, help="samples per step (default 4M tokens / seq)")
    p.add_argument("--micro-batch-size", type=int, default=1, help="LLM samples per micro-batch per DP replica")
    p.add_argument("--memory-limit-gb", type=float, default=None, help="per-rank limit (default 90%% of device memory)")
    p.add_argument("--placements", default="homogeneous,colocated,disjoint", help="comma-separated placements to try")
    p.add_argument("--max-segments", type=int, choices=[1, 2], default=2, help="LLM segments on a disjoint island")
    p.add_argument("--all-layouts", action="store_true",
                   help="search the cost model's whole space, also layouts `megatron-hetero train` does not run "
                        "(uneven pipeline stages, the encoder inside LLM stage 0, encoders with CP); "
                        "default: only runnable layouts, so --out runs directly with `train`")
    p.add_argument("--top", type=int, default=5, help="candidates to print (default 5)")
    p.add_argument("--out", metavar="best.yaml", default=None, help="write the best layout YAML here")
    p.add_argument("--json", action="store_true", help="print a JSON document")
    p.add_argument("--regime-table", action="store_true",
                   help="print the simulated regime table (encoder 1B-12B x LLM 14B-120B x 8K-128K) as markdown")
    p.set_defaults(func=run)
    return p


def _profile(args):
    from megatron_hetero.plan.cost import HardwareSpec, Profile

    if args.profile:
        return Profile.load(args.profile)
    if args.simulate:
        return Profile.from_hardware(HardwareSpec.load(args.simulate))
    if args.regime_table and DEFAULT_HARDWARE.exists():
        return Profile.from_hardware(HardwareSpec.load(DEFAULT_HARDWARE))
    raise ValueError("give the cost source: --profile PROFILE.json (fitted) or --simulate HARDWARE.json")


def _spec(base, args, side: str, seq: int):
    from megatron_hetero.plan.cost import ModelSpec

    def pick(name, default):
        v = getattr(args, f"{side}_{name}")
        return default if v is None else v

    vocab = base.vocab if side == "encoder" or args.vocab_size is None else args.vocab_size
    return ModelSpec(base.name.split("-")[0] if side == "encoder" else "language", pick("layers", base.num_layers),
                     pick("hidden", base.hidden), pick("ffn_hidden", base.ffn_hidden), pick("heads", base.heads), seq,
                     kind=base.kind, vocab=vocab, gated=base.gated)


def workload_from_args(args):
    from megatron_hetero.plan.cost import Workload
    from megatron_hetero.plan.search import ENCODER_PRESETS, LLM_PRESETS, TOKENS_PER_STEP

    enc_base = ENCODER_PRESETS[args.encoder]
    enc = _spec(enc_base, args, "encoder", args.image_tokens or enc_base.seq)
    llm = _spec(LLM_PRESETS[args.llm], args, "llm", args.seq_length)
    gbs = args.global_batch_size or max(1, TOKENS_PER_STEP // args.seq_length)
    return Workload(enc, llm, global_batch=gbs, micro_batch=args.micro_batch_size,
                    images_per_sample=args.images_per_sample)


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


def result_text(res, wl, prof) -> str:
    e, m = wl.encoder, wl.llm
    lines = [
        f"workload: encoder {e.total_params / 1e9:.2f}B ({e.num_layers} layers, h={e.hidden}, "
        f"{wl.images_per_sample}x{e.seq} tokens/sample) -> LLM {m.total_params / 1e9:.2f}B ({m.num_layers} layers, "
        f"h={m.hidden}, context {m.seq}); global batch {wl.global_batch}, micro-batch {wl.micro_batch}",
        f"cost model: {prof.source or 'profile'}; {res.world_size} ranks; memory limit {_gb(res.memory_limit)} GB/rank",
        f"space: {res.space_size:,} candidates, {res.evaluated:,} evaluated in {res.seconds:.3f} s",
        "",
        "| # | step (s) | vs homog. | configuration | compute | tp | cp | pp | dp | optimizer | boundary | offload | bubble "
        "| mem (GB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = res.baseline.breakdown.total if res.baseline else None
    for i, r in enumerate(res.ranked, 1):
        b = r.breakdown
        rel = f"{base / b.total - 1:+.1%}" if base else "n/a"
        lines.append(f"| {i} | {b.total:.3f} | {rel} | {r.candidate.describe()} | {b.compute:.3f} | {b.tp_comm:.3f} | "
                     f"{b.cp_comm:.3f} | {b.pp_comm:.3f} | {b.dp_comm:.3f} | {b.optimizer:.3f} | {b.boundary:.3f} | {b.offload:.3f} | "
                     f"{b.bubble:.3f} | {_gb(b.memory_per_rank_peak)} |")
    lines.append("")
    lines.append("best per placement:")
    for kind in ("homogeneous", "colocated", "disjoint"):
        r = res.by_placement.get(kind)
        if kind == "homogeneous" and r is None:
            r = res.baseline  # runnable space: the colocated candidate whose modules share one layout
        lines.append(f"  {kind:12s} " + (f"{r.breakdown.total:.3f} s  {r.candidate.describe()}" if r else "none fits"))
    gain = res.gain
    lines.append(f"predicted gain over homogeneous: {gain:+.1%}" if gain is not None
                 else "predicted gain over homogeneous: n/a (no homogeneous configuration fits)")
    return "\n".join(lines)


def regime_markdown(rows: list) -> str:
    head = ("| encoder | LLM | context | GPUs | global batch | picked | configuration | step (s) | homogeneous (s) | "
            "colocated (s) | disjoint (s) | gain vs homogeneous |")
    out = [head, "|" + "---|" * 12]

    def f(x):
        return "OOM" if x is None else f"{x:.2f}"

    for r in rows:
        gain = ("n/a" if r["step_s"] is None else "n/a (homogeneous OOM)") if r["gain"] is None else f"{r['gain']:+.1%}"
        out.append(f"| {r['encoder']} | {r['llm']} | {r['context'] // 1024}K | {r['gpus']} | {r['global_batch']} | "
                   f"{r['picked'] or 'none fits'} | {r['layout'] or ''} | {f(r['step_s'])} | {f(r['homogeneous_s'])} | "
                   f"{f(r['colocated_s'])} | {f(r['disjoint_s'])} | {gain} |")
    return "\n".join(out)


def _space(args):
    from megatron_hetero.plan.search import SearchSpace

    placements = tuple(p.strip() for p in args.placements.split(",") if p.strip())
    runtime = not (args.all_layouts or args.regime_table)  # the regime table studies the whole space
    return SearchSpace(placements=placements, max_segments=args.max_segments, runtime=runtime)


def run(args: argparse.Namespace) -> int:
    from megatron_hetero.layout.yaml_io import dump_layout
    from megatron_hetero.plan.search import regime_table, search, train_micro_batch_size

    prof = _profile(args)
    limit = None if args.memory_limit_gb is None else args.memory_limit_gb * 1e9
    if limit is not None and limit <= 0:
        raise ValueError(f"--memory-limit-gb must be positive, got {args.memory_limit_gb}")
    space = _space(args)
    if args.regime_table:
        rows = regime_table(prof, memory_limit=limit, space=space)
        print(json.dumps(rows, indent=1) if args.json else regime_markdown(rows))
        return 0
    if args.world_size is None:
        raise ValueError("--world-size is required (or use --regime-table)")
    if args.out and args.all_layouts:
        raise ValueError("--out writes a layout for `megatron-hetero train`, which runs only the default space; "
                         "drop --all-layouts (or --out)")
    if space.runtime and space.placements == ("homogeneous",):
        raise ValueError("--placements homogeneous: the runtime runs a homogeneous layout as colocated with equal "
                         "module layouts (searched under 'colocated'); use --all-layouts for the cost model's "
                         "Megatron-LLaVA homogeneous placement")
    wl = workload_from_args(args)
    res = search(wl, prof, args.world_size, limit, space, top=args.top)
    layout = res.best_layout()
    text = dump_layout(layout)
    if args.out:
        header = (f"# megatron-hetero search: best of {res.space_size} candidates on {res.world_size} ranks\n"
                  f"# {res.best.candidate.describe()}\n# predicted step {res.best.breakdown.total:.3f} s"
                  + (f", {res.gain:+.1%} over the best homogeneous\n" if res.gain is not None else "\n")
                  + f"# megatron-hetero train --hetero-layout {Path(args.out).name} --global-batch-size "
                    f"{wl.global_batch} --micro-batch-size {train_micro_batch_size(res.best.candidate, wl)}\n")
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


def main(argv: Optional[list] = None) -> int:
    """Stand-alone entry (`python -m megatron_hetero.cli_search search ...`): exit 0 ok, 2 invalid input."""
    parser = argparse.ArgumentParser(prog="megatron-hetero")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:
        print(f"megatron-hetero search: invalid input: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

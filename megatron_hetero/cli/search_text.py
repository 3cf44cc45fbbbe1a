"""What `megatron-hetero search` prints: the ranked table, the best layout per placement, the
regime table's markdown, and the `train` line that runs the layout written with `--out`. Pure: no torch."""

from __future__ import annotations

from pathlib import Path

from megatron_hetero.layout.flags import dest, option
from megatron_hetero.config.model import size_flags
from megatron_hetero.planner.presets import (
    paper_direction,
)
from megatron_hetero.cli.search_workload import uses_presets


def train_command(args, out: str, wl, micro_batch_size: int) -> str:
    """The `megatron-hetero train` line that runs the layout written to `out` with the searched model."""

    words = ["megatron-hetero train --hetero-layout", Path(out).name]
    if not uses_presets(args):  # the model flags given, so train builds the model that was searched
        # --encoder-max-tiles: never searched (the cost model refuses it), so never written
        words += [
            f"{option(f)} {getattr(args, dest(f))}"
            for f in size_flags()
            if getattr(args, dest(f)) is not None and f.name != "max_tiles"
        ]
    if wl.extra_encoders and not uses_presets(args):
        words.append("--audio-model-type whisper")
    words += [f"--global-batch-size {wl.global_batch} --micro-batch-size {micro_batch_size}"]
    words += feature_flags(wl)
    return " ".join(words)


def feature_flags(wl) -> list[str]:
    """train's flags for the features the workload was priced with (precision, distributed optimizer,
    SP, recompute): the run the printed line starts is the one the search priced."""
    out = ["--bf16"] if wl.dtype_bytes == 2 else []
    if wl.optimizer != "adam":
        out.append(f"--optimizer {wl.optimizer}")
    if wl.distributed_optimizer:
        out.append("--use-distributed-optimizer")
    if wl.sequence_parallel:
        out.append("--sequence-parallel")
    if wl.recompute == "selective":
        out.append("--recompute-granularity selective")
    elif wl.recompute == "full":
        out.append("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
    return out


def _params(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


def time_unit(seconds: float) -> tuple[str, float]:
    """Seconds, or milliseconds where seconds would print as 0.00x (tiny models on fast hardware)."""
    return ("s", 1.0) if seconds >= 0.01 else ("ms", 1e3)


def result_text(res, wl, prof) -> str:
    e, m = wl.encoder, wl.llm
    unit, scale = time_unit(res.best.breakdown.total)
    lines = [
        f"workload: encoder {_params(e.total_params)} ({e.num_layers} layers, h={e.hidden}, "
        f"{wl.images_per_sample}x{e.seq} tokens/sample) -> LLM {_params(m.total_params)} ({m.num_layers} layers, "
        f"h={m.hidden}, context {m.seq}); global batch {wl.global_batch}, micro-batch {wl.micro_batch}",
        *(
            f"second encoder {x.name}: {_params(x.total_params)} ({x.num_layers} layers, h={x.hidden}, "
            f"{k}x{x.seq} tokens/sample)"
            for x, k in zip(wl.extra_encoders, wl.extra_inputs or (1,) * len(wl.extra_encoders))
        ),
        f"cost model: {prof.source or 'profile'}; {res.world_size} ranks; memory limit {_gb(res.memory_limit)} GB/rank",
        f"space: {res.space_size:,} candidates, {res.evaluated:,} evaluated in {res.seconds:.3f} s",
        "",
        f"| # | step ({unit}) | vs homog. | configuration | compute | tp | cp | pp | dp | optimizer | boundary | offload "
        "| bubble | mem (GB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = res.baseline.breakdown.total if res.baseline else None
    for i, r in enumerate(res.ranked, 1):
        b = r.breakdown
        rel = f"{base / b.total - 1:+.1%}" if base else "n/a"
        t = [
            x * scale
            for x in (
                b.total,
                b.compute,
                b.tp_comm,
                b.cp_comm,
                b.pp_comm,
                b.dp_comm,
                b.optimizer,
                b.boundary,
                b.offload,
                b.bubble,
            )
        ]
        lines.append(
            f"| {i} | {t[0]:.3f} | {rel} | {r.candidate.describe()} | {t[1]:.3f} | {t[2]:.3f} | "
            f"{t[3]:.3f} | {t[4]:.3f} | {t[5]:.3f} | {t[6]:.3f} | {t[7]:.3f} | {t[8]:.3f} | "
            f"{t[9]:.3f} | {_gb(b.memory_per_rank_peak)} |"
        )
    lines.append("")
    lines.append("best per placement:")
    for kind in ("homogeneous", "colocated", "disjoint"):
        r = res.by_placement.get(kind)
        if kind == "homogeneous" and r is None:
            r = res.baseline  # runnable space: the colocated candidate whose modules share one layout
        lines.append(
            f"  {kind:12s} "
            + (f"{r.breakdown.total * scale:.3f} {unit}  {r.candidate.describe()}" if r else "none fits")
        )
    gain = res.gain
    lines.append(
        f"predicted gain over homogeneous: {gain:+.1%}"
        if gain is not None
        else "predicted gain over homogeneous: n/a (no homogeneous configuration fits)"
    )
    return "\n".join(lines)


def regime_markdown(rows: list) -> str:
    head = (
        "| encoder | LLM | context | GPUs | global batch | picked | configuration | step (s) | homogeneous (s) | "
        "colocated (s) | disjoint (s) | gain vs homogeneous | paper's direction |"
    )
    out = [head, "|" + "---|" * 13]

    def f(x):
        return "OOM" if x is None else f"{x:.2f}"

    for r in rows:
        gain = ("n/a" if r["step_s"] is None else "n/a (homogeneous OOM)") if r["gain"] is None else f"{r['gain']:+.1%}"
        out.append(
            f"| {r['encoder']} | {r['llm']} | {r['context'] // 1024}K | {r['gpus']} | {r['global_batch']} | "
            f"{r['picked'] or 'none fits'} | {r['layout'] or ''} | {f(r['step_s'])} | {f(r['homogeneous_s'])} | "
            f"{f(r['colocated_s'])} | {f(r['disjoint_s'])} | {gain} | {paper_direction(r)} |"
        )
    return "\n".join(out)

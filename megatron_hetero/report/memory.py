"""`megatron-hetero plan`'s memory columns: every rank's predicted resident state and activation peak
of one training step (`planner.memory`), from the model, batch and feature flags `train` takes.
Pure: no torch."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Optional

from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.planner.memory import (
    StateFeatures,
    rank_activation_bytes,
    rank_peak_bytes,
    rank_state_bytes,
    total_bytes,
)

#: train's flags that decide the prediction beyond the model's sizes and architecture (plan takes them too)
OPTIM_FLAGS = ("optimizer", "bf16", "fp16", "use_distributed_optimizer")
JOB_FLAGS = ("sequence_parallel", "recompute_granularity", "recompute_method", "recompute_num_layers")


def memory_rows(args: Any, layout: HeteroLayout, ranks: Optional[Iterable[int]] = None) -> list[dict[str, Any]]:
    """Per rank: {rank, predicted_state_bytes, predicted_activation_bytes, predicted_peak_bytes (the
    most at one moment: less than their sum with --hetero-offload-encoder), state (per module: params,
    grads, optimizer), activations (per module)} for `train` with these flags on `layout` (every rank,
    or the given `ranks`). ValueError for bad sizes or batches."""
    from megatron_hetero.layout.flags import values
    from megatron_hetero.layout.validate import check_recompute
    from megatron_hetero.planner.model import MOE_FLAGS, LlavaSpec, spec_from_flags
    from megatron_hetero.runtime.config import OptimConfig
    from megatron_hetero.training.arch_args import apply_arch_args
    from megatron_hetero.training.config import JobConfig, job_recompute
    from megatron_hetero.training.job import batch_from_args

    global_batch, micro_batch = batch_from_args(args, layout)
    spec = spec_from_flags(args, layout)
    moe = {k: v for k, v in values(LlavaSpec, args, MOE_FLAGS).items() if v is not None}
    spec = apply_arch_args(args, dataclasses.replace(spec, **moe))
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
    rows = []
    for r in range(layout.world_size) if ranks is None else ranks:
        state = rank_state_bytes(layout, spec, r, features)
        acts = rank_activation_bytes(
            layout, spec, r, global_batch, micro_batch, bool(j["sequence_parallel"]), recompute
        )
        offload = bool(getattr(args, "hetero_offload_encoder", False))
        peak = rank_peak_bytes(
            layout, spec, r, features, global_batch, micro_batch, bool(j["sequence_parallel"]), recompute, offload
        )
        rows.append(
            {
                "rank": r,
                "predicted_state_bytes": total_bytes(state),
                "predicted_activation_bytes": acts.total,
                "predicted_peak_bytes": peak,
                "state": state,
                "activations": acts.per_module,
            }
        )
    return rows


def memory_text(rows: list[dict[str, Any]]) -> str:
    """The memory table of `plan`: one line per rank."""

    def mib(n: int) -> str:
        return f"{n / 2**20:10.3f}"

    lines = ["predicted memory per rank (MiB): state (params + grads + optimizer), activation peak, peak at one moment"]
    for row in rows:
        s, a = row["predicted_state_bytes"], row["predicted_activation_bytes"]
        lines.append(f"  rank {row['rank']:>4}: {mib(s)} {mib(a)} {mib(row['predicted_peak_bytes'])}")
    return "\n".join(lines)

"""`megatron-hetero plan`'s memory columns: every rank's predicted resident state and activation peak
of one training step (`planner.memory`), for the model, batch and features of train's flags (read
at `plan`'s door: `cli.plan`).
Pure: no torch."""

from __future__ import annotations

from typing import Any, Iterable, Optional

from megatron_hetero.layout.spec import HeteroLayout, Recompute
from megatron_hetero.config.model import LlavaSpec
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


def memory_rows(
    layout: HeteroLayout,
    spec: LlavaSpec,
    global_batch: int,
    micro_batch: int,
    features: StateFeatures,
    sequence_parallel: bool = False,
    recompute: Optional[Recompute] = None,
    offload_encoder: bool = False,
    ranks: Optional[Iterable[int]] = None,
) -> list[dict[str, Any]]:
    """Per rank: {rank, predicted_state_bytes, predicted_activation_bytes, predicted_peak_bytes (the
    most at one moment: less than their sum with `offload_encoder`), state (per module: params,
    grads, optimizer), activations (per module)} for a training step of `spec` on `layout` (every
    rank, or the given `ranks`); what `plan --memory` reads from train's flags (`cli.plan`)."""
    rows = []
    for r in range(layout.world_size) if ranks is None else ranks:
        state = rank_state_bytes(layout, spec, r, features)
        acts = rank_activation_bytes(layout, spec, r, global_batch, micro_batch, sequence_parallel, recompute)
        peak = rank_peak_bytes(
            layout, spec, r, features, global_batch, micro_batch, sequence_parallel, recompute, offload_encoder
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

"""`search --segments N`: one language model cut into N pipeline segments, each with its own layer
range and TP x DP, chosen by the heteropipe dynamic programme (`planner/heteropipe.py`) and returned
as a disjoint layout of N modules `language_0 -> language_1 -> ...` that `train` runs.

The problem handed to the DP (`segments_problem`):
  * layers: the language model's `num_layers`; stages: N (every segment holds >= 1 layer);
  * strategies: TP x DP with pp = cp = 1, tp and dp powers of two, tp dividing the heads and the
    hidden size, dp at most `max_dp`, so that every edge's DP ratio is an integer and every segment's
    DP divides a micro-batch; the segments use exactly the world's ranks;
  * micro-batches: a micro-batch carries micro_batch * max_dp samples (the cost model's convention:
    `--micro-batch-size` is per replica of the largest DP), B = global_batch / that.
One problem per `max_dp` (every power of two <= the world size that divides global_batch /
micro_batch: the micro-batch size changes every stage's cost and the number of micro-batches);
`plan_segments` solves each and keeps the least step time (the objectives are all seconds per step).
  * stage cost: `heteropipe.transformer_stage_cost` (compute + TP per layer for the segment's share of
    a micro-batch, the pipeline exchange, inf beyond the memory limit).
Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_hetero.layout.degrees import Degrees
from megatron_hetero.layout.spec import Edge, HeteroLayout, ModuleLayout, RankRange
from megatron_hetero.layout.validate import resolve_layout
from megatron_hetero.planner.hardware import Profile
from megatron_hetero.planner.heteropipe import PipelinePlan, StageCost, heteropipe_search, transformer_stage_cost
from megatron_hetero.planner.workload import Workload


@dataclass(frozen=True)
class SegmentsProblem:
    """The heteropipe problem of `search --segments` (see module docstring)."""

    num_layers: int
    world_size: int
    num_segments: int
    strategies: tuple[Degrees, ...]
    stage_cost: StageCost
    num_microbatches: int
    microbatch_samples: int
    max_dp: int


def _powers_of_two(limit: int) -> list[int]:
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    return out


def segments_problems(
    wl: Workload, prof: Profile, world_size: int, num_segments: int, memory_limit: Optional[float] = None
) -> list[SegmentsProblem]:
    """The DP's inputs for `wl`'s language model on `world_size` ranks in `num_segments` segments, one
    per largest DP (module docstring); ValueError naming the arithmetic when no segment layout can exist."""
    for name, v in (("world size", world_size), ("--segments", num_segments)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    llm = wl.llm
    if num_segments > llm.num_layers:
        raise ValueError(f"--segments {num_segments}: the language model has only {llm.num_layers} layers")
    if num_segments > world_size:
        raise ValueError(f"--segments {num_segments}: each segment needs a rank, the world has {world_size}")
    if wl.global_batch % wl.micro_batch:
        raise ValueError(
            f"global batch {wl.global_batch} is not divisible by micro-batch size {wl.micro_batch} "
            f"({wl.global_batch} % {wl.micro_batch} = {wl.global_batch % wl.micro_batch})"
        )
    per = wl.global_batch // wl.micro_batch
    limit = 0.9 * prof.memory_bytes if memory_limit is None else float(memory_limit)
    tps = [t for t in _powers_of_two(world_size) if llm.heads % t == 0 and llm.hidden % t == 0]
    out = []
    for max_dp in (d for d in _powers_of_two(world_size) if per % d == 0):
        samples = wl.micro_batch * max_dp
        out.append(
            SegmentsProblem(
                num_layers=llm.num_layers,
                world_size=world_size,
                num_segments=num_segments,
                strategies=tuple(
                    Degrees(tp=t, dp=d) for t in tps for d in _powers_of_two(max_dp) if t * d <= world_size
                ),
                stage_cost=transformer_stage_cost(prof, wl, llm, samples, num_segments, memory_limit=limit),
                num_microbatches=wl.global_batch // samples,
                microbatch_samples=samples,
                max_dp=max_dp,
            )
        )
    return out


def plan_segments(problems: list[SegmentsProblem]) -> tuple[SegmentsProblem, PipelinePlan]:
    """The DP's exact optimum of sum + (B-1) * max over layer cuts and per-segment TP x DP, for each
    problem; the problem and plan of the least step time (ValueError when none is feasible)."""
    best: Optional[tuple[SegmentsProblem, PipelinePlan]] = None
    reasons = []
    for p in problems:
        try:
            plan = heteropipe_search(
                p.num_layers, p.world_size, p.num_segments, p.strategies, p.stage_cost, p.num_microbatches
            )
        except ValueError as exc:
            reasons.append(f"micro-batches of {p.microbatch_samples} samples: {exc}")
            continue
        if best is None or plan.objective < best[1].objective:
            best = (p, plan)
    if best is None:
        raise ValueError("no segment layout fits (memory limit or world size): " + "; ".join(reasons[-1:]))
    return best


def segments_layout(plan: PipelinePlan) -> HeteroLayout:
    """The plan as a disjoint layout: segment k is module `language_k` (its layers, TP, DP) on the next
    tp*dp ranks; edges language_0 -> language_1 -> ..."""
    mods, start = [], 0
    for k, s in enumerate(plan.stages):
        size = s.strategy.tp * s.strategy.dp
        mods.append(
            ModuleLayout(
                name=f"language_{k}",
                tp=s.strategy.tp,
                dp=s.strategy.dp,
                ranks=RankRange(start, start + size - 1),
                layers=RankRange(s.start, s.end - 1),
            )
        )
        start += size
    edges = tuple(Edge(f"language_{k}", f"language_{k + 1}") for k in range(len(mods) - 1))
    return resolve_layout(HeteroLayout(placement="disjoint", modules=tuple(mods), edges=edges), start)


def train_micro_batch_size(problem: SegmentsProblem, plan: PipelinePlan) -> int:
    """`train --micro-batch-size` (per rank of the first segment) that runs micro-batches of the
    planned `microbatch_samples`."""
    return problem.microbatch_samples // plan.stages[0].strategy.dp

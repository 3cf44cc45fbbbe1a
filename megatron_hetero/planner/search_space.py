"""What the layout search (`planner/search.py`) takes and gives: `SearchSpace`, the degrees it tries (and the
runtime's restrictions), and `SearchResult`, the ranked candidates with their breakdowns. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_hetero.planner.workload import Candidate, CostBreakdown


INF = float("inf")


@dataclass(frozen=True)
class SearchSpace:
    """The degrees the search tries. island_sizes: encoder island sizes for disjoint (default:
    2^k and 3*2^k up to world/2). max_segments: 1 or 2 LLM segments on disjoint islands.

    runtime: only layouts `megatron-hetero train` runs (what `Candidate.to_layout` writes for it):
    every pipeline stage holds the same number of layers (layers % pp == 0, per module and per LLM
    segment), encoders run with cp = 1, the two LLM segments of a disjoint chain may differ in TP,
    PP and DP (not only in TP/DP at equal PP), a disjoint step has at most MAX_MICRO_BATCHES
    micro-batches, and no 'homogeneous' candidate: the runtime runs a layout whose modules share
    one layout on the colocated schedule, so those are the colocated candidates with equal layouts
    (the baseline). Train a disjoint pick with --micro-batch-size = micro_batch * max segment dp /
    first segment dp (the search's micro-batch carries micro_batch samples per replica of the
    largest DP; `train`'s is per rank of the first language module)."""

    placements: tuple = ("homogeneous", "colocated", "disjoint")
    tp: tuple = (1, 2, 4, 8)
    cp: tuple = (1, 2, 4, 8, 16)
    pp: tuple = tuple(range(1, 17))
    encoder_tp: tuple = (1, 2, 4, 8)
    encoder_cp: tuple = (1,)
    encoder_pp: tuple = (1, 2, 4)
    island_sizes: Optional[tuple] = None
    max_segments: int = 2
    offload: tuple = (False, True)
    runtime: bool = False

    def effective(self) -> "SearchSpace":
        """The space after the runtime's restrictions (see the class docstring)."""
        if not self.runtime:
            return self
        import dataclasses

        return dataclasses.replace(
            self, placements=tuple(p for p in self.placements if p != "homogeneous"), encoder_cp=(1,)
        )

    def islands(self, world: int) -> list[int]:
        if self.island_sizes is not None:
            return sorted({int(x) for x in self.island_sizes if 0 < int(x) < world})
        out = set()
        k = 1
        while k <= world // 2:
            out.add(k)
            if 3 * k // 2 <= world // 2 and k >= 2:
                out.add(3 * k // 2)
            k *= 2
        return sorted(out)


@dataclass(frozen=True)
class Ranked:
    candidate: Candidate
    breakdown: CostBreakdown


@dataclass
class SearchResult:
    """ranked: the best `top` candidates (ascending step time); baseline: the best homogeneous one;
    space_size: valid candidates in the space (homogeneous: one per stage-0 layer count);
    evaluated: candidate step times computed in full (the rest were excluded by a per-module memory
    check or by the lower bound); by_placement: the best candidate of each placement kind."""

    ranked: list
    baseline: Optional[Ranked]
    evaluated: int
    space_size: int
    seconds: float
    world_size: int
    memory_limit: float
    by_placement: dict = field(default_factory=dict)  # best Ranked per placement kind

    @property
    def best(self) -> Ranked:
        return self.ranked[0]

    @property
    def gain(self) -> Optional[float]:
        """Predicted throughput gain of the best over the best homogeneous: t_homog / t_best - 1."""
        if self.baseline is None:
            return None
        return self.baseline.breakdown.total / self.best.breakdown.total - 1.0

    def best_layout(self):
        return self.best.candidate.to_layout()

    def to_dict(self) -> dict:
        def one(r):
            return (
                None
                if r is None
                else {
                    "candidate": r.candidate.to_dict(),
                    "describe": r.candidate.describe(),
                    "breakdown": r.breakdown.to_dict(),
                }
            )

        return {
            "world_size": self.world_size,
            "memory_limit": self.memory_limit,
            "evaluated": self.evaluated,
            "space_size": self.space_size,
            "seconds": self.seconds,
            "gain_over_homogeneous": self.gain,
            "ranked": [one(r) for r in self.ranked],
            "baseline": one(self.baseline),
            "best_per_placement": {k: one(v) for k, v in self.by_placement.items()},
        }

"""Brute-force references for the searches (tests only): every configuration built one by one.

`heteropipe_brute_force` scores every layer partition x strategy assignment of
`heteropipe.enumerate_pipelines`; `brute_force` builds every candidate of a `SearchSpace` as a
`Candidate` and scores it with `cost.evaluate`. `Scores` keeps each candidate's (total, peak memory)
so that references for several memory limits of one workload evaluate every candidate once.
"""

from __future__ import annotations

from typing import Optional, Sequence


import numpy as np

from megatron_hetero.layout.degrees import Degrees
from megatron_hetero.planner.cost import evaluate
from megatron_hetero.planner.hardware import Profile
from megatron_hetero.planner.heteropipe import PipelinePlan, StageCost, StagePlan, enumerate_pipelines
from megatron_hetero.planner.search_disjoint import _chains
from megatron_hetero.planner.search_rows import _layouts
from megatron_hetero.planner.search_space import SearchSpace
from megatron_hetero.planner.workload import Candidate, Segment, Workload

#: candidate -> (step total, peak memory per rank), or None where `cost.evaluate` refuses it
Scores = dict[Candidate, Optional[tuple[float, float]]]


def heteropipe_brute_force(
    num_layers: int,
    num_devices: int,
    num_stages: int,
    strategies: Sequence[Degrees],
    stage_cost: StageCost,
    num_microbatches: int,
    use_all_devices: bool = True,
) -> PipelinePlan:
    """Reference: evaluate every configuration of `enumerate_pipelines` (small problems only)."""
    best = None
    for conf in enumerate_pipelines(num_layers, num_devices, num_stages, strategies, use_all_devices):
        plan = PipelinePlan(
            tuple(StagePlan(i, j, s, float(stage_cost(i, j, s, k))) for k, (i, j, s) in enumerate(conf)),
            num_microbatches,
        )
        if np.isfinite(plan.objective) and (best is None or plan.objective < best.objective):
            best = plan
    if best is None:
        raise ValueError("no feasible pipeline")
    return best


def brute_force(
    wl: Workload,
    prof: Profile,
    world_size: int,
    memory_limit: Optional[float] = None,
    space: SearchSpace = SearchSpace(),
    scores: Optional[Scores] = None,
) -> list[tuple[float, Candidate]]:
    """Reference for tests: every candidate of `space` built one by one and scored with the scalar
    `cost.evaluate` (homogeneous: every stage-0 layer count). Sorted (total, candidate), feasible only.
    `scores`: a cache of `cost.evaluate`'s results kept across calls on the same workload and profile."""
    scores = {} if scores is None else scores
    limit = 0.9 * prof.memory_bytes if memory_limit is None else float(memory_limit)
    space = space.effective()
    enc, llm, L, Le = wl.encoder, wl.llm, wl.llm.num_layers, wl.encoder.num_layers
    cands: list[Candidate] = []
    if "homogeneous" in space.placements:
        for t, c, p, d in _layouts(world_size, space.tp, space.cp, space.pp, llm, True):
            if enc.heads % t == 0 and Le >= p:
                best = None
                for l0 in [0] if p == 1 else range(1, L - p + 2):
                    cand = Candidate(
                        "homogeneous", Segment.of(t, c, p, d, Le), (Segment.of(t, c, p, d, L),), first_stage_layers=l0
                    )
                    r = _try(cand, wl, prof, limit, scores)
                    if r is not None and (best is None or r < best[0]):
                        best = (r, cand)
                if best:
                    cands.append(best[1])
    if "colocated" in space.placements:
        for a in _layouts(world_size, space.tp, space.cp, space.pp, llm, True, space.runtime):
            for e in _layouts(
                world_size, space.encoder_tp, space.encoder_cp, space.encoder_pp, enc, False, space.runtime
            ):
                if max(a[3], e[3]) % min(a[3], e[3]) == 0:
                    for o in space.offload:
                        cands.append(Candidate("colocated", Segment.of(*e, Le), (Segment.of(*a, L),), offload=o))
    if "disjoint" in space.placements:
        for we in space.islands(world_size):
            for e in _layouts(we, space.encoder_tp, space.encoder_cp, space.encoder_pp, enc, False, space.runtime):
                for r in _chains(wl, world_size - we, space):
                    ta, cp, pa, da, na, tb, pb, db, nb = r
                    if max(e[3], da) % min(e[3], da):
                        continue
                    segs = (Segment.of(ta, cp, pa, da, na),) + ((Segment.of(tb, cp, pb, db, nb),) if nb else ())
                    cands.append(Candidate("disjoint", Segment.of(*e, Le), segs, encoder_ranks=we))
    out = []
    for cand in cands:
        r = _try(cand, wl, prof, limit, scores)
        if r is not None:
            out.append((r, cand))
    out.sort(key=lambda x: x[0])
    return out


def _try(cand: Candidate, wl: Workload, prof: Profile, limit: float, scores: Scores) -> Optional[float]:
    if cand not in scores:
        try:
            bd = evaluate(cand, wl, prof)
            scores[cand] = (bd.total, bd.memory_per_rank_peak)
        except ValueError:
            scores[cand] = None
    score = scores[cand]
    return score[0] if score is not None and score[1] <= limit else None

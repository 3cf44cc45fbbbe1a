"""Multimodal layout search. Pure (numpy only).

`search` ranks the space of `SearchSpace`: homogeneous (encoder on the LLM's layout in pipeline
stage 0; the LLM layers of stage 0 chosen optimally), colocated heterogeneous (three-phase, with or
without encoder offload) and disjoint islands (encoder island size, encoder layout, LLM as one
segment or two segments with their own TP/DP and a layer split). Every candidate is scored by the
cost model's evaluator (`planner/cost.py`) on numpy arrays, whatever the profile (simulated, or
measured with overheads and shared execution units); the reported candidates' breakdowns are the
same evaluator with one row (`cost.evaluate`).
Disjoint candidates pair an encoder configuration e with an LLM chain c; with
K(c) = C_sum + (B-1) C_max + C_tail + loss, the critical path is >= E_sum + K(c) and the step
>= uncontended * (E_sum + K(c)) (a lower bound), so after a probe gives tau (the K-th best exact
value seen), only pairs with E_sum + K(c) <= tau / uncontended are evaluated: the returned top-K
equals the top-K of exhaustive evaluation (`prune=False` evaluates every pair).
`SearchSpace(runtime=True)` keeps only layouts `megatron-hetero train` runs (the `search --out` CLI
default). The exact layer-partition search of one model is `planner/heteropipe.py`; presets and the
regime table are `planner/presets.py`. The search's files: its space and result types
(`planner/search_space.py`), the homogeneous and colocated rows (`planner/search_rows.py`) and the
disjoint pairs (`planner/search_disjoint.py`).
Several encoders (`Workload.extra_encoders`): each encoder gets its own layout; homogeneous and
colocated candidates are every combination of the encoders' layouts on the same ranks; disjoint
candidates give each encoder its own island (every combination of island sizes and layouts) and the
language model one segment on the rest, evaluated exhaustively (`planner/search_encoders.py`).
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np

from megatron_hetero.planner.cost import evaluate
from megatron_hetero.planner.hardware import Profile
from megatron_hetero.planner.workload import PLACEMENT_KINDS, Candidate, Segment, Workload
from megatron_hetero.planner.search_space import INF, SearchSpace, Ranked, SearchResult
from megatron_hetero.planner.search_rows import _layouts, _Pool, _homogeneous, _colocated
from megatron_hetero.planner.search_disjoint import _disjoint, _pairs, _chain_candidate
from megatron_hetero.planner.search_encoders import disjoint_islands


def train_micro_batch_size(cand: Candidate, wl: Workload) -> int:
    """`megatron-hetero train --micro-batch-size` that runs `cand` with the micro-batches the cost
    model assumed: per rank of the first language module (disjoint: micro_batch * max dp / dp_first)."""
    if cand.placement != "disjoint":
        return wl.micro_batch
    return wl.micro_batch * max(s.dp for s in cand.llm) // cand.llm[0].dp


def search(
    wl: Workload,
    prof: Profile,
    world_size: int,
    memory_limit: Optional[float] = None,
    space: SearchSpace = SearchSpace(),
    top: int = 10,
    prune: bool = True,
) -> SearchResult:
    """Rank the configurations of `space` on `world_size` ranks by predicted step time.

    memory_limit: bytes per rank (default: 90% of the profile's device memory). Returns the `top`
    best with their `CostBreakdown`, the best homogeneous one (baseline) and the best per placement.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size must be a positive integer, got {world_size!r}")
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top}")
    unknown = sorted(set(space.placements) - set(PLACEMENT_KINDS))
    if unknown:
        raise ValueError(f"unknown placements {unknown}; choose from {list(PLACEMENT_KINDS)}")
    limit = 0.9 * prof.memory_bytes if memory_limit is None else float(memory_limit)
    space = space.effective()
    t0 = time.perf_counter()
    pool, evaluated, size = _Pool(), 0, 0
    if "homogeneous" in space.placements:
        n = _homogeneous(wl, prof, world_size, space, limit, pool)
        evaluated += n
        size += n
    if "colocated" in space.placements:
        n = _colocated(wl, prof, world_size, space, limit, pool)
        evaluated += n
        size += n
    groups: list = []
    if "disjoint" in space.placements and world_size > 1 and wl.extra_encoders:
        n = disjoint_islands(wl, prof, world_size, space, limit, pool)
        evaluated += n
        size += n
    elif "disjoint" in space.placements and world_size > 1:
        size += _disjoint(wl, prof, world_size, space, limit, groups)
    exact = [t[np.isfinite(t)] for t in pool.totals]
    tau = INF
    if prune and groups:
        best_disjoint = INF
        for gr in groups:
            _, _, tot = _pairs(gr, prof, wl, world_size, INF, top)
            evaluated += len(tot)
            exact.append(tot[np.isfinite(tot)])
            best_disjoint = min(best_disjoint, float(tot.min()))
        allv = np.concatenate(exact)
        if len(allv) >= top:
            # the K-th best value seen bounds the true K-th best; the best disjoint value seen
            # bounds the best disjoint candidate (reported per placement)
            tau = max(float(np.partition(allv, top - 1)[top - 1]), best_disjoint)
    for _gi, gr in enumerate(groups):
        ei, ci, tot = _pairs(gr, prof, wl, world_size, tau, None)
        evaluated += len(tot)
        keep = tot <= tau if np.isfinite(tau) else np.isfinite(tot)
        if prune:
            ei, ci, tot = ei[keep], ci[keep], tot[keep]
        else:  # keep the group's best `top` only
            if len(tot) > top:
                part = np.argpartition(tot, top - 1)[:top]
                ei, ci, tot = ei[part], ci[part], tot[part]
        pool.add(tot, (lambda g, a, c: lambda i: _chain_candidate(g, int(a[i]), int(c[i]), wl))(gr, ei, ci), "disjoint")
    ranked, by_placement = _rank(pool, wl, prof, top)
    if not ranked:
        raise ValueError(
            f"no configuration of {wl.encoder.name} + {wl.llm.name} on {world_size} ranks fits the "
            f"memory limit of {limit / 1e9:.1f} GB per rank (or none divides global batch "
            f"{wl.global_batch} with micro-batch {wl.micro_batch})"
        )
    baseline = (
        _runtime_baseline(wl, prof, world_size, space, limit) if space.runtime else by_placement.get("homogeneous")
    )
    return SearchResult(
        ranked=ranked,
        baseline=baseline,
        evaluated=evaluated,
        space_size=size,
        seconds=time.perf_counter() - t0,
        world_size=world_size,
        memory_limit=limit,
        by_placement=by_placement,
    )


def _runtime_baseline(wl: Workload, prof: Profile, world: int, space: SearchSpace, limit: float) -> Optional[Ranked]:
    """The runtime's homogeneous baseline: the best colocated candidate whose encoder runs on the
    LLM's own layout (cp = 1: the runtime's encoders do not take CP)."""
    best = None
    for t, c, p, d in _layouts(world, space.tp, (1,), space.pp, wl.llm, True, True):
        if any(e.heads % t or e.num_layers % p for e in wl.encoders):
            continue
        cand = Candidate(
            "colocated",
            Segment.of(t, c, p, d, wl.encoder.num_layers),
            (Segment.of(t, c, p, d, wl.llm.num_layers),),
            extra_encoders=tuple(Segment.of(t, c, p, d, e.num_layers) for e in wl.extra_encoders),
        )
        try:
            bd = evaluate(cand, wl, prof)
        except ValueError:
            continue
        if bd.memory_per_rank_peak <= limit and (best is None or bd.total < best.breakdown.total):
            best = Ranked(cand, bd)
    return best


def _rank(pool: _Pool, wl: Workload, prof: Profile, top: int) -> tuple[list, dict]:
    if not pool.totals:
        return [], {}
    totals = np.concatenate(pool.totals)
    src = np.concatenate([np.full(len(t), i) for i, t in enumerate(pool.totals)])
    idx = np.concatenate([np.arange(len(t)) for t in pool.totals])
    order = np.argsort(totals, kind="stable")
    order = order[np.isfinite(totals[order])]

    def make(j) -> Ranked:
        cand = pool.builders[src[j]](int(idx[j]))
        return Ranked(cand, evaluate(cand, wl, prof))

    ranked = [make(j) for j in order[:top]]
    kinds = np.array(pool.placement)[src[order]]
    by_placement = {}
    for kind in PLACEMENT_KINDS:
        hit = np.nonzero(kinds == kind)[0]
        if len(hit):
            by_placement[kind] = make(order[hit[0]])
    return ranked, by_placement

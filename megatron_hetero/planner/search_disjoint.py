"""The layout search's disjoint candidates: LLM chains of one or two segments, paired with encoder islands
and pruned by the lower bound of `planner/search.py`'s docstring (the returned top-K equals exhaustive
evaluation's). Pure (numpy only).
"""

from __future__ import annotations

import itertools
from typing import Optional

import numpy as np

from megatron_hetero.planner import placements as PL
from megatron_hetero.planner.cost_terms import loss_reduce
from megatron_hetero.planner.hardware import Profile
from megatron_hetero.plan.schedule import MAX_MICRO_BATCHES  # the disjoint schedule's stage tables
from megatron_hetero.planner.workload import Candidate, Segment, Workload
from megatron_hetero.planner.search_space import SearchSpace
from megatron_hetero.planner.search_rows import _layouts


def _chains(wl: Workload, world_llm: int, space: SearchSpace) -> list[tuple]:
    """LLM chains on an island: (tp_a, cp, pp_a, dp_a, n_a, tp_b, pp_b, dp_b, n_b); n_b = 0: one segment."""
    llm, L, G, m = wl.llm, wl.llm.num_layers, wl.global_batch, wl.micro_batch
    rows = [
        (t, c, p, d, L, 0, 0, 0, 0)
        for t, c, p, d in _layouts(world_llm, space.tp, space.cp, space.pp, llm, True, space.runtime)
        if G % (m * d) == 0 and (not space.runtime or G // (m * d) <= MAX_MICRO_BATCHES)
    ]
    if space.max_segments >= 2 and world_llm % 2 == 0:
        half = _layouts(world_llm // 2, space.tp, space.cp, space.pp, llm, True)
        if space.runtime:
            # the runtime's segments: any two different TP/PP/DP (one DP dividing the other), every
            # stage of a segment holding the same number of layers, at most MAX_MICRO_BATCHES
            # micro-batches (the disjoint schedule's tables)
            by_cp: dict[int, list[tuple[int, int, int]]] = {}
            for t, c, p, d in half:
                by_cp.setdefault(c, []).append((t, p, d))
            for c, opts in by_cp.items():
                for (ta, pa, da), (tb, pb, db) in itertools.permutations(opts, 2):
                    hi, lo = max(da, db), min(da, db)
                    if hi % lo or G % (m * hi) or G // (m * hi) > MAX_MICRO_BATCHES:
                        continue
                    for na in range(pa, L - pb + 1):
                        if na % pa == 0 and (L - na) % pb == 0:
                            rows.append((ta, c, pa, da, na, tb, pb, db, L - na))
            return rows
        by: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for t, c, p, d in half:
            by.setdefault((c, p), []).append((t, d))
        for (c, p), pairs in by.items():
            for (ta, da), (tb, db) in itertools.permutations(pairs, 2):  # two different strategies
                hi, lo = max(da, db), min(da, db)
                if hi % lo or G % (m * hi):
                    continue
                for na in range(p, L - p + 1):
                    rows.append((ta, c, p, da, na, tb, p, db, L - na))
    return rows


def _disjoint(wl: Workload, prof: Profile, world: int, space: SearchSpace, limit: float, groups: list) -> int:
    """Prepare the disjoint groups (encoder rows x chain rows sharing the pipeline micro-batch M,
    the LLM's stage count and the first segment's dp): each side's aggregates (`planner.step.Side`) and
    memory; rows over the memory limit are dropped. Returns the number of valid (encoder, chain)
    pairs."""
    enc, G, m = wl.encoder, wl.global_batch, wl.micro_batch
    loss = float(loss_reduce(prof, world))
    size = 0
    for we in space.islands(world):
        enc_rows = _layouts(we, space.encoder_tp, space.encoder_cp, space.encoder_pp, enc, False, space.runtime)
        rows = _chains(wl, world - we, space)
        if not enc_rows or not rows:
            continue
        ch = np.array(rows, dtype=np.int64)
        ta, cp, pa, da, na, tb, pb, db, nb = (ch[:, i] for i in range(9))
        M = m * np.maximum(da, np.where(nb > 0, db, 1))
        b = G // M
        P_llm = pa + pb
        chain, c_mem = PL.llm_chain(prof, wl, [(ta, cp, pa, da, na), (tb, cp, pb, db, nb)], world)
        key = chain.sum + (b - 1) * chain.max + chain.tail + loss
        ok = c_mem <= limit
        er = np.array(enc_rows, dtype=np.int64)
        etp, ecp, epp, edp = (er[:, i] for i in range(4))
        uniq, inv = np.unique(np.stack([M, P_llm, da], axis=1), axis=0, return_inverse=True)
        inv = inv.reshape(-1)
        esels = [
            np.nonzero((Mg % edp == 0) & ((np.maximum(edp, dag) % np.minimum(edp, dag)) == 0))[0] for Mg, _, dag in uniq
        ]
        # every group's encoder rows in one evaluator call
        rows_e = np.concatenate(esels)
        rep = np.repeat(np.arange(len(uniq)), [len(x) for x in esels])
        eside_all, e_mem_all = PL.encoder_island(
            prof, wl, etp[rows_e], ecp[rows_e], epp[rows_e], edp[rows_e], uniq[rep, 0], uniq[rep, 1]
        )
        starts = np.cumsum([0] + [len(x) for x in esels])
        for gi, (Mg, _Pg, _dag) in enumerate(uniq):
            sel, esel = np.nonzero(inv == gi)[0], esels[gi]
            if not len(esel):
                continue
            size += len(sel) * len(esel)
            at = np.arange(starts[gi], starts[gi + 1])
            eok = np.nonzero(e_mem_all[at] <= limit)[0]
            eside = eside_all.rows(at, full=False)
            csel = sel[ok[sel]]
            if not len(csel) or not len(eok):
                continue
            csel = csel[np.argsort(key[csel], kind="stable")]
            groups.append(
                dict(
                    we=we,
                    b=int(G // Mg),
                    rows=rows,
                    enc_rows=enc_rows,
                    cidx=csel,
                    ckey=key[csel],
                    chain=chain.rows(csel, full=False),
                    eidx=esel[eok],
                    enc=eside.rows(eok, full=False),
                )
            )
    return size


def _pairs(
    gr: dict, prof: Profile, wl: Workload, world: int, tau: float, probe: Optional[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(encoder positions, chain positions, step times) of the pairs to evaluate in group `gr`: the
    first `probe` chains per encoder, or every chain with E_sum + K(c) <= tau / uncontended."""
    nE, nC = len(gr["eidx"]), len(gr["cidx"])
    if probe is not None:
        cnt = np.full(nE, min(probe, nC))
    else:
        # slack: when the bound is tight it equals the step time up to rounding
        cnt = np.searchsorted(gr["ckey"], tau / prof.uncontended * (1 + 1e-9) - gr["enc"].sum, side="right")
    ei = np.repeat(np.arange(nE), cnt)
    starts = np.cumsum(cnt) - cnt
    ci = np.arange(int(cnt.sum())) - np.repeat(starts, cnt)
    enc, chain = gr["enc"].rows(ei, full=False), gr["chain"].rows(ci, full=False)
    tot = PL.disjoint(prof, wl, enc, chain, world, gr["b"], full=False)
    return ei, ci, np.asarray(tot, dtype=float)


def _chain_candidate(gr: dict, e: int, c: int, wl: Workload) -> Candidate:
    et, ec, ep, ed = gr["enc_rows"][gr["eidx"][e]]
    ta, cp, pa, da, na, tb, pb, db, nb = gr["rows"][gr["cidx"][c]]
    segs = (Segment.of(ta, cp, pa, da, na),) + ((Segment.of(tb, cp, pb, db, nb),) if nb else ())
    return Candidate("disjoint", Segment.of(et, ec, ep, ed, wl.encoder.num_layers), segs, encoder_ranks=gr["we"])

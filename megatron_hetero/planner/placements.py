"""The batched evaluator, one function per placement: breakdown arrays (`CostBreakdown` fields) of many
candidates at once, homogeneous, colocated (three-phase) and disjoint (an encoder island and an LLM
chain). The search scores whole candidate arrays with these; `planner.cost.evaluate` is the same code
with one row. Pure (numpy only); formulas in `planner/cost.py`.
"""

from __future__ import annotations

import numpy as np

from megatron_hetero.planner.hardware import Profile
from megatron_hetero.planner.workload import Workload
from megatron_hetero.planner.cost_terms import (
    layer_parts,
    act_bytes,
    loss_reduce,
    disjoint_boundary,
    io_time,
    colocated_boundary,
    shared_step,
)
from megatron_hetero.planner.stages import _PARTS, Stages, module_stages
from megatron_hetero.planner.step import Side, peak_memory, _valid_max, finish, _scaled


# --- homogeneous ------------------------------------------------------------------------------
def homogeneous(prof: Profile, wl: Workload, tp, cp, pp, dp, first_layers, ep=1) -> dict:
    """Breakdown arrays of homogeneous candidates: the encoder on the LLM's layout inside LLM
    stage 0, which holds `first_layers` LLM layers (pp = 1: all of them); the other LLM layers
    split evenly over the other stages."""
    llm, m = wl.llm, wl.micro_batch
    tp, cp, pp, dp, first_layers, ep = np.broadcast_arrays(*(np.asarray(x) for x in (tp, cp, pp, dp, first_layers, ep)))
    L = llm.num_layers
    l0 = np.where(pp == 1, L, first_layers)
    b = wl.global_batch // (m * dp)
    world = tp * cp * pp * dp
    inter = world > prof.devices_per_node
    head: dict = {}
    for v in wl.encoder_views():  # every encoder on stage 0, one after the other
        enc, k = v.encoder, v.images_per_sample
        ec, et, eq = layer_parts(prof, v, enc, m * k, tp, cp)
        one = {
            "compute": enc.num_layers * ec + io_time(prof, v, enc, m * k, tp, cp),
            "tp": enc.num_layers * et,
            "cp": enc.num_layers * eq,
            # the encoder's layers and (times tp: the stage divides by it) its parameters outside them
            "params": float(enc.total_params) + tp * np.add(*v.encoder_io_params(tp)),
            "act": act_bytes(v, enc, m * k, tp, cp, enc.num_layers),
        }
        head = one if not head else {key: head[key] + one[key] for key in head}
    common = dict(runs=b, p2p=pp > 1, inter=inter, placement="homogeneous", data="all", ep=ep)
    st = Stages.cat(
        module_stages(
            prof,
            wl,
            llm,
            tp,
            cp,
            np.ones_like(pp),
            dp,
            l0,
            m,
            embed_first=True,
            embed_last=pp == 1,
            io_last=pp == 1,
            head=head,
            **common,
        ),
        module_stages(prof, wl, llm, tp, cp, pp - 1, dp, L - l0, m, offset=1, embed_last=True, io_last=True, **common),
    )
    s = Side.of(st)
    pipe = s.sum + (b - 1) * s.max
    return finish(
        prof, world, b, pipe, _scaled(s.parts, b), s.tail_dp, s.tail_opt, s.busy, 0.0, 0.0, peak_memory(st, pp, b)
    )


# --- colocated --------------------------------------------------------------------------------
def colocated(
    prof: Profile, wl: Workload, tp, cp, pp, dp, etp, ecp, epp, edp, offload, ep=1, extra: tuple = ()
) -> dict:
    """Breakdown arrays of colocated three-phase candidates (LLM tp/cp/pp/dp (and ep, with experts),
    encoder etp/ecp/epp/edp on the same ranks; `offload`: the encoders' state leaves the device
    during the LLM phase). extra: (etp, ecp, epp, edp) of each of the workload's extra encoders: every
    encoder's passes run one after the other on the same ranks, their activations and state add up,
    each crosses its own boundary."""
    llm, G = wl.llm, wl.global_batch
    views = wl.encoder_views()
    if len(extra) != len(views) - 1:
        raise ValueError(f"colocated: {len(views) - 1} extra encoders, {len(extra)} layouts given")
    flat = [x for e in extra for x in e]
    tp, cp, pp, dp, etp, ecp, epp, edp, offload, ep, *flat = np.broadcast_arrays(
        *(np.asarray(x) for x in (tp, cp, pp, dp, etp, ecp, epp, edp, offload, ep, *flat))
    )
    degrees = [(etp, ecp, epp, edp)] + [tuple(flat[4 * i : 4 * i + 4]) for i in range(len(extra))]
    b = G // (wl.micro_batch * dp)
    world = tp * cp * pp * dp
    inter = world > prof.devices_per_node
    lst = module_stages(
        prof,
        wl,
        llm,
        tp,
        cp,
        pp,
        dp,
        llm.num_layers,
        wl.micro_batch,
        runs=b,
        p2p=pp > 1,
        inter=inter,
        placement="colocated",
        embed_first=True,
        embed_last=True,
        io_last=True,
        data="all",
        ep=ep,
    )
    ls = Side.of(lst)
    pipe = ls.sum + (b - 1) * ls.max
    parts = {n: b * ls.parts[n] for n in _PARTS}
    busy, enc_busy = dict(ls.busy), {n: 0.0 for n in ls.busy}
    tail_dp, tail_opt = ls.tail_dp, ls.tail_opt
    zero = np.zeros(np.shape(tp))
    enc_sum, enc_state, enc_acts, bnd = zero, zero, zero, zero
    for v, (etp, ecp, epp, edp) in zip(views, degrees):
        be = G * v.images_per_sample / edp  # inputs of the rank's encoder-DP share: one pass
        est = module_stages(
            prof,
            v,
            v.encoder,
            etp,
            ecp,
            epp,
            edp,
            v.encoder.num_layers,
            be,
            runs=1,
            p2p=epp > 1,
            inter=inter,
            placement="colocated",
            io_last=True,
            data="first",
        )
        es = Side.of(est)
        pipe, enc_sum = pipe + es.sum, enc_sum + es.sum
        parts = {n: parts[n] + es.parts[n] for n in _PARTS}
        busy = {n: busy[n] + es.busy[n] for n in busy}
        enc_busy = {n: enc_busy[n] + es.busy[n] for n in enc_busy}
        tail_dp, tail_opt = tail_dp + es.tail_dp, tail_opt + es.tail_opt
        enc_state = enc_state + _valid_max(est, est.state)
        enc_acts = enc_acts + _valid_max(est, est.act)
        bnd = bnd + colocated_boundary(prof, v, etp, ecp, epp, edp, tp, cp, pp, dp)
    mem = np.maximum(
        _valid_max(lst, lst.state) + enc_state + enc_acts,
        peak_memory(lst, pp, b) + enc_acts + np.where(offload, 0.0, enc_state),
    )
    off = np.where(offload, 2.0 * enc_state / prof.host_bandwidth, 0.0)
    # the encoder passes run alone (every rank waits at the boundary): on shared units their own phase
    enc_phase = (enc_sum, enc_busy)
    return finish(prof, world, b, pipe, parts, tail_dp, tail_opt, busy, bnd, off, mem, enc_phase)


# --- disjoint: an encoder island and an LLM chain, one 1F1B pipeline ---------------------------
def encoder_island(
    prof: Profile, wl: Workload, etp, ecp, epp, edp, micro_samples, llm_stages
) -> tuple[Side, np.ndarray]:
    """The encoder island's side of disjoint candidates whose pipeline micro-batch carries
    `micro_samples` samples and whose LLM chain has `llm_stages` stages: (Side, memory peak)."""
    enc, k = wl.encoder, wl.images_per_sample
    etp, ecp, epp, edp, M, P = np.broadcast_arrays(
        *(np.asarray(x) for x in (etp, ecp, epp, edp, micro_samples, llm_stages))
    )
    b = wl.global_batch // M
    st = module_stages(
        prof,
        wl,
        enc,
        etp,
        ecp,
        epp,
        edp,
        enc.num_layers,
        M * k / edp,
        runs=b,
        p2p=epp > 1,
        inter=etp * ecp * epp * edp > prof.devices_per_node,
        placement="disjoint",
        io_last=True,
        data="first",
    )
    return Side.of(st), peak_memory(st, epp + P, b)


def llm_chain(prof: Profile, wl: Workload, segments: list, world) -> tuple[Side, np.ndarray]:
    """The LLM side of disjoint candidates: `segments` [(tp, cp, pp, dp, layers)] in pipeline order
    (arrays; pp = 0: the segment is absent), on the island of the world's other ranks: (Side, memory
    peak). The first stage receives the encoder boundary."""
    segs = [tuple(np.asarray(x) for x in s) + ((np.asarray(1),) if len(s) == 5 else ()) for s in segments]
    present = [s[2] > 0 for s in segs]
    M = wl.micro_batch * np.max([np.where(p, s[3], 1) for s, p in zip(segs, present)], axis=0)
    b = wl.global_batch // M
    P = sum(s[2] for s in segs)
    island = sum(np.where(p, s[0] * s[1] * s[2] * s[3], 0) for s, p in zip(segs, present))
    offset: np.ndarray | int
    parts, offset = [], 0
    for i, (tp, cp, pp, dp, layers, ep) in enumerate(segs):
        later = np.zeros_like(present[i])
        for p in present[i + 1 :]:
            later = later | p
        dps = np.maximum(dp, 1)
        st = module_stages(
            prof,
            wl,
            wl.llm,
            np.maximum(tp, 1),
            np.maximum(cp, 1),
            pp,
            dps,
            layers,
            M / dps,
            runs=b,
            p2p=P > 1,
            inter=island > prof.devices_per_node,
            placement="disjoint",
            offset=offset,
            embed_first=i == 0,
            embed_last=present[i] & ~later,
            io_last=present[i] & ~later,
            data="all",
            ep=ep,
        )
        if i == 0:  # every encoder's tokens arrive here (the join)
            bnd = sum(disjoint_boundary(prof, v, M / dps, cp, world) for v in wl.encoder_views())
            st.boundary[:, :1] = np.asarray(bnd)[..., None]
        parts.append(st)
        offset = offset + pp
    st = Stages.cat(*parts)
    return Side.of(st), peak_memory(st, P, b)


def encoder_islands(prof: Profile, wl: Workload, degrees: list, micro_samples, llm_stages) -> tuple[Side, np.ndarray]:
    """Every encoder's island of disjoint candidates (`degrees`: (etp, ecp, epp, edp) per encoder, in
    `Workload.encoders` order), side by side: they run in parallel and the language model's first
    stage waits for all of them (`Side.parallel`); the memory peak is the largest island's."""
    sides, mems = [], []
    for v, (etp, ecp, epp, edp) in zip(wl.encoder_views(), degrees, strict=True):
        side, mem = encoder_island(prof, v, etp, ecp, epp, edp, micro_samples, llm_stages)
        sides.append(side)
        mems.append(mem)
    return Side.parallel(sides), np.maximum.reduce(mems) if len(mems) > 1 else mems[0]


def disjoint(prof: Profile, wl: Workload, enc: Side, llm: Side, world, b, full: bool = True):
    """Disjoint candidates pairing encoder-island rows with LLM-chain rows (already indexed alike):
    breakdown arrays (full) or the step times only. The bottleneck and the slowest tail are the
    encoder's on ties (its stages come first)."""
    e_top = enc.max >= llm.max
    mx = np.where(e_top, enc.max, llm.max)
    pipe = enc.sum + llm.sum + (b - 1) * mx
    e_tail = enc.tail >= llm.tail
    tail_dp, tail_opt = np.where(e_tail, enc.tail_dp, llm.tail_dp), np.where(e_tail, enc.tail_opt, llm.tail_opt)
    if not full:
        loss = loss_reduce(prof, world)
        crit = pipe + tail_dp + tail_opt + loss
        return shared_step(prof, (enc.work + llm.work) / world + loss, crit) if prof.shared else crit
    parts = {n: b * np.where(e_top, enc.parts[n], llm.parts[n]) for n in _PARTS}
    busy = {n: enc.busy[n] + llm.busy[n] for n in enc.busy}
    return finish(prof, world, b, pipe, parts, tail_dp, tail_opt, busy, 0.0, 0.0, None)

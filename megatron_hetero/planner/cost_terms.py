"""The cost model's terms, elementwise on numpy arrays of candidates: per-layer compute and
collective times, pipeline point-to-point, data-parallel gradient reduction, state and activation
bytes, boundary traffic (colocated: the point-to-point pieces each rank lacks; disjoint: the edge's
bytes), I/O layers, data building and the shared-CPU step rule. `planner/cost.py` assembles them into
pipeline stages and whole candidates (see its docstring for the formulas).
"""

from __future__ import annotations

import numpy as np

from megatron_hetero.planner.hardware import Profile, layer_flops
from megatron_hetero.planner.memory_terms import layer_activation_bytes
from megatron_hetero.planner.workload import ModelSpec, Workload


# ---------------------------------------------------------------------------------------------
# Primitives (elementwise on arrays)
# ---------------------------------------------------------------------------------------------
def _cp_eff(spec: ModelSpec, cp):
    return cp if spec.shards else np.ones_like(np.asarray(cp))


def layer_flops_of(spec: ModelSpec, tokens, seq_flops: bool = True):
    """Training FLOPs of one layer of `spec` over `tokens` tokens (`hardware.layer_flops`'s terms):
    a GPT layer's attention + MLP, or a hybrid layer's mix of attention, dense MLP and top-k experts
    (`ModelSpec.mix`)."""
    if spec.layer_mix is None:
        return layer_flops(tokens, spec.span, spec.hidden, spec.flops_ffn, spec.gated)
    attn, mlp, moe = spec.layer_mix
    t = np.asarray(tokens, dtype=float)
    attention = layer_flops(t, spec.span, spec.hidden, 0, spec.gated)
    mlp_flops = layer_flops(t, spec.span, spec.hidden, spec.ffn_hidden, spec.gated) - attention
    moe_ffn = spec.moe_topk * spec.expert_ffn if spec.num_experts else 0
    moe_flops = layer_flops(t, spec.span, spec.hidden, moe_ffn, spec.gated) - attention
    return attn * attention + mlp * mlp_flops + moe * moe_flops


def layer_parts(prof: Profile, wl: Workload, spec: ModelSpec, samples, tp, cp, ep=1):
    """(compute, tp_comm, cp_comm) of one layer, one micro-batch of `samples` per replica. With
    experts the MLP FLOPs are the top-k experts' (`flops_ffn`), and tp_comm also holds the token
    dispatcher's all-to-alls over the EP group (`ep_dispatch_time`). A hybrid layer (`ModelSpec.mix`:
    attention, dense MLP, MoE shares) has its types' shares of each term: attention 2 of a GPT
    layer's 4 TP collectives, its core attention and CP ring; an MLP the other 2; MoE those 2 and the
    dispatch."""
    attn, mlp, moe = spec.mix
    cpe = _cp_eff(spec, cp)
    tokens = np.asarray(samples, dtype=float) * spec.seq
    flops = layer_flops_of(spec, tokens) / (np.asarray(tp) * cpe)
    if spec.layer_mix is None:
        compute = prof.layer_time(spec.kind, flops)
    else:  # a hybrid layer is half a GPT layer's modules: half its fixed time
        model = prof.layer_model(spec.kind)
        compute = 0.5 * (attn + mlp + moe) * model.a + model.b * np.asarray(flops, dtype=float)
    tp_calls = 2.0 * (attn + max(mlp, moe) if spec.layer_mix is None else attn + mlp + moe)  # 2 fwd + 2 bwd a layer
    if wl.recompute == "full":  # the forward again before each backward: 4 passes' worth of 3
        compute, tp_calls = compute * 4.0 / 3.0, tp_calls * 1.5
    elif wl.recompute == "selective":  # the core attention's forward again (QK^T and AV: 4Tsh FLOPs)
        attention = attn * 4.0 * tokens * spec.span * spec.hidden / (np.asarray(tp) * cpe)
        compute = compute + prof.layer_model(spec.kind).b * attention
    dpn = prof.devices_per_node
    act = tokens / cpe * spec.hidden * wl.dtype_bytes
    tpc = tp_calls * prof.layer_collective_time("all_reduce", act, tp, np.asarray(tp) > dpn)
    if spec.shards:
        kv = 2.0 * tokens * spec.hidden / np.asarray(tp) * wl.dtype_bytes
        ring = 3.0 * prof.layer_collective_time("all_gather", kv, cp, np.asarray(tp) * cp > dpn)
        attention = prof.layer_model(spec.kind).b * 12.0 * tokens * spec.span * spec.hidden / (np.asarray(tp) * cpe)
        cpc = attn * np.maximum(ring - attention, 0.0)
    else:
        cpc = np.zeros_like(compute)
    if spec.has_experts:
        tpc = tpc + moe * ep_dispatch_time(prof, wl, spec, samples, tp, cp, ep)
    return compute, tpc, cpc


def ep_dispatch_time(prof: Profile, wl: Workload, spec: ModelSpec, samples, tp, cp, ep):
    """Megatron's alltoall token dispatcher of one MoE layer, one micro-batch: dispatch and combine
    in forward and again in backward, 4 all-to-alls over the EP group, each carrying this rank's
    routed tokens (T/cp_eff * topk * h * dtype, of which (ep-1)/ep leave the rank). Priced as an
    all-gather of that size over ep ranks (the same per-rank volume, alpha-beta); 0 at ep = 1."""
    ep = np.asarray(ep)
    nbytes = (
        np.asarray(samples, dtype=float) * spec.seq / _cp_eff(spec, cp) * spec.moe_topk * spec.hidden * wl.dtype_bytes
    )
    t = 4.0 * prof.layer_collective_time("all_gather", nbytes, ep, np.asarray(tp) * ep > prof.devices_per_node)
    return np.where(ep > 1, t, 0.0)


def synced(prof: Profile, t):
    """Time of communication that closes a phase (ranks arrive as their own work ends): the
    profile's measured `grad_sync` overhead applied to the formula's time `t` (t where the profile
    has none; 0 stays 0)."""
    if "grad_sync" not in prof.overheads:
        return t
    t = np.asarray(t, dtype=float)
    return np.where(t > 0, prof.overhead_time("grad_sync", t), 0.0)


def p2p_time(prof: Profile, wl: Workload, spec: ModelSpec, samples, cp, inter):
    """Pipeline exchange of one stage per micro-batch: 2 * sendrecv(tokens/cp_eff * h * dtype)."""
    nbytes = np.asarray(samples, dtype=float) * spec.seq / _cp_eff(spec, cp) * spec.hidden * wl.dtype_bytes
    return synced(prof, 2.0 * prof.collective_time("send_recv", nbytes, 2, inter))


def state_bytes(wl: Workload, params_rank, dp_group):
    """Weights + fp32 grads + optimizer state of `params_rank` parameters (the bytes per parameter of
    `planner.memory_terms.StateFeatures`: precision, optimizer, distributed optimizer over dp_group)."""
    opt = wl.optimizer_bytes / (np.asarray(dp_group, dtype=float) if wl.distributed_optimizer else 1.0)
    return np.asarray(params_rank, dtype=float) * (wl.weight_bytes + wl.grad_bytes + opt)


def act_bytes(wl: Workload, spec: ModelSpec, samples, tp, cp, layers):
    """Activations kept for backward by `layers` layers for one micro-batch of `samples` per
    replica: `planner.memory_terms.layer_activation_bytes` (the bytes train's layers keep, measured:
    tests/ranks/test_memory_model.py) under the workload's features (sequence parallelism on the
    language model, recompute, the attention's scores); with full recompute each layer keeps its input
    only (the one layer recomputed at a time during a backward is not counted)."""
    tp = np.asarray(tp, dtype=float)
    rows = np.asarray(samples, dtype=float)
    tokens = spec.seq / _cp_eff(spec, cp)
    sp = wl.sequence_parallel and spec.kind == "llm"
    feats = wl.activation_features(sp)
    if wl.recompute == "full":
        per = tokens * rows * spec.hidden / (tp if sp else 1.0) * wl.dtype_bytes
    else:
        per = _layer_act(spec, tokens, rows, tp, feats)
    return np.asarray(layers, dtype=float) * per


def _layer_act(spec: ModelSpec, tokens, rows, tp, feats):
    """Activation bytes of one layer (`layer_activation_bytes`); a hybrid layer's mix: attention one
    norm and the attention's bytes, a dense MLP / MoE one norm and its MLP's (top-k experts' width)."""
    if spec.layer_mix is None:
        ffn = spec.moe_topk * spec.expert_ffn if spec.num_experts else spec.ffn_hidden  # a token's MLP width
        return layer_activation_bytes(tokens, rows, spec.hidden, ffn, spec.heads, tp, feats, gated=spec.gated)
    attn, mlp, moe = spec.layer_mix
    base = layer_activation_bytes(tokens, rows, spec.hidden, 0, spec.heads, tp, feats, gated=spec.gated)
    sp = tp if feats.sequence_parallel else 1.0
    n = tokens * rows / sp  # one LayerNorm (the cost model's): its input and output, 2 fp32 statistics
    norm = 2.0 * n * spec.hidden * feats.dtype_bytes + 2.0 * n * 4

    def mlp_bytes(ffn):
        return layer_activation_bytes(tokens, rows, spec.hidden, ffn, spec.heads, tp, feats, gated=spec.gated) - base

    moe_ffn = spec.moe_topk * spec.expert_ffn if spec.num_experts else 0
    return attn * (base - norm) + mlp * (norm + mlp_bytes(spec.ffn_hidden)) + moe * (norm + mlp_bytes(moe_ffn))


def dp_time(prof: Profile, wl: Workload, params_rank, tp, cp, dp):
    """Once per step: all-reduce of the rank's fp32 grads over dp*cp ranks (through the profile's
    measured `grad_sync` overhead where it has one)."""
    n = np.asarray(dp) * cp
    t = prof.collective_time(
        "all_reduce",
        np.asarray(params_rank, dtype=float) * wl.grad_bytes,
        n,
        np.asarray(tp) * n > prof.devices_per_node,
    )
    return prof.overhead_time("grad_sync", t) if "grad_sync" in prof.overheads else t  # also at n = 1


def loss_reduce(prof: Profile, world):
    """Once per step: the all-reduce of the step's loss over every rank (8 bytes); like the gradient
    reduction it closes a phase, so it goes through the profile's `grad_sync` overhead too."""
    return synced(prof, prof.collective_time("all_reduce", 8.0, world, np.asarray(world) > prof.devices_per_node))


def disjoint_boundary(prof: Profile, wl: Workload, samples_dst, cp_dst, world_size):
    """Encoder -> LLM per micro-batch on the LLM's first stage: 2 * sendrecv of what one LLM rank
    needs (its samples, its CP share of the image tokens, projected to the LLM's hidden size)."""
    nbytes = np.asarray(samples_dst, dtype=float) * wl.image_tokens / cp_dst * wl.llm.hidden * wl.dtype_bytes
    return synced(
        prof, 2.0 * prof.collective_time("send_recv", nbytes, 2, np.asarray(world_size) > prof.devices_per_node)
    )


def io_flops(wl: Workload, spec: ModelSpec, samples, tp, cp):
    """FLOPs per rank (fwd+bwd) of a module's work outside its layers, per run: the LLM's output
    layer (6 * T * h * vocab), an encoder's projector to the LLM's hidden size (6 * T * (h_e * h + h^2))."""
    tokens = np.asarray(samples, dtype=float) * spec.seq / _cp_eff(spec, cp)
    if spec.kind == "encoder":
        per_token = spec.hidden * wl.llm.hidden + wl.llm.hidden**2
    else:
        per_token = spec.hidden * spec.vocab
    return 6.0 * tokens * per_token / np.asarray(tp)


def io_allreduce(prof: Profile, wl: Workload, spec: ModelSpec, samples, tp, cp):
    """One all-reduce of a run's activation (T/cp_eff * h * dtype) over the TP group (0 at tp = 1)."""
    tokens = np.asarray(samples, dtype=float) * spec.seq / _cp_eff(spec, cp)
    return prof.collective_time(
        "all_reduce", tokens * wl.llm.hidden * wl.dtype_bytes, tp, np.asarray(tp) > prof.devices_per_node
    )


def io_time(prof: Profile, wl: Workload, spec: ModelSpec, samples, tp, cp):
    """The profile's `<kind>_io` overhead of one run (0 where not modelled), plus, with TP, its
    `<kind>_io_tp` count of activation all-reduces over the TP group (embedding, output layer,
    vocab-parallel loss / projector)."""
    t = prof.overhead_time(f"{spec.kind}_io", io_flops(wl, spec, samples, tp, cp))
    if f"{spec.kind}_io_tp" in prof.overheads:
        t = t + prof.overhead_time(f"{spec.kind}_io_tp", io_allreduce(prof, wl, spec, samples, tp, cp))
    return t


def data_time(prof: Profile, wl: Workload, samples):
    """The profile's `data` overhead: a rank building `samples` samples (0 where not modelled)."""
    return prof.overhead_time("data", np.asarray(samples, dtype=float) * wl.llm.seq)


def colocated_traffic(wl: Workload, enc_pp, enc_dp, tp, cp, pp, dp) -> dict:
    """Per direction ("forward": encoder last stage -> LLM first stage; "backward": the inverse
    route), the bytes and messages of the busiest receiving rank and of the mean sending rank in
    the colocated boundary, as the direct plan of `plan/boundary.py` routes it (point-to-point
    messages of what a rank needs and does not hold; what it holds is copied locally).

    An LLM first-stage rank needs N = G/dp samples x T/cp image tokens (h x dtype bytes each); an
    encoder last-stage rank holds (and needs the gradient of) Ns = G/enc_dp samples x T tokens
    (encoders do not shard their sequence; the runtime's run with cp = 1). A rank that is on both
    sides holds loc = G/max(enc_dp, dp) samples x T/cp of what it needs when the two grids line up:
      forward, every LLM rank:  enc_pp = 1 and (pp = 1 or dp = 1 or enc_dp = 1);
      backward, every encoder rank:  pp = 1 and (enc_pp = 1 or enc_dp = 1 or dp = 1);
    otherwise some receiver holds nothing of its need. Pieces per receiver: one per encoder shard
    it needs (max(enc_dp/dp, 1)) forward, one per LLM DP shard and CP chunk (max(dp/enc_dp, 1) * cp)
    backward, less the one held. Senders share the bytes nobody held (ranks on both sides of a
    one-sided alignment, enc_pp > 1 = pp or enc_pp = 1 < pp with enc_dp = 1 or dp = 1, hold loc
    too); the plan's routing spreads them evenly."""
    enc_pp, enc_dp, tp, cp, pp, dp = np.broadcast_arrays(*(np.asarray(x) for x in (enc_pp, enc_dp, tp, cp, pp, dp)))
    T, unit = wl.image_tokens, wl.llm.hidden * wl.dtype_bytes
    G, world = float(wl.global_batch), tp * cp * pp * dp
    se, sl = world // enc_pp, world // pp  # ranks of the encoder's last stage, of the LLM's first
    need, hold = G / dp * T / cp * unit, G / enc_dp * T * unit
    loc = G / np.maximum(enc_dp, dp) * T / cp * unit
    thin = (enc_dp == 1) | (dp == 1)
    fwd_all = (enc_pp == 1) & ((pp == 1) | thin)
    bwd_all = (pp == 1) & ((enc_pp == 1) | thin)
    fwd_some, bwd_some = (enc_pp > 1) & (pp == 1) & thin, (enc_pp == 1) & (pp > 1) & thin
    out = {}
    for d, (recv, pieces, n_recv, n_send, every, some) in {
        "forward": (need, np.maximum(enc_dp // dp, 1), sl, se, fwd_all, fwd_some),
        "backward": (hold, np.maximum(dp // enc_dp, 1) * cp, se, sl, bwd_all, bwd_some),
    }.items():
        holders = np.where(every, n_recv, np.where(some, n_send, 0))
        out[d] = {
            "recv_bytes": recv - np.where(every, loc, 0.0),
            "recv_msgs": pieces - every,
            "send_bytes": (n_recv * recv - holders * loc) / n_send,
            "send_msgs": (n_recv * pieces - holders) / n_send,
        }
    return out


def colocated_boundary(prof: Profile, wl: Workload, enc_tp, enc_cp, enc_pp, enc_dp, tp, cp, pp, dp):
    """Whole-step colocated transform, forward + backward, as `runtime/boundary.py` (direct mode)
    runs it: point-to-point messages of exactly what each rank needs and does not hold, a local copy
    of what it holds (no collective). Per direction the slower of the busiest receiver and the mean
    sender (`colocated_traffic`), messages * alpha + bytes * beta of send/recv; intra-node when the
    grids line up inside the LLM's TP x CP span (pp = enc_pp = 1) or the world fits a node. Local
    copies are not priced."""
    world = np.asarray(tp) * cp * pp * dp
    span = np.where((np.asarray(pp) == 1) & (np.asarray(enc_pp) == 1), np.asarray(tp) * cp, world)
    inter = span > prof.devices_per_node
    t: np.ndarray | float = 0.0
    for d in colocated_traffic(wl, enc_pp, enc_dp, tp, cp, pp, dp).values():
        ends = []
        for nbytes, msgs in ((d["recv_bytes"], d["recv_msgs"]), (d["send_bytes"], d["send_msgs"])):
            one = prof.collective_time("send_recv", nbytes / np.maximum(msgs, 1e-300), 2, inter)
            ends.append(np.where(msgs > 0, msgs * one, 0.0))
        t = t + np.maximum(*ends)
    return synced(prof, t)


def shared_step(prof: Profile, work, critical):
    """Step time when ranks share execution units (`Profile.cores` > 0).

    The profile's times are per-rank times with `concurrency` (W) ranks busy at once, when the
    units deliver `cores` ranks' worth of uncontended work per second. `work`: the mean rank's busy
    time at that sharing (every rank's busy time summed over the world / W), so the step's
    uncontended work is D = work * cores; `critical`: the formulas' critical path at that sharing,
    P = critical * uncontended with the units to itself. Ranks that wait on others (pipeline fill
    and drain, islands idle while the other works) leave the units to the rest: on average
    k = min(W, D / P) ranks are runnable, and the units then deliver `cores_at(k)` (more than at W
    when oversubscription costs, `Profile.cores_at`). The step is the larger of D / cores_at(k)
    and P; with every rank always runnable (k = W) it is max(work, P), as without `cpu_cores`."""
    work = np.asarray(work, dtype=float)
    return np.maximum(work * sharing_scale(prof, work, critical), np.asarray(critical, dtype=float) * prof.uncontended)


def sharing_scale(prof: Profile, work, critical):
    """cores / cores_at(k), k = min(W, work * W / critical) runnable ranks on average (`shared_step`):
    the factor from busy times at the profile's sharing to busy times at the step's (<= 1 while at
    least `cores` ranks are runnable; with fewer, the scaled work is D / k = P, the critical path)."""
    W = float(max(prof.concurrency, 1))
    k = np.minimum(W, np.asarray(work, dtype=float) * W / np.maximum(np.asarray(critical, dtype=float), 1e-300))
    return prof.cores / prof.cores_at(k)

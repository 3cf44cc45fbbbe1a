"""Cost model: step time and per-rank memory of heterogeneous configurations. Pure (numpy only).

One evaluator: every formula below works on numpy arrays, one row per candidate; the search
(`planner/search.py`) scores whole candidate arrays with it and `evaluate(candidate, workload,
profile)` is the same code with one row. A pipeline's stages are held as classes of equal stages
(`Stages`: a module's evenly split stages are four classes), so a candidate costs O(classes), not
O(stages). Profiles and hardware: `planner/hardware.py`; models, workloads, candidates:
`planner/workload.py`.

Formulas (all times in seconds, per *micro-batch*, forward + backward, unless stated otherwise)
-------------------------------------------------------------------------------------------------
Layer FLOPs (Megatron counting, training = 3 x forward; T = tokens of the micro-batch replica,
s = sequence per sample, h = hidden, f = ffn hidden, m = 3 MLP matrices if gated (SwiGLU) else 2):
    F = 3 * (8*T*h^2 + 2*m*T*h*f + 4*T*s*h)
Layer compute time on one rank (the profile's `LayerModel` of the module kind):
    t = a + b * F / (tp * cp_eff)          cp_eff = cp if the module shards its sequence else 1
  a: per-layer fixed overhead (launches, small kernels); b: seconds per FLOP (1 / achieved FLOP/s).
  Encoders do not shard their (short, resolution-bound) sequence over CP: as in Megatron's LLaVA,
  the encoder runs replicated on every CP rank (`ModelSpec.shards_sequence`).
TP (sequence-parallel: 2 all-gathers + 2 reduce-scatters forward, the same backward = 4 all-reduce
volumes of the rank's activation, A = T/cp_eff * h * dtype bytes):
    t_tp = 4 * allreduce(A, n=tp)
CP (ring attention: K and V of the rank's heads circulate forward, K,V again + dK,dV backward),
overlapped with the attention-score compute (Megatron's ring attention); only the excess is exposed:
    t_cp = max(0, 3 * allgather(2 * T * h/tp * dtype, n=cp) - b * 3 * 4*T*s*h / (tp * cp))
Pipeline p2p per stage (activation forward + its gradient backward, one exchange each):
    t_pp = 2 * sendrecv(T/cp_eff * h * dtype)          (only when the module has > 1 stage)
Collectives: alpha-beta per link, ring algorithms (`planner/hardware.py`). A group uses the inter-node
link when the ranks it spans (group size x stride) exceed a node.
Data-parallel gradient reduction, once per step (fp32 main grads, group dp*cp), and the all-reduce
of the step's loss over the world (breakdown: dp_comm):
    t_dp = allreduce(params_per_rank * grad_bytes, n=dp*cp) + allreduce(8, n=world)
Pipeline of stages with per-micro-batch costs c_i and B micro-batches (1F1B):
    t_pipe = sum_i c_i + (B-1) * max_i c_i
  Breakdown: the bottleneck stage's components x B are compute/tp/cp/pp/boundary; the rest
  (sum of the other stages: fill and drain) is the bubble.
Memory per rank (bytes):
    state = params_rank * (weight_bytes + grad_bytes + optimizer_bytes [/ dp*cp: distributed optimizer])
  (defaults: bf16 weights 2, fp32 main grads 4, Adam fp32 master + 2 moments 12, distributed optimizer on)
    activations per layer per micro-batch = T/cp_eff * h * activation_bytes / tp
  (activation_bytes = 34: Korthikanti et al. with sequence parallelism and flash attention).
  1F1B stage i of P holds min(P - i, B) micro-batches of activations.

Placements (see `evaluate`):
- homogeneous: the encoder runs on the LLM's layout inside LLM pipeline stage 0 (Megatron LLaVA);
  stage 0 holds `first_stage_layers` LLM layers, the rest are split evenly.
- colocated (three-phase, as `runtime/colocated.py` runs it): encoder forward phase, one pass over the
  rank's encoder-DP share (G * images / dp_enc images; with pp_enc > 1 the whole share goes stage to
  stage, not pipelined: the stages' costs add up), LLM 1F1B pipeline, encoder backward phase (one
  pass); encoder activations of the whole step are held across the LLM phase; with
  `offload` the encoder's parameters/grads/optimizer state leave the device during the LLM phase
  (costing 2 * state / host_bandwidth).
- disjoint: one 1F1B pipeline through the encoder island's stages and the LLM island's segments;
  the bottleneck is the most expensive stage of either island; each island reduces its own
  gradients concurrently (the step waits for the slower).
Boundaries (encoder -> LLM, forward activations + backward gradients):
- disjoint, per micro-batch, on the LLM's first stage: 2 * sendrecv(samples/dp_llm * image_tokens
  / cp_llm * h * dtype), the bytes one destination rank needs (direct routing spreads senders; the
  encoder's projector runs in the encoder module, so its tokens cross at the LLM's hidden size h);
- colocated, once per step, as the runtime's direct boundary moves it (point-to-point messages of
  what a rank needs and does not hold, local copies of what it holds; `colocated_boundary`): per
  direction, messages * alpha + bytes * beta (send/recv) of the busiest receiver or of the mean
  sender, whichever is slower. Forward an LLM first-stage rank needs N = G/dp_llm *
  image_tokens/cp_llm * h * dtype; when the grids line up (one encoder stage, LLM pp = 1 or either
  dp = 1) it holds all of it (enc_dp <= dp_llm: nothing moves) or 1/f of it (f = enc_dp/dp_llm:
  it receives N(1 - 1/f) in f - 1 messages), else some rank receives N. Backward the encoder's
  last-stage ranks receive the gradient of their G/enc_dp samples (`colocated_traffic`).
Measured overheads (a `Profile` from `megatron-hetero profile`; absent from simulated profiles: 0):
  per run, building the run's samples `overheads["data"]` (x = samples * seq: every LLM stage, an
  encoder's first stage); per run of a module's last stage, its work outside the layers,
  `overheads["<kind>_io"]` at x = 6 * T * h * vocab / tp (LLM: embedding, output layer, loss) or 6 * T * (h_enc * h + h^2)
  / tp (encoder: patch embedding, projector), plus with TP `overheads["<kind>_io_tp"].b` all-reduces of
  the run's activation (T/cp * h * dtype) over the TP group; per stage and step, the optimizer step
  `overheads["optimizer"]` at x = parameters on the rank, and SNAPSHOTS[placement] resident-state
  snapshots `overheads["snapshot"]` (breakdown field `optimizer`); communication that closes a phase
  (gradient and loss all-reduces, pipeline p2p, boundaries) goes through `overheads["grad_sync"]`
  (t = a + b * the formula's time: ranks arrive as their own work ends) when measured. The step's
  once-per-step tail is that of the stage with the longest dp + optimizer time.
Shared execution units (`Profile.cores` > 0, e.g. ranks forked on one CPU machine; the profile's times
were measured with `Profile.concurrency` = W ranks busy at once, the units then delivering `cores`):
  work: the mean rank's busy time, sum over stages of ranks x (runs x stage cost + dp + optimizer),
  over the world, plus the whole-step terms (colocated boundary, offload); critical: the formulas
  above (the critical path at the profile's sharing). In uncontended units the step's work is
  D = work * cores and the critical path P = critical * min(1, cores / W); ranks that wait (pipeline
  fill and drain, a disjoint island idle while the other works) leave the units to the others, so
  on average k = min(W, D / P) ranks are runnable and the units deliver `Profile.cores_at(k)`
  (k up to the machine's `cpu_cores`, less per rank beyond: oversubscription costs switching):
    step = max(D / cores_at(k), P)                         (`shared_step`)
  With every rank always runnable (k = W) this is max(work, P).
  The breakdown then gives the mean rank's busy time per part and the rest of the step as bubble.
Not modelled (deliberately simple): overlap of TP/DP/p2p communication with compute, embedding and
output-layer FLOPs in simulated profiles (their parameters count for memory), grouped-query
attention, activation recomputation. Colocated memory adds the worst LLM stage and the worst encoder
stage (a rank may host both).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from megatron_hetero.planner.hardware import Profile
from megatron_hetero.planner.workload import Candidate, CostBreakdown, ModelSpec, Workload, check_candidate
from megatron_hetero.planner.cost_terms import (  # noqa: F401 (the terms are part of this module's API)
    _cp_eff,
    layer_parts,
    ep_dispatch_time,
    synced,
    p2p_time,
    state_bytes,
    act_bytes,
    dp_time,
    loss_reduce,
    disjoint_boundary,
    io_flops,
    io_allreduce,
    io_time,
    data_time,
    colocated_traffic,
    colocated_boundary,
    shared_step,
    sharing_scale,
)

#: resident-state snapshots per module per step (the runtimes report memory per phase / per step)
SNAPSHOTS = {"colocated": 3, "disjoint": 1, "homogeneous": 0}


# ---------------------------------------------------------------------------------------------
# The evaluator: pipeline stages of many candidates at once, as numpy arrays
# ---------------------------------------------------------------------------------------------
_PARTS = ("compute", "tp", "cp", "pp", "boundary")
_FIELDS = _PARTS + ("ranks", "runs", "dp", "opt", "state", "act")


@dataclass
class Stages:
    """The pipeline stages of N rows (candidates, or one side of them), grouped into K classes of
    equal stages: arrays (N, K). A module's evenly split stages fall into four classes (its first
    stage, the other stages with ceil(L/pp) layers, those with floor(L/pp), its last stage).

    count: stages in the class (0: absent); first: index of its first stage in the pipeline (the
    1F1B in-flight micro-batches of stage i of n are min(n - i, B)); compute/tp/cp/pp/boundary: one
    run (a micro-batch, or a colocated encoder's whole share); ranks: ranks running one stage;
    runs: per step; dp/opt: once per step (gradient all-reduce, optimizer step); state: bytes of
    weights, grads and optimizer state on a rank; act: activation bytes of one run."""

    count: np.ndarray
    first: np.ndarray
    compute: np.ndarray
    tp: np.ndarray
    cp: np.ndarray
    pp: np.ndarray
    boundary: np.ndarray
    ranks: np.ndarray
    runs: np.ndarray
    dp: np.ndarray
    opt: np.ndarray
    state: np.ndarray
    act: np.ndarray

    @property
    def cost(self) -> np.ndarray:
        return self.compute + self.tp + self.cp + self.pp + self.boundary

    @staticmethod
    def cat(*parts: "Stages") -> "Stages":
        return Stages(
            **{k: np.concatenate([getattr(p, k) for p in parts], axis=1) for k in ("count", "first") + _FIELDS}
        )


def _col(x, n: int) -> np.ndarray:
    return np.broadcast_to(np.asarray(x), (n,))[:, None]


def module_stages(
    prof: Profile,
    wl: Workload,
    spec: ModelSpec,
    tp,
    cp,
    pp,
    dp,
    layers,
    samples,
    *,
    runs,
    p2p,
    inter,
    placement: str,
    offset=0,
    embed_first=False,
    embed_last=False,
    io_last=False,
    data: str = "none",
    head: Optional[dict] = None,
    ep=1,
) -> Stages:
    """The four stage classes of a module (or LLM segment) of `layers` layers evenly split over `pp`
    stages (pp = 0: absent), each stage running `samples` samples per replica and run.

    embed_first / embed_last: the first / last stage holds an embedding's parameters; io_last: the
    last stage does the module's work outside its layers (`io_time`); data: which stages build the
    run's samples, "all" (language model), "first" (an encoder: the samples of its images) or
    "none"; p2p: whether stages exchange with a neighbour stage (over the inter-node link where
    `inter`); head: extra per-run costs / parameters / activations on the first stage (the encoder
    inside a homogeneous stage 0: keys compute, tp, cp, params, act). Arguments broadcast over rows.
    ep: the module's expert parallelism (a model with experts: expert parameters are split over ep
    instead of tp, and their gradients reduce over expert-DP = tp*cp*dp/ep)."""
    shape = np.broadcast(
        *(
            np.asarray(x)
            for x in (tp, cp, pp, dp, layers, samples, runs, p2p, inter, offset, embed_first, embed_last, io_last, ep)
        )
    ).shape
    n = int(np.prod(shape)) if shape else 1
    tp, cp, pp, dp, layers, samples, runs, ep = (_col(x, n) for x in (tp, cp, pp, dp, layers, samples, runs, ep))
    p2p, inter, offset = _col(p2p, n), _col(inter, n), _col(offset, n)
    embed_first, embed_last, io_last = _col(embed_first, n), _col(embed_last, n), _col(io_last, n)
    p = np.maximum(pp, 1)
    r = layers % p
    fl = layers // p
    ce = fl + (r > 0)
    multi = pp > 1
    count = np.hstack(
        [
            (pp >= 1).astype(int),
            np.maximum(r - 1, 0),
            np.where(multi, np.maximum(p - 1 - np.maximum(r, 1), 0), 0),
            multi.astype(int),
        ]
    )
    first = offset + np.hstack([np.zeros_like(p), np.ones_like(p), np.maximum(r, 1), p - 1])
    lam = np.hstack([ce, ce, fl, fl]).astype(float)
    is_first = np.array([True, False, False, False])[None, :]
    is_last = np.hstack([pp == 1, np.zeros((n, 2), bool), np.ones((n, 1), bool)])
    c, t, q = layer_parts(prof, wl, spec, samples, tp, cp, ep)
    compute = lam * c
    if data != "none":
        per = samples / wl.images_per_sample if data == "first" else samples
        compute = compute + data_time(prof, wl, per) * (is_first if data == "first" else 1.0)
    compute = compute + np.where(io_last & is_last, io_time(prof, wl, spec, samples, tp, cp), 0.0)
    tpc, cpc = lam * t, lam * q
    ppc = np.broadcast_to(np.where(p2p, p2p_time(prof, wl, spec, samples, cp, inter), 0.0), lam.shape)
    emb = float(spec.embedding_params)
    experts = float(spec.expert_layer_params)  # 0 for a dense model
    params = lam * (spec.layer_params - experts) + emb * (
        (embed_first & is_first).astype(float) + (embed_last & is_last)
    )
    act = act_bytes(wl, spec, samples, tp, cp, lam)
    if head is not None:
        compute = compute + is_first * np.asarray(head["compute"])[..., None]
        tpc = tpc + is_first * np.asarray(head["tp"])[..., None]
        cpc = cpc + is_first * np.asarray(head["cp"])[..., None]
        params = params + is_first * np.asarray(head["params"])[..., None]
        act = act + is_first * np.asarray(head["act"])[..., None]
    params = params / tp
    dpt, state = dp_time(prof, wl, params, tp, cp, dp), state_bytes(wl, params, dp * cp)
    if experts:  # this rank's experts: 1/ep of each layer's, reduced and sharded over expert-DP
        eparams = lam * experts / ep
        edp = tp * cp * dp // ep
        dpt = dpt + dp_time(prof, wl, eparams, ep, 1, edp)
        state = state + state_bytes(wl, eparams, edp)
        params = params + eparams
    opt = prof.overhead_time("optimizer", params) + SNAPSHOTS[placement] * prof.overhead_time("snapshot", params)
    shape = lam.shape
    return Stages(
        count=count,
        first=first,
        compute=compute,
        tp=np.broadcast_to(tpc, shape),
        cp=np.broadcast_to(cpc, shape),
        pp=ppc,
        boundary=np.zeros(shape),
        ranks=np.broadcast_to((tp * cp * dp).astype(float), shape),
        runs=np.broadcast_to(runs, shape),
        dp=dpt,
        opt=np.broadcast_to(opt, shape),
        state=state,
        act=act,
    )


@dataclass
class Side:
    """Aggregates of a pipeline's stages (or of one side: a disjoint encoder island, an LLM chain)
    for `b` runs per step: sum and max of the stage costs, the bottleneck's components, the stage
    with the longest once-per-step tail, and the busy time of all its ranks."""

    sum: np.ndarray
    max: np.ndarray
    parts: dict  # the bottleneck stage's per-run components
    tail: np.ndarray
    tail_dp: np.ndarray
    tail_opt: np.ndarray
    busy: dict  # sum over stages of count * ranks * runs * part, and of count * ranks * dp / opt
    work: np.ndarray  # sum of `busy`

    @classmethod
    def of(cls, st: Stages) -> "Side":
        valid = st.count > 0
        rows = np.arange(st.count.shape[0])
        cost = st.cost
        top = np.argmax(np.where(valid, cost, -np.inf), axis=1)  # the first of equal maxima, as stage order
        tail = st.dp + st.opt
        tt = np.argmax(np.where(valid, tail, -np.inf), axis=1)
        w = st.count * st.ranks
        busy = {k: (w * st.runs * getattr(st, k)).sum(axis=1) for k in _PARTS}
        busy["dp"], busy["opt"] = (w * st.dp).sum(axis=1), (w * st.opt).sum(axis=1)
        return cls(
            sum=(st.count * cost).sum(axis=1),
            max=cost[rows, top],
            parts={k: getattr(st, k)[rows, top] for k in _PARTS},
            tail=tail[rows, tt],
            tail_dp=st.dp[rows, tt],
            tail_opt=st.opt[rows, tt],
            busy=busy,
            work=sum(busy.values()),
        )

    def rows(self, idx, full: bool = True) -> "Side":
        """Rows `idx`; without `full`, only what the step time needs (no breakdown parts)."""
        pick = (lambda d: {k: v[idx] for k, v in d.items()}) if full else (lambda d: {})
        return Side(
            sum=self.sum[idx],
            max=self.max[idx],
            parts=pick(self.parts),
            tail=self.tail[idx],
            tail_dp=self.tail_dp[idx],
            tail_opt=self.tail_opt[idx],
            busy=pick(self.busy),
            work=self.work[idx],
        )


def peak_memory(st: Stages, n, b) -> np.ndarray:
    """Largest per-rank bytes of any stage: state + activations of min(n - i, b) in-flight runs."""
    flight = np.minimum(np.asarray(n)[..., None] - st.first, np.asarray(b)[..., None])
    return np.where(st.count > 0, st.state + st.act * flight, -np.inf).max(axis=1)


def _valid_max(st: Stages, x) -> np.ndarray:
    return np.where(st.count > 0, x, -np.inf).max(axis=1)


def finish(
    prof: Profile, world, b, pipe, parts: dict, tail_dp, tail_opt, busy: dict, step_boundary, offload, memory
) -> dict:
    """The breakdown arrays (`CostBreakdown` fields) of a critical path: the pipeline time `pipe`
    (bottleneck components `parts`, the rest is bubble), the slowest once-per-step tail, the loss
    all-reduce and the whole-step terms; on a profile whose ranks share execution units, the step
    is `shared_step` of it and the parts are the mean rank's busy time (`busy` / world) at the
    step's sharing (`sharing_scale`)."""
    loss = loss_reduce(prof, world)
    dp = tail_dp + loss
    crit = pipe + dp + tail_opt + step_boundary + offload
    out = {"memory_per_rank_peak": memory, "micro_batches": b, "offload": np.broadcast_to(offload, np.shape(crit))}
    if not prof.shared:
        out.update(
            compute=parts["compute"],
            tp_comm=parts["tp"],
            cp_comm=parts["cp"],
            pp_comm=parts["pp"],
            dp_comm=dp,
            boundary=parts["boundary"] + step_boundary,
            optimizer=tail_opt,
            bubble=pipe - sum(parts.values()),
            total=crit,
        )
        return out
    mean = {k: busy[k] / world for k in busy}
    work = sum(mean[k] for k in _PARTS) + mean["dp"] + loss + mean["opt"] + step_boundary + offload
    scale = sharing_scale(prof, work, crit)  # busy times at the step's sharing (fewer ranks runnable: less)
    mean = {k: v * scale for k, v in mean.items()}
    loss, step_boundary, offload = loss * scale, step_boundary * scale, offload * scale
    work = work * scale
    total = np.maximum(work, crit * prof.uncontended)  # = shared_step(prof, work before scaling, crit)
    out["offload"] = np.broadcast_to(offload, np.shape(total))
    out.update(
        compute=mean["compute"],
        tp_comm=mean["tp"],
        cp_comm=mean["cp"],
        pp_comm=mean["pp"],
        dp_comm=mean["dp"] + loss,
        boundary=mean["boundary"] + step_boundary,
        optimizer=mean["opt"],
        bubble=total - work,
        total=total,
    )
    return out


def _scaled(parts: dict, k) -> dict:
    return {name: v * k for name, v in parts.items()}


# --- homogeneous ------------------------------------------------------------------------------
def homogeneous(prof: Profile, wl: Workload, tp, cp, pp, dp, first_layers, ep=1) -> dict:
    """Breakdown arrays of homogeneous candidates: the encoder on the LLM's layout inside LLM
    stage 0, which holds `first_layers` LLM layers (pp = 1: all of them); the other LLM layers
    split evenly over the other stages."""
    enc, llm, m, k = wl.encoder, wl.llm, wl.micro_batch, wl.images_per_sample
    tp, cp, pp, dp, first_layers, ep = np.broadcast_arrays(*(np.asarray(x) for x in (tp, cp, pp, dp, first_layers, ep)))
    L = llm.num_layers
    l0 = np.where(pp == 1, L, first_layers)
    b = wl.global_batch // (m * dp)
    world = tp * cp * pp * dp
    inter = world > prof.devices_per_node
    ec, et, eq = layer_parts(prof, wl, enc, m * k, tp, cp)
    head = {
        "compute": enc.num_layers * ec + io_time(prof, wl, enc, m * k, tp, cp),
        "tp": enc.num_layers * et,
        "cp": enc.num_layers * eq,
        "params": np.broadcast_to(float(enc.total_params), tp.shape),
        "act": act_bytes(wl, enc, m * k, tp, cp, enc.num_layers),
    }
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
def colocated(prof: Profile, wl: Workload, tp, cp, pp, dp, etp, ecp, epp, edp, offload, ep=1) -> dict:
    """Breakdown arrays of colocated three-phase candidates (LLM tp/cp/pp/dp (and ep, with experts),
    encoder etp/ecp/epp/edp on the same ranks; `offload`: the encoder's state leaves the device
    during the LLM phase)."""
    enc, llm, G, k = wl.encoder, wl.llm, wl.global_batch, wl.images_per_sample
    tp, cp, pp, dp, etp, ecp, epp, edp, offload, ep = np.broadcast_arrays(
        *(np.asarray(x) for x in (tp, cp, pp, dp, etp, ecp, epp, edp, offload, ep))
    )
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
    be = G * k / edp  # images of the rank's encoder-DP share: one pass
    est = module_stages(
        prof,
        wl,
        enc,
        etp,
        ecp,
        epp,
        edp,
        enc.num_layers,
        be,
        runs=1,
        p2p=epp > 1,
        inter=inter,
        placement="colocated",
        io_last=True,
        data="first",
    )
    ls, es = Side.of(lst), Side.of(est)
    pipe = (ls.sum + (b - 1) * ls.max) + es.sum
    parts = {n: b * ls.parts[n] + es.parts[n] for n in _PARTS}
    busy = {n: ls.busy[n] + es.busy[n] for n in ls.busy}
    enc_state, enc_acts = _valid_max(est, est.state), _valid_max(est, est.act)
    mem = np.maximum(
        _valid_max(lst, lst.state) + enc_state + enc_acts,
        peak_memory(lst, pp, b) + enc_acts + np.where(offload, 0.0, enc_state),
    )
    bnd = colocated_boundary(prof, wl, etp, ecp, epp, edp, tp, cp, pp, dp)
    off = np.where(offload, 2.0 * enc_state / prof.host_bandwidth, 0.0)
    return finish(prof, world, b, pipe, parts, ls.tail_dp + es.tail_dp, ls.tail_opt + es.tail_opt, busy, bnd, off, mem)


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
        if i == 0:
            st.boundary[:, :1] = disjoint_boundary(prof, wl, M / dps, cp, world)[..., None]
        parts.append(st)
        offset = offset + pp
    st = Stages.cat(*parts)
    return Side.of(st), peak_memory(st, P, b)


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


# --- one candidate ----------------------------------------------------------------------------
def evaluate(c: Candidate, wl: Workload, prof: Profile) -> CostBreakdown:
    """Step time and per-rank memory peak of candidate `c` (formulas in the module docstring): the
    evaluator above with one row."""
    b = check_candidate(c, wl)
    e, s = c.encoder, c.llm[0]
    if c.placement == "homogeneous":
        out = homogeneous(prof, wl, s.tp, s.cp, s.pp, s.dp, c.first_stage_layers, s.ep)
    elif c.placement == "colocated":
        out = colocated(prof, wl, s.tp, s.cp, s.pp, s.dp, e.tp, e.cp, e.pp, e.dp, c.offload, s.ep)
    else:
        mb = wl.micro_batch * max(x.dp for x in c.llm)
        llm, llm_mem = llm_chain(prof, wl, [(x.tp, x.cp, x.pp, x.dp, x.layers, x.ep) for x in c.llm], c.world_size)
        enc, enc_mem = encoder_island(prof, wl, e.tp, e.cp, e.pp, e.dp, mb, sum(x.pp for x in c.llm))
        out = disjoint(prof, wl, enc, llm, c.world_size, b)
        out["memory_per_rank_peak"] = np.maximum(enc_mem, llm_mem)
    # each field gets its own type (int for micro_batches, float for the rest); mypy sees one union
    return CostBreakdown(
        **{
            k: (int if k == "micro_batches" else float)(np.asarray(out[k]).reshape(-1)[0])  # type: ignore[arg-type]
            for k in out
        }
    )

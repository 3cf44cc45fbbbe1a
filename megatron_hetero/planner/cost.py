"""Cost model: step time and per-rank memory of heterogeneous configurations. Pure (numpy only).

One evaluator: every formula below works on numpy arrays, one row per candidate; the search
(`planner/search.py`) scores whole candidate arrays with it and `evaluate(candidate, workload,
profile)` is the same code with one row. Its files: the terms (`planner/cost_terms.py`), a module's
pipeline stages (`planner/stages.py`), stages summed into a step (`planner/step.py`) and one function
per placement (`planner/placements.py`). A pipeline's stages are held as classes of equal stages
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
Several encoders (`Workload.extra_encoders`, e.g. a speech encoder beside the vision one; each
priced with the one-encoder terms on its own sequence, `Workload.encoder_views`):
- homogeneous: every encoder inside LLM stage 0, one after the other (their costs add up);
- colocated: each encoder's forward and backward pass on the same ranks, one after the other (their
  passes, gradient reductions, optimizer steps, state, kept activations, boundaries and offload add
  up);
- disjoint: each encoder on its own island, the islands in parallel, joined at the LLM's first
  stage, which receives every encoder's boundary: the pipeline's fill is the longest island's,
  the bottleneck the most expensive stage of any island or segment:
    t_pipe = max_e E_sum(e) + LLM_sum + (B-1) * max(max_e E_max(e), LLM_max).
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
  With every rank always runnable (k = W) this is max(work, P). A colocated layout's encoder passes run
  alone (every rank waits at the boundary; a pipelined encoder works one stage at a time): they are
  priced as their own phase with this formula, and the rest of the step after them (`step.finish`).
  The breakdown then gives the mean rank's busy time per part and the rest of the step as bubble.
Not modelled (deliberately simple): overlap of TP/DP/p2p communication with compute, embedding and
output-layer FLOPs in simulated profiles (their parameters count for memory), grouped-query
attention, activation recomputation. Colocated memory adds the worst LLM stage and the worst encoder
stage (a rank may host both).
"""

from __future__ import annotations

import numpy as np

from megatron_hetero.planner.hardware import Profile
from megatron_hetero.planner.workload import Candidate, CostBreakdown, Workload, check_candidate
from megatron_hetero.planner.placements import homogeneous, colocated, encoder_islands, llm_chain, disjoint


# --- one candidate ----------------------------------------------------------------------------
def evaluate(c: Candidate, wl: Workload, prof: Profile) -> CostBreakdown:
    """Step time and per-rank memory peak of candidate `c` (formulas in the module docstring): the
    evaluator (`planner/placements.py`) with one row."""
    b = check_candidate(c, wl)
    e, s = c.encoder, c.llm[0]
    if c.placement == "homogeneous":
        out = homogeneous(prof, wl, s.tp, s.cp, s.pp, s.dp, c.first_stage_layers, s.ep)
    elif c.placement == "colocated":
        extra = tuple((x.tp, x.cp, x.pp, x.dp) for x in c.extra_encoders)
        out = colocated(prof, wl, s.tp, s.cp, s.pp, s.dp, e.tp, e.cp, e.pp, e.dp, c.offload, s.ep, extra)
    else:
        mb = wl.micro_batch * max(x.dp for x in c.llm)
        llm, llm_mem = llm_chain(prof, wl, [(x.tp, x.cp, x.pp, x.dp, x.layers, x.ep) for x in c.llm], c.world_size)
        degrees = [(x.tp, x.cp, x.pp, x.dp) for x in c.encoders]
        enc, enc_mem = encoder_islands(prof, wl, degrees, mb, sum(x.pp for x in c.llm))
        out = disjoint(prof, wl, enc, llm, c.world_size, b)
        out["memory_per_rank_peak"] = np.maximum(enc_mem, llm_mem)
    # each field gets its own type (int for micro_batches, float for the rest); mypy sees one union
    return CostBreakdown(
        **{
            k: (int if k == "micro_batches" else float)(np.asarray(out[k]).reshape(-1)[0])  # type: ignore[arg-type]
            for k in out
        }
    )

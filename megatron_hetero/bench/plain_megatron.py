"""The plugin's overhead: a homogeneous layout through our colocated schedule against the same model
run by Megatron-core's own `get_forward_backward_func`, step by step in the same processes.

Every rank builds the model three times from the same seed (`ModuleState` sets: Megatron DDP wrappers
and optimizers; identical initial weights), one trained by our `ColocatedSchedule`, the other by
`plain_step`: per micro-batch, one `forward_step` that runs the encoder on the micro-batch's features
and the language model on its tokens with the encoder's tokens spliced in (the model code of
`models/`, as any Megatron user's forward_step calls its model), Megatron-core's forward-backward
function over the micro-batches, then Megatron's `DistributedDataParallel.finish_grad_sync` and
`MegatronOptimizer.step` per module, and one all-reduce of the loss. No plugin runtime code (plans,
schedule tables, boundaries, traces, memory snapshots) runs in that step. Two plain variants: the
encoder per micro-batch inside forward_step (`megatron`, as Megatron-LM's LLaVA runs it), and the
encoder once per step over the rank's share before the forward-backward function and its backward
once after (`megatron_batched`: the batching of our colocated schedule, so only the plugin's own code
differs). The three alternate step by step (the order rotated every step), so all see the machine in
the same periods; the first step of each is dropped. Also reported: the CPU time of a step summed
over the ranks (the work each does; less disturbed than wall time by other processes on the cores).
All three train on the same samples, so their losses must agree step for step (the encoder per
micro-batch or once per step: the same arithmetic, different batching).

Only layouts without pipeline parallelism (pp = 1) and with every module on the same degrees: the
encoder would otherwise need a place in Megatron's pipeline, which is what the plugin adds.

Wire: DDP's gradient all-reduce per module over its DP x CP group, Megatron's TP collectives inside the
model, one float64 all-reduce of the loss over the world per step (as ours).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from megatron_hetero.compat import default_backend, require_compat
from megatron_hetero.runtime.launcher import run_ranks


#: ours; Megatron-core with the encoder per micro-batch (as Megatron-LM's LLaVA runs it); Megatron-core
#: with the encoder once per step over the rank's share (the same batching as ours: plugin code only differs)
MODES = ("ours", "megatron", "megatron_batched")


def check_layout(layout) -> None:
    """ValueError unless `layout` is colocated, pp = 1 and every module on the same degrees."""
    degrees = {(m.tp, m.cp, m.pp, m.dp) for m in layout.modules}
    if layout.placement != "colocated" or len(degrees) != 1 or layout.modules[0].pp != 1:
        raise ValueError(
            "the plain Megatron-core baseline runs a homogeneous colocated layout with pp = 1; got "
            + ", ".join(f"{m.name} {m.short()}" for m in layout.modules)
        )


def plain_step(step: int, job, states, runner, forward_backward, batched: bool = False) -> float:
    """One training step of the validated `job` (`config.job.Job`: its homogeneous layout and
    config) with Megatron-core's schedule (module docstring); returns the global per-token loss (the
    same on every rank). batched: the encoder runs once over the rank's whole share before the
    forward-backward function (its output a leaf whose gradient the micro-batches accumulate) and
    backward once after it, as our colocated schedule batches it."""
    from megatron_hetero.plan.batch import micro_batching

    config = job.config
    spec = config.spec
    (enc_name,) = tuple(spec.encoders)
    lang_name = next(m.name for m in job.layout.modules if m.name not in spec.encoders)
    lang = states[lang_name]
    G, mbs = config.global_batch_size, config.micro_batch_size
    dp, dp_rank = lang.pgs.dp.size(), lang.pgs.dp.rank()
    share = G // dp
    count = share // mbs
    micro_batching(G, dp, mbs)  # the same arithmetic check as the runtime's
    first = step * G + dp_rank * share
    loss_tokens = runner.loss_tokens(step)
    for s in states.values():
        s.ddp.zero_grad_buffer()
        s.optimizer.zero_grad()
    config = lang.module.config
    config.grad_scale_func = lambda t: t / loss_tokens  # per-token loss over the global token count
    sums: list[torch.Tensor] = []
    enc_out = leaf = None
    if batched:
        enc_out = runner.forward(enc_name, range(first, first + share), {}, None)
        leaf = enc_out.detach().requires_grad_(True)

    def forward_step(data_iterator, model):
        i = next(data_iterator)
        samples = range(first + i * mbs, first + (i + 1) * mbs)
        if leaf is not None:
            tokens = leaf[i * mbs : (i + 1) * mbs]
        else:
            tokens = runner.forward(enc_name, samples, {}, None)  # [rows, n, hidden] (projector output)
        out = runner.forward(lang_name, samples, {enc_name: tokens}, None)

        def loss_func(loss_sum):
            sums.append(loss_sum.detach())
            return loss_sum, out.tokens, {}

        return out.loss_sum, loss_func

    forward_backward(
        forward_step_func=forward_step,
        data_iterator=iter(range(count)),
        model=[lang.model],
        num_microbatches=count,
        seq_length=spec.seq_length,
        micro_batch_size=mbs,
        forward_only=False,
        pg_collection=lang.pgs,
    )
    config.grad_scale_func = None
    if leaf is not None:
        torch.autograd.backward(enc_out, leaf.grad if leaf.grad is not None else torch.zeros_like(leaf))
    for s in states.values():
        s.ddp.finish_grad_sync()
    for s in states.values():
        ok, _, _ = s.optimizer.step()
        if not ok:
            raise RuntimeError(f"plain Megatron step {step}: optimizer step of {s.name} skipped")
    total = torch.zeros(1, dtype=torch.float64)
    if lang.pgs.tp.rank() == 0:
        for t in sums:
            total += t.to(total)
    dist.all_reduce(total)
    return float(total.item()) / loss_tokens


def _rank(validated, steps: int) -> dict[str, Any]:
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

    from megatron_hetero.models.llava_runner import LlavaStageRunner
    from megatron_hetero.training.setup import build_states
    from megatron_hetero.training.trainer import prepare_rank, train_session

    job = validated.config
    prepare_rank(job)
    session = train_session(validated, log=None)  # ours: the session `train` builds, its schedule only
    try:
        plan, topo, ours = session.plan, session.topo, session.schedule
        plain = {}
        for mode in MODES[1:]:
            st = build_states(plan, job, topo)
            plain[mode] = (st, LlavaStageRunner(job.spec, plan, st))
        fb = get_forward_backward_func(pp_size=1, vp_size=None)
        times: dict[str, list[float]] = {m: [] for m in MODES}
        cpu: dict[str, list[float]] = {m: [] for m in MODES}
        losses: dict[str, list[float]] = {m: [] for m in MODES}
        for k in range(steps):
            for j in range(len(MODES)):
                mode = MODES[(k + j) % len(MODES)]  # the order rotates every step
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                if mode == "ours":
                    loss = ours.step(k).loss
                else:
                    st, runner = plain[mode]
                    loss = plain_step(k, validated, st, runner, fb, batched=mode == "megatron_batched")
                times[mode].append(time.perf_counter() - t0)
                cpu[mode].append(time.process_time() - c0)
                losses[mode].append(loss)
        dist.barrier()
        return {"times": times, "cpu": cpu, "losses": losses}
    finally:
        session.destroy()


def measure(job, steps: int = 10, timeout: float = 900.0) -> dict[str, Any]:
    """`steps` steps of each mode of the validated `job` (`config.job.Job`; its layout as
    `check_layout` asks), after one dropped warm-up step each, alternated; the step time of a step is
    the slowest rank's. Returns the medians, ours over each plain variant (ratio of the medians, and
    the median of the per-step ratios) and the losses."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    check_layout(job.layout)
    require_compat("bench.plain_megatron.measure")
    per_rank = run_ranks(job.layout.world_size, _rank, job, steps + 1, timeout=timeout, backend=default_backend())
    step = {m: [max(r["times"][m][i] for r in per_rank) for i in range(steps + 1)][1:] for m in MODES}
    med = {m: float(statistics.median(v)) for m, v in step.items()}
    # CPU time summed over the ranks: the work each mode does, less disturbed by other processes
    cpu = {m: [sum(r["cpu"][m][i] for r in per_rank) for i in range(steps + 1)][1:] for m in MODES}
    cpu_med = {m: float(statistics.median(v)) for m, v in cpu.items()}
    losses = per_rank[0]["losses"]
    diff = max(abs(a - b) / max(abs(b), 1e-30) for m in MODES[1:] for a, b in zip(losses["ours"], losses[m]))
    return {
        "steps": steps,
        "step_time_s": med,
        "steps_s": step,
        "overhead_vs_megatron": med["ours"] / med["megatron"],
        "overhead_vs_megatron_batched": med["ours"] / med["megatron_batched"],
        "cpu_time_s": cpu_med,
        "cpu_overhead_vs_megatron_batched": cpu_med["ours"] / cpu_med["megatron_batched"],
        "step_ratio_medians": {
            m: float(statistics.median(o / p for o, p in zip(step["ours"], step[m]))) for m in MODES[1:]
        },
        "losses": losses,
        "loss_max_rel_diff": diff,
    }

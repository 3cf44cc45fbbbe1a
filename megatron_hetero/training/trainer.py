"""The training loop of one rank, for colocated and disjoint layouts alike."""
from __future__ import annotations

import os
import time
from typing import Any

import torch.distributed as dist

from megatron_hetero.compat import ensure_global_memory_buffer, set_local_device
from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.models.llava_runner import LlavaStageRunner
from megatron_hetero.plan.rank_plan import RankPlan, rank_plan
from megatron_hetero.runtime.topology import Topology
from megatron_hetero.training.setup import JobConfig, build_states


def prepare_rank(job: JobConfig) -> None:
    """Per-process state Megatron-core needs before models are built: the device, the attention
    score buffer and the RNG tracker (dropout is 0, so the tracker's streams are never drawn)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    set_local_device(int(os.environ.get("LOCAL_RANK", "0")))  # GPU: one device per rank; CPU: no-op
    ensure_global_memory_buffer()
    model_parallel_cuda_manual_seed(job.spec.seed, tp_rank=0, ep_rank=0, etp_rank=0)


def make_schedule(plan: RankPlan, job: JobConfig, topo, states, runner=None):
    """The schedule of the plan's placement, driving `runner` (the LLaVA runner by default)."""
    runner = runner if runner is not None else LlavaStageRunner(job.spec, plan, states)
    if plan.layout.placement == "colocated":
        from megatron_hetero.runtime.colocated import ColocatedSchedule

        return ColocatedSchedule(plan, job.runtime_config(), topo, states, runner)
    from megatron_hetero.runtime.disjoint import DisjointSchedule

    return DisjointSchedule(plan, job.runtime_config(), topo, states, runner)


def train_rank(layout: HeteroLayout, job: JobConfig, collect_params: bool = False) -> dict[str, Any]:
    """Run `job.train_iters` steps on this rank; returns per-step records (loss is global, the same
    on every rank) and, if asked, this rank's parameters by module (for parity tests)."""
    prepare_rank(job)
    topo = Topology.build(layout, timeout_s=job.comm_timeout_s)
    try:
        plan = rank_plan(layout, topo.rank, job.global_batch_size, job.micro_batch_size, job.offload_encoder)
        states = build_states(layout, job, topo)
        schedule = make_schedule(plan, job, topo, states)
        records = []
        for it in range(job.train_iters):
            dist.barrier()
            t0 = time.perf_counter()
            res = schedule.step(it)
            records.append({"iteration": it + 1, "loss": res.loss, "step_time_s": time.perf_counter() - t0,
                            "memory": res.memory, "loss_parts": res.loss_parts,
                            "aux_loss": getattr(res, "aux_loss", None)})
        out: dict[str, Any] = {"records": records}
        if collect_params:
            out["params"] = {n: {k: p.detach().cpu().clone() for k, p in s.module.named_parameters()}
                             for n, s in states.items()}
            out["coords"] = {n: topo.coord(n).as_dict() for n in states}
        return out
    finally:
        topo.destroy()

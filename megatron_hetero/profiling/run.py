"""`megatron-hetero profile` on the local host: the kernels that build the model's own layers and
modules (`_rank_layers`, `_rank_modules`), the measurement run on forked ranks (`measure`) and
`run_profile` (measure, fit with `planner/profile_fit.py`, write the JSON). The model-free kernels
and the load detection are `profiling/kernels.py`.

Layers (`_rank_layers`): for each module kind of the LLaVA model (`llm`: the language model's causal
GPT layer with the context-parallel attention of `compat`; `encoder`: the encoder's bidirectional
layer), a Megatron `TransformerBlock` of `LAYERS_PER_BLOCK` layers is built on the fly with the
model's own `models.llava.transformer_config` on a grid TP x CP x DP = world (every DP replica runs
the same block concurrently); forward + backward of one micro-batch `[seq/cp, batch, hidden]`,
divided by the layer count. Grid: tokens (batch x seq), hidden size, TP and CP (CP for `llm` only:
encoders run with cp = 1). One case is also timed with a single busy rank (`solo_layer`).

Modules (`_rank_modules`): the model's own `LanguageModule` / `EncoderModule` with one layer, in its
DDP wrapper and with its optimizer (`ModuleState`), TP1 and the grid's largest TP: forward +
backward of a micro-batch as the schedules run it (the LLM builds its batch from the synthetic
data, embeds it and computes the loss), the optimizer step + zero_grad, one resident-state
snapshot, and DDP's gradient all-reduce right after a backward pass.

On a machine shared with other jobs, `measure` retries a round that another process disturbed
(`profiling.kernels.undisturbed`) and, with `rounds` > 1, keeps each case's fastest round.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_hetero.planner.hardware import Profile
from megatron_hetero.planner.profile_fit import (
    ProfileGrid,
    collective_cases,
    combine_rounds,
    fit_profile,
    layer_cases,
    module_cases,
    profile_document,
    slowest_median,
    solo_layer_case,
)
from megatron_hetero.profiling.kernels import (
    rank_collectives,
    rank_host_bandwidth,
    rank_memory,
    timed,
    undisturbed,
    wait_quiet,
)
from megatron_hetero.compat import default_backend, ensure_global_memory_buffer, require_compat, set_local_device
from megatron_hetero.compat.device import get_device, synchronize
from megatron_hetero.data import samples as data_mod
from megatron_hetero.layout.spec import HeteroLayout, ModuleLayout
from megatron_hetero.layout.validate import resolve_layout
from megatron_hetero.config.optim import OptimConfig
from megatron_hetero.runtime.launcher import run_ranks

#: Layers per timed block (the per-layer time is the block time / this).
LAYERS_PER_BLOCK = 2


def _rank_layers(
    cases: list[dict],
    iters: int,
    warmup: int,
    reps: int,
    dtype: torch.dtype = torch.float32,
    impl: str = "local",
) -> tuple[list[list[float]], list[float]]:
    """Per-layer forward + backward times of `cases` (and the solo case's). `dtype`: the layers'
    parameters and activations (bf16 sets Megatron's bf16 too); `impl`: --transformer-impl's layer
    spec (`models.layer_specs`); a case's optional `gated`: a swiglu MLP."""
    import torch.nn.functional as F
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_hetero.models.layer_specs import (
        encoder_layer_spec,
        get_gpt_layer_local_spec_with_cp,
        language_layer_spec,
    )
    from megatron_hetero.models.llava import transformer_config
    from megatron_hetero.runtime.topology import Topology

    world = dist.get_world_size()
    device = get_device()
    ensure_global_memory_buffer()
    model_parallel_cuda_manual_seed(1234, tp_rank=0, ep_rank=0, etp_rank=0)
    out: list[list[float]] = [[] for _ in cases]
    solo: list[float] = []
    solo_case = solo_layer_case(cases)
    by_grid: dict[tuple[int, int], list[int]] = {}
    for i, c in enumerate(cases):
        by_grid.setdefault((c["tp"], c["cp"]), []).append(i)
    for (tp, cp), idx in by_grid.items():  # one set of groups per (tp, cp)
        m = ModuleLayout(name="profile", tp=tp, cp=cp, dp=world // (tp * cp))
        layout = resolve_layout(HeteroLayout(placement="colocated", modules=(m,), edges=()), world)
        topo = Topology.build(layout)
        try:
            pgs = topo.pg_collection("profile")
            for i in idx:
                c = cases[i]
                extra: dict[str, Any] = {"bf16": True} if dtype == torch.bfloat16 else {}
                if c.get("gated"):
                    extra.update(gated_linear_unit=True, activation_func=F.silu)
                config = transformer_config(
                    num_layers=LAYERS_PER_BLOCK,
                    hidden=c["hidden"],
                    heads=c["heads"],
                    ffn=c["ffn_hidden"],
                    m=layout.module("profile"),
                    dtype=dtype,
                    **extra,
                )
                if c["kind"] == "llm":
                    spec = (
                        get_gpt_layer_local_spec_with_cp() if impl == "local" else language_layer_spec(impl, None, "")
                    )
                else:
                    spec = encoder_layer_spec(impl)
                block = TransformerBlock(
                    config, spec, post_layer_norm=False, pre_process=True, post_process=False, pg_collection=pgs
                ).to(device)
                x = torch.randn(c["seq"] // cp, c["batch"], c["hidden"], device=device, dtype=dtype)
                g = torch.randn_like(x)

                def step() -> None:
                    xi = x.clone().requires_grad_(True)
                    y = block(xi, attention_mask=None)  # noqa: F821 (`del block` below)
                    y.backward(g)
                    synchronize(device)

                out[i] = [t / LAYERS_PER_BLOCK for t in timed(step, iters, warmup, reps)]
                if i == solo_case:  # the same layer with one busy rank (the others wait at a barrier)
                    solo = [
                        t / LAYERS_PER_BLOCK
                        for t in timed(lambda: step() if dist.get_rank() == 0 else None, iters, warmup, reps)
                    ]
                del block
        finally:
            topo.destroy()
    return out, solo


def _rank_modules(cases: list[dict], iters: int, warmup: int, reps: int) -> list[dict]:
    """Whole one-layer modules of the LLaVA model (data + embedding + layer + output layer + loss for
    `llm`; patch embedding + layer + projector for `encoder`) forward + backward through their DDP
    wrapper, and the module's optimizer step (+ zero_grad), on a grid TP x DP = world."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hetero.models.llava import EncoderModule, EncoderSpec, LanguageModule, LlavaSpec, data_config
    from megatron_hetero.runtime.module_state import ModuleState
    from megatron_hetero.runtime.topology import Topology

    world = dist.get_world_size()
    device = get_device()
    ensure_global_memory_buffer()
    model_parallel_cuda_manual_seed(1234, tp_rank=0, ep_rank=0, etp_rank=0)
    out: list[dict] = [{} for _ in cases]
    by_tp: dict[int, list[int]] = {}
    for i, c in enumerate(cases):
        by_tp.setdefault(c["tp"], []).append(i)
    for tp, idx in by_tp.items():
        names = ("language", "vision")
        mods = tuple(ModuleLayout(name=n, tp=tp, dp=world // tp) for n in names)
        layout = resolve_layout(HeteroLayout(placement="colocated", modules=mods, edges=()), world)
        topo = Topology.build(layout)
        try:
            for i in idx:
                c = cases[i]
                name = "language" if c["kind"] == "llm" else "vision"
                m, pgs = layout.module(name), topo.pg_collection(name)
                if c["kind"] == "llm":
                    spec = LlavaSpec(
                        num_layers=1,
                        hidden_size=c["hidden"],
                        num_attention_heads=c["heads"],
                        vocab_size=c["vocab"],
                        seq_length=c["seq"],
                        encoders={},
                    )
                    module = LanguageModule(name, spec, m, pgs, first_segment=True, last_segment=True).to(device)
                    dcfg = data_config(spec)
                else:
                    enc = EncoderSpec(
                        num_layers=1,
                        hidden_size=c["hidden"],
                        num_attention_heads=c["heads"],
                        tokens=c["seq"],
                        feature_dim=24,
                        offset=1,
                    )
                    module = EncoderModule(name, enc, c["llm_hidden"], m, pgs, seed=1234).to(device)
                    feats = torch.randn(c["batch"], c["seq"], 24, device=device)
                    gout = torch.randn(c["batch"], c["seq"], c["llm_hidden"], device=device)
                state = ModuleState(name, module, pgs, OptimConfig())

                def fwd_bwd(c=c, state=state, module=module) -> None:
                    if c["kind"] == "llm":
                        b = data_mod.batch(dcfg, 0, c["batch"])
                        hidden = module.embed(b["tokens"].to(device), {})
                        per_token = state.model(hidden, b["labels"].to(device))
                        (per_token * b["loss_mask"].to(device)).sum().backward()
                    else:
                        state.model(feats).backward(gout)
                    synchronize(device)

                def opt(state=state) -> None:
                    state.step()
                    state.zero_grad()
                    synchronize(device)

                t_mod = timed(fwd_bwd, iters, warmup, reps)
                t_opt = timed(opt, iters, 1, reps)  # the step's cost does not depend on the gradient values
                t_snap = timed(state.resident_bytes, iters, 1, reps)
                # a rank builds its micro-batch from the synthetic data (every pipeline stage does)
                t_data = timed(
                    lambda c=c: data_mod.batch(data_mod.DataConfig(seq_length=c["seq"], vocab_size=128), 0, c["batch"]),
                    iters,
                    1,
                    reps,
                )

                def fwd_bwd_sync(state=state) -> None:  # DDP's gradient all-reduce, as a step runs it:
                    fwd_bwd()  # after the backward pass (the ranks arrive as their compute ends)
                    state.finalize_grads()
                    state.zero_grad()

                def fwd_bwd_zero(state=state) -> None:
                    fwd_bwd()
                    state.zero_grad()

                t_fbs = timed(fwd_bwd_sync, iters, 1, reps)
                t_fbz = timed(fwd_bwd_zero, iters, 1, reps)
                t_sync = [max(0.0, a - b) for a, b in zip(sorted(t_fbs), sorted(t_fbz))]
                out[i] = {
                    "module": t_mod,
                    "optimizer": t_opt,
                    "snapshot": t_snap,
                    "grad_sync": t_sync,
                    "data": t_data,
                    "params": int(sum(p.numel() for p in module.parameters())),
                }
                del state, module
        finally:
            topo.destroy()
    return out


def _rank_main(
    lcases: list[dict], mcases: list[dict], ccases: list[dict], iters: int, warmup: int, reps: int
) -> dict[str, Any]:
    set_local_device(int(os.environ.get("LOCAL_RANK", "0")))
    layers, solo = _rank_layers(lcases, iters, warmup, reps)
    return {
        "layers": layers,
        "solo": solo,
        "modules": _rank_modules(mcases, iters, warmup, reps),
        "collectives": rank_collectives(ccases, iters, warmup, reps),
        "host_bandwidth": rank_host_bandwidth(),
        "memory_bytes": rank_memory(dist.get_world_size()),
    }


def measure(
    world_size: int,
    grid: ProfileGrid = ProfileGrid(),
    timeout: float = 1200.0,
    rounds: int = 1,
    quiet_wait_s: float = 10.0,
    tries: int = 3,
) -> dict[str, Any]:
    """Run the measurements on `world_size` forked ranks; returns the raw measurement document.

    rounds > 1 repeats the whole measurement and keeps, per case, the round with the least time
    (another process on a shared machine only ever adds time)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    docs = []
    for _ in range(rounds):
        docs.append(undisturbed(lambda: _measure_once(world_size, grid, timeout, quiet_wait_s), tries, quiet_wait_s)[0])
    return combine_rounds(docs)


def cpu_cores() -> int:
    """Execution units this process (and the ranks it forks) may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _measure_once(world_size: int, grid: ProfileGrid, timeout: float, quiet_wait_s: float) -> dict[str, Any]:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"--world-size must be an integer >= 2 (collectives need two ranks), got {world_size!r}")
    if grid.iters < 1 or grid.reps < 1 or grid.warmup < 0:
        raise ValueError(
            f"profile grid: iters and reps must be >= 1 and warmup >= 0, got {grid.iters}, {grid.reps}, {grid.warmup}"
        )
    lcases, ccases = layer_cases(grid, world_size), collective_cases(grid, world_size)
    mcases = module_cases(grid, world_size)
    if not any(c["tp"] == 1 and c["cp"] == 1 for c in lcases):
        raise ValueError("profile grid: the layer fit needs TP1·CP1 shapes")
    require_compat("training.profile._measure_once")
    backend = default_backend()
    load = wait_quiet(quiet_wait_s)
    t0 = time.perf_counter()
    per_rank = run_ranks(
        world_size,
        _rank_main,
        lcases,
        mcases,
        ccases,
        grid.iters,
        grid.warmup,
        grid.reps,
        timeout=timeout,
        backend=backend,
    )
    layers = [dict(c, seconds=slowest_median([r["layers"][i] for r in per_rank])) for i, c in enumerate(lcases)]
    modules = [
        dict(
            c,
            seconds=slowest_median([r["modules"][i]["module"] for r in per_rank]),
            optimizer_seconds=slowest_median([r["modules"][i]["optimizer"] for r in per_rank]),
            snapshot_seconds=slowest_median([r["modules"][i]["snapshot"] for r in per_rank]),
            grad_sync_seconds=slowest_median([r["modules"][i]["grad_sync"] for r in per_rank]),
            data_seconds=slowest_median([r["modules"][i]["data"] for r in per_rank]),
            dp=world_size // c["tp"],
            params=max(r["modules"][i]["params"] for r in per_rank),
        )
        for i, c in enumerate(mcases)
    ]
    colls = [dict(c, seconds=slowest_median([r["collectives"][i] for r in per_rank])) for i, c in enumerate(ccases)]
    host = min(r["host_bandwidth"] for r in per_rank)
    memory = min(r["memory_bytes"] for r in per_rank)
    solo = dict(lcases[solo_layer_case(lcases)], seconds=float(statistics.median(per_rank[0]["solo"])))
    return {
        "world_size": world_size,
        "backend": backend,
        "grid": grid.to_dict(),
        "layers": layers,
        "solo_layer": solo,
        "modules": modules,
        "collectives": colls,
        "host_bandwidth": host,
        "memory_bytes": memory,
        "seconds": time.perf_counter() - t0,
        "external_load": load,
        "cpu_cores": cpu_cores(),
    }


def run_profile(
    world_size: int,
    grid: ProfileGrid = ProfileGrid(),
    out=None,
    memory_bytes: Optional[float] = None,
    rounds: int = 1,
    quiet_wait_s: float = 10.0,
    tries: int = 3,
) -> tuple[Profile, dict[str, Any]]:
    """Measure, fit, and (if `out`) write the profile JSON. Returns (Profile, document)."""
    raw = measure(world_size, grid, rounds=rounds, quiet_wait_s=quiet_wait_s, tries=tries)
    prof = fit_profile(raw, memory_bytes)
    doc = profile_document(raw, prof)
    if out is not None:
        from pathlib import Path
        import json

        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1) + "\n")
    return prof, doc

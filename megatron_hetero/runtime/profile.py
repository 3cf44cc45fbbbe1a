"""Measure the cost profile of this machine: transformer-layer, module and collective times, fitted
into a `plan.cost.Profile` (written as JSON by `megatron-hetero profile`).

Everything is measured on `world_size` forked ranks (`runtime.launcher.run_ranks`, gloo on CPU,
NCCL on GPU) *all working at the same time*, as in a training step: on a machine where ranks share
cores (CPU), a layer measured alone is several times faster than the same layer while the other
ranks compute too, so every measurement keeps every rank busy with the same work, and a profile
is specific to its world size there. Each sample runs `reps` calls back to back between two
barriers (the ops of a step follow each other too) and is divided by `reps`; a case's time is the
median over `iters` samples (after `warmup` calls) of the slowest rank.

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

Collectives (`_rank_collectives`): all-reduce, all-gather, broadcast (and reduce-scatter if asked)
over groups of n consecutive ranks (every group of the partition of the world runs the same
collective at the same time) and send/recv between rank pairs, for each message size.

Fit (`fit_profile`), all from the measurements of this run (least squares, a, b >= 0):
  * per module kind, `LayerModel` t = a + b * flops_per_rank on the TP1·CP1 layers (the layer
    compute of the cost model);
  * per collective and group size (link `intra`): `AlphaBeta` t = alpha + bytes * beta, which
    overrides the ring formula at that size; the link's per-hop alpha/beta from send/recv;
  * `layer_collectives`: the TP all-reduce and CP all-gather as they cost inside a layer, from the
    measured TP>1 and CP>1 layers minus the layer compute model;
  * `overheads`: `data` (building a micro-batch of synthetic samples, against its tokens),
    `<kind>_io` (module minus its layer model and data: embedding, output layer, loss / patch
    embedding, projector) against the output-layer / projector FLOPs, `<kind>_io_tp` (what
    TP adds, in activation all-reduces over the TP group), `optimizer`, `snapshot` (against the
    parameters on the rank), `grad_sync` (DDP's gradient all-reduce against the all-reduce model);
  * gloo (ranks share the CPU): `cores` = world * t(one busy rank) / t(all ranks busy) of the solo
    layer case, `concurrency` = world (see `plan.cost.shared_step`).
The residuals of the layer model against every measured layer (TP/CP included) are reported in
the JSON (`checks`). The profile JSON is `Profile.to_dict()` plus `world_size`, `backend`, `grid`
and the raw `measurements`; `Profile.load` reads it.

On a machine shared with other jobs, `measure` retries a round that another process disturbed
(`ExternalLoad`, `undisturbed`) and, with `rounds` > 1, keeps each case's fastest round.
"""
from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_hetero.plan import cost as C

#: Layers per timed block (the per-layer time is the block time / this).
LAYERS_PER_BLOCK = 2
KINDS = ("llm", "encoder")


@dataclass(frozen=True)
class ProfileGrid:
    """What to measure. `layer_shapes`: (hidden, heads, seq, batch) per kind; `tp`/`cp`: degrees
    (kept where they divide the world and the heads); `sizes`: collective message bytes."""

    layer_shapes: dict = field(default_factory=lambda: {
        "llm": ((64, 4, 32, 1), (64, 4, 32, 4), (128, 4, 64, 2), (256, 8, 128, 2)),
        "encoder": ((32, 4, 8, 1), (32, 4, 8, 8), (64, 4, 16, 4), (128, 4, 32, 4)),
    })
    #: whole modules of the LLaVA model with one layer (per-micro-batch parts outside the layers:
    #: data, embedding, output layer and loss / patch embedding and projector; and the optimizer step):
    #: kind -> (hidden, heads, seq, batch, vocab or llm hidden)
    module_shapes: dict = field(default_factory=lambda: {
        "llm": ((64, 4, 32, 2, 128), (128, 4, 64, 2, 512), (256, 8, 128, 2, 1024)),
        "encoder": ((32, 4, 8, 2, 64), (64, 4, 16, 4, 128), (128, 4, 32, 4, 256)),
    })
    tp: tuple = (1, 2, 4)
    cp: tuple = (1, 2)
    sizes: tuple = (1 << 10, 1 << 14, 1 << 18, 1 << 21)
    collectives: tuple = ("all_reduce", "all_gather", "broadcast", "send_recv")
    iters: int = 5
    warmup: int = 2
    reps: int = 6

    @classmethod
    def quick(cls) -> "ProfileGrid":
        return cls(layer_shapes={"llm": ((64, 4, 32, 1), (128, 4, 64, 2)), "encoder": ((32, 4, 8, 1), (64, 4, 16, 4))},
                   module_shapes={"llm": ((64, 4, 32, 2, 128), (128, 4, 64, 2, 512)),
                                  "encoder": ((32, 4, 8, 2, 64), (64, 4, 16, 4, 128))},
                   tp=(1, 2), cp=(1, 2), sizes=(1 << 10, 1 << 14, 1 << 18), iters=3, warmup=1, reps=2)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layer_shapes"] = {k: [list(s) for s in v] for k, v in self.layer_shapes.items()}
        d["module_shapes"] = {k: [list(s) for s in v] for k, v in self.module_shapes.items()}
        return d


def _ffn(hidden: int) -> int:
    return 4 * hidden  # Megatron's default ffn_hidden_size (the LLaVA model passes None)


def layer_cases(grid: ProfileGrid, world: int) -> list[dict]:
    """Every layer case of the grid that fits the world: kind, shape, tp, cp."""
    out = []
    for kind, shapes in grid.layer_shapes.items():
        if kind not in KINDS:
            raise ValueError(f"profile grid: unknown module kind {kind!r}; kinds are {list(KINDS)}")
        for hidden, heads, seq, batch in shapes:
            for tp in grid.tp:
                for cp in (grid.cp if kind == "llm" else (1,)):
                    if world % (tp * cp) or heads % tp or hidden % heads or (cp > 1 and seq % (2 * cp)):
                        continue
                    out.append({"kind": kind, "hidden": hidden, "heads": heads, "ffn_hidden": _ffn(hidden),
                                "seq": seq, "batch": batch, "tp": tp, "cp": cp})
    return out


def module_cases(grid: ProfileGrid, world: int) -> list[dict]:
    """Every whole-module case (one layer) of the grid: TP1 and the largest TP of the grid, CP1."""
    out = []
    for kind, shapes in grid.module_shapes.items():
        if kind not in KINDS:
            raise ValueError(f"profile grid: unknown module kind {kind!r}; kinds are {list(KINDS)}")
        for hidden, heads, seq, batch, other in shapes:
            for tp in sorted({1, max(t for t in grid.tp if world % t == 0 and heads % t == 0)}):
                c = {"kind": kind, "hidden": hidden, "heads": heads, "ffn_hidden": _ffn(hidden), "seq": seq,
                     "batch": batch, "tp": tp, "cp": 1}
                c["vocab" if kind == "llm" else "llm_hidden"] = other
                out.append(c)
    return out


def collective_cases(grid: ProfileGrid, world: int) -> list[dict]:
    out = []
    for kind in grid.collectives:
        if kind not in C.COLLECTIVES:
            raise ValueError(f"profile grid: unknown collective {kind!r}; kinds are {list(C.COLLECTIVES)}")
        sizes = [n for n in (2, 4, 8, 16, 32) if n <= world and world % n == 0]
        for n in ([2] if kind == "send_recv" else sizes):
            if n > world:
                continue
            for nbytes in grid.sizes:
                out.append({"kind": kind, "n": n, "bytes": int(nbytes)})
    return out


# ---------------------------------------------------------------------------------------------
# Per-rank measurement (runs inside run_ranks)
# ---------------------------------------------------------------------------------------------
def _timed(fn, iters: int, warmup: int, reps: int = 1) -> list[float]:
    """`iters` samples of the time per call of `fn`: each sample runs `reps` calls back to back
    between two barriers (so every rank's sample spans the same interval, as the ops of a training
    step follow each other) and is divided by `reps`."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        dist.barrier()
        out.append((time.perf_counter() - t0) / reps)
    return out


def _rank_layers(cases: list[dict], iters: int, warmup: int, reps: int) -> tuple[list[list[float]], list[float]]:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_hetero.compat import ensure_global_memory_buffer, get_gpt_layer_local_spec_with_cp
    from megatron_hetero.compat.device import get_device, synchronize
    from megatron_hetero.layout.spec import HeteroLayout, ModuleLayout
    from megatron_hetero.layout.validate import resolve_layout
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
                config = transformer_config(num_layers=LAYERS_PER_BLOCK, hidden=c["hidden"], heads=c["heads"],
                                            ffn=c["ffn_hidden"], m=layout.module("profile"))
                if c["kind"] == "llm":
                    spec = get_gpt_layer_local_spec_with_cp()
                else:
                    spec = get_gpt_layer_local_spec()
                    spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.no_mask
                block = TransformerBlock(config, spec, post_layer_norm=False, pre_process=True, post_process=False,
                                         pg_collection=pgs).to(device)
                x = torch.randn(c["seq"] // cp, c["batch"], c["hidden"], device=device)
                g = torch.randn_like(x)

                def step() -> None:
                    xi = x.clone().requires_grad_(True)
                    y = block(xi, attention_mask=None)
                    y.backward(g)
                    synchronize(device)

                out[i] = [t / LAYERS_PER_BLOCK for t in _timed(step, iters, warmup, reps)]
                if i == solo_case:  # the same layer with one busy rank (the others wait at a barrier)
                    solo = [t / LAYERS_PER_BLOCK for t in _timed(lambda: step() if dist.get_rank() == 0 else None,
                                                                 iters, warmup, reps)]
                del block
        finally:
            topo.destroy()
    return out, solo


def solo_layer_case(cases: list[dict]) -> int:
    """The layer case also timed with one busy rank: the first TP1·CP1 language-model case."""
    return next(i for i, c in enumerate(cases) if c["tp"] == 1 and c["cp"] == 1 and c["kind"] == cases[0]["kind"])


def _rank_modules(cases: list[dict], iters: int, warmup: int, reps: int) -> list[dict]:
    """Whole one-layer modules of the LLaVA model (data + embedding + layer + output layer + loss for
    `llm`; patch embedding + layer + projector for `encoder`) forward + backward through their DDP
    wrapper, and the module's optimizer step (+ zero_grad), on a grid TP x DP = world."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hetero.compat import ensure_global_memory_buffer
    from megatron_hetero.compat.device import get_device, synchronize
    from megatron_hetero.layout.spec import HeteroLayout, ModuleLayout
    from megatron_hetero.layout.validate import resolve_layout
    from megatron_hetero.models.llava import EncoderModule, EncoderSpec, LanguageModule, LlavaSpec
    from megatron_hetero.runtime.module_state import ModuleState, OptimConfig
    from megatron_hetero.runtime.topology import Topology
    from megatron_hetero.training import data as data_mod

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
                    spec = LlavaSpec(num_layers=1, hidden_size=c["hidden"], num_attention_heads=c["heads"],
                                     vocab_size=c["vocab"], seq_length=c["seq"], encoders={})
                    module = LanguageModule(name, spec, m, pgs, first_segment=True, last_segment=True).to(device)
                    dcfg = spec.data_config()
                else:
                    enc = EncoderSpec(num_layers=1, hidden_size=c["hidden"], num_attention_heads=c["heads"],
                                      tokens=c["seq"], feature_dim=24, offset=1)
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

                t_mod = _timed(fwd_bwd, iters, warmup, reps)
                t_opt = _timed(opt, iters, 1, reps)  # the step's cost does not depend on the gradient values
                t_snap = _timed(state.resident_bytes, iters, 1, reps)
                # a rank builds its micro-batch from the synthetic data (every pipeline stage does)
                t_data = _timed(lambda c=c: data_mod.batch(data_mod.DataConfig(seq_length=c["seq"], vocab_size=128),
                                                           0, c["batch"]), iters, 1, reps)

                def fwd_bwd_sync(state=state) -> None:  # DDP's gradient all-reduce, as a step runs it:
                    fwd_bwd()  # after the backward pass (the ranks arrive as their compute ends)
                    state.finalize_grads()
                    state.zero_grad()

                def fwd_bwd_zero(state=state) -> None:
                    fwd_bwd()
                    state.zero_grad()

                t_fbs = _timed(fwd_bwd_sync, iters, 1, reps)
                t_fbz = _timed(fwd_bwd_zero, iters, 1, reps)
                t_sync = [max(0.0, a - b) for a, b in zip(sorted(t_fbs), sorted(t_fbz))]
                out[i] = {"module": t_mod, "optimizer": t_opt, "snapshot": t_snap, "grad_sync": t_sync, "data": t_data,
                          "params": int(sum(p.numel() for p in module.parameters()))}
                del state, module
        finally:
            topo.destroy()
    return out


def _rank_collectives(cases: list[dict], iters: int, warmup: int, reps: int) -> list[list[float]]:
    from megatron_hetero.compat.device import get_device, synchronize

    world, rank = dist.get_world_size(), dist.get_rank()
    device = get_device()
    groups: dict[int, Any] = {}
    for n in sorted({c["n"] for c in cases if c["kind"] != "send_recv"}):
        mine, made = dist.new_subgroups_by_enumeration([list(range(s, s + n)) for s in range(0, world, n)])
        groups[n] = (mine, made)
    out: list[list[float]] = [[] for _ in cases]
    try:
        for i, c in enumerate(cases):
            n, nbytes, kind = c["n"], c["bytes"], c["kind"]
            numel = max(nbytes // 4, n)
            numel -= numel % n
            if kind == "send_recv":
                buf = torch.ones(numel, device=device)
                peer = rank ^ 1
                active = peer < world

                def op() -> None:
                    if not active:
                        return
                    if rank % 2 == 0:
                        dist.send(buf, dst=peer)
                    else:
                        dist.recv(buf, src=peer)
                    synchronize(device)
            else:
                grp = groups[n][0]
                first = (rank // n) * n
                full = torch.ones(numel, device=device)
                part = torch.ones(numel // n, device=device)
                parts = [torch.empty(numel // n, device=device) for _ in range(n)]

                def op(kind=kind, grp=grp, first=first, full=full, part=part, parts=parts) -> None:
                    if kind == "all_reduce":
                        dist.all_reduce(full, group=grp)
                    elif kind == "all_gather":
                        dist.all_gather(parts, part, group=grp)
                    elif kind == "reduce_scatter":
                        dist.reduce_scatter(part, list(full.chunk(n)), group=grp)
                    elif kind == "broadcast":
                        dist.broadcast(full, src=first, group=grp)
                    synchronize(device)
            out[i] = _timed(op, iters, warmup, reps)
    finally:
        for mine, made in groups.values():
            for g in made:
                dist.destroy_process_group(g)
    return out


def _rank_host_bandwidth(nbytes: int = 1 << 25) -> float:
    """Bytes/s of a host copy of `nbytes` (device -> host on GPU), all ranks at once."""
    from megatron_hetero.compat.device import get_device, synchronize

    device = get_device()
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty(nbytes // 4, device="cpu", pin_memory=device.type == "cuda")

    def op() -> None:
        dst.copy_(src)
        synchronize(device)

    return nbytes / statistics.median(_timed(op, 3, 1))


def _rank_main(lcases: list[dict], mcases: list[dict], ccases: list[dict], iters: int,
               warmup: int, reps: int) -> dict[str, Any]:
    from megatron_hetero.compat import set_local_device

    set_local_device(int(os.environ.get("LOCAL_RANK", "0")))
    layers, solo = _rank_layers(lcases, iters, warmup, reps)
    return {"layers": layers, "solo": solo,
            "modules": _rank_modules(mcases, iters, warmup, reps),
            "collectives": _rank_collectives(ccases, iters, warmup, reps),
            "host_bandwidth": _rank_host_bandwidth(), "memory_bytes": _rank_memory(dist.get_world_size())}


# ---------------------------------------------------------------------------------------------
# Parent: launch, reduce, fit
# ---------------------------------------------------------------------------------------------
def _slowest_median(per_rank: list[list[float]]) -> float:
    """Median over iterations of the slowest rank's time."""
    return float(statistics.median(max(r[k] for r in per_rank) for k in range(len(per_rank[0]))))


def busy_cores(interval: float = 0.3) -> Optional[float]:
    """Cores kept busy by *other* processes over `interval` seconds while this one sleeps (Linux
    /proc/stat; None elsewhere)."""
    def snap():
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
        return sum(vals), idle
    try:
        t0, i0 = snap()
        time.sleep(interval)
        t1, i1 = snap()
    except (OSError, ValueError, IndexError):
        return None
    ncpu = os.cpu_count() or 1
    return ncpu * (1.0 - (i1 - i0) / max(t1 - t0, 1))


class ExternalLoad:
    """Cores kept busy by processes outside this process tree while the `with` block runs (Linux:
    /proc/stat minus this process's and its waited-for children's CPU time; None elsewhere).

    On a machine shared with other jobs, a measurement they disturbed is too slow; callers retry
    those (`DISTURBED`)."""

    def __enter__(self) -> "ExternalLoad":
        self.cores: Optional[float] = None
        self._start = self._snap()
        return self

    def __exit__(self, *exc) -> None:
        end = self._snap()
        if self._start is None or end is None:
            return
        (b0, own0, t0), (b1, own1, t1) = self._start, end
        if t1 > t0:
            self.cores = max(0.0, ((b1 - b0) - (own1 - own0)) / (t1 - t0))

    @staticmethod
    def _snap():
        try:
            with open("/proc/stat") as f:
                vals = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        busy = (sum(vals) - vals[3] - (vals[4] if len(vals) > 4 else 0)) / os.sysconf("SC_CLK_TCK")
        t = os.times()
        own = t.user + t.system + t.children_user + t.children_system
        return busy, own, time.monotonic()


#: external load (cores) above which a measurement counts as disturbed by another job
DISTURBED = 0.15


def wait_quiet(max_wait_s: float = 10.0, threshold: float = 0.3) -> Optional[float]:
    """Wait (up to `max_wait_s`) until other processes keep fewer than `threshold` cores busy, so a
    measurement is not skewed by another job on a shared machine; returns the last load seen."""
    if max_wait_s <= 0:
        return None
    deadline = time.monotonic() + max_wait_s
    load = busy_cores()
    while load is not None and load > threshold and time.monotonic() < deadline:
        load = busy_cores(1.0)
    return load


def measure(world_size: int, grid: ProfileGrid = ProfileGrid(), timeout: float = 1200.0,
            rounds: int = 1, quiet_wait_s: float = 10.0, tries: int = 3) -> dict[str, Any]:
    """Run the measurements on `world_size` forked ranks; returns the raw measurement document.

    rounds > 1 repeats the whole measurement and keeps, per case, the round with the least time
    (another process on a shared machine only ever adds time)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    docs = []
    for _ in range(rounds):
        docs.append(undisturbed(lambda: _measure_once(world_size, grid, timeout, quiet_wait_s), tries,
                                quiet_wait_s)[0])
    return combine_rounds(docs)


def combine_rounds(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """One measurement document from rounds of the same grid: per case the fastest round."""
    if not docs:
        raise ValueError("no measurement rounds to combine")
    docs = [dict(d, external_load=d["external_load"] if isinstance(d["external_load"], list) else [d["external_load"]])
            for d in docs]
    out = {**docs[0], **{k: list(docs[0][k]) for k in ("layers", "modules", "collectives")}}
    for key in ("layers", "modules", "collectives"):
        for i, case in enumerate(out[key]):
            best = min((d[key][i] for d in docs), key=lambda c: c["seconds"])
            out[key][i] = best
    out["solo_layer"] = min((d["solo_layer"] for d in docs), key=lambda c: c["seconds"])
    out["host_bandwidth"] = max(d["host_bandwidth"] for d in docs)
    out["seconds"] = sum(d["seconds"] for d in docs)
    out["rounds"] = sum(d.get("rounds", 1) for d in docs)
    out["external_load"] = [x for d in docs for x in d["external_load"]]
    return out


def undisturbed(fn, tries: int = 3, quiet_wait_s: float = 10.0):
    """Run `fn()` until another job's load stayed below `DISTURBED` cores during it (at most `tries`
    times; else the least disturbed run). Returns (result, external load in cores or None, tries)."""
    best = None
    for k in range(1, tries + 1):
        with ExternalLoad() as load:
            out = fn()
        if isinstance(out, dict) and "external_load" in out:
            out["external_load"] = load.cores
        if load.cores is None or load.cores < DISTURBED:
            return out, load.cores, k
        if best is None or load.cores < best[1]:
            best = (out, load.cores)
        wait_quiet(quiet_wait_s)
    return best[0], best[1], tries


def _measure_once(world_size: int, grid: ProfileGrid, timeout: float, quiet_wait_s: float) -> dict[str, Any]:
    from megatron_hetero.compat import apply_compat, default_backend
    from megatron_hetero.runtime.launcher import run_ranks

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"--world-size must be an integer >= 2 (collectives need two ranks), got {world_size!r}")
    if grid.iters < 1 or grid.reps < 1 or grid.warmup < 0:
        raise ValueError(f"profile grid: iters and reps must be >= 1 and warmup >= 0, got {grid.iters}, "
                         f"{grid.reps}, {grid.warmup}")
    lcases, ccases = layer_cases(grid, world_size), collective_cases(grid, world_size)
    mcases = module_cases(grid, world_size)
    if not any(c["tp"] == 1 and c["cp"] == 1 for c in lcases):
        raise ValueError("profile grid: the layer fit needs TP1·CP1 shapes")
    apply_compat()
    backend = default_backend()
    load = wait_quiet(quiet_wait_s)
    t0 = time.perf_counter()
    per_rank = run_ranks(world_size, _rank_main, lcases, mcases, ccases, grid.iters, grid.warmup, grid.reps,
                         timeout=timeout, backend=backend)
    layers = [dict(c, seconds=_slowest_median([r["layers"][i] for r in per_rank]))
              for i, c in enumerate(lcases)]
    modules = [dict(c, seconds=_slowest_median([r["modules"][i]["module"] for r in per_rank]),
                    optimizer_seconds=_slowest_median([r["modules"][i]["optimizer"] for r in per_rank]),
                    snapshot_seconds=_slowest_median([r["modules"][i]["snapshot"] for r in per_rank]),
                    grad_sync_seconds=_slowest_median([r["modules"][i]["grad_sync"] for r in per_rank]),
                    data_seconds=_slowest_median([r["modules"][i]["data"] for r in per_rank]),
                    dp=world_size // c["tp"],
                    params=max(r["modules"][i]["params"] for r in per_rank))
               for i, c in enumerate(mcases)]
    colls = [dict(c, seconds=_slowest_median([r["collectives"][i] for r in per_rank]))
             for i, c in enumerate(ccases)]
    host = min(r["host_bandwidth"] for r in per_rank)
    memory = min(r["memory_bytes"] for r in per_rank)
    solo = dict(lcases[solo_layer_case(lcases)], seconds=float(statistics.median(per_rank[0]["solo"])))
    return {"world_size": world_size, "backend": backend, "grid": grid.to_dict(), "layers": layers, "solo_layer": solo, "modules": modules,
            "collectives": colls, "host_bandwidth": host, "memory_bytes": memory, "seconds": time.perf_counter() - t0, "external_load": load}


def _rank_memory(world_size: int) -> float:
    """Memory one rank may use: its device's, or on CPU the host's share of the ranks."""
    from megatron_hetero.compat.device import get_device

    device = get_device()
    if device.type != "cpu":
        return float(torch.get_device_module(device.type).get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / world_size


def _fit_line(xs: list[float], ys: list[float]) -> C.LayerModel:
    """t = a + b * x with a, b >= 0 (a negative slope from noise: the mean, flat)."""
    if len(set(xs)) < 2:
        return C.LayerModel(a=max(0.0, float(statistics.mean(ys))), b=0.0)
    a, b = C.fit_alpha_beta(xs, ys)
    if b < 0:
        return C.LayerModel(a=max(0.0, float(statistics.mean(ys))), b=0.0)
    return C.LayerModel(a=a, b=b)


def fit_profile(raw: dict[str, Any], memory_bytes: Optional[float] = None) -> C.Profile:
    """The `Profile` of a measurement document (see module docstring)."""
    world = int(raw["world_size"])
    layers = {}
    for kind in KINDS:
        samples = [dict(s, tokens=s["batch"] * s["seq"], gated=False) for s in raw["layers"]
                   if s["kind"] == kind and s["tp"] == 1 and s["cp"] == 1]
        if samples:
            pairs = [(float(C.layer_flops(x["tokens"], x["seq"], x["hidden"], x["ffn_hidden"])), x["seconds"])
                     for x in samples]
            layers[kind] = _fit_line([f for f, _ in pairs], [t for _, t in pairs])
    if not layers:
        raise ValueError("profile: no TP1·CP1 layer measurement to fit")
    layers["default"] = layers.get("llm") or next(iter(layers.values()))
    coll: dict[str, dict] = {}
    for kind in C.COLLECTIVES:
        for n in sorted({s["n"] for s in raw["collectives"] if s["kind"] == kind}):
            pts = [(s["bytes"], s["seconds"]) for s in raw["collectives"] if s["kind"] == kind and s["n"] == n]
            if len({b for b, _ in pts}) < 2:
                continue
            ab = _fit_line([p[0] for p in pts], [p[1] for p in pts])
            coll.setdefault(kind, {}).setdefault("intra", {})[n] = C.AlphaBeta(ab.a, ab.b)
    sr = coll.get("send_recv", {}).get("intra", {}).get(2)
    if sr is None:
        raise ValueError("profile: send/recv measurements are needed for the link model")
    link = C.AlphaBeta(sr.alpha, sr.beta)
    shared = raw["backend"] == "gloo"  # ranks forked on one CPU machine share its cores
    solo = raw.get("solo_layer")
    cores, concurrency = 0.0, 0
    if shared and solo:
        same = next(s for s in raw["layers"] if all(s[k] == solo[k] for k in ("kind", "hidden", "seq", "batch", "tp", "cp")))
        # effective cores: the world's ranks did `world` layers in the time one rank alone does
        # world * t_solo / t_all of them
        cores, concurrency = min(float(world), world * solo["seconds"] / same["seconds"]), world
    prof = C.Profile(layers=layers, links={"intra": link, "inter": link}, devices_per_node=world,
                     memory_bytes=float(memory_bytes if memory_bytes is not None else raw["memory_bytes"]),
                     host_bandwidth=float(raw["host_bandwidth"]), collectives=coll,
                     source=f"measured on {raw['backend']}, {world} concurrent ranks (megatron-hetero profile)",
                     cores=cores, concurrency=concurrency)
    prof = dataclasses.replace(prof, layer_collectives=_fit_layer_collectives(prof, raw))
    overheads = {}
    for kind in KINDS:
        pts = []  # (tp, flops, one activation all-reduce over TP, io seconds)
        for s in raw.get("modules", []):
            if s["kind"] != kind:
                continue
            spec, wl = _specs(s)
            layer = float(sum(C.layer_parts(prof, wl, spec, s["batch"], s["tp"], 1)))
            data = s["data_seconds"] if kind == "llm" else 0.0  # the LLM module built its batch
            pts.append((s["tp"], float(C.io_flops(wl, spec, s["batch"], s["tp"], 1)),
                        float(C.io_allreduce(prof, wl, spec, s["batch"], s["tp"], 1)), s["seconds"] - layer - data))
        one = [p for p in pts if p[0] == 1]
        if not one:
            continue
        io = _fit_line([p[1] for p in one], [p[3] for p in one])
        overheads[f"{kind}_io"] = io
        # TP > 1: the extra time over the TP1 model, in activation all-reduces over the TP group
        # (embedding, output layer, vocab-parallel loss / projector), least squares through 0
        tps = [(p[2], p[3] - float(io.time(p[1]))) for p in pts if p[0] > 1 and p[2] > 0]
        if tps:
            k = sum(x * y for x, y in tps) / sum(x * x for x, _ in tps)
            overheads[f"{kind}_io_tp"] = C.LayerModel(a=0.0, b=max(0.0, k))
    mods = raw.get("modules", [])
    if mods:
        overheads["data"] = _fit_line([float(s["batch"] * s["seq"]) for s in mods], [s["data_seconds"] for s in mods])
        overheads["optimizer"] = _fit_line([float(s["params"]) for s in mods], [s["optimizer_seconds"] for s in mods])
        overheads["snapshot"] = _fit_line([float(s["params"]) for s in mods], [s["snapshot_seconds"] for s in mods])
        # DDP's gradient all-reduce right after the backward pass (fwd+bwd+sync minus fwd+bwd), against
        # the all-reduce model of the same bytes and group
        xs = [float(prof.collective_time("all_reduce", s["params"] * 4.0, s["dp"], False)) for s in mods]
        overheads["grad_sync"] = _fit_line(xs, [s["grad_sync_seconds"] for s in mods])
    return dataclasses.replace(prof, overheads=overheads)


def _fit_layer_collectives(prof: C.Profile, raw: dict[str, Any]) -> dict:
    """TP all-reduces and CP all-gathers as they cost inside a layer: from every measured TP>1·CP1
    (CP>1·TP1) layer, the time over the layer compute model, per all-reduce (per all-gather, plus
    the attention compute the model overlaps with it), fitted as alpha + bytes * beta per group size."""
    pts: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for s in raw["layers"]:
        if (s["tp"] > 1) == (s["cp"] > 1):
            continue
        spec = C.ModelSpec(s["kind"], 1, s["hidden"], s["ffn_hidden"], s["heads"], s["seq"], kind=s["kind"])
        wl = C.Workload(spec, spec, global_batch=1, dtype_bytes=4)
        compute = float(C.layer_parts(prof, wl, spec, s["batch"], s["tp"], s["cp"])[0])
        tokens = s["batch"] * s["seq"]
        if s["tp"] > 1:
            nbytes = tokens / s["cp"] * s["hidden"] * 4
            pts.setdefault(("all_reduce", s["tp"]), []).append((nbytes, (s["seconds"] - compute) / 4.0))
        elif spec.shards:
            nbytes = 2.0 * tokens * s["hidden"] * 4
            overlap = prof.layer_model(s["kind"]).b * 12.0 * tokens * s["seq"] * s["hidden"] / s["cp"]
            pts.setdefault(("all_gather", s["cp"]), []).append((nbytes, (s["seconds"] - compute + overlap) / 3.0))
    out: dict[str, dict] = {}
    for (kind, n), xy in sorted(pts.items()):
        ab = _fit_line([x for x, _ in xy], [max(0.0, y) for _, y in xy])
        out.setdefault(kind, {}).setdefault("intra", {})[n] = C.AlphaBeta(ab.a, ab.b)
    return out


def _specs(s: dict) -> tuple[C.ModelSpec, C.Workload]:
    """Cost-model specs of one measured module case (fp32)."""
    if s["kind"] == "llm":
        spec = C.ModelSpec("llm", 1, s["hidden"], s["ffn_hidden"], s["heads"], s["seq"], kind="llm", vocab=s["vocab"])
        llm = spec
    else:
        spec = C.ModelSpec("encoder", 1, s["hidden"], s["ffn_hidden"], s["heads"], s["seq"], kind="encoder")
        llm = C.ModelSpec("llm", 1, s["llm_hidden"], 4 * s["llm_hidden"], s["heads"], s["seq"], kind="llm")
    enc = spec if s["kind"] == "encoder" else C.ModelSpec("encoder", 1, 8, 32, 1, 1, kind="encoder")
    return spec, C.Workload(enc, llm, global_batch=1, dtype_bytes=4)


def layer_checks(prof: C.Profile, raw: dict[str, Any]) -> list[dict]:
    """Every measured layer against the model: compute + TP all-reduces + CP gathers (fp32)."""
    out = []
    for s in raw["layers"]:
        spec = C.ModelSpec(s["kind"], 1, s["hidden"], s["ffn_hidden"], s["heads"], s["seq"], kind=s["kind"])
        wl = C.Workload(spec, spec, global_batch=1, dtype_bytes=4)
        est = float(sum(C.layer_parts(prof, wl, spec, s["batch"], s["tp"], s["cp"])))
        out.append({**{k: s[k] for k in ("kind", "hidden", "seq", "batch", "tp", "cp")}, "measured_s": s["seconds"],
                    "model_s": est, "error": est / s["seconds"] - 1.0})
    return out


def profile_document(raw: dict[str, Any], prof: C.Profile) -> dict[str, Any]:
    """The JSON written by `megatron-hetero profile`: the Profile plus the measurements."""
    checks = layer_checks(prof, raw)
    errs = [abs(c["error"]) for c in checks]
    return {**prof.to_dict(), "world_size": raw["world_size"], "backend": raw["backend"], "grid": raw["grid"],
            "measure_seconds": raw["seconds"], "rounds": raw.get("rounds", 1),
            "external_load": raw.get("external_load"), "measurements": {"layers": raw["layers"], "collectives": raw["collectives"],
                                                                "host_bandwidth": raw["host_bandwidth"]},
            "checks": {"layers": checks, "layer_mape": sum(errs) / len(errs) if errs else None}}


def run_profile(world_size: int, grid: ProfileGrid = ProfileGrid(), out=None,
                memory_bytes: Optional[float] = None, rounds: int = 1, quiet_wait_s: float = 10.0,
                tries: int = 3) -> tuple[C.Profile, dict[str, Any]]:
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


def summary(doc: dict[str, Any]) -> str:
    """A short text report of a profile document."""
    lines = [f"profile: {doc['source']}; measured in {doc['measure_seconds']:.1f} s"]
    for kind, lm in doc["layers"].items():
        if kind != "default":
            lines.append(f"  layer {kind:8s} t = {lm['a'] * 1e3:.3f} ms + flops * {lm['b'] * 1e12:.3f} ps")
    for kind, per in doc["collectives"].items():
        for n, ab in sorted(per.get("intra", {}).items(), key=lambda x: int(x[0])):
            lines.append(f"  {kind:14s} n={n:<3} alpha {ab['alpha'] * 1e6:8.1f} us  beta {ab['beta'] * 1e9:8.3f} ns/B"
                         f" ({(1 / ab['beta'] / 1e9) if ab['beta'] > 0 else math.inf:.2f} GB/s)")
    if doc["checks"]["layer_mape"] is not None:
        lines.append(f"  layer model vs every measured layer (TP/CP included): mean |error| "
                     f"{doc['checks']['layer_mape']:.1%}")
    return "\n".join(lines)

"""Timing kernels of `megatron-hetero profile` that need no model: the timed-call helper, the
collectives (all-reduce, all-gather, broadcast, reduce-scatter over groups of n consecutive ranks,
send/recv between rank pairs, each message size), the host copy bandwidth and a rank's memory, all
run inside `runtime.launcher.run_ranks`; and the detection of other jobs' load on a shared machine
(`ExternalLoad`, `undisturbed`, `wait_quiet`). The layer and module kernels (they build the model)
and `run_profile` are `profiling/run.py`; the case grid and the fit, `planner/profile_fit.py`.

Everything is measured on `world_size` forked ranks *all working at the same time*, as in a
training step: on a machine where ranks share cores (CPU), a layer measured alone is several times
faster than the same layer while the other ranks compute too. Each sample runs `reps` calls back to
back between two barriers (the ops of a step follow each other too) and is divided by `reps`; a
case's time is the median over `iters` samples (after `warmup` calls) of the slowest rank.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron_hetero.compat.device import get_device, synchronize


def timed(fn, iters: int, warmup: int, reps: int = 1) -> list[float]:
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


def rank_collectives(cases: list[dict], iters: int, warmup: int, reps: int) -> list[list[float]]:
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

            out[i] = timed(op, iters, warmup, reps)
    finally:
        for _mine, made in groups.values():
            for g in made:
                dist.destroy_process_group(g)
    return out


def rank_host_bandwidth(nbytes: int = 1 << 25) -> float:
    """Bytes/s of a host copy of `nbytes` (device -> host on GPU), all ranks at once."""

    device = get_device()
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty(nbytes // 4, device="cpu", pin_memory=device.type == "cuda")

    def op() -> None:
        dst.copy_(src)
        synchronize(device)

    return nbytes / statistics.median(timed(op, 3, 1))


def rank_memory(world_size: int) -> float:
    """Memory one rank may use: its device's, or on CPU the host's share of the ranks."""

    device = get_device()
    if device.type != "cpu":
        return float(torch.get_device_module(device.type).get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / world_size


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

"""`megatron-hetero bench boundary`: every transform and mode at world 8, side by side in one run, and
the colocated cases also through Megatron-core 0.19's `ColocatedBridgeCommunicator` (upstream).

For each case: bytes moved (forward + backward, summed over ranks) / the theoretical minimum of the
plan, and the time of one forward+backward boundary call / the time of a plain send of the same
number of bytes between two ranks on the same backend, measured in the same process tree.
Both times are bracketed by the same two barriers; medians over `iters`. Colocated cases run the
direct mode (point-to-point messages plus local copies); disjoint cases run both the direct mode and
the hierarchical leader route (the steps of `plan.route`).

Upstream (`bench/boundary_upstream.py`: its NCCL groups made gloo without CUDA, for the bench's
upstream part only) runs every case it accepts on the same ranks and the same source tensor: bytes its
all-gathers delivered (counted) and their analytic figure, its time per call (same bracketing), ours /
upstream; for a case it refuses, the reason it gives. Correctness, on every rank: our boundary delivers
the destination's slice of the global tensor and returns the source exactly its gradient (the
destination's gradient is its input, `y.backward(y)`), and upstream delivers the same tensor and the
same source gradient as ours (`torch.equal`).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_hetero.bench import boundary_upstream as upstream
from megatron_hetero.bench.common import bar_plot, markdown_table, write_json
from megatron_hetero.layout import layout_from_dict
from megatron_hetero.plan.batch import dp_rows
from megatron_hetero.plan.blocks import Block
from megatron_hetero.plan.boundary import plan_boundary
from megatron_hetero.plan.placement import coord_of
from megatron_hetero.runtime.boundary import Boundary
from megatron_hetero.runtime.launcher import run_ranks
from megatron_hetero.runtime.topology import Topology

WORLD = 8
#: the batch of the case whose fan-out factor does not divide the per-rank batch (both refuse it)
UNEVEN_BATCH = 4


def _doc(placement: str, src: dict, dst: dict) -> dict:
    return {"placement": placement, "modules": {"vision": src, "language": dst}, "edges": ["vision -> language"]}


# (name, layout, mode, batch: None = the run's)
CASES: list[tuple[str, dict, str, Optional[int]]] = [
    (
        "colocated equal-dp TP2·DP4 -> TP2·DP4",
        _doc("colocated", {"tp": 2, "dp": 4}, {"tp": 2, "dp": 4}),
        "direct",
        None,
    ),
    (
        "colocated equal-dp TP2·DP4 -> CP2·DP4",
        _doc("colocated", {"tp": 2, "dp": 4}, {"cp": 2, "dp": 4}),
        "direct",
        None,
    ),
    ("colocated fan-in DP8 -> TP2·DP4", _doc("colocated", {"dp": 8}, {"tp": 2, "dp": 4}), "direct", None),
    ("colocated fan-in DP8 -> TP4·DP2", _doc("colocated", {"dp": 8}, {"tp": 4, "dp": 2}), "direct", None),
    ("colocated fan-in DP8 -> TP2·PP2·DP2", _doc("colocated", {"dp": 8}, {"tp": 2, "pp": 2, "dp": 2}), "direct", None),
    ("colocated fan-out TP4·DP2 -> DP8", _doc("colocated", {"tp": 4, "dp": 2}, {"dp": 8}), "direct", None),
    ("colocated fan-out TP2·DP4 -> DP8", _doc("colocated", {"tp": 2, "dp": 4}, {"dp": 8}), "direct", None),
    (
        f"colocated fan-out TP4·DP2 -> DP8, batch {UNEVEN_BATCH}",
        _doc("colocated", {"tp": 4, "dp": 2}, {"dp": 8}),
        "direct",
        UNEVEN_BATCH,
    ),
]
for _name, _src, _dst in [
    ("equal-dp TP2·DP2 -> TP2·DP2", {"tp": 2, "dp": 2}, {"tp": 2, "dp": 2}),
    ("fan-in DP4 -> TP2·DP2", {"dp": 4}, {"tp": 2, "dp": 2}),
    ("fan-out TP4 -> DP4", {"tp": 4}, {"dp": 4}),
    ("equal-dp TP2·DP2 -> CP2·DP2", {"tp": 2, "dp": 2}, {"cp": 2, "dp": 2}),
]:
    for _mode in ("direct", "hierarchical"):
        CASES.append((f"disjoint {_name}", _doc("disjoint", _src, _dst), _mode, None))


def _timed(fn, iters: int) -> float:
    """Median over `iters` of fn() bracketed by barriers (the same bracketing for every measurement)."""
    samples = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _local(full: torch.Tensor, blocks: tuple[Block, ...]) -> torch.Tensor:
    """This rank's tensor made of `blocks` of the global tensor (concatenated along seq)."""
    return torch.cat([full[b.b0 : b.b1, b.s0 : b.s1] for b in blocks], dim=1).contiguous()


def _all(flag: bool) -> bool:
    """True on every rank iff `flag` is True on every rank."""
    t = torch.tensor([0 if flag else 1], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item()) == 0


def _summed(n: int) -> int:
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


def _run_once(fn, x: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """One forward+backward through `fn` (ours or upstream) with the destination's gradient = its
    output: (output on a destination rank, the source's input gradient on a source rank)."""
    xi = x.clone().requires_grad_(True) if x is not None else None
    y = fn(xi)
    if y is not None and y.numel() and y.requires_grad:
        y.backward(y.detach())
    elif y is not None:
        Boundary.backward_source(y)
    return (y.detach() if y is not None and y.numel() else None), (xi.grad if xi is not None else None)


def _ours(layout, topo, batch: int, seq: int, hidden: int, mode: str, full: torch.Tensor, iters: int) -> dict:
    # as the schedules call it: the colocated one skips the header round (fixed seq), the disjoint one not
    headers = layout.placement == "disjoint"
    bnd = Boundary(
        layout, layout.edges[0], batch=batch, hidden=hidden, seq=seq, mode=mode, topology=topo, headers=headers
    )
    plan = bnd.plan_for(seq)
    x = _local(full, plan.holds) if bnd.is_src else None
    y, g = _run_once(bnd, x)  # also the warm-up (connections, plan cache)
    ok = (not bnd.is_dst or torch.equal(y, _local(full, plan.needs))) and (g is None or torch.equal(g, x))
    before = (bnd.stats["forward"].payload_bytes, bnd.stats["backward"].payload_bytes)

    def step() -> None:
        xi = x.clone().requires_grad_(True) if x is not None else None
        y = bnd(xi)
        if bnd.is_dst:
            y.sum().backward()
        elif bnd.is_src:
            Boundary.backward_source(y)

    t = _timed(step, iters)
    whole = plan_boundary(layout, layout.edges[0], plan.shape)  # the whole edge's minimum (bnd plans this rank's part)
    moved = (bnd.stats["forward"].payload_bytes - before[0] + bnd.stats["backward"].payload_bytes - before[1]) // iters
    total = _summed(moved)
    return {
        "plan": plan,
        "x": x,
        "y": y,
        "grad": g,
        "delivers_expected": _all(ok),
        "bytes_moved": total,
        "min_bytes": whole.min_bytes_forward + whole.min_bytes_backward,
        "time_s": t,
    }


def _upstream(topo, layout, ours: Optional[dict], batch: int, seq: int, hidden: int, full, iters: int) -> dict:
    """Upstream's communicator on the same edge: its refusal, or its bytes, time and agreement with ours."""
    rank, src = dist.get_rank(), layout.module(layout.edges[0].src)
    with upstream.upstream_on_this_machine() as counter:
        comm, refusal = upstream.build(topo, layout.edges[0].src, layout.edges[0].dst)
        if comm is None:
            return {"refusal": refusal}
        try:
            # the source's rows of the global tensor (upstream: TP-replicated, the whole sequence)
            rows = dp_rows(batch, src.dp, coord_of(src, rank).dp)
            x = full[rows.start : rows.stop].contiguous()
            try:
                y, g = _run_once(comm.communicate, x)
            except ValueError as exc:  # its call-time check (a fan-out factor that does not divide)
                return {"refusal": str(exc)}
            same = ours is not None and torch.equal(y, ours["y"]) and torch.equal(g, ours["grad"])
            counter.received = 0

            def step() -> None:
                y = comm.communicate(x.clone().requires_grad_(True))
                y.sum().backward()

            t = _timed(step, iters)
            moved = _summed(counter.received // iters)
            return {
                "refusal": None,
                "same_as_ours": _all(same),
                "bytes_moved": moved,
                "analytic_bytes": upstream.analytic_bytes(comm, tuple(x.shape), x.element_size(), WORLD),
                "time_s": t,
            }
        finally:
            comm.destroy()


def _plain_send(total: int, iters: int) -> float:
    rank = dist.get_rank()
    buf = torch.empty(max(total // 4, 1))

    def plain() -> None:
        if rank == 0:
            dist.send(buf, dst=1)
        elif rank == 1:
            dist.recv(buf, src=0)

    plain()
    return _timed(plain, iters)


def _rank_main(batch: int, seq: int, hidden: int, iters: int) -> list[dict[str, Any]]:
    out = []
    for name, doc, mode, case_batch in CASES:
        b = case_batch or batch
        layout = layout_from_dict(doc, world_size=WORLD)
        topo = Topology.build(layout)
        full = torch.randn(b, seq, hidden, generator=torch.Generator().manual_seed(len(out)))
        try:
            row: dict[str, Any] = {"case": name, "placement": layout.placement, "mode": mode, "batch": b}
            row["backend"] = dist.get_backend()
            try:
                ours = _ours(layout, topo, b, seq, hidden, mode, full, iters)
            except ValueError as exc:  # our own check (the same on every rank, before any message)
                ours, row["refusal"] = None, str(exc)
            if ours is not None:
                plan = ours["plan"]
                row.update(
                    transform=plan.transform,
                    factor=plan.factor,
                    refusal=None,
                    delivers_expected=ours["delivers_expected"],
                    bytes_moved=ours["bytes_moved"],
                    min_bytes=ours["min_bytes"],
                    time_s=ours["time_s"],
                    plain_send_s=_plain_send(ours["bytes_moved"], iters),
                )
            row["upstream"] = _upstream(topo, layout, ours, b, seq, hidden, full, iters)
            out.append(row)
        finally:
            topo.destroy()
    return out


def _merge(per_rank: list[list[dict]], i: int) -> dict[str, Any]:
    """Case `i` as rank 0 saw it, times the slowest rank's."""
    case = dict(per_rank[0][i])
    case.pop("backend", None)  # the document's
    up = dict(case["upstream"])
    if case.get("time_s") is not None:
        t = max(r[i]["time_s"] for r in per_rank)
        tp = max(r[i]["plain_send_s"] for r in per_rank)
        case.update(
            time_s=t,
            plain_send_s=tp,
            bytes_ratio=(case["bytes_moved"] / case["min_bytes"]) if case["min_bytes"] else None,
            time_ratio=t / tp,
        )
    if up.get("time_s") is not None:
        up["time_s"] = max(r[i]["upstream"]["time_s"] for r in per_rank)
        up["time_ratio_ours_upstream"] = case["time_s"] / up["time_s"]
    case["upstream"] = up
    return case


def run(out_dir: Path, batch: int = 8, seq: int = 512, hidden: int = 256, iters: int = 10) -> dict[str, Any]:
    """Run every case at world 8; write boundary.json (+ boundary.png); return the document."""
    per_rank = run_ranks(WORLD, _rank_main, batch, seq, hidden, iters, timeout=900)
    rows = [_merge(per_rank, i) for i in range(len(per_rank[0]))]
    doc = {
        "benchmark": "boundary",
        "world_size": WORLD,
        "backend": per_rank[0][0]["backend"],
        "upstream": "megatron.core.models.mimo.comm.colocated_communicator.ColocatedBridgeCommunicator"
        + (f" (its groups on {per_rank[0][0]['backend']}, not nccl)" if per_rank[0][0]["backend"] != "nccl" else ""),
        "shape": {"batch": batch, "seq": seq, "hidden": hidden, "dtype": "float32"},
        "iters": iters,
        "cases": rows,
    }
    write_json(out_dir / "boundary.json", doc)
    ran = [r for r in rows if r.get("time_s") is not None]
    bar_plot(
        out_dir / "boundary.png",
        [f"{r['case']} [{r['mode']}]" for r in ran],
        {
            "time / plain send of the same bytes": [r["time_ratio"] for r in ran],
            "bytes / minimum": [r["bytes_ratio"] or 0.0 for r in ran],
            "time ours / upstream (colocated it accepts)": [
                r["upstream"].get("time_ratio_ours_upstream") or 0.0 for r in ran
            ],
        },
        "ratio (same run)",
        f"boundary: batch {batch}, seq {seq}, hidden {hidden} fp32, world {WORLD}",
        reference=1.0,
    )
    return doc


def _mib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / 2**20:.2f} MiB"


def table(doc: dict[str, Any]) -> str:
    """Our boundary per case and mode, then ours against upstream per case."""
    ours = [
        [
            r["case"],
            r["mode"],
            _mib(r["bytes_moved"]),
            "-" if r["bytes_ratio"] is None else f"{r['bytes_ratio']:.2f}",
            f"{r['time_s'] * 1e3:.1f} ms",
            f"{r['time_ratio']:.2f}",
        ]
        for r in doc["cases"]
        if r.get("time_s") is not None
    ]
    head = ["case", "mode", "moved (fwd+bwd)", "moved / minimum", "time", "time / plain send"]
    vs = []
    for r in doc["cases"]:
        if r["mode"] != "direct":
            continue
        up = r["upstream"]
        if up.get("refusal"):
            reason = f"refuses: {up['refusal']}"
            vs.append([r["case"], _mib(r.get("bytes_moved")), "-", _fmt_ms(r.get("time_s")), "-", "-", "-", reason])
            continue
        vs.append(
            [
                r["case"],
                _mib(r["bytes_moved"]),
                _mib(up["bytes_moved"]),
                _fmt_ms(r["time_s"]),
                _fmt_ms(up["time_s"]),
                f"{up['time_ratio_ours_upstream']:.2f}",
                "yes" if up["same_as_ours"] and r["delivers_expected"] else "NO",
                "-",
            ]
        )
    head_vs = [
        "case",
        "ours moved",
        "upstream moved",
        "ours time",
        "upstream time",
        "ours / upstream",
        "same tensors",
        "upstream",
    ]
    refused = [[r["case"], r["refusal"]] for r in doc["cases"] if r.get("refusal")]
    parts = [markdown_table(head, ours), markdown_table(head_vs, vs)]
    if refused:
        parts.append(markdown_table(["case", "our boundary refuses"], refused))
    return "\n\n".join(parts)


def _fmt_ms(t: Optional[float]) -> str:
    return "-" if t is None else f"{t * 1e3:.1f} ms"

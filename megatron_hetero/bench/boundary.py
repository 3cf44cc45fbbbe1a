"""`megatron-hetero bench boundary`: every transform and mode at world 8, side by side in one run.

For each case: bytes moved (forward + backward, summed over ranks) / the theoretical minimum of the
plan, and the time of one forward+backward boundary call / the time of a plain send of the same
number of bytes between two ranks on the same backend, measured in the same process tree.
Both times are bracketed by the same two barriers; medians over `iters`. Colocated cases run the
direct mode (point-to-point messages plus local copies); disjoint cases run both the direct mode and
the hierarchical leader route (the steps of `plan.route`).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_hetero.bench.common import bar_plot, markdown_table, write_json
from megatron_hetero.layout import layout_from_dict
from megatron_hetero.plan.blocks import local_extent
from megatron_hetero.runtime.boundary import Boundary
from megatron_hetero.runtime.launcher import run_ranks
from megatron_hetero.runtime.topology import Topology

WORLD = 8


def _doc(placement: str, src: dict, dst: dict) -> dict:
    return {"placement": placement, "modules": {"vision": src, "language": dst}, "edges": ["vision -> language"]}


# (name, layout, mode)
CASES: list[tuple[str, dict, str]] = [
    ("colocated equal-dp TP2·DP4 -> CP2·DP4", _doc("colocated", {"tp": 2, "dp": 4}, {"cp": 2, "dp": 4}), "direct"),
    ("colocated fan-in DP8 -> TP2·PP2·DP2", _doc("colocated", {"dp": 8}, {"tp": 2, "pp": 2, "dp": 2}), "direct"),
    ("colocated fan-out TP4·DP2 -> DP8", _doc("colocated", {"tp": 4, "dp": 2}, {"dp": 8}), "direct"),
]
for _name, _src, _dst in [
    ("equal-dp TP2·DP2 -> TP2·DP2", {"tp": 2, "dp": 2}, {"tp": 2, "dp": 2}),
    ("fan-in DP4 -> TP2·DP2", {"dp": 4}, {"tp": 2, "dp": 2}),
    ("fan-out TP4 -> DP4", {"tp": 4}, {"dp": 4}),
    ("equal-dp TP2·DP2 -> CP2·DP2", {"tp": 2, "dp": 2}, {"cp": 2, "dp": 2}),
]:
    for _mode in ("direct", "hierarchical"):
        CASES.append((f"disjoint {_name}", _doc("disjoint", _src, _dst), _mode))


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


def _rank_main(batch: int, seq: int, hidden: int, iters: int) -> list[dict[str, Any]]:
    rank = dist.get_rank()
    out = []
    for name, doc, mode in CASES:
        layout = layout_from_dict(doc, world_size=WORLD)
        topo = Topology.build(layout)
        try:
            bnd = Boundary(layout, layout.edges[0], batch=batch, hidden=hidden, seq=seq, mode=mode, topology=topo)
            plan = bnd.plan_for(seq)
            x = torch.randn(*local_extent(plan.holds[rank]), hidden) if bnd.is_src else None

            def step() -> None:
                xi = x.clone().requires_grad_(True) if x is not None else None
                y = bnd(xi)
                if bnd.is_dst:
                    y.sum().backward()
                elif bnd.is_src:
                    Boundary.backward_source(y)

            step()  # warm-up (connections, plan cache)
            before = (bnd.stats["forward"].payload_bytes, bnd.stats["backward"].payload_bytes)
            t_boundary = _timed(step, iters)
            moved_fwd = (bnd.stats["forward"].payload_bytes - before[0]) // iters
            moved_bwd = (bnd.stats["backward"].payload_bytes - before[1]) // iters
            totals = torch.tensor([moved_fwd + moved_bwd], dtype=torch.int64)
            dist.all_reduce(totals)
            total = int(totals.item())
            buf = torch.empty(max(total // 4, 1))

            def plain() -> None:
                if rank == 0:
                    dist.send(buf, dst=1)
                elif rank == 1:
                    dist.recv(buf, src=0)

            plain()
            t_plain = _timed(plain, iters)
            out.append(
                {
                    "case": name,
                    "placement": layout.placement,
                    "mode": mode,
                    "transform": plan.transform,
                    "factor": plan.factor,
                    "bytes_moved": total,
                    "min_bytes": plan.min_bytes_forward + plan.min_bytes_backward,
                    "time_s": t_boundary,
                    "plain_send_s": t_plain,
                }
            )
        finally:
            topo.destroy()
    return out


def run(out_dir: Path, batch: int = 8, seq: int = 512, hidden: int = 256, iters: int = 10) -> dict[str, Any]:
    """Run every case at world 8; write boundary.json (+ boundary.png); return the document."""
    per_rank = run_ranks(WORLD, _rank_main, batch, seq, hidden, iters, timeout=900)
    rows = []
    for i, case in enumerate(per_rank[0]):
        t = max(r[i]["time_s"] for r in per_rank)
        tp = max(r[i]["plain_send_s"] for r in per_rank)
        rows.append(
            {
                **case,
                "time_s": t,
                "plain_send_s": tp,
                "bytes_ratio": (case["bytes_moved"] / case["min_bytes"]) if case["min_bytes"] else None,
                "time_ratio": t / tp,
            }
        )
    doc = {
        "benchmark": "boundary",
        "world_size": WORLD,
        "backend": "gloo" if not torch.cuda.is_available() else "nccl",
        "shape": {"batch": batch, "seq": seq, "hidden": hidden, "dtype": "float32"},
        "iters": iters,
        "cases": rows,
    }
    write_json(out_dir / "boundary.json", doc)
    bar_plot(
        out_dir / "boundary.png",
        [f"{r['case']} [{r['mode']}]" for r in rows],
        {
            "time / plain send of the same bytes": [r["time_ratio"] for r in rows],
            "bytes / minimum": [r["bytes_ratio"] or 0.0 for r in rows],
        },
        "ratio (same run)",
        f"boundary: batch {batch}, seq {seq}, hidden {hidden} fp32, world {WORLD}",
        reference=1.0,
    )
    return doc


def table(doc: dict[str, Any]) -> str:
    rows = [
        [
            r["case"],
            r["mode"],
            f"{r['bytes_moved'] / 2**20:.2f} MiB",
            "-" if r["bytes_ratio"] is None else f"{r['bytes_ratio']:.2f}",
            f"{r['time_s'] * 1e3:.1f} ms",
            f"{r['time_ratio']:.2f}",
        ]
        for r in doc["cases"]
    ]
    return markdown_table(["case", "mode", "moved (fwd+bwd)", "moved / minimum", "time", "time / plain send"], rows)

"""Human and JSON reports of a resolved layout: the rank map and every edge's boundary plan."""

from __future__ import annotations

import math
from typing import Any, Optional

from megatron_hetero.layout.spec import HeteroLayout, ModuleLayout
from megatron_hetero.plan.boundary import BoundaryPlan, BoundaryShape, Transfer, plan_all
from megatron_hetero.plan.placement import Coord, rank_map


def default_shape(
    layout: HeteroLayout, batch: Optional[int] = None, seq: Optional[int] = None, hidden: int = 64, dtype_bytes: int = 4
) -> BoundaryShape:
    """A shape every edge can split: batch = lcm of all DP sizes, seq = 8 * lcm of all 2*cp."""
    if batch is None:
        batch = math.lcm(*(m.dp for m in layout.modules))
    if seq is None:
        seq = 8 * math.lcm(*(2 * m.cp if m.cp > 1 else 1 for m in layout.modules))
    return BoundaryShape(batch=batch, seq=seq, hidden=hidden, dtype_bytes=dtype_bytes)


def _transfer_json(t: Transfer) -> dict[str, int]:
    b = t.block
    return {"src": t.src, "dst": t.dst, "b0": b.b0, "b1": b.b1, "s0": b.s0, "s1": b.s1}


def edge_json(p: BoundaryPlan) -> dict[str, Any]:
    return {
        "src": p.edge.src,
        "dst": p.edge.dst,
        "transform": p.transform,
        "factor": p.factor,
        "shape": {
            "batch": p.shape.batch,
            "seq": p.shape.seq,
            "hidden": p.shape.hidden,
            "dtype_bytes": p.shape.dtype_bytes,
        },
        "src_ranks": list(p.src_ranks),
        "dst_ranks": list(p.dst_ranks),
        "src_leaders": list(p.src_leaders),
        "dst_leader": p.dst_leader,
        "min_bytes_forward": p.min_bytes_forward,
        "planned_bytes_forward": p.planned_bytes("forward"),
        "min_bytes_backward": p.min_bytes_backward,
        "planned_bytes_backward": p.planned_bytes("backward"),
        "modes": {k: {"bytes": c.bytes, "hops": c.hops} for k, c in p.costs.items()},
        "recommended_mode": p.recommended_mode,
        "local_groups": [list(g) for g in p.local_groups()],
        "forward": [_transfer_json(t) for t in p.forward],
        "backward": [_transfer_json(t) for t in p.backward],
    }


def is_moe(m: ModuleLayout, experts: Optional[dict[str, int]] = None) -> bool:
    """Whether module `m` has experts: it declares ep or expt_tp > 1, or `experts` gives it some."""
    return m.ep > 1 or m.expt_tp > 1 or bool((experts or {}).get(m.name))


def expert_coord(m: ModuleLayout, c: Coord) -> dict[str, int]:
    """A rank's expert coordinates in `m` (Megatron's parallel folding inside a pipeline stage:
    expt_tp fastest, then ep, then expert-DP over the stage's tp*cp*dp ranks)."""
    in_stage = c.tp + m.tp * (c.cp + m.cp * c.dp)
    return {"ep": c.ep, "expt_tp": c.expt_tp, "expt_dp": in_stage // (m.expt_tp * m.ep)}


def _module_json(m: ModuleLayout, experts: Optional[dict[str, int]]) -> dict[str, Any]:
    d: dict[str, Any] = {**m.degrees(), "ranks": str(m.ranks), "frozen": m.frozen}
    if m.role is not None:
        d["role"] = m.role
    if is_moe(m, experts):
        d["expt_dp"] = m.stage_size // (m.expt_tp * m.ep)
        n = (experts or {}).get(m.name)
        if n:
            d["num_experts"] = n
            d["experts_per_rank"] = n // m.ep
    return d


def layout_json(layout: HeteroLayout, shape: BoundaryShape, experts: Optional[dict[str, int]] = None) -> dict[str, Any]:
    """The `megatron-hetero plan --json` document. Rank entries of a module with experts (`is_moe`)
    carry its expert coordinates `ep`, `expt_tp`, `expt_dp` too."""

    def coords(e) -> dict[str, dict[str, int]]:
        out = {}
        for n, c in e.modules.items():
            m = layout.module(n)
            out[n] = {**c.as_dict(), **(expert_coord(m, c) if is_moe(m, experts) else {})}
        return out

    return {
        "world_size": layout.world_size,
        "placement": layout.placement,
        "boundary_mode": layout.boundary_mode,
        "modules": {m.name: _module_json(m, experts) for m in layout.modules},
        "ranks": [{"rank": e.rank, "modules": coords(e)} for e in rank_map(layout)],
        "edges": [edge_json(p) for p in plan_all(layout, shape)],
    }


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def layout_text(layout: HeteroLayout, shape: BoundaryShape, experts: Optional[dict[str, int]] = None) -> str:
    """The `megatron-hetero plan` table: rank map (with expert coordinates `ep`, `edp` (expert-DP)
    and `etp` for modules with experts), then one paragraph per edge."""
    lines = [f"world size {layout.world_size}, placement {layout.placement}, boundary mode {layout.boundary_mode}", ""]
    for m in layout.modules:
        if is_moe(m, experts):
            n = (experts or {}).get(m.name)
            lines.insert(
                -1,
                f"module {m.name}: experts folded as expt_tp({m.expt_tp}) x ep({m.ep}) x expt_dp("
                f"{m.stage_size // (m.expt_tp * m.ep)}) over each stage's {m.stage_size} ranks"
                + (f"; {n} experts, {n // m.ep} per EP rank" if n else ""),
            )
    heads = ["rank"] + [f"{m.name} {m.short()} @{m.ranks}" + (" frozen" if m.frozen else "") for m in layout.modules]
    rows = []
    for e in rank_map(layout):
        row = [str(e.rank)]
        for m in layout.modules:
            c = e.modules.get(m.name)
            if c is None:
                row.append("-")
            else:
                text = f"tp{c.tp} cp{c.cp} dp{c.dp} pp{c.pp}"
                if is_moe(m, experts):
                    x = expert_coord(m, c)
                    text += f" ep{x['ep']} edp{x['expt_dp']}" + (f" etp{x['expt_tp']}" if m.expt_tp > 1 else "")
                row.append(text)
        rows.append(row)
    widths = [max(len(r[i]) for r in [heads] + rows) for i in range(len(heads))]
    for cells in [heads] + rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(cells, widths)).rstrip())
    for p in plan_all(layout, shape):
        s = p.shape
        lines += [
            "",
            f"edge {p.edge}: {p.transform}"
            + (f" x{p.factor}" if p.factor > 1 else "")
            + f"  [batch {s.batch}, seq {s.seq}, hidden {s.hidden}] x {s.dtype_bytes} B",
            f"  source ranks {list(p.src_ranks)} -> destination ranks {list(p.dst_ranks)}",
            f"  forward : moves {fmt_bytes(p.planned_bytes('forward'))} (minimum {fmt_bytes(p.min_bytes_forward)})",
            f"  backward: moves {fmt_bytes(p.planned_bytes('backward'))} (minimum {fmt_bytes(p.min_bytes_backward)})",
            "  modes   : "
            + ", ".join(f"{k} {fmt_bytes(c.bytes)} in {c.hops} serial hops" for k, c in p.costs.items())
            + f"; recommended {p.recommended_mode}",
            f"  leaders : source {list(p.src_leaders)}, destination {p.dst_leader}",
        ]
        if p.placement == "colocated":
            lines.append(f"  local groups: {[list(g) for g in p.local_groups()]}")
        for r in p.dst_ranks:
            got = p.recvs(r)
            own = p.local_copies(r)
            parts = []
            if own:
                parts.append("selects " + ", ".join(str(t.block) for t in own))
            if got:
                parts.append("receives " + ", ".join(f"{t.block} from {t.src}" for t in got))
            lines.append(f"  rank {r}: " + "; ".join(parts))
    return "\n".join(lines)

"""Pictures: a trace as a per-rank Gantt chart, a layout's ranks and edges, a schedule's planned timeline.

    draw_timeline(trace_doc, out)     `megatron-hetero timeline FILE.json --out FILE.png`
    draw_layout(layout, out)          `megatron-hetero plan LAYOUT --draw FILE.png`
    draw_schedule(layout, out, ...)   `megatron-hetero schedule LAYOUT --draw FILE.png`

Each returns a summary of what it drew, read back from the figure before it is saved: `ranks` (the
rank rows or cells drawn, from the axes' labels), `bars` / `cells`, `kinds` or `modules`, `size`
(the PNG's [width, height] in pixels). The per-rank rows of a planned schedule come from the pure
plan (`planned_timeline`: the disjoint tables' simulated spans, `plan.schedule_check.simulate`; the
colocated tables' phases with nominal costs) and need no matplotlib.

matplotlib (the `bench` extra) is imported inside the drawing functions only (Agg backend); without
it they raise ImportError with the install hint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

#: Colours of the span kinds (`runtime.trace.KINDS`; the planned timelines use the same kinds).
KIND_COLOURS = {
    "encoder-forward": "#4c9be8",
    "encoder-backward": "#1f4e99",
    "llm-forward": "#f5a54a",
    "llm-backward": "#c4580c",
    "boundary": "#2ca02c",
    "comm": "#c7e9c0",
    "wait": "#d62728",
    "grad-reduce": "#9467bd",
    "optimizer": "#8c564b",
    "loss-reduce": "#e377c2",
    "offload": "#7f7f7f",
    "schedule": "#eeeeee",
}
#: Nominal costs of the colocated phases' actions (one encoder stage's forward over its DP share,
#: one language micro-batch per stage, ...): a picture of the order, not a prediction.
NOMINAL = {
    "encoder-forward": 1.0,
    "encoder-backward": 2.0,
    "llm-forward": 1.0,
    "llm-backward": 2.0,
    "boundary": 0.5,
    "offload": 0.5,
    "grad-reduce": 0.5,
    "optimizer": 0.25,
}

Row = list  # of (start, end, kind, label)


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("drawing needs matplotlib: pip install -e '.[bench]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# -- Gantt charts ------------------------------------------------------------------------------
def _depths(spans: Row) -> tuple[list[int], list[bool]]:
    """Nesting depth of each span of one row (a span inside another is one deeper), and whether a
    span has a span inside it."""
    order = sorted(range(len(spans)), key=lambda i: (spans[i][0], -(spans[i][1] - spans[i][0])))
    depth, parent = [0] * len(spans), [False] * len(spans)
    stack: list[tuple[float, int]] = []
    for i in order:
        t0, t1 = spans[i][0], spans[i][1]
        while stack and stack[-1][0] <= t0:
            stack.pop()
        depth[i] = len(stack)
        if stack:
            parent[stack[-1][1]] = True
        stack.append((t1, i))
    return depth, parent


def gantt(
    rows: Mapping[int, Row], out: Path, *, title: str, xlabel: str, kinds_order: Optional[list[str]] = None
) -> dict[str, Any]:
    """One row per rank (rank 0 at the top), one bar per span coloured by kind, nested spans drawn
    thinner on top of their parents; a bar's label is written inside it when it fits."""
    plt = _pyplot()
    from matplotlib.patches import Patch

    ranks = sorted(rows)
    t_end = max((s[1] for r in rows.values() for s in r), default=1.0) or 1.0
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.42 * max(len(ranks), 1)))
    char = 6 * 0.62 / 72 * (t_end * 1.01) / (14 * 0.8)  # the width of one 6 pt character in data units
    kinds_seen: list[str] = []
    bars, labels = 0, 0
    for y, rank in enumerate(ranks):
        spans = rows[rank]
        depth, parent = _depths(spans)
        groups: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for (t0, t1, kind, label), d, has_inner in zip(spans, depth, parent):
            groups.setdefault((kind, d), []).append((t0, max(t1 - t0, t_end * 1e-4)))
            if kind not in kinds_seen:
                kinds_seen.append(kind)
            if label and not has_inner and (t1 - t0) >= (len(label) + 1) * char and labels < 600:
                ax.text((t0 + t1) / 2, y, label, ha="center", va="center", fontsize=6, zorder=10 + d, clip_on=True)
                labels += 1
        for (kind, d), segs in groups.items():
            h = 0.8 * 0.72**d
            ax.broken_barh(
                segs,
                (y - h / 2, h),
                facecolors=KIND_COLOURS.get(kind, "#bbbbbb"),
                edgecolor="white",
                linewidth=0.3,
                zorder=2 + d,
                gid=f"rank{rank}",
            )
            bars += len(segs)
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}" for r in ranks], fontsize=8)
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_xlim(0, t_end * 1.01)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    order = [k for k in (kinds_order or list(KIND_COLOURS)) if k in kinds_seen] + [
        k for k in kinds_seen if k not in (kinds_order or list(KIND_COLOURS))
    ]
    ax.legend(
        handles=[Patch(facecolor=KIND_COLOURS.get(k, "#bbbbbb"), label=k) for k in order],
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        frameon=False,
    )
    ax.grid(axis="x", lw=0.3, alpha=0.5)
    fig.tight_layout()
    drawn = sorted(int(t.get_text().split()[1]) for t in ax.get_yticklabels())
    n_bars = sum(len(c.get_paths()) for c in ax.collections)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    size = [round(fig.get_figwidth() * 100), round(fig.get_figheight() * 100)]
    plt.close(fig)
    assert n_bars == bars, (n_bars, bars)
    return {"ranks": drawn, "bars": n_bars, "kinds": order, "size": size, "out": str(out)}


def trace_rows(doc: Mapping[str, Any]) -> dict[int, Row]:
    """{rank: [(start ms, end ms, kind, name)]} of a Chrome trace document (`runtime.trace`)."""
    rows: dict[int, Row] = {r: [] for r in doc.get("otherData", {}).get("ranks", [])}
    for e in doc["traceEvents"]:
        if e.get("ph") != "X":
            continue
        t0 = float(e["ts"]) / 1e3
        rows.setdefault(int(e["pid"]), []).append(
            (t0, t0 + float(e.get("dur", 0.0)) / 1e3, e.get("cat", ""), e.get("name", ""))
        )
    return rows


def draw_timeline(doc: Mapping[str, Any], out: Path, title: Optional[str] = None) -> dict[str, Any]:
    """A trace (`train --trace`) as a per-rank Gantt chart; see `gantt`."""
    rows = trace_rows(doc)
    if not rows:
        raise ValueError("the trace holds no rank: not a megatron-hetero trace (no 'X' events, no otherData.ranks)")
    other = doc.get("otherData", {})
    if title is None:
        lay = other.get("layout", {})
        title = f"trace: {other.get('placement', '')} " + ", ".join(f"{n} {d}" for n, d in lay.items())
    return gantt(rows, out, title=title, xlabel="time (ms)", kinds_order=other.get("kinds"))


# -- the planned schedule -------------------------------------------------------------------------
def _with_waits(row: Row, start: float = 0.0) -> Row:
    """`row` (sorted, non-overlapping) with a 'wait' span in every gap from `start` on."""
    out: Row = []
    t = start
    for sp in sorted(row):
        if sp[0] > t + 1e-12:
            out.append((t, sp[0], "wait", ""))
        out.append(sp)
        t = max(t, sp[1])
    return out


def _disjoint_rows(
    layout, micro_batches: int, stage_costs=None, module_costs=None, latency: float = 0.0
) -> dict[int, Row]:
    from megatron_hetero.plan.roles import roles
    from megatron_hetero.plan.schedule import Forward, build_tables
    from megatron_hetero.plan.schedule_check import check_tables

    tables = build_tables(layout, micro_batches, stage_costs=stage_costs, module_costs=module_costs)
    report = check_tables(tables, layout=layout, micro_batches=micro_batches, latency=latency)
    who = roles(layout)
    rows: dict[int, Row] = {r: [] for r in range(layout.world_size)}
    for st, t in tables.items():
        role = "encoder" if who.is_encoder(st.module) else "llm"
        row = []
        for sp in report.spans[st]:
            d = "forward" if isinstance(sp.action, Forward) else "backward"
            row.append((sp.start, sp.end, f"{role}-{d}", sp.action.short()))
        row = _with_waits(row)
        for r in t.ranks:
            rows[r] = list(row)
    return rows


def _pipeline(pp: int, micro: int, f: float, b: float) -> list[Row]:
    """Nominal 1F1B of one language DP replica: per stage, (start, end, kind, label) from 0."""
    from megatron_hetero.plan.schedule import one_f_one_b_order

    orders = [one_f_one_b_order(micro, min(micro, pp - s - 1)) for s in range(pp)]
    done: dict[tuple[str, int, int], float] = {}
    pos, clock = [0] * pp, [0.0] * pp
    rows: list[Row] = [[] for _ in range(pp)]
    while any(pos[s] < len(orders[s]) for s in range(pp)):
        moved = False
        for s in range(pp):
            while pos[s] < len(orders[s]):
                kind, i = orders[s][pos[s]]
                dep = (
                    ("F", s - 1, i)
                    if kind == "F" and s > 0
                    else ("B", s + 1, i)
                    if kind == "B" and s < pp - 1
                    else None
                )
                if dep is not None and dep not in done:
                    break
                t0 = max(clock[s], done.get(dep, 0.0)) if dep else clock[s]
                t1 = t0 + (f if kind == "F" else b)
                done[(kind, s, i)] = clock[s] = t1
                rows[s].append((t0, t1, "llm-forward" if kind == "F" else "llm-backward", f"{kind}{i}"))
                pos[s] += 1
                moved = True
        assert moved, "nominal 1F1B deadlocked"
    return [_with_waits(r) for r in rows]


def _colocated_rows(layout, global_batch: int, micro_batch_size: int, offload: bool) -> dict[int, Row]:
    """The colocated tables' phases on a common clock with `NOMINAL` costs: pipeline receives wait
    for their send, boundary calls, the language phase and the closing collectives start together."""
    from megatron_hetero.plan.colocated import (
        BoundaryCall,
        Collective,
        EncoderBackward,
        EncoderForward,
        LanguagePhase,
        StateMove,
        colocated_tables,
    )
    from megatron_hetero.plan.actions import Recv, Send

    tables = colocated_tables(layout, global_batch, micro_batch_size, offload)
    acts = {r: t.actions for r, t in tables.items()}
    pos = {r: 0 for r in tables}
    clock = {r: 0.0 for r in tables}
    rows: dict[int, Row] = {r: [] for r in tables}
    wires: dict[tuple[int, int], list[float]] = {}
    glob = (BoundaryCall, LanguagePhase, Collective)
    pipe_cache: dict[tuple[int, int], list[Row]] = {}
    while True:
        for r in tables:
            while pos[r] < len(acts[r]):
                a = acts[r][pos[r]]
                if isinstance(a, Send):
                    wires.setdefault((r, a.peer_rank), []).append(clock[r])
                elif isinstance(a, Recv):
                    q = wires.get((a.peer_rank, r))
                    if not q:
                        break
                    t = q.pop(0)
                    if t > clock[r]:
                        rows[r].append((clock[r], t, "wait", ""))
                        clock[r] = t
                elif isinstance(a, glob):
                    break
                else:
                    kind = (
                        "encoder-forward"
                        if isinstance(a, EncoderForward)
                        else "encoder-backward"
                        if isinstance(a, EncoderBackward)
                        else "offload"
                    )
                    assert isinstance(a, (EncoderForward, EncoderBackward, StateMove)), a
                    label = ("F" if kind == "encoder-forward" else "B") if kind != "offload" else a.kind[:3]
                    rows[r].append((clock[r], clock[r] + NOMINAL[kind], kind, label))
                    clock[r] += NOMINAL[kind]
                pos[r] += 1
        waiting = {r: acts[r][pos[r]] for r in tables if pos[r] < len(acts[r])}
        if not waiting:
            break
        assert len(waiting) == len(tables) and all(isinstance(a, glob) for a in waiting.values()), waiting
        start = max(clock.values())
        for r, a in waiting.items():
            if clock[r] < start:
                rows[r].append((clock[r], start, "wait", ""))
            if isinstance(a, BoundaryCall):
                end = start + NOMINAL["boundary"]
                rows[r].append((start, end, "boundary", a.direction[:3]))
            elif isinstance(a, LanguagePhase):
                key = (a.pp, a.micro_batches)
                if key not in pipe_cache:
                    pipe_cache[key] = _pipeline(a.pp, a.micro_batches, NOMINAL["llm-forward"], NOMINAL["llm-backward"])
                stage = pipe_cache[key][a.stage]
                rows[r] += [(start + t0, start + t1, k, lab) for t0, t1, k, lab in stage]
                end = start + (stage[-1][1] if stage else 0.0)
            else:
                kind = {"grad-sync": "grad-reduce", "optimizer": "optimizer"}.get(a.kind, "loss-reduce")
                end = start + NOMINAL.get(kind, 0.25)
                rows[r].append((start, end, kind, a.kind[:4]))
            clock[r] = end
            pos[r] += 1
    return rows


def planned_timeline(
    layout,
    *,
    micro_batches: Optional[int] = None,
    global_batch: int = 8,
    micro_batch_size: int = 1,
    offload: bool = False,
    stage_costs=None,
    module_costs=None,
    latency: float = 0.0,
) -> dict[int, Row]:
    """{rank: [(start, end, kind, label)]} of every rank of `layout` (pure, no matplotlib): disjoint,
    the simulated spans of the 1F1B stage tables (`micro_batches` required); colocated, the
    three-phase tables with `NOMINAL` costs. Idle ranks get an empty row."""
    if layout.placement == "colocated":
        return _colocated_rows(layout, global_batch, micro_batch_size, offload)
    if micro_batches is None:
        raise ValueError("--micro-batches M is required for a disjoint layout")
    return _disjoint_rows(layout, micro_batches, stage_costs, module_costs, latency)


def draw_schedule(layout, out: Path, **kwargs) -> dict[str, Any]:
    """`planned_timeline` as a Gantt chart (one row per rank of the layout)."""
    rows = planned_timeline(layout, **kwargs)
    if layout.placement == "colocated":
        title = f"colocated three-phase schedule, nominal costs (global batch {kwargs.get('global_batch', 8)})"
    else:
        title = f"disjoint graph-aware 1F1B, {kwargs.get('micro_batches')} micro-batches (simulated costs)"
    title += ": " + ", ".join(f"{m.name} {m.short()} @{m.ranks}" for m in layout.modules)
    return gantt(rows, out, title=title, xlabel="time (cost units)")


# -- the layout -----------------------------------------------------------------------------------
def _coord_text(m, c) -> str:
    text = f"tp{c.tp} cp{c.cp}\npp{c.pp} dp{c.dp}"
    if m.ep > 1 or m.expt_tp > 1:
        text += f"\nep{c.ep} etp{c.expt_tp}"
    return text


def draw_layout(layout, out: Path, shape=None) -> dict[str, Any]:
    """Ranks as cells, one row per module over the global ranks: a module's cells sit on its ranks
    (colocated: every row is full; disjoint: each module on its island), coloured by module and
    labelled with the rank's coordinates in that module; idle ranks (gaps between islands) in grey.
    Every edge is an arrow from its source row to its destination row, labelled with its transform
    (`plan.boundary.transform_of`) and, with `shape` (a `BoundaryShape`), the bytes its plan moves."""
    plt = _pyplot()
    from matplotlib.patches import FancyArrowPatch, Rectangle

    from megatron_hetero.plan.boundary import plan_boundary, transform_of
    from megatron_hetero.plan.placement import coord_of, stage_ranks

    world, mods = layout.world_size, list(layout.modules)
    colours = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(max(6.0, 1.05 * world + 3.5), 1.2 + 1.25 * len(mods)))
    cells, drawn_ranks = 0, set()
    used = set()
    for y, m in enumerate(mods):
        for r in m.ranks.ranks():
            ax.add_patch(
                Rectangle(
                    (r, y),
                    0.94,
                    0.86,
                    facecolor=colours(y % 10),
                    alpha=0.75,
                    edgecolor="black",
                    linewidth=0.5,
                    gid=f"cell {m.name} {r}",
                )
            )
            ax.text(
                r + 0.47, y + 0.43, f"r{r}\n" + _coord_text(m, coord_of(m, r)), ha="center", va="center", fontsize=6.5
            )
            cells += 1
            used.add(r)
    for r in range(world):  # ranks no module uses
        if r not in used:
            ax.add_patch(
                Rectangle(
                    (r, -0.9), 0.94, 0.6, facecolor="#dddddd", edgecolor="black", linewidth=0.5, gid=f"cell idle {r}"
                )
            )
            ax.text(r + 0.47, -0.6, f"r{r}\nidle", ha="center", va="center", fontsize=6.5)
            cells += 1
    row = {m.name: y for y, m in enumerate(mods)}
    edges = []
    for k, e in enumerate(layout.edges):
        src, dst = layout.module(e.src), layout.module(e.dst)
        kind, factor = transform_of(src, dst)
        label = f"{e.src}->{e.dst}: {kind}" + (f" x{factor}" if factor > 1 else "") + f"\nDP{src.dp}->DP{dst.dp}"
        if src.tp != dst.tp or src.cp != dst.cp:
            label += f", TP{src.tp}->TP{dst.tp}, CP{src.cp}->CP{dst.cp}"
        if shape is not None:
            p = plan_boundary(layout, e, shape)
            label += f"\n{p.planned_bytes('forward')} B fwd, {p.planned_bytes('backward')} B bwd"
        y0, y1 = row[e.src] + 0.43, row[e.dst] + 0.43
        if layout.placement == "colocated":  # rows over the same ranks: arrows in the left margin
            x0 = x1 = -0.35 - 0.5 * k
            a, b = (x0, y0), (x1, y1)
            tx, ty, ha = x0 - 0.12, y0 + 0.3 * (y1 - y0), "right"
        else:  # from the source's last stage to the destination's first stage
            last, first = stage_ranks(src, src.pp - 1), stage_ranks(dst, 0)  # the edge's end stages
            x0, x1 = (last[0] + last[-1] + 1) / 2, (first[0] + first[-1] + 1) / 2
            down = 1 if y1 > y0 else -1
            a, b = (x0, y0 + down * 0.45), (x1, y1 - down * 0.45)
            tx, ty, ha = x0 + 0.3 * (x1 - x0) + 0.1, a[1] + 0.3 * (b[1] - a[1]), "left"
        ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=14, color="black", lw=1.2, zorder=7))
        ax.text(
            tx, ty, label, fontsize=7, ha=ha, va="center", zorder=6, bbox={"facecolor": "white", "alpha": 0.85, "lw": 0}
        )
        edges.append({"edge": str(e), "transform": kind, "factor": factor})
    left = -0.3 - (0.5 * len(layout.edges) + 2.4 if layout.placement == "colocated" else 0)
    ax.set_xlim(left, world + 0.2)
    ax.set_ylim(len(mods) + 0.05, -1.0 if len(used) < world else -0.15)
    ax.set_yticks([y + 0.43 for y in range(len(mods))])
    ax.set_yticklabels([f"{m.name}\n{m.short()}" + (" frozen" if m.frozen else "") for m in mods], fontsize=8)
    ax.set_xticks([r + 0.47 for r in range(world)])
    ax.set_xticklabels([str(r) for r in range(world)], fontsize=7)
    ax.set_xlabel("global rank")
    ax.set_title(f"{layout.placement} layout, {world} ranks", fontsize=10)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    for p in ax.patches:
        gid = p.get_gid() or ""
        if gid.startswith("cell "):
            drawn_ranks.add(int(gid.split()[-1]))
    n_cells = sum(1 for p in ax.patches if (p.get_gid() or "").startswith("cell "))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    size = [round(fig.get_figwidth() * 100), round(fig.get_figheight() * 100)]
    plt.close(fig)
    return {
        "ranks": sorted(drawn_ranks),
        "cells": n_cells,
        "modules": [m.name for m in mods],
        "edges": edges,
        "size": size,
        "out": str(out),
    }

"""Checker and simulator for per-stage schedule tables (pure: no torch, no torch.distributed).

Execution models: `schedule_sim.py` ('buffered', the default for timing, and 'rendezvous', what
the runtime's `batch_isend_irecv` batches execute under).

`check_tables` proves, raising `ScheduleError` (a ValueError) naming stage, action and micro-batch:
  0. every action belongs to its table's stage (Forward/Backward of that stage, sends/receives on
     links that end at it in the right direction); with `layout=`, the stages and links are exactly
     those of the layout's stage graph;
  1. coverage: every micro-batch 0..M-1 runs Forward and Backward exactly once on every stage,
     Backward after Forward; in a zero-bubble table (`schedule` "zb") also WeightGrad exactly once,
     after its Backward (and none in a 1F1B table); WeightGrad has no communication, so data flow
     and deadlock freedom are checked exactly as for 1F1B, with the weight passes in the order the
     runtime runs them (they take their share of the backward cost, `StageTable.cost_of`);
  2. matching: every receive has exactly one matching send and every send is received once;
  3. data flow: on every link, the activation of mb is received before the consumer's Forward(mb)
     and sent after the producer's Forward(mb); the gradient is received before the producer's
     Backward(mb) and sent after the consumer's Backward(mb);
  4. no deadlock: the simulation in the chosen mode completes (otherwise the message lists each
     blocked stage and the receive or batch it waits on);
and reports the makespan, per-stage busy/idle time and the bubble fraction
  1 - sum(busy over stages) / (makespan * number of stages).

`chain_bubble(P, M)` is the analytic 1F1B bubble (P-1)/(M+P-1) of a linear chain of P stages with
equal stage costs, for cross-checking the simulation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, NoReturn, Optional, Union

from megatron_hetero.plan.actions import Backward, Forward, Link, Recv, Send, Stage, WeightGrad
from megatron_hetero.plan.schedule import StageGraph, StageTable, stage_graph
from megatron_hetero.plan.schedule_sim import (  # the simulators; re-exported: their public path
    ScheduleError,
    Span,
    simulate,
    simulate_leader_routes,
    simulate_rendezvous,
    split_batches,
)

__all__ = [
    "CheckReport",
    "ScheduleError",
    "Span",
    "chain_bubble",
    "chain_makespan",
    "check_tables",
    "simulate",
    "simulate_leader_routes",
    "simulate_rendezvous",
    "split_batches",
]


@dataclass(frozen=True)
class CheckReport:
    """The verdict of `check_tables` (only produced when every check passed)."""

    ok: bool
    micro_batches: int
    stages: tuple  # of Stage, sorted
    makespan: float
    bubble_fraction: float
    busy: Mapping  # Stage -> total compute time
    idle: Mapping  # Stage -> makespan - busy
    finish: Mapping  # Stage -> time its last action completed
    spans: Mapping  # Stage -> tuple of Span (compute actions, in order)
    messages: int  # number of matched send/receive pairs

    def summary(self) -> str:
        return (
            f"ok: {len(self.stages)} stages, {self.micro_batches} micro-batches, {self.messages} messages matched, "
            f"no deadlock; makespan {self.makespan:g}, bubble {self.bubble_fraction:.4f}"
        )


def chain_bubble(num_stages: int, micro_batches: int) -> float:
    """Analytic 1F1B bubble of a linear chain of `num_stages` equal-cost stages: (P-1)/(M+P-1)."""
    p, m = num_stages, micro_batches
    if p < 1 or m < 1:
        raise ValueError(f"need num_stages >= 1 and micro_batches >= 1, got {p} and {m}")
    return (p - 1) / (m + p - 1)


def chain_makespan(num_stages: int, micro_batches: int, forward: float = 1.0, backward: float = 2.0) -> float:
    """Analytic 1F1B makespan of a linear equal-cost chain: (M+P-1) * (forward + backward)."""
    return (micro_batches + num_stages - 1) * (forward + backward)


def _fail(stage: Stage, msg: str) -> NoReturn:
    raise ScheduleError(f"stage {stage}: {msg}")


def _normalize(tables) -> dict[Stage, StageTable]:
    """Accept {Stage: table}, {rank: table} (from rank_tables) or an iterable of tables."""
    items: Iterable[StageTable] = tables.values() if isinstance(tables, Mapping) else tables
    if isinstance(tables, Mapping):
        for key, t in tables.items():
            if isinstance(key, Stage) and isinstance(t, StageTable) and t.stage != key:
                raise ScheduleError(f"table under key {key} is the table of stage {t.stage}")
    out: dict[Stage, StageTable] = {}
    for t in items:
        if not isinstance(t, StageTable):
            raise ScheduleError(f"expected StageTable objects, got {type(t).__name__}")
        if t.stage in out and out[t.stage] != t:
            raise ScheduleError(
                f"stage {t.stage}: two different tables given (ranks of one stage must share one table)"
            )
        out[t.stage] = t
    if not out:
        raise ScheduleError("no tables given")
    return dict(sorted(out.items()))


def _check_ownership(t: StageTable) -> None:
    for i, a in enumerate(t.actions):
        if not isinstance(a, (Forward, Backward, WeightGrad, Send, Recv)):
            _fail(t.stage, f"action #{i} {a!r} is not a Forward, Backward, WeightGrad, Send or Recv")
        owner = a.stage  # Send/Recv: the end of the link that executes it, by direction
        if isinstance(a.mb, bool) or not isinstance(a.mb, int) or a.mb < 0:
            _fail(t.stage, f"action #{i} {a}: micro-batch must be an integer >= 0")
        if owner != t.stage:
            _fail(t.stage, f"action #{i} {a} belongs to stage {owner}, not to this table")


def _check_against_graph(tables: dict[Stage, StageTable], graph: StageGraph) -> None:
    want, have = set(graph.stages), set(tables)
    if want - have:
        raise ScheduleError(f"no table for stages {sorted(map(str, want - have))} of the layout")
    if have - want:
        raise ScheduleError(f"tables for stages {sorted(map(str, have - want))} that the layout does not have")
    known = set(graph.links)
    for st, t in tables.items():
        for i, a in enumerate(t.actions):
            if isinstance(a, (Send, Recv)) and a.link not in known:
                _fail(st, f"action #{i} {a}: link {a.link} is not in the layout's stage graph")


def _check_coverage(tables: dict[Stage, StageTable], micro_batches: Optional[int]) -> int:
    mbs = {a.mb for t in tables.values() for a in t.actions}
    m = micro_batches if micro_batches is not None else (max(mbs) + 1 if mbs else 0)
    if m < 1:
        raise ScheduleError("tables contain no micro-batches")
    for st, t in tables.items():
        pos: dict[tuple[type, int], int] = {}
        for i, a in enumerate(t.actions):
            if a.mb >= m:
                _fail(st, f"action #{i} {a}: micro-batch {a.mb} outside 0..{m - 1}")
            if isinstance(a, (Forward, Backward, WeightGrad)):
                key = (type(a), a.mb)
                if key in pos:
                    _fail(st, f"{a} appears twice (actions #{pos[key]} and #{i})")
                pos[key] = i
        for mb in range(m):
            f, b = pos.get((Forward, mb)), pos.get((Backward, mb))
            if f is None:
                _fail(st, f"Forward mb {mb} is missing")
            if b is None:
                _fail(st, f"Backward mb {mb} is missing")
            if b < f:
                _fail(st, f"Backward mb {mb} (action #{b}) comes before Forward mb {mb} (action #{f})")
            # zero-bubble tables: the weight-gradient pass of every micro-batch, once, after its Backward
            w = pos.get((WeightGrad, mb))
            if t.schedule == "zb" and w is None:
                _fail(st, f"WeightGrad mb {mb} is missing (a zero-bubble table)")
            if t.schedule != "zb" and w is not None:
                _fail(st, f"WeightGrad mb {mb} (action #{w}) in a {t.schedule} table")
            if w is not None and w < b:
                _fail(st, f"WeightGrad mb {mb} (action #{w}) comes before Backward mb {mb} (action #{b})")
    return m


def _check_matching(tables: dict[Stage, StageTable]) -> int:
    sends: dict[tuple, tuple[Stage, int]] = {}
    recvs: dict[tuple, tuple[Stage, int]] = {}
    for st, t in tables.items():
        for i, a in enumerate(t.actions):
            if isinstance(a, (Send, Recv)):
                book = sends if isinstance(a, Send) else recvs
                key = (a.link, a.mb, a.direction)
                if key in book:
                    _fail(st, f"{a} appears twice (actions #{book[key][1]} and #{i})")
                book[key] = (st, i)
    for key, (st, _i) in recvs.items():
        if key not in sends:
            link, mb, d = key
            peer = link.src if d == "forward" else link.dst
            extra = "" if peer in tables else f" (no table for stage {peer})"
            _fail(st, f"Recv {d} {link} mb {mb} has no matching send{extra}")
    for key, (st, _i) in sends.items():
        if key not in recvs:
            link, mb, d = key
            peer = link.dst if d == "forward" else link.src
            _fail(st, f"Send {d} {link} mb {mb} is never received (stage {peer} has no Recv {d} {link} mb {mb})")
    return len(sends)


def _check_dataflow(tables: dict[Stage, StageTable], graph: Optional[StageGraph], m: int) -> None:
    links = set(graph.links) if graph is not None else set()
    for t in tables.values():
        links |= {a.link for a in t.actions if isinstance(a, (Send, Recv))}
    index: dict[Stage, dict[object, int]] = {st: {a: i for i, a in enumerate(t.actions)} for st, t in tables.items()}
    for lk in sorted(links):
        src, dst = index.get(lk.src), index.get(lk.dst)
        if src is None or dst is None:
            missing = lk.src if src is None else lk.dst
            raise ScheduleError(f"link {lk}: no table for stage {missing}")
        for mb in range(m):
            # (stage, index of stage, the compute action, the comm action, comm must come before compute?)
            checks = (
                (lk.dst, dst, Forward(lk.dst, mb), Recv(lk, mb, "forward"), True),
                (lk.src, src, Forward(lk.src, mb), Send(lk, mb, "forward"), False),
                (lk.src, src, Backward(lk.src, mb), Recv(lk, mb, "backward"), True),
                (lk.dst, dst, Backward(lk.dst, mb), Send(lk, mb, "backward"), False),
            )
            for st, idx, compute, comm, before in checks:
                ci, mi = idx[compute], idx.get(comm)
                if mi is None:
                    word = "preceded" if before else "followed"
                    _fail(st, f"{compute} is not {word} by {comm}")
                if before and mi > ci:
                    _fail(st, f"{comm} (action #{mi}) comes after {compute} (action #{ci}) that needs it")
                if not before and mi < ci:
                    _fail(st, f"{comm} (action #{mi}) comes before {compute} (action #{ci}) that produces it")


def check_tables(
    tables,
    *,
    layout=None,
    micro_batches: Optional[int] = None,
    costs: Optional[Mapping[str, tuple]] = None,
    latency: Union[None, float, Mapping[Link, float]] = None,
    mode: str = "buffered",
) -> CheckReport:
    """Check and simulate a complete set of stage tables; see the module docstring.

    `tables`: {Stage: StageTable}, {rank: StageTable} or an iterable of StageTable.
    `layout`: optional resolved disjoint layout whose stage graph the tables must implement.
    `micro_batches`: the expected M (default: inferred as the largest micro-batch + 1).
    `costs`: {module: (forward, backward)} per-stage costs overriding the tables' own.
    `latency`: per-message latency, one number or {Link: seconds}.
    `mode`: 'buffered' or 'rendezvous' (the execution model of the simulation).
    """
    if mode not in ("buffered", "rendezvous"):
        raise ValueError(f"mode must be 'buffered' or 'rendezvous', got {mode!r}")
    by_stage = _normalize(tables)
    for t in by_stage.values():
        _check_ownership(t)
    graph = stage_graph(layout) if layout is not None else None
    if graph is not None:
        _check_against_graph(by_stage, graph)
    m = _check_coverage(by_stage, micro_batches)
    messages = _check_matching(by_stage)
    _check_dataflow(by_stage, graph, m)
    sim = simulate if mode == "buffered" else simulate_rendezvous
    finish, spans, busy = sim(by_stage, costs=costs, latency=latency)
    makespan = max(finish.values())
    total_busy = sum(busy.values())
    n = len(by_stage)
    bubble = 1.0 - total_busy / (makespan * n) if makespan > 0 else 0.0
    return CheckReport(
        ok=True,
        micro_batches=m,
        stages=tuple(by_stage),
        makespan=makespan,
        bubble_fraction=bubble,
        busy=busy,
        idle={st: makespan - b for st, b in busy.items()},
        finish=finish,
        spans=spans,
        messages=messages,
    )

"""Checker and simulator for per-stage schedule tables (pure: no torch, no torch.distributed).

Execution models (all stage tables run together, each stage sequentially in table order):
  'buffered' (the default for timing): a send is asynchronous and never blocks, the message is
    buffered until received; a receive blocks until the matching send (same link, micro-batch,
    direction) has executed and completes at max(own clock, send time + link latency);
  'rendezvous' (what NCCL and gloo point-to-point guarantee, zero buffering): the table runs as its
    `StageTable.batches()`; a batch of sends and receives is posted at once, each of its operations
    is matched only when the peer has posted the batch holding the counterpart, and the batch
    completes when all its operations are matched (at the latest post time + link latency). This is
    the model the runtime's `batch_isend_irecv` batches execute under.
  Forward/Backward take the stage's forward/backward cost; communication takes no time.

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


class ScheduleError(ValueError):
    """A schedule table set is inconsistent, incomplete or deadlocks."""


@dataclass(frozen=True)
class Span:
    """One compute action's simulated interval."""

    start: float
    end: float
    action: object


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


def _latency_of(latency, link: Link) -> float:
    if latency is None:
        return 0.0
    if isinstance(latency, Mapping):
        return float(latency.get(link, 0.0))
    return float(latency)


def _cost_of(t: StageTable, a, costs) -> float:
    if costs is not None and t.stage.module in costs:
        f, b = costs[t.stage.module]
        return t.cost_of(a, f, b)
    return t.cost_of(a)


def simulate(
    tables: dict[Stage, StageTable],
    *,
    costs: Optional[Mapping[str, tuple]] = None,
    latency: Union[None, float, Mapping[Link, float]] = None,
) -> tuple[dict[Stage, float], dict[Stage, tuple], dict[Stage, float]]:
    """Run all tables under the execution model; returns (finish, spans, busy) per stage.

    Raises `ScheduleError` on deadlock, listing every blocked stage and what it waits on.
    Event-driven: a stage runs until it blocks on a receive; a send wakes the stage waiting on it.
    The resulting times do not depend on the order in which stages are advanced.
    """
    clock = {st: 0.0 for st in tables}
    pc = {st: 0 for st in tables}
    busy = {st: 0.0 for st in tables}
    spans: dict[Stage, list[Span]] = {st: [] for st in tables}
    sent: dict[tuple, float] = {}
    waiting: dict[tuple, Stage] = {}
    ready = list(tables)
    while ready:
        st = ready.pop()
        t = tables[st]
        while pc[st] < len(t.actions):
            a = t.actions[pc[st]]
            if isinstance(a, Recv):
                key = (a.link, a.mb, a.direction)
                if key not in sent:
                    waiting[key] = st
                    break
                clock[st] = max(clock[st], sent.pop(key))
            elif isinstance(a, Send):
                key = (a.link, a.mb, a.direction)
                sent[key] = clock[st] + _latency_of(latency, a.link)
                if key in waiting:
                    ready.append(waiting.pop(key))
            else:
                c = _cost_of(t, a, costs)
                spans[st].append(Span(clock[st], clock[st] + c, a))
                clock[st] += c
                busy[st] += c
            pc[st] += 1
    blocked = [st for st in tables if pc[st] < len(tables[st].actions)]
    if blocked:
        lines = []
        for st in blocked:
            a = tables[st].actions[pc[st]]
            lines.append(f"stage {st} blocked at action #{pc[st]} {a} (waiting for stage {a.peer})")
        raise ScheduleError("deadlock: " + "; ".join(lines))
    return clock, {st: tuple(v) for st, v in spans.items()}, busy


def _counterpart(op) -> tuple:
    rnd, a = op if isinstance(op, tuple) else ("", op)
    kind = "recv" if isinstance(a, Send) else "send"
    return (kind, a.link, a.mb, a.direction, rnd)


def _key(op) -> tuple:
    rnd, a = op if isinstance(op, tuple) else ("", op)
    return ("send" if isinstance(a, Send) else "recv", a.link, a.mb, a.direction, rnd)


def simulate_rendezvous(
    tables: dict[Stage, StageTable],
    *,
    costs: Optional[Mapping[str, tuple]] = None,
    latency: Union[None, float, Mapping[Link, float]] = None,
    batches: Optional[Mapping[Stage, tuple]] = None,
) -> tuple[dict[Stage, float], dict[Stage, tuple], dict[Stage, float]]:
    """Run all tables under the rendezvous model (module docstring); returns (finish, spans, busy).

    `batches`: {stage: the table as compute actions and comm batches} to simulate another grouping
    (default `StageTable.batches()`, what the runtime posts). Raises `ScheduleError` on deadlock naming every blocked stage,
    the batch it has posted and the operations of it still unmatched."""
    items = {st: (batches[st] if batches is not None else t.batches()) for st, t in tables.items()}
    clock = {st: 0.0 for st in tables}
    pc = {st: 0 for st in tables}
    busy = {st: 0.0 for st in tables}
    spans: dict[Stage, list[Span]] = {st: [] for st in tables}
    posted: dict[tuple, tuple[Stage, float]] = {}  # op key -> (stage, post time), while unmatched
    pending: dict[Stage, dict[tuple, float]] = {}  # stage -> its posted batch's ops -> match time (-1: open)
    progress = True
    while progress:
        progress = False
        for st, t in tables.items():
            while pc[st] < len(items[st]):
                item = items[st][pc[st]]
                if not isinstance(item, tuple):  # compute
                    c = _cost_of(t, item, costs)
                    spans[st].append(Span(clock[st], clock[st] + c, item))
                    clock[st] += c
                    busy[st] += c
                    pc[st] += 1
                    progress = True
                    continue
                if st not in pending:  # post the batch
                    ops = {}
                    for a in item:
                        other = posted.pop(_counterpart(a), None)
                        if other is None:
                            posted[_key(a)] = (st, clock[st])
                            ops[_key(a)] = -1.0
                        else:
                            peer, t_peer = other
                            done = max(clock[st], t_peer) + _latency_of(
                                latency, (a[1] if isinstance(a, tuple) else a).link
                            )
                            ops[_key(a)] = done
                            pending[peer][_counterpart(a)] = done
                    pending[st] = ops
                    progress = True
                if any(v < 0 for v in pending[st].values()):
                    break
                clock[st] = max([clock[st], *pending.pop(st).values()])
                pc[st] += 1
                progress = True
    blocked = [st for st in tables if pc[st] < len(items[st])]
    if blocked:
        lines = []
        for st in blocked:
            open_ops = [k for k, v in pending.get(st, {}).items() if v < 0]
            lines.append(
                f"stage {st} blocked in batch #{pc[st]} with unmatched "
                + ", ".join(f"{k[0]} {k[3]} {k[1]} mb {k[2]}{' (' + k[4] + ')' if k[4] else ''}" for k in open_ops)
            )
        raise ScheduleError("deadlock (rendezvous): " + "; ".join(lines))
    return clock, {st: tuple(v) for st, v in spans.items()}, busy


def simulate_leader_routes(tables: dict[Stage, StageTable], edge_order: Mapping[tuple[str, str], int]) -> None:
    """The disjoint schedule with hierarchical boundaries (`runtime/disjoint.py`): in each batch a
    stage posts its pipeline-link sends and receives (rendezvous, as `simulate_rendezvous`), then runs
    the batch's module-edge actions one at a time as blocking meetings of the edge's two stages, in
    (`edge_order[(src module, dst module)]`, forward first, micro-batch) order, then waits for the
    posted ones. A meeting completes when both stages are at it (every rank of a stage runs the same
    table, so the leader route's ranks meet when their stages do). Raises `ScheduleError` naming every
    blocked stage on deadlock."""
    items = {st: t.batches() for st, t in tables.items()}
    pc = {st: 0 for st in tables}
    posted: dict[tuple, Stage] = {}  # pipeline op key -> its stage, while unmatched
    unmatched: dict[Stage, set] = {}
    routes: dict[Stage, list] = {}  # stage -> [the batch's edge actions in order, index of the next]
    at: dict[Stage, tuple] = {}  # stage -> the meeting it waits at

    def order(a) -> tuple:
        return (edge_order[(a.link.src.module, a.link.dst.module)], 0 if a.direction == "forward" else 1, a.mb)

    progress = True
    while progress:
        progress = False
        for st in tables:
            while pc[st] < len(items[st]):
                item = items[st][pc[st]]
                if not isinstance(item, tuple):
                    pc[st] += 1
                    progress = True
                    continue
                if st not in routes:  # post the batch's pipeline-link operations
                    unmatched[st] = set()
                    for a in item:
                        if a.link.src.module != a.link.dst.module:
                            continue
                        peer = posted.pop(_counterpart(a), None)
                        if peer is None:
                            posted[_key(a)] = st
                            unmatched[st].add(_key(a))
                        else:
                            unmatched[peer].discard(_counterpart(a))
                    edge_acts = sorted((a for a in item if a.link.src.module != a.link.dst.module), key=order)
                    routes[st] = [edge_acts, 0]
                    progress = True
                acts, i = routes[st]
                if i < len(acts):
                    a = acts[i]
                    meeting = (a.link, a.mb, a.direction)
                    at[st] = meeting
                    other = a.link.dst if a.link.src == st else a.link.src
                    if at.get(other) != meeting:
                        break
                    for s2 in (st, other):
                        routes[s2][1] += 1
                        del at[s2]
                    progress = True
                    continue
                if unmatched[st]:
                    break
                del routes[st], unmatched[st]
                pc[st] += 1
                progress = True
    blocked = [st for st in tables if pc[st] < len(items[st])]
    if blocked:
        lines = []
        for st in blocked:
            m = at.get(st)
            what = f"at the {m[2]} route of {m[0]} mb {m[1]}" if m else f"with {len(unmatched.get(st, ()))} unmatched"
            lines.append(f"stage {st} blocked in batch #{pc[st]} {what}")
        raise ScheduleError("deadlock (leader routes): " + "; ".join(lines))


def split_batches(tables: dict[Stage, StageTable]) -> dict[Stage, tuple]:
    """Every send and receive as a batch of its own, in table order (the pairs split)."""
    return {st: tuple((a,) if isinstance(a, (Send, Recv)) else a for a in t.actions) for st, t in tables.items()}


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

"""The simulators of per-stage schedule tables (pure: no torch, no torch.distributed);
`schedule_check.check_tables` runs them after its static checks.

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
`simulate_leader_routes` checks the order of the disjoint schedule with hierarchical boundaries
(each module edge's leader route a blocking meeting of its two stages).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Union

from megatron_hetero.plan.actions import Link, Recv, Send, Stage
from megatron_hetero.plan.schedule import StageTable


class ScheduleError(ValueError):
    """A schedule table set is inconsistent, incomplete or deadlocks."""


@dataclass(frozen=True)
class Span:
    """One compute action's simulated interval."""

    start: float
    end: float
    action: object


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

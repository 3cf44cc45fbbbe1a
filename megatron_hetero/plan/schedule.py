"""Graph-aware 1F1B schedule tables for disjoint placement (pure: no torch, no torch.distributed).

Model
-----
Input: a resolved `HeteroLayout` with placement "disjoint" (every module on its own rank island;
the edges form a DAG that may have several sources (encoders), joins (several producers feed one
module), branches (one producer feeds several consumers) and one or several sinks), a number of
micro-batches M (1..64) and optional compute costs.

* A **stage** is (module, pp index). In disjoint placement every rank belongs to exactly one stage;
  the ranks of a stage (its TP/CP/DP peers, `placement.stage_ranks`) all run the same table.
* The **stage graph** has a directed **link** for every stage -> stage connection: inside a module
  stage s -> s+1; for a module edge a -> b, the last stage of a -> the first stage of b.
* Placement by PP-weighted longest path: `depth(stage)` = longest path (counted in stages) from any
  source stage; `dist_to_sink(stage)` = longest path from the stage to a sink's last stage (0 there).
* **1F1B per stage**: warm-up forwards w = min(M, dist_to_sink) (a stage with k stages downstream
  does k warm-up forwards, as Megatron's `pp_size - rank - 1`), then M - w steady pairs
  "forward of micro-batch w+i, backward of micro-batch i", then w cool-down backwards. Forwards
  and backwards each run micro-batches 0..M-1 in order. `StageTable.steady` counts the pairs and
  `StageTable.cooldown` == `warmup`.
* **Communication** around each compute action (within a group, sorted by link):
  Forward(mb) is preceded by Recv(link, mb, "forward") on every incoming link (a join waits for
  all producers) and followed by Send(link, mb, "forward") on every outgoing link (a branch feeds
  all consumers). Backward(mb) is preceded by Recv(link, mb, "backward") on every outgoing link.
  The gradient of mb goes back on an incoming link whose producer has warm-up w_p no earlier than
  the batch with the receive of activation min(mb + w_p, M - 1) on that link (where the producer,
  after sending that activation, receives exactly this gradient: Megatron's
  send_backward_recv_forward), no earlier than right after Backward(mb), and in micro-batch order. On a chain link w_p = w + 1 and this is
  Megatron's 1F1B; on a skip link (a producer with a longer path to the sink elsewhere) it holds
  the gradient until the producer can take it, because a send completes only when its receive is
  posted (NCCL and gloo have no buffering): `StageTable.batches()` groups each run of sends and
  receives into one batch, and `schedule_check` proves the batches complete in its rendezvous mode.
* **Costs** (used by the checker/simulator in `schedule_check.py`; they do not change the order):
  forward 1.0 and backward 2.0 per stage by default; `stage_costs={module: (f, b)}` gives the
  cost of each stage of a module, `module_costs={module: (f, b)}` gives a module's total, split
  evenly over its pp stages.

Why it cannot deadlock with buffered (asynchronous) sends and blocking receives: give F(mb k) on stage S the
potential 2k - d(S) and B(mb i) the potential 2i + d(S) + 1, d = dist_to_sink. A forward waits on
its producers (d larger, so smaller potential), a backward on its consumers (d smaller), and the
local 1F1B order puts F(k) before B(i) exactly when k <= d(S) + i; each of these dependencies goes
from a smaller to a larger potential, so the waits-for relation has no cycle.
`schedule_check.check_tables` verifies this (and more) by simulation for any given tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.layout.graph import topological_order
from megatron_hetero.plan.actions import (
    BACKWARD,
    COMPUTE,
    FORWARD,
    MESSAGES,
    Backward,
    Forward,
    Link,
    Recv,
    Send,
    Stage,
    WeightGrad,
)
from megatron_hetero.plan.placement import stage_ranks

MAX_MICRO_BATCHES = 64
DEFAULT_FORWARD_COST = 1.0
DEFAULT_BACKWARD_COST = 2.0


@dataclass(frozen=True)
class StageTable:
    """The ordered actions of one stage (run identically by each of its ranks).

    `warmup` forwards, `steady` 1F1B pairs, `cooldown` backwards (== warmup); `ranks` are the
    stage's global ranks; `forward_cost`/`backward_cost` the compute cost of one micro-batch.
    """

    stage: Stage
    actions: tuple
    warmup: int
    steady: int
    cooldown: int
    ranks: tuple = ()
    forward_cost: float = DEFAULT_FORWARD_COST
    backward_cost: float = DEFAULT_BACKWARD_COST
    schedule: str = "1f1b"
    weight_fraction: float = 0.0  # zb: the share of backward_cost that is the weight-gradient pass

    def compute(self) -> tuple:
        """Only the compute actions (Forward, Backward, WeightGrad), in order."""
        return tuple(a for a in self.actions if isinstance(a, COMPUTE))

    def cost_of(self, action, forward: Optional[float] = None, backward: Optional[float] = None) -> float:
        """The cost of one compute action (`forward`/`backward`: override the table's per-stage costs):
        in a zero-bubble table the backward's cost splits into the input-gradient pass (Backward) and
        the weight-gradient pass (WeightGrad) by `weight_fraction`."""
        f = self.forward_cost if forward is None else forward
        b = self.backward_cost if backward is None else backward
        if isinstance(action, Forward):
            return float(f)
        if isinstance(action, WeightGrad):
            return float(b) * self.weight_fraction
        return float(b) * (1.0 - self.weight_fraction)

    def batches(self) -> tuple:
        """The table as the runtime posts it: each compute action alone, and each maximal run of
        sends and receives between two compute actions as ONE batch (a tuple of Send/Recv)
        posted together (`torch.distributed.batch_isend_irecv`) and completed together: the 1F1B
        steady state's "send forward, receive backward" and "send backward, receive forward" pairs
        (Megatron's `send_forward_recv_backward` / `send_backward_recv_forward`), generalised to
        joins and branches. Under rendezvous semantics (a send completes only when its receive is
        posted) split pairs deadlock; these batches do not (`schedule_check`, mode 'rendezvous')."""
        out: list = []
        run: list = []
        for a in self.actions:
            if isinstance(a, MESSAGES):
                run.append(a)
                continue
            if run:
                out.append(tuple(run))
                run = []
            out.append(a)
        if run:
            out.append(tuple(run))
        return tuple(out)

    def compact(self) -> str:
        """'F0 F1 | F2 B0 F3 B1 | B2 B3': compute order, warm-up | steady | cool-down ('-' if empty);
        zero-bubble tables: the F/B order so, each W after the B it follows."""
        ops: list[str] = []
        for a in self.compute():
            if isinstance(a, WeightGrad) and ops:
                ops[-1] += " " + a.short()
            else:
                ops.append(a.short())
        w, s = self.warmup, 2 * self.steady
        parts = [" ".join(ops[:w]), " ".join(ops[w : w + s]), " ".join(ops[w + s :])]
        return " | ".join(p or "-" for p in parts)


@dataclass(frozen=True)
class StageGraph:
    """Stages, links and longest-path positions of a disjoint layout."""

    stages: tuple  # of Stage, in topological module order, then pp order
    links: tuple  # of Link, sorted
    depth: Mapping  # Stage -> longest path (in stages) from any source
    dist_to_sink: Mapping  # Stage -> longest path (in stages) to a sink's last stage
    ranks: Mapping  # Stage -> tuple of global ranks
    incoming: Mapping = field(default_factory=dict)  # Stage -> tuple of Link (sorted)
    outgoing: Mapping = field(default_factory=dict)  # Stage -> tuple of Link (sorted)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def longest_path(self) -> int:
        """Stages on the longest source -> sink path."""
        return 1 + max(self.depth[s] + self.dist_to_sink[s] for s in self.stages)


def _require_disjoint(layout: HeteroLayout) -> None:
    if not isinstance(layout, HeteroLayout):
        raise ValueError(f"expected a HeteroLayout, got {type(layout).__name__}")
    if layout.placement != "disjoint":
        raise ValueError(
            f"graph-aware 1F1B tables need placement 'disjoint' (each rank in exactly one stage), "
            f"got placement {layout.placement!r}"
        )
    unresolved = [m.name for m in layout.modules if m.ranks is None]
    if unresolved:
        raise ValueError(f"layout is not resolved (modules {unresolved} have no ranks); use resolve_layout first")


def stage_graph(layout: HeteroLayout) -> StageGraph:
    """The stage graph of a resolved disjoint layout, with depth and dist_to_sink of every stage."""
    _require_disjoint(layout)
    order = topological_order(layout)
    mods = {m.name: m for m in layout.modules}
    stages = [Stage(n, s) for n in order for s in range(mods[n].pp)]
    links: list[Link] = []
    for n in order:
        for s in range(mods[n].pp - 1):
            links.append(Link(Stage(n, s), Stage(n, s + 1)))
    for e in layout.edges:
        links.append(Link(Stage(e.src, mods[e.src].pp - 1), Stage(e.dst, 0)))
    links.sort()
    incoming: dict[Stage, list[Link]] = {s: [] for s in stages}
    outgoing: dict[Stage, list[Link]] = {s: [] for s in stages}
    for lk in links:
        outgoing[lk.src].append(lk)
        incoming[lk.dst].append(lk)
    depth: dict[Stage, int] = {}
    for st in stages:  # topological order: producers first
        depth[st] = max((depth[lk.src] + 1 for lk in incoming[st]), default=0)
    dist: dict[Stage, int] = {}
    for st in reversed(stages):
        dist[st] = max((dist[lk.dst] + 1 for lk in outgoing[st]), default=0)
    return StageGraph(
        stages=tuple(stages),
        links=tuple(links),
        depth=depth,
        dist_to_sink=dist,
        ranks={st: tuple(stage_ranks(mods[st.module], st.pp)) for st in stages},
        incoming={s: tuple(v) for s, v in incoming.items()},
        outgoing={s: tuple(v) for s, v in outgoing.items()},
    )


def _check_micro_batches(micro_batches: int) -> None:
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int):
        raise ValueError(f"micro-batches must be an integer in 1..{MAX_MICRO_BATCHES}, got {micro_batches!r}")
    if not 1 <= micro_batches <= MAX_MICRO_BATCHES:
        raise ValueError(f"micro-batches must be in 1..{MAX_MICRO_BATCHES}, got {micro_batches}")


def _cost_pair(value, where: str) -> tuple[float, float]:
    try:
        f, b = value
        f, b = float(f), float(b)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: expected a pair (forward, backward) of numbers, got {value!r}") from None
    for name, v in (("forward", f), ("backward", b)):
        if not (v >= 0.0) or v == float("inf"):
            raise ValueError(f"{where}: {name} cost must be a finite number >= 0, got {v!r}")
    return f, b


def stage_costs_of(
    layout: HeteroLayout,
    stage_costs: Optional[Mapping[str, tuple]] = None,
    module_costs: Optional[Mapping[str, tuple]] = None,
) -> dict[str, tuple[float, float]]:
    """Per-stage (forward, backward) cost of every module.

    Default (1.0, 2.0) per stage; `stage_costs[m]` is the cost of each stage of m; `module_costs[m]`
    is m's total cost, split evenly over its pp stages. Naming a module in both is an error.
    """
    names = layout.names
    stage_costs = dict(stage_costs or {})
    module_costs = dict(module_costs or {})
    for label, given in (("stage cost", stage_costs), ("module cost", module_costs)):
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise ValueError(f"{label} for unknown modules {unknown}; modules are {names}")
    both = sorted(set(stage_costs) & set(module_costs))
    if both:
        raise ValueError(f"modules {both} have both a per-stage cost and a total module cost; give one")
    out: dict[str, tuple[float, float]] = {}
    for m in layout.modules:
        if m.name in stage_costs:
            out[m.name] = _cost_pair(stage_costs[m.name], f"module {m.name}: stage cost")
        elif m.name in module_costs:
            f, b = _cost_pair(module_costs[m.name], f"module {m.name}: module cost")
            out[m.name] = (f / m.pp, b / m.pp)
        else:
            out[m.name] = (DEFAULT_FORWARD_COST, DEFAULT_BACKWARD_COST)
    return out


def one_f_one_b_order(micro_batches: int, warmup: int) -> list[tuple[str, int]]:
    """The compute order of one stage: [("F", 0), ..., ("B", M-1)] for `warmup` warm-up forwards."""
    m, w = micro_batches, min(micro_batches, warmup)
    order = [("F", k) for k in range(w)]
    for i in range(m - w):
        order += [("F", w + i), ("B", i)]
    order += [("B", i) for i in range(m - w, m)]
    return order


def zero_bubble_order(micro_batches: int, warmup: int) -> list[tuple[str, int]]:
    """The compute order of one stage of the zero-bubble schedule: the 1F1B order of
    `one_f_one_b_order` with each backward split into "B" (the gradient of the stage's inputs, on the
    critical path) and "W" (the gradient of its weights, needed only by the optimizer step), W(i)
    right after B(i). The gradients keep 1F1B's rendezvous pairing (`build_tables`: sent with the
    receive of the activation the producer sends next), which in the steady phase puts the send after
    W; in the cool-down, where no activation is left to pair with, the gradient leaves between B and
    W, so the upstream stage's backward overlaps this stage's weight pass instead of waiting for it.
    No weight pass is ever pending at a forward: a stage holds no more activations than under 1F1B.
    Chosen by simulation (`schedule_check`, rendezvous mode) among the static orders tried on chains
    of 2-8 stages and the join layout with 4-16 micro-batches (W deferred by 1, by 2, by the stage's
    warm-up, or only in the cool-down; and the gradient sent before W in the steady phase too, which
    blocks on the producer and took longer than 1F1B): this one was the shortest in every case."""
    out: list[tuple[str, int]] = []
    for kind, mb in one_f_one_b_order(micro_batches, warmup):
        out.append((kind, mb))
        if kind == "B":
            out.append(("W", mb))
    return out


SCHEDULES = ("1f1b", "zb")
#: zb: the share of a stage's backward cost that is the weight-gradient pass (ZB's B ~ W ~ F)
DEFAULT_WEIGHT_FRACTION = 0.5


def check_schedule_choice(schedule: str, layout: HeteroLayout) -> None:
    """`--hetero-schedule`'s rules, for both front ends: zb applies to the disjoint schedule, and with
    direct boundaries only (the leader routes' order check covers 1F1B tables). ValueError otherwise."""
    if schedule not in SCHEDULES:
        raise ValueError(f"--hetero-schedule must be one of {list(SCHEDULES)}, got {schedule!r}")
    if schedule != "1f1b" and layout.placement != "disjoint":
        raise ValueError(f"--hetero-schedule {schedule} applies to the disjoint schedule only")
    if schedule != "1f1b" and layout.boundary_mode != "direct":
        raise ValueError(
            f"--hetero-schedule {schedule} runs with boundary_mode direct only (the layout asks for "
            f"{layout.boundary_mode}: its leader routes are checked against 1F1B tables)"
        )


def build_tables(
    layout: HeteroLayout,
    micro_batches: int,
    *,
    stage_costs: Optional[Mapping[str, tuple]] = None,
    module_costs: Optional[Mapping[str, tuple]] = None,
    schedule: str = "1f1b",
    weight_fraction: float = DEFAULT_WEIGHT_FRACTION,
) -> dict[Stage, StageTable]:
    """The table of every stage of a resolved disjoint layout (see the module docstring): `schedule`
    "1f1b" (default), or "zb", the same order with each backward split into its input-gradient pass
    (Backward) and weight-gradient pass (WeightGrad, `zero_bubble_order`), the gradient sent upstream
    between the two; `weight_fraction` (zb): the W share of the backward cost."""
    _check_micro_batches(micro_batches)
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {schedule!r}")
    if not 0.0 <= weight_fraction <= 1.0:
        raise ValueError(f"weight_fraction must be in [0, 1], got {weight_fraction!r}")
    graph = stage_graph(layout)
    costs = stage_costs_of(layout, stage_costs, module_costs)
    tables: dict[Stage, StageTable] = {}
    warmup = {st: min(micro_batches, graph.dist_to_sink[st]) for st in graph.stages}
    for st in graph.stages:
        w = warmup[st]
        order = (zero_bubble_order if schedule == "zb" else one_f_one_b_order)(micro_batches, w)
        where = {op: i for i, op in enumerate(order)}
        # slot i = the communication between compute i-1 and compute i; each slot holds first the
        # sends that follow compute i-1, then the gradient sends placed there, then the receives
        # that compute i needs.
        grads: dict[int, list] = {}
        for lk in graph.incoming[st]:
            last = 0
            for mb in range(micro_batches):
                after_backward = where[("B", mb)] + 1
                # the producer posts the receive of gradient mb with its send of activation
                # mb + w_p (or, in its cool-down, after sending its last activation): never earlier
                paired = min(mb + warmup[lk.src], micro_batches - 1)
                slot = max(after_backward, where[("F", paired)], last)
                grads.setdefault(slot, []).append(Send(lk, mb, BACKWARD))
                last = slot
        actions: list = []
        for i, (kind, mb) in enumerate(order):
            actions += grads.get(i, [])
            if kind == "F":
                actions += [Recv(lk, mb, FORWARD) for lk in graph.incoming[st]]
                actions.append(Forward(st, mb))
                actions += [Send(lk, mb, FORWARD) for lk in graph.outgoing[st]]
            elif kind == "W":
                actions.append(WeightGrad(st, mb))
            else:
                actions += [Recv(lk, mb, BACKWARD) for lk in graph.outgoing[st]]
                actions.append(Backward(st, mb))
        actions += grads.get(len(order), [])
        f, b = costs[st.module]
        tables[st] = StageTable(
            stage=st,
            actions=tuple(actions),
            warmup=w,
            steady=micro_batches - w,
            cooldown=w,
            ranks=graph.ranks[st],
            forward_cost=f,
            backward_cost=b,
            schedule=schedule,
            weight_fraction=weight_fraction if schedule == "zb" else 0.0,
        )
    return tables


def rank_tables(
    layout: HeteroLayout,
    micro_batches: int,
    *,
    stage_costs: Optional[Mapping[str, tuple]] = None,
    module_costs: Optional[Mapping[str, tuple]] = None,
    schedule: str = "1f1b",
) -> dict[int, StageTable]:
    """{global rank: its stage's table} for every rank of a resolved disjoint layout."""
    tables = build_tables(layout, micro_batches, stage_costs=stage_costs, module_costs=module_costs, schedule=schedule)
    out: dict[int, StageTable] = {}
    for table in tables.values():
        for r in table.ranks:
            assert r not in out, f"rank {r} is in two stages"
            out[r] = table
    return dict(sorted(out.items()))

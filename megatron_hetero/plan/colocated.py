"""The three-phase colocated schedule as per-rank tables (pure: no torch, no torch.distributed).

Every module spans the same ranks [0, W), each through its own grid. Per step (global batch G):

  phase 1  for each encoder, in declaration order: stage input (features on the first stage, a
           pipeline receive from the previous stage otherwise), one forward over this rank's
           encoder-DP share of the step (G/dp rows), a pipeline send to the next stage; then the
           encoder's boundary forward (every rank takes part: sources on the encoder's last stage,
           destinations on the language model's first stage).
  phase 2  `StateMove('offload')` moves the encoders' state to host memory (when asked), then
           `LanguagePhase`: the language model's own 1F1B over its M = G/dp/micro_batch_size
           micro-batches (Megatron's `get_forward_backward_func`), fed from the detached boundary
           outputs; `warmup` is Megatron's pp - stage - 1 (at most M).
           With output modules (heads after the language model, e.g. `generator`), phase 2 is
           2a `LanguagePhase(forward_only)`: Megatron's forward-only pass over the same micro-batches,
              keeping (detached) the last stage's hidden states that the heads read;
           2b per output module: boundary forward (language model's last stage -> the head's layout),
              `OutputStep` (the head's forward and backward over its DP share of the step, its loss
              into the step's loss), boundary backward (the gradient of those hidden states back on
              the language model's last stage);
           2c the full `LanguagePhase`, whose last stage adds <hidden, gradient> to its loss, so the
              language model's backward carries the heads' gradients exactly.
           Why a second forward: the heads need the language model's output of every micro-batch
           and the language model's backward needs the heads' gradients, and the heads' boundary is
           a collective of the whole rank set, which cannot run inside the language model's 1F1B
           (the other stages are busy in their own 1F1B). Recomputing the forward keeps Megatron's
           1F1B (and its activation memory) for the language model; the price is one extra
           forward of it.
  phase 3  `Restore`; for each encoder in reverse order: boundary backward (and the encoder's last
           stage backward behind it), then, stage by stage from last to first, a pipeline receive of
           the output gradient, the stage backward, a pipeline send of the input gradient.
  then     `GradSync` (each module over its own DP x CP group), `OptimizerStep`, `LossReduce`.

An encoder's pipeline messages are the vocabulary's `Send`/`Recv` (`plan/actions.py`) on the link
stage s -> s+1, micro-batch 0 (one encoder pass per step), with the peer's rank and the batch rows.
No encoder collective runs while the language model's pipeline is in flight. Pipeline peers are
computed here (`rank_of` with the same tp/cp/dp coordinates one stage up or down); the runtime
executes the tables and never recomputes rank arithmetic. `check_colocated_tables` simulates all
tables together: every pipeline send has its receive in the same order, every rank reaches the same
collectives in the same order, and nothing waits forever.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.plan.actions import BACKWARD, FORWARD, Link, Recv, Send, Stage
from megatron_hetero.plan.batch import MicroBatching, dp_rows, micro_batching
from megatron_hetero.plan.placement import Coord, coord_of, rank_of
from megatron_hetero.plan.roles import Roles, roles as layout_roles


@dataclass(frozen=True)
class EncoderForward:
    """Forward of encoder stage `module/stage` over rows [rows.start, rows.stop) of the step."""

    module: str
    stage: int
    rows: range

    def __str__(self) -> str:
        return f"forward {self.module}/{self.stage} rows {self.rows.start}-{self.rows.stop - 1}"


@dataclass(frozen=True)
class EncoderBackward:
    """Backward of encoder stage `module/stage` with the received output gradient."""

    module: str
    stage: int

    def __str__(self) -> str:
        return f"backward {self.module}/{self.stage}"


@dataclass(frozen=True)
class BoundaryCall:
    """The boundary of edge `edge` ('src->dst') in `direction` ('forward'/'backward'); every rank of
    the colocated set takes part. `src`/`dst`: whether this rank holds the edge's source tensor
    (the encoder's last stage) or needs its destination (the language model's first stage)."""

    edge: str
    direction: str
    src: bool
    dst: bool

    def __str__(self) -> str:
        side = "+".join(s for s, on in (("src", self.src), ("dst", self.dst)) if on) or "neither"
        return f"boundary {self.direction} {self.edge} ({side})"


@dataclass(frozen=True)
class LanguagePhase:
    """Megatron's forward-backward of the language model: `micro_batches` micro-batches of
    `micro_batch_size` rows from this DP rank's share `rows` of the step; stage `stage` of `pp`.
    `forward_only`: the forward pass that produces the output modules' inputs (phase 2a)."""

    module: str
    stage: int
    pp: int
    micro_batches: int
    micro_batch_size: int
    warmup: int
    rows: range
    forward_only: bool = False

    def __str__(self) -> str:
        kind = "forward-only" if self.forward_only else "1F1B"
        warm = "" if self.forward_only else f", warm-up {self.warmup}"
        return (
            f"{kind} {self.module}/{self.stage} of pp {self.pp}: {self.micro_batches} micro-batches of "
            f"{self.micro_batch_size} (rows {self.rows.start}-{self.rows.stop - 1}){warm}"
        )


@dataclass(frozen=True)
class OutputStep:
    """Forward and backward of output module `module` (pp 1) over rows [rows.start, rows.stop) of
    the step, from its boundary's output; its loss enters the step's loss."""

    module: str
    rows: range

    def __str__(self) -> str:
        return f"forward+backward {self.module} rows {self.rows.start}-{self.rows.stop - 1}"


@dataclass(frozen=True)
class StateMove:
    """`offload` (to host) or `restore` (to the device) of the listed modules' state."""

    kind: str
    modules: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.kind} {', '.join(self.modules)}"


@dataclass(frozen=True)
class Collective:
    """A step-closing collective: 'grad-sync' (each module over its DP x CP group), 'optimizer',
    'loss-reduce' (over the world)."""

    kind: str

    def __str__(self) -> str:
        return self.kind


ColocatedAction = Union[
    Send, Recv, EncoderForward, EncoderBackward, BoundaryCall, LanguagePhase, OutputStep, StateMove, Collective
]


@dataclass(frozen=True)
class ColocatedTable:
    """One rank's ordered actions of a colocated step, grouped by phase."""

    rank: int
    phases: tuple[tuple[str, tuple], ...]  # (phase name, actions)

    @property
    def actions(self) -> tuple:
        return tuple(a for _, acts in self.phases for a in acts)

    def format(self) -> str:
        lines = [f"rank {self.rank}:"]
        for name, acts in self.phases:
            lines.append(f"  {name}: " + ("; ".join(str(a) for a in acts) or "-"))
        return "\n".join(lines)


def stage_peer(layout: HeteroLayout, module: str, rank: int, delta: int) -> Optional[int]:
    """The rank with this rank's tp/cp/dp coordinates `delta` stages away in `module` (None past the ends)."""
    m = layout.module(module)
    c = coord_of(m, rank)
    if not 0 <= c.pp + delta < m.pp:
        return None
    return rank_of(m, tp=c.tp, cp=c.cp, dp=c.dp, pp=c.pp + delta)


def _pipe_link(module: str, stage: int) -> Link:
    """The pipeline link of `module` from stage `stage` to stage `stage + 1`."""
    return Link(Stage(module, stage), Stage(module, stage + 1))


def _encoder_forward(layout: HeteroLayout, name: str, rank: int, global_batch: int) -> list:
    m, c = layout.module(name), coord_of(layout.module(name), rank)
    acts: list = []
    prev, nxt = stage_peer(layout, name, rank, -1), stage_peer(layout, name, rank, +1)
    rows = dp_rows(global_batch, m.dp, c.dp)
    if prev is not None:
        acts.append(Recv(_pipe_link(name, c.pp - 1), 0, FORWARD, prev, len(rows)))
    acts.append(EncoderForward(name, c.pp, rows))
    if nxt is not None:
        acts.append(Send(_pipe_link(name, c.pp), 0, FORWARD, nxt, len(rows)))
    return acts


def _encoder_backward(layout: HeteroLayout, name: str, rank: int, global_batch: int) -> list:
    """Stages before the last: receive the output gradient, backward, send the input gradient down.
    A frozen encoder trains only its projector (on its last stage): no pipeline backward."""
    m, c = layout.module(name), coord_of(layout.module(name), rank)
    if m.pp == 1 or m.frozen:
        return []
    acts: list = []
    nxt, prev = stage_peer(layout, name, rank, +1), stage_peer(layout, name, rank, -1)
    rows = len(dp_rows(global_batch, m.dp, c.dp))
    if nxt is not None:
        acts += [Recv(_pipe_link(name, c.pp), 0, BACKWARD, nxt, rows), EncoderBackward(name, c.pp)]
    if prev is not None:
        acts.append(Send(_pipe_link(name, c.pp - 1), 0, BACKWARD, prev, rows))
    return acts


def check_colocated(
    layout: HeteroLayout, global_batch: int, micro_batch_size: int, who: Optional[Roles] = None
) -> MicroBatching:
    """The arithmetic every rank's colocated table rests on (module degrees only, no rank loop):
    ValueError for layouts this schedule cannot run (not colocated, several language segments, batch
    arithmetic, output modules with pp > 1). Returns the language model's micro-batching."""
    if layout.placement != "colocated":
        raise ValueError(f"the colocated schedule needs placement 'colocated', got {layout.placement!r}")
    who = who or layout_roles(layout)
    if len(who.language) != 1:
        raise ValueError("colocated placement takes one language module; segments are disjoint modules")
    lang = layout.module(who.first_language)
    mbs = micro_batching(global_batch, lang.dp, micro_batch_size, what=f"module {lang.name}")
    for name in who.encoders + who.outputs:
        dp_rows(global_batch, layout.module(name).dp, 0)  # ValueError when dp does not divide G
    for name in who.outputs:
        if layout.module(name).pp != 1:
            raise ValueError(
                f"module {name}: an output module runs with pp 1 in colocated placement, "
                f"got pp({layout.module(name).pp})"
            )
    return mbs


def colocated_table(
    layout: HeteroLayout,
    rank: int,
    global_batch: int,
    micro_batch_size: int,
    offload_encoders: bool = False,
    who: Optional[Roles] = None,
    checked: Optional[MicroBatching] = None,
) -> ColocatedTable:
    """Rank `rank`'s table of a resolved colocated layout (see the module docstring), from its own
    coordinates only. `checked`: `check_colocated`'s result when the caller ran it (else it runs here)."""
    who = who or layout_roles(layout)
    mbs = checked or check_colocated(layout, global_batch, micro_batch_size, who)
    lang = layout.module(who.first_language)
    lc: Coord = coord_of(lang, rank)
    phase1: list = []
    for name in who.encoders:
        m = layout.module(name)
        phase1 += _encoder_forward(layout, name, rank, global_batch)
        phase1.append(
            BoundaryCall(f"{name}->{lang.name}", "forward", src=coord_of(m, rank).pp == m.pp - 1, dst=lc.pp == 0)
        )
    phase2: list = [StateMove("offload", who.encoders)] if offload_encoders and who.encoders else []
    lrows = dp_rows(global_batch, lang.dp, lc.dp)
    if who.outputs:
        phase2.append(
            LanguagePhase(lang.name, lc.pp, lang.pp, mbs.count, micro_batch_size, 0, lrows, forward_only=True)
        )
        for name in who.outputs:
            om = layout.module(name)
            edge = f"{lang.name}->{name}"
            phase2 += [
                BoundaryCall(edge, "forward", src=lc.pp == lang.pp - 1, dst=True),
                OutputStep(name, dp_rows(global_batch, om.dp, coord_of(om, rank).dp)),
                BoundaryCall(edge, "backward", src=lc.pp == lang.pp - 1, dst=True),
            ]
    phase2 += [
        LanguagePhase(
            lang.name, lc.pp, lang.pp, mbs.count, micro_batch_size, min(mbs.count, lang.pp - lc.pp - 1), lrows
        )
    ]
    phase3: list = [StateMove("restore", who.encoders)] if offload_encoders and who.encoders else []
    for name in reversed(who.encoders):
        m = layout.module(name)
        phase3.append(
            BoundaryCall(f"{name}->{lang.name}", "backward", src=coord_of(m, rank).pp == m.pp - 1, dst=lc.pp == 0)
        )
        phase3 += _encoder_backward(layout, name, rank, global_batch)
    close = [Collective("grad-sync"), Collective("optimizer"), Collective("loss-reduce")]
    return ColocatedTable(
        rank,
        (
            ("phase 1", tuple(phase1)),
            ("phase 2", tuple(phase2)),
            ("phase 3", tuple(phase3)),
            ("close", tuple(close)),
        ),
    )


def colocated_tables(
    layout: HeteroLayout,
    global_batch: int,
    micro_batch_size: int,
    offload_encoders: bool = False,
    who: Optional[Roles] = None,
) -> dict[int, ColocatedTable]:
    """{rank: its table} for every rank of a resolved colocated layout (the schedule checker's input;
    a rank that runs needs only its own, `colocated_table`). ValueError as `check_colocated`."""
    who = who or layout_roles(layout)
    mbs = check_colocated(layout, global_batch, micro_batch_size, who)
    return {
        rank: colocated_table(layout, rank, global_batch, micro_batch_size, offload_encoders, who, mbs)
        for rank in range(layout.world_size)
    }


_GLOBAL = (BoundaryCall, LanguagePhase, Collective)


def check_colocated_tables(tables: dict[int, ColocatedTable]) -> int:
    """Simulate every rank's table together: sends are asynchronous and FIFO per (sender, receiver),
    receives block, and the boundary calls, the language phase and the closing collectives are
    rendezvous of all ranks that must be reached in the same order. Returns the number of pipeline
    messages; ValueError naming the rank and action when a receive has no matching send, a rank
    reaches another collective than its peers, or the tables stop before every rank finishes."""
    pos = {r: 0 for r in tables}
    acts = {r: t.actions for r, t in tables.items()}
    wires: dict[tuple[int, int], list] = {}
    messages = 0
    while True:
        progressed = False
        for r in tables:
            while pos[r] < len(acts[r]):
                a = acts[r][pos[r]]
                if isinstance(a, Send):
                    assert a.peer_rank is not None, a
                    wires.setdefault((r, a.peer_rank), []).append(a)
                    messages += 1
                elif isinstance(a, Recv):
                    assert a.peer_rank is not None, a
                    q = wires.get((a.peer_rank, r), [])
                    if not q:
                        break
                    got = q.pop(0)
                    if (got.link, got.mb, got.direction) != (a.link, a.mb, a.direction):
                        raise ValueError(f"rank {r}: '{a}' receives '{got}'")
                elif isinstance(a, _GLOBAL):
                    break
                pos[r] += 1
                progressed = True
        waiting = {r: acts[r][pos[r]] for r in tables if pos[r] < len(acts[r])}
        if not waiting:
            break
        if all(isinstance(a, _GLOBAL) for a in waiting.values()) and len(waiting) == len(tables):
            kinds = {
                type(a).__name__
                + ":"
                + (
                    a.edge + a.direction
                    if isinstance(a, BoundaryCall)
                    else f"{a.module}{a.forward_only}"
                    if isinstance(a, LanguagePhase)
                    else a.kind
                )
                for a in waiting.values()
            }
            if len(kinds) != 1:
                raise ValueError(
                    "ranks reach different collectives: "
                    + ", ".join(f"rank {r}: {a}" for r, a in sorted(waiting.items()))
                )
            for r in tables:
                pos[r] += 1
            continue
        if not progressed:
            raise ValueError(
                "the colocated tables deadlock: "
                + ", ".join(f"rank {r} waits in '{a}'" for r, a in sorted(waiting.items()))
            )
    left = {k: v for k, v in wires.items() if v}
    if left:
        raise ValueError(f"pipeline messages never received: {left}")
    return messages

"""The disjoint schedule: every module (or pipeline stage of one) on its own rank island, run by an
interpreter of the graph-aware 1F1B stage tables of `plan/schedule.py`.

Per step, for a global batch of G samples and M micro-batches (M = G / dp / micro_batch_size of the
first language module; the arithmetic is the rank plan's, `plan/rank_plan.py`):
  * micro-batch i covers the global samples [first + i*G/M, first + (i+1)*G/M), first = step*G;
    inside it, DP rank d of a module owns the contiguous rows [d*(G/M)/dp, (d+1)*(G/M)/dp), so every
    module's DP share of a micro-batch is (G/M)/dp samples (G/M must be divisible by every dp);
  * this rank executes its stage's table action by action:
      Recv forward   receive the stage's input of micro-batch mb (boundary forward on the
                     destination side of a module edge; a plain receive from the previous pipeline
                     stage inside a module); the input becomes a detached leaf that will collect
                     its gradient;
      Forward        the stage runner runs the stage over this rank's samples of the micro-batch,
                     from the received inputs (a loss stage returns its loss sum, divided here by
                     the step's loss tokens, as the colocated schedule does);
      Send forward   send the stage's output (boundary forward on the source side / pipeline send);
      Recv backward  receive the gradient of the output (boundary backward on the source side /
                     pipeline receive);
      Backward       torch.autograd.backward(output, gradient) (the loss itself on the last stage);
      Send backward  send the input leaves' gradients back (boundary backward on the destination
                     side / pipeline send).
    Activations of a micro-batch live until its backward.
  * then every module reduces its gradients over its own DP x CP group and steps its optimizer
    (`ModuleState`; frozen modules do nothing), and the loss is all-reduced over the world.

Communication runs in batches, no threads: `StageTable.batches()` groups each run of sends and
receives between two compute actions (1F1B's "send forward, receive backward" and "send backward,
receive forward", generalised to joins, branches and skip links), and this rank posts each batch at
once with `torch.distributed.batch_isend_irecv` and waits for all of it (`wire.exchange_batch`): the
same code path on gloo and NCCL. Boundary messages carry no header here: an edge has a fixed
sequence length (the stage runner's `edge_tensor`) or, with variable image tokens, one per
micro-batch that both sides compute from the samples' metadata (`StageRunner.edge_seq`); both sides
size each message from the same plan, and the source checks its tensor against it
(`Boundary.planned_forward_phase`); a header round
inside a batch would hold back the batch's other messages and can deadlock. Neither transport
buffers a message, so a send completes only when its receive is posted; the checker's rendezvous
mode proves that these batches complete for every table set the planner generates.
A layout with `boundary_mode: hierarchical` sends its module edges by the leader route (gathers and
broadcasts over groups, `runtime/hierarchical.py`), which cannot join a batch: a batch posts its
pipeline-link messages, runs its edge routes one at a time in (edge, forward first, micro-batch)
order, then waits (`_prepare_route`).
The autograd cut at every stage input/output is done here, as Megatron's pipeline schedules do
(detached input leaves, backward with the received gradient), so the boundary's phases are used
directly.

Every wait has the job's communication timeout; a timeout or a dead peer raises an error that names
the edge or pipeline link and both ranks (`runtime/wire.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_hetero.compat.device import get_device
from megatron_hetero.layout.spec import Edge
from megatron_hetero.plan.rank_plan import RankPlan
from megatron_hetero.plan.actions import Backward, Forward, Link, Recv, Send, WeightGrad
from megatron_hetero.plan.schedule import StageTable, build_tables
from megatron_hetero.plan.boundary_rank import BoundaryPlanCache
from megatron_hetero.runtime.boundary import Boundary, Phase
from megatron_hetero.runtime.config import RuntimeConfig
from megatron_hetero.runtime.faults import fault_point
from megatron_hetero.runtime.module_state import ModuleState
from megatron_hetero.runtime.stage_runner import LossSum, StageRunner
from megatron_hetero.runtime.loss_scale import loss_scale_of
from megatron_hetero.runtime.optimizer_step import ModelStep, step_modules
from megatron_hetero.runtime.step import (
    StepResult,
    global_loss_parts,
    loss_normaliser,
    resident_memory,
    run_collective,
)
from megatron_hetero.runtime.trace import kind_of, wire_args
from megatron_hetero.runtime.wire import BoundaryTimeout, WireOp, post_batch

#: p2p tag of pipeline links inside a module (boundaries use their edge index, always smaller).
PIPELINE_TAG = 1 << 20


class LinkError(RuntimeError):
    """A send or receive of the disjoint schedule failed (e.g. its peer died); names the action, the
    edge or pipeline link, this rank and the peer ranks."""


@dataclass
class _Comm:
    """One send or receive of a batch on this rank: its messages (`phase`) and what to do with the
    result once the batch completed."""

    action: object
    where: str
    phase: Optional[Phase]
    finish: Callable[[Phase], None]
    run: Optional[Callable[[], None]] = None  # a hierarchical edge: its leader route, run now (blocking)
    key: tuple = ()  # the order of the hierarchical routes of a batch, the same on every rank


def disjoint_boundaries(
    plan: RankPlan, config: RuntimeConfig, runner: StageRunner, topo: Any = None
) -> dict[Link, Boundary]:
    """Link -> this rank's `Boundary` of every module edge its stage table sends on or receives from
    (none on an idle rank), one call per micro-batch: what the schedule runs and `dryrun` plans.
    Builds plans only (no communication); the layout's boundary mode decides the route (`topo`: the
    rank's Topology, whose groups the hierarchical route broadcasts over)."""
    out: dict[Link, Boundary] = {}
    if plan.disjoint is None:
        return out
    plans = BoundaryPlanCache(plan.layout, plan.rank)  # this rank's boundary plans, shared by the edges
    links = {a.link for a in plan.disjoint.actions if isinstance(a, (Send, Recv))}
    for lk in sorted(links):
        if lk.src.module == lk.dst.module:
            continue
        edge = Edge(lk.src.module, lk.dst.module)
        t = runner.edge_tensor(edge)
        out[lk] = Boundary(
            plan.layout,
            edge,
            batch=plan.micro_batching.samples,
            hidden=t.hidden,
            seq=t.seq,
            dst_seq=t.dst_seq,
            dst_offset=t.dst_offset,
            dtype=t.dtype,
            timeout_s=float(config.comm_timeout_s),
            device=get_device(),
            plans=plans,
            mode=plan.layout.boundary_mode,
            topology=topo,
        )
    return out


class DisjointSchedule:
    """Runs training steps of the graph-aware 1F1B tables on this rank (see module docstring)."""

    def __init__(
        self, plan: RankPlan, config: RuntimeConfig, topo, states: dict[str, ModuleState], runner: StageRunner
    ) -> None:
        if plan.layout.placement != "disjoint":
            raise ValueError(f"the disjoint schedule needs placement 'disjoint', got {plan.layout.placement!r}")
        self.plan, self.config, self.topo, self.states, self.runner = plan, config, topo, states, runner
        self.model_step: Optional[ModelStep] = None  # the step's whole-model optimizer step, once taken
        self.layout = plan.layout
        self.micro_batches, self.mb_samples = plan.micro_batching.count, plan.micro_batching.samples
        self.timeout_s = float(config.comm_timeout_s)
        self.rank = plan.rank
        self.device = get_device()
        self.table: Optional[StageTable] = plan.disjoint  # None: an idle rank (gap between islands)
        self._step = -1
        if self.table is None:
            return
        if config.schedule != "1f1b":  # --hetero-schedule zb: this stage's zero-bubble table (pure, cheap)
            self.table = build_tables(self.layout, self.micro_batches, schedule=config.schedule)[self.table.stage]
        self._wgrad: dict[int, tuple[list, list]] = {}  # zb: mb -> (tensors, gradients) kept for its W pass
        self.stage = self.table.stage
        self.name = self.stage.module
        self.me = plan.modules[self.name]
        self.state = states[self.name]
        assert self.me.coord.pp == self.stage.pp, (self.me, self.stage)
        self.dp_share = self.mb_samples // self.me.dp  # this module's rows of one micro-batch per DP rank
        self.prev_rank, self.next_rank = self.me.prev_rank, self.me.next_rank
        self.is_loss_stage = self.name in runner.loss_modules() and self.me.last_stage
        # One Boundary per module edge this stage sends on or receives from.
        self.boundaries: dict[Link, Boundary] = disjoint_boundaries(plan, config, runner, topo)

    def close(self) -> None:
        """Nothing to release: communication has no background threads."""

    # -- the step ---------------------------------------------------------------------------------
    def step(self, step: int, train: bool = True) -> StepResult:
        """One step over the global samples [step*G, (step+1)*G) of the runner's current data.
        train=False (evaluation): the same tables, but no gradient reduction and no optimizer step;
        the gradients computed are discarded (the next step zeroes them)."""
        self._step = step
        self._iteration = step + 1 if train else None  # 1-based, for fault injection (runtime/faults.py)
        for s in self.states.values():
            s.zero_grad()
        self._inputs: dict[int, dict[Link, torch.Tensor]] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._out_grads: dict[int, dict[Link, torch.Tensor]] = {}
        self._seqs: dict[tuple[Link, int], int] = {}
        self._loss_sums: list[torch.Tensor] = []
        self._stage_losses: dict[int, torch.Tensor] = {}  # mb -> loss of a loss stage that also sends on
        self._loss_tokens = self.runner.loss_tokens(step)
        # --fp16: the loss is multiplied by the whole model's one loss scale before backward (1.0 otherwise)
        self._loss_scale = loss_scale_of(self.states)
        memory = {}
        if self.table is not None:
            tr, enc = self.config.tracer, self.plan.roles.is_encoder(self.name)
            # --overlap-grad-reduce: every backward of this stage but the step's last one runs inside the
            # module's no_sync (evaluation: every one), so DDP launches the reductions in the last one
            # (zb: the weight passes are the backwards that fill the gradient buffers)
            grad_kind = WeightGrad if self._split_backward() else Backward
            backwards_left = sum(isinstance(a, grad_kind) for a in self.table.actions)
            for item in self.table.batches():
                if isinstance(item, tuple):
                    with tr.span(
                        "comm",
                        lambda: " + ".join(a.short() for a in item),
                        lambda: {"module": self.name, "stage": self.stage.pp, "actions": [str(a) for a in item]},
                    ):
                        self._exchange(item)
                elif isinstance(item, Forward):
                    with tr.span(
                        kind_of(enc, "forward"),
                        lambda: f"{self.stage} {item.short()}",
                        lambda: {"module": self.name, "stage": self.stage.pp, "mb": item.mb},
                    ):
                        self._forward(item.mb)
                elif isinstance(item, Backward):
                    with tr.span(
                        kind_of(enc, "backward"),
                        lambda: f"{self.stage} {item.short()}",
                        lambda: {"module": self.name, "stage": self.stage.pp, "mb": item.mb},
                    ):
                        if grad_kind is Backward:
                            backwards_left -= 1
                        with self.state.no_sync(when=backwards_left > 0 or not train):
                            self._backward(item.mb)
                elif isinstance(item, WeightGrad):
                    with tr.span(
                        kind_of(enc, "backward"),
                        lambda: f"{self.stage} {item.short()}",
                        lambda: {"module": self.name, "stage": self.stage.pp, "mb": item.mb, "pass": "weight"},
                    ):
                        backwards_left -= 1
                        with self.state.no_sync(when=backwards_left > 0 or not train):
                            self._weight_grad(item.mb)
                else:  # pragma: no cover - the tables hold only these
                    raise AssertionError(f"unknown action {item!r}")
            assert not self._outputs and not self._inputs and not self._wgrad, "a micro-batch was not finished"
        memory["step"] = resident_memory(self.states)
        fault_point("grad-reduce", self.rank, self._iteration, when=train)
        for s in self.states.values() if train else ():
            ranks = dist.get_process_group_ranks(s.pgs.dp_cp)
            with self.config.tracer.span("grad-reduce", f"gradient reduction {s.name}", {"module": s.name}):
                run_collective(
                    f"module {s.name}: gradient reduction over its DP x CP group (ranks {ranks})",
                    self.rank,
                    s.finalize_grads,
                )
        fault_point("optimizer", self.rank, self._iteration, when=train)
        if train:
            with self.config.tracer.span("optimizer", "optimizer step"):
                self.model_step = step_modules(self.states, self.layout.names, self.rank)
        counts = self.table is not None and self.is_loss_stage and self.me.coord.tp == 0
        extras = self.runner.aux_losses(step)
        loss, parts, aux = global_loss_parts(
            tuple(self.runner.loss_modules()),
            {self.name: self._loss_sums} if self.table is not None else {},
            {self.name} if counts else set(),
            extras,
            self._loss_tokens,
            self.rank,
        )
        ms, self.model_step = self.model_step, None
        return StepResult(
            loss=loss,
            memory=memory,
            loss_parts=parts,
            aux_loss=aux,
            grad_norm=ms.grad_norm if ms is not None else None,
            skipped=ms.skipped if ms is not None else False,
            no_loss_tokens=self._loss_tokens == 0,
        )

    # -- communication: one batch at a time --------------------------------------------------------
    def _peers(self, a) -> list[int]:
        """The ranks on the other end of action `a` from this rank."""
        lk = a.link
        if lk not in self.boundaries:
            return [self.next_rank if a.stage == lk.src else self.prev_rank]
        other = lk.dst if a.stage == lk.src else lk.src
        return self.plan.stage_ranks(other.module, other.pp)

    def _exchange(self, actions: tuple) -> None:
        """Post one batch of sends and receives at once, wait for all of it, then finish each."""
        comms = [self._prepare(a) for a in actions]
        ops = []
        routes = sorted((c for c in comms if c.run is not None), key=lambda c: c.key)
        for c in comms:
            if c.phase is None:
                continue
            ph, what = c.phase, str(c.action)
            ops += [WireOp(True, peer, t.contiguous(), ph.tag, what, c.where) for peer, t in ph.sends.items()]
            ops += [WireOp(False, peer, t, ph.tag, what, c.where) for peer, t in ph.recvs.items()]
        try:
            with self.config.tracer.span(
                "wait", lambda: "wait " + " + ".join(a.short() for a in actions), lambda: wire_args(ops)
            ):
                wait = post_batch(ops, timeout_s=self.timeout_s)
                for c in routes:  # hierarchical edges: each leader route in turn, in the same order everywhere
                    c.run()
                wait()
        except BoundaryTimeout:  # already names the edge, this rank and the peer
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. gloo 'Connection closed by peer' when posting
            first = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
            where = "; ".join(f"{c.where} '{c.action}' with peer ranks {self._peers(c.action)}" for c in comms)
            raise LinkError(f"rank {self.rank} failed in a batch on {where}: {type(exc).__name__}: {first}") from exc
        for c in comms:
            if c.phase is not None:
                c.finish(c.phase)

    def _edge_seq(self, b: Boundary, mb: int) -> Optional[int]:
        """The edge's sequence length for micro-batch `mb` (None: the edge's fixed one)."""
        return self.runner.edge_seq(b.edge, self.plan.micro_batching.rows(1, 0, mb, self._step))

    def _prepare(self, a) -> _Comm:
        """The messages of action `a` on this rank (see `_Comm`)."""
        mb, lk = a.mb, a.link
        b = self.boundaries.get(lk)
        where = f"edge {b.edge}" if b is not None else f"pipeline link {lk}"
        none = lambda: None  # noqa: E731 - a pipeline message assembles nothing
        if b is not None and b.route is not None:
            return self._prepare_route(a, b, where)
        if isinstance(a, Send) and a.direction == "forward":
            out = self._outputs[mb].detach().contiguous()  # an edge tensor [rows, seq, hidden] / a stage tensor
            if b is None:
                return _Comm(a, where, Phase({self.next_rank: out}, {}, none, PIPELINE_TAG), lambda ph: None)
            assert out.shape[0] == self.dp_share, (out.shape, lk)
            fault_point("boundary-send", self.rank, self._iteration)
            ph, self._seqs[(lk, mb)] = b.planned_forward_phase(out, self._edge_seq(b, mb))
            return _Comm(a, where, ph, lambda ph: ph.finish())
        if isinstance(a, Send):  # gradients of this stage's input leaves go back
            leaf = self._inputs[mb].pop(lk)
            if not self._inputs[mb]:
                del self._inputs[mb]
            g = (leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)).detach().contiguous()
            if b is None:
                return _Comm(a, where, Phase({self.prev_rank: g}, {}, none, PIPELINE_TAG), lambda ph: None)
            return _Comm(a, where, b.backward_phase(g, self._seqs.pop((lk, mb))), lambda ph: ph.finish())
        if a.direction == "forward":  # receive this stage's input of mb
            if b is None:
                shape, dtype = self.runner.stage_tensor(self.name, self.dp_share)
                buf = torch.empty(shape, dtype=dtype, device=self.device)
                ph = Phase({}, {self.prev_rank: buf}, lambda: buf, PIPELINE_TAG)
            else:
                fault_point("boundary-recv", self.rank, self._iteration)
                ph, self._seqs[(lk, mb)] = b.planned_forward_phase(None, self._edge_seq(b, mb))

            def store_input(ph: Phase) -> None:
                self._inputs.setdefault(mb, {})[lk] = ph.finish().detach().requires_grad_(True)

            return _Comm(a, where, ph, store_input)
        # receive the gradient of this stage's output
        if b is None:
            shape, dtype = self.runner.stage_tensor(self.name, self.dp_share)
            gbuf = torch.empty(shape, dtype=dtype, device=self.device)
            ph = Phase({}, {self.next_rank: gbuf}, lambda: gbuf, PIPELINE_TAG)
        else:
            ph = b.backward_phase(None, self._seqs.pop((lk, mb)))

        def store_grad(ph: Phase) -> None:
            self._out_grads.setdefault(mb, {})[lk] = ph.finish()

        return _Comm(a, where, ph, store_grad)

    def _prepare_route(self, a, b: Boundary, where: str) -> _Comm:
        """Action `a` on a hierarchical edge: its leader route as one blocking call (`Boundary.
        forward_exchange` / `backward_exchange`: gathers to the leaders, broadcasts over the
        destination's TP and DP x CP groups, and back), which cannot join a batch of point-to-point
        messages; `_exchange` runs the batch's routes in (edge, forward first, micro-batch) order on
        every rank, between posting and waiting for the batch's other messages (an order that
        `plan.schedule_check.simulate_leader_routes` proves deadlock-free for a layout's tables;
        backward first deadlocks the 1F1B steady state)."""
        mb, lk = a.mb, a.link
        key = (b.tag, 0 if a.direction == "forward" else 1, mb)
        skip = lambda ph: None  # noqa: E731 - the route's result is stored by `run`
        if isinstance(a, Send) and a.direction == "forward":
            out = self._outputs[mb].detach().contiguous()
            fault_point("boundary-send", self.rank, self._iteration)
            self._seqs[(lk, mb)] = b.seq
            return _Comm(a, where, None, skip, lambda: b.forward_exchange(out), key)
        if isinstance(a, Send):
            leaf = self._inputs[mb].pop(lk)
            if not self._inputs[mb]:
                del self._inputs[mb]
            g = (leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)).detach().contiguous()
            seq = self._seqs.pop((lk, mb))
            return _Comm(a, where, None, skip, lambda: b.backward_exchange(g, seq), key)
        if a.direction == "forward":
            fault_point("boundary-recv", self.rank, self._iteration)
            self._seqs[(lk, mb)] = b.seq

            def recv_input() -> None:
                y, _ = b.forward_exchange(None)
                self._inputs.setdefault(mb, {})[lk] = y.detach().requires_grad_(True)

            return _Comm(a, where, None, skip, recv_input, key)
        seq = self._seqs.pop((lk, mb))

        def recv_grad() -> None:
            self._out_grads.setdefault(mb, {})[lk] = b.backward_exchange(None, seq)

        return _Comm(a, where, None, skip, recv_grad, key)

    # -- compute ----------------------------------------------------------------------------------
    def _forward(self, mb: int) -> None:
        samples = self.plan.micro_batching.rows(self.me.dp, self.me.coord.dp, mb, self._step)
        inputs = self._inputs.get(mb, {})
        edge_in = {lk.src.module: t for lk, t in inputs.items() if lk in self.boundaries}
        stage_in = next((t for lk, t in inputs.items() if lk not in self.boundaries), None)
        fault_point("encoder-forward", self.rank, self._iteration, when=self.plan.roles.is_encoder(self.name))
        fault_point(
            "llm-1f1b",
            self.rank,
            self._iteration,
            when=self.name in self.plan.roles.language and mb == self.micro_batches // 2,
        )
        out = self.runner.forward(self.name, samples, edge_in, stage_in)
        if isinstance(out, LossSum):
            self._loss_sums.append(out.loss_sum.detach())
            if out.output is not None:  # a loss stage that also feeds modules after it
                self._stage_losses[mb] = out.loss_sum / loss_normaliser(self._loss_tokens) * self._loss_scale
                out = out.output
            else:
                out = out.loss_sum / loss_normaliser(self._loss_tokens) * self._loss_scale
        self._outputs[mb] = out

    def _backward(self, mb: int) -> None:
        out = self._outputs.pop(mb)
        grads = self._out_grads.pop(mb, {})
        tensors: list = []
        seeds: list = []
        if not grads:  # the loss (last stage of the last language segment)
            if out.requires_grad:
                tensors, seeds = [out], [None]
        else:
            g = None
            for t in grads.values():  # a branch: the output's gradient is the sum over its consumers
                g = t if g is None else g + t
            loss = self._stage_losses.pop(mb, None)
            if loss is not None and loss.requires_grad:  # its own loss and its consumers' gradient together
                tensors, seeds = [loss, out], [None, g.to(out.dtype)]
            elif out.requires_grad:
                tensors, seeds = [out], [g.to(out.dtype)]
        if not self._split_backward():
            if tensors:
                torch.autograd.backward(tensors, seeds)
            if self.table.schedule == "zb":
                self._wgrad[mb] = ([], [])  # the loss stage's weight pass has nothing left to do
            return
        # zb, the input-gradient pass: only the stage's input leaves (what goes upstream); the graph is
        # kept for this micro-batch's weight pass
        self._wgrad[mb] = (tensors, seeds)
        leaves = [t for t in self._inputs.get(mb, {}).values() if t.requires_grad]
        if tensors and leaves:
            torch.autograd.backward(tensors, seeds, inputs=leaves, retain_graph=True)

    def _split_backward(self) -> bool:
        """zb: whether this stage splits its backward. A loss stage does not: Megatron's vocab-parallel
        cross entropy computes its softmax in place in the logits it saved and its backward writes the
        gradient into that same tensor, so its graph cannot be walked twice; it runs its backward
        whole at Backward (the gradient still leaves before its WeightGrad, which does nothing)."""
        return self.table is not None and self.table.schedule == "zb" and not self.is_loss_stage

    def _weight_grad(self, mb: int) -> None:
        """zb, the weight-gradient pass of micro-batch `mb`: the gradients of this stage's trainable
        parameters (into Megatron DDP's buffers, through its hooks), from the tensors and gradients
        its input-gradient pass kept; the graph is freed after it."""
        tensors, seeds = self._wgrad.pop(mb)
        params = [p for p in self.state.module.parameters() if p.requires_grad]
        if tensors and params:
            torch.autograd.backward(tensors, seeds, inputs=params)

"""The disjoint schedule: every module (or pipeline stage of one) on its own rank island, run by an
interpreter of the graph-aware 1F1B stage tables of `plan/schedule.py`.

Per step, for a global batch of G samples and M micro-batches (M = G / dp / micro_batch_size of the
first language module; the arithmetic is the rank plan's, `plan/rank_plan.py`):
  * micro-batch i covers the global samples [first + i*G/M, first + (i+1)*G/M), first = step*G;
    inside it, DP rank d of a module owns the contiguous rows [d*(G/M)/dp, (d+1)*(G/M)/dp), so every
    module's DP share of a micro-batch is (G/M)/dp samples (G/M must be divisible by every dp);
  * this rank executes its stage's table action by action:
      RecvAct fwd  receive the stage's input of micro-batch mb (boundary forward on the destination
                   side of a module edge; a plain receive from the previous pipeline stage inside a
                   module); the input becomes a detached leaf that will collect its gradient;
      Forward      the stage runner runs the stage over this rank's samples of the micro-batch, from
                   the received inputs (a loss stage returns its loss sum, divided here by the
                   step's loss tokens, as the colocated schedule does);
      SendAct fwd  send the stage's output (boundary forward on the source side / pipeline send);
      RecvAct bwd  receive the gradient of the output (boundary backward on the source side / pipeline
                   receive);
      Backward     torch.autograd.backward(output, gradient) (the loss itself on the last stage);
      SendAct bwd  send the input leaves' gradients back (boundary backward on the destination side /
                   pipeline send).
    Activations of a micro-batch live until its backward.
  * then every module reduces its gradients over its own DP x CP group and steps its optimizer
    (`ModuleState`; frozen modules do nothing), and the loss is all-reduced over the world.

Sends are asynchronous, receives blocking (the model under which the tables are proven free of
deadlock): gloo's send only completes once the peer has posted the matching receive, so every send
runs on a per-channel sender thread (one channel = one (link, direction) of this rank, FIFO, so the
messages of a channel leave in micro-batch order, the order in which the peer receives them). A
boundary call has a source side and a destination side; in disjoint placement a rank is on exactly
one side of an edge, so the source's `forward_exchange` (and the destination's `backward_exchange`)
only sends and runs on the sender thread, while the receiving side runs on the main thread. The
autograd cut at every stage input/output is done here, as Megatron's pipeline schedules do (detached
input leaves, backward with the received gradient), so the boundary's exchanges are used directly.

Every wait has the job's communication timeout; a timeout or a dead peer raises an error that names
the edge or pipeline link and both ranks (`runtime/wire.py`).
"""
from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_hetero.compat.device import get_device
from megatron_hetero.layout.spec import Edge
from megatron_hetero.plan.placement import stage_ranks
from megatron_hetero.plan.rank_plan import RankPlan
from megatron_hetero.plan.schedule import Backward, Forward, Link, RecvAct, SendAct, StageTable
from megatron_hetero.runtime.boundary import Boundary
from megatron_hetero.runtime.config import RuntimeConfig
from megatron_hetero.runtime.module_state import ModuleState
from megatron_hetero.runtime.stage_runner import LossSum, StageRunner
from megatron_hetero.runtime.step import StepResult, global_loss_parts, resident_memory, run_collective
from megatron_hetero.runtime.wire import BoundaryTimeout, p2p

#: p2p tag of pipeline links inside a module (boundaries use their edge index, always smaller).
PIPELINE_TAG = 1 << 20


class LinkError(RuntimeError):
    """A send or receive of the disjoint schedule failed (e.g. its peer died); names the action, the
    edge or pipeline link, this rank and the peer ranks."""


class _SendChannel:
    """One FIFO sender thread for one (link, direction) of this rank. `submit` returns a Future; after
    a failure the channel refuses further work (its peer is gone or late: the step is lost)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self._queue: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._failed: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name=f"send {label}", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            if self._failed is not None:
                fut.set_exception(RuntimeError(f"{self.label}: an earlier send failed: {self._failed}"))
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                self._failed = exc
                fut.set_exception(exc)

    def close(self) -> None:
        self._queue.put(None)


class DisjointSchedule:
    """Runs training steps of the graph-aware 1F1B tables on this rank (see module docstring)."""

    def __init__(self, plan: RankPlan, config: RuntimeConfig, topo, states: dict[str, ModuleState],
                 runner: StageRunner) -> None:
        if plan.layout.placement != "disjoint":
            raise ValueError(f"the disjoint schedule needs placement 'disjoint', got {plan.layout.placement!r}")
        if dist.get_backend() == "nccl":
            # NCCL runs the sends and receives between two ranks on one stream in issue order, so the
            # forward send of micro-batch k+1 and the backward receive of micro-batch k on the same
            # pair deadlock on the device whatever the host threads do (Megatron fuses such pairs
            # into one batched call); the disjoint schedule needs that fusion first.
            raise NotImplementedError("the disjoint schedule runs on gloo only for now (NCCL needs the "
                                      "fused send/receive pairs of 1F1B); use --hetero-placement colocated on GPUs")
        self.plan, self.config, self.topo, self.states, self.runner = plan, config, topo, states, runner
        self.layout = plan.layout
        self.micro_batches, self.mb_samples = plan.micro_batching.count, plan.micro_batching.samples
        self.timeout_s = float(config.comm_timeout_s)
        self.rank = plan.rank
        self.device = get_device()
        self.table: Optional[StageTable] = plan.disjoint  # None: an idle rank (gap between islands)
        self._channels: dict[tuple[Link, str], _SendChannel] = {}
        self._step = -1
        if self.table is None:
            return
        self.stage = self.table.stage
        self.name = self.stage.module
        self.me = plan.modules[self.name]
        self.state = states[self.name]
        assert self.me.coord.pp == self.stage.pp, (self.me, self.stage)
        self.dp_share = self.mb_samples // self.me.dp  # this module's rows of one micro-batch per DP rank
        self.prev_rank, self.next_rank = self.me.prev_rank, self.me.next_rank
        self.is_loss_stage = self.name in runner.loss_modules() and self.me.last_stage
        # One Boundary per module edge this stage sends on or receives from.
        self.boundaries: dict[Link, Boundary] = {}
        links = {a.link for a in self.table.actions if isinstance(a, (SendAct, RecvAct))}
        for lk in sorted(links):
            if lk.src.module != lk.dst.module:
                self.boundaries[lk] = self._boundary(Edge(lk.src.module, lk.dst.module))

    # -- construction helpers -------------------------------------------------------------------
    def _boundary(self, edge: Edge) -> Boundary:
        t = self.runner.edge_tensor(edge)
        return Boundary(self.layout, edge, batch=self.mb_samples, hidden=t.hidden, seq=t.seq, dst_seq=t.dst_seq,
                        dst_offset=t.dst_offset, timeout_s=self.timeout_s, device=self.device)

    def _channel(self, link: Link, direction: str) -> _SendChannel:
        key = (link, direction)
        if key not in self._channels:
            self._channels[key] = _SendChannel(f"rank {self.rank} {direction} sends on {link}")
        return self._channels[key]

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()
        self._channels = {}

    # -- the step ---------------------------------------------------------------------------------
    def step(self, step: int) -> StepResult:
        self._step = step
        for s in self.states.values():
            s.zero_grad()
        self._inputs: dict[int, dict[Link, torch.Tensor]] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._out_grads: dict[int, dict[Link, torch.Tensor]] = {}
        self._seqs: dict[tuple[Link, int], int] = {}
        self._fwd_sends: dict[tuple[Link, int], concurrent.futures.Future] = {}
        self._pending: list[tuple[str, concurrent.futures.Future]] = []
        self._loss_sums: list[torch.Tensor] = []
        self._stage_losses: dict[int, torch.Tensor] = {}  # mb -> loss of a loss stage that also sends on
        self._loss_tokens = self.runner.loss_tokens(step)
        memory = {}
        if self.table is not None:
            for action in self.table.actions:
                self._raise_failed_sends()
                if isinstance(action, RecvAct):
                    self._recv(action)
                elif isinstance(action, Forward):
                    self._forward(action.mb)
                elif isinstance(action, SendAct):
                    self._send(action)
                elif isinstance(action, Backward):
                    self._backward(action.mb)
                else:  # pragma: no cover - the tables hold only these four
                    raise AssertionError(f"unknown action {action!r}")
            self._drain()
            assert not self._outputs and not self._inputs, "a micro-batch was not finished"
        memory["step"] = resident_memory(self.states)
        for s in self.states.values():
            ranks = dist.get_process_group_ranks(s.pgs.dp_cp)
            run_collective(f"module {s.name}: gradient reduction over its DP x CP group (ranks {ranks})", self.rank,
                           s.finalize_grads)
        for s in self.states.values():
            s.step()
        counts = self.table is not None and self.is_loss_stage and self.me.coord.tp == 0
        extras = self.runner.aux_losses(step) if hasattr(self.runner, "aux_losses") else {}
        loss, parts, aux = global_loss_parts(tuple(self.runner.loss_modules()),
                                             {self.name: self._loss_sums} if self.table is not None else {},
                                             {self.name} if counts else set(), extras, self._loss_tokens, self.rank)
        return StepResult(loss=loss, memory=memory, loss_parts=parts, aux_loss=aux)

    # -- sends: asynchronous, FIFO per channel ------------------------------------------------------
    def _raise_failed_sends(self) -> None:
        for _, fut in self._pending:
            if fut.done() and fut.exception() is not None:
                raise fut.exception()

    def _drain(self) -> None:
        for label, fut in self._pending:
            try:
                fut.result(timeout=2 * self.timeout_s + 5.0)  # each wait inside has timeout_s
            except concurrent.futures.TimeoutError:
                raise RuntimeError(f"rank {self.rank}: {label} did not finish within {2 * self.timeout_s + 5.0:g} s "
                                   f"(--hetero-comm-timeout {self.timeout_s:g} s)") from None
        self._pending = []
        self._fwd_sends = {}

    def _peers(self, a) -> list[int]:
        """The ranks on the other end of action `a` from this rank."""
        lk = a.link
        if lk not in self.boundaries:
            return [self.next_rank if a.stage == lk.src else self.prev_rank]
        other = lk.dst if a.stage == lk.src else lk.src
        return stage_ranks(self.layout.module(other.module), other.pp)

    def _comm(self, a, fn: Callable[..., Any], *args: Any) -> Any:
        """Run one communication of action `a`; failures name the edge/link, this rank and its peers."""
        try:
            return fn(*args)
        except BoundaryTimeout:  # already names the edge, this rank and the peer
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. gloo 'Connection closed by peer' when posting
            where = f"edge {self.boundaries[a.link].edge}" if a.link in self.boundaries else f"pipeline link {a.link}"
            first = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
            raise LinkError(f"{where}: rank {self.rank} failed in '{a}' with peer ranks {self._peers(a)}: "
                            f"{type(exc).__name__}: {first}") from exc

    def _send(self, a: SendAct) -> None:
        mb, lk = a.mb, a.link
        ch = self._channel(lk, a.direction)
        label = f"{a} (rank {self.rank})"
        if a.direction == "fwd":
            out = self._outputs[mb].detach()
            if lk in self.boundaries:
                b = self.boundaries[lk]
                x = out.contiguous()  # an edge tensor: [rows, seq, hidden]
                assert x.shape[0] == self.dp_share, (x.shape, lk)
                self._seqs[(lk, mb)] = x.shape[1] * self.me.cp
                fut = ch.submit(self._comm, a, b.forward_exchange, x)
            else:
                fut = ch.submit(self._comm, a, self._pipeline_send, out.contiguous(), self.next_rank, lk,
                                "activation")
            self._fwd_sends[(lk, mb)] = fut
        else:
            leaf = self._inputs[mb][lk]
            g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            g = g.detach()
            if lk in self.boundaries:
                b = self.boundaries[lk]
                fut = ch.submit(self._comm, a, b.backward_exchange, g.contiguous(), self._seqs.pop((lk, mb)))
            else:
                fut = ch.submit(self._comm, a, self._pipeline_send, g.contiguous(), self.prev_rank, lk, "gradient")
            del self._inputs[mb][lk]
            if not self._inputs[mb]:
                del self._inputs[mb]
        self._pending.append((label, fut))

    def _pipeline_send(self, t: torch.Tensor, peer: int, link: Link, what: str) -> None:
        p2p({peer: t}, {}, what=f"pipeline {what}", edge=str(link), timeout_s=self.timeout_s, tag=PIPELINE_TAG)

    def _pipeline_recv(self, peer: int, link: Link, what: str) -> torch.Tensor:
        shape, dtype = self.runner.stage_tensor(self.name, self.dp_share)
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        p2p({}, {peer: buf}, what=f"pipeline {what}", edge=str(link), timeout_s=self.timeout_s, tag=PIPELINE_TAG)
        return buf

    # -- receives: blocking, on this thread --------------------------------------------------------
    def _recv(self, a: RecvAct) -> None:
        mb, lk = a.mb, a.link
        if a.direction == "fwd":
            if lk in self.boundaries:
                y, seq = self._comm(a, self.boundaries[lk].forward_exchange, None)
                self._seqs[(lk, mb)] = seq
            else:
                y = self._comm(a, self._pipeline_recv, self.prev_rank, lk, "activation")
            self._inputs.setdefault(mb, {})[lk] = y.detach().requires_grad_(True)
        else:
            if lk in self.boundaries:
                self._fwd_sends[(lk, mb)].result(timeout=2 * self.timeout_s + 5.0)  # our forward send of mb has left
                g = self._comm(a, self.boundaries[lk].backward_exchange, None, self._seqs.pop((lk, mb)))
            else:
                g = self._comm(a, self._pipeline_recv, self.next_rank, lk, "gradient")
            self._out_grads.setdefault(mb, {})[lk] = g

    # -- compute ----------------------------------------------------------------------------------
    def _forward(self, mb: int) -> None:
        samples = self.plan.micro_batching.rows(self.me.dp, self.me.coord.dp, mb, self._step)
        inputs = self._inputs.get(mb, {})
        edge_in = {lk.src.module: t for lk, t in inputs.items() if lk in self.boundaries}
        stage_in = next((t for lk, t in inputs.items() if lk not in self.boundaries), None)
        out = self.runner.forward(self.name, samples, edge_in, stage_in)
        if isinstance(out, LossSum):
            self._loss_sums.append(out.loss_sum.detach())
            if out.output is not None:  # a loss stage that also feeds modules after it
                self._stage_losses[mb] = out.loss_sum / self._loss_tokens
                out = out.output
            else:
                out = out.loss_sum / self._loss_tokens
        self._outputs[mb] = out

    def _backward(self, mb: int) -> None:
        out = self._outputs.pop(mb)
        grads = self._out_grads.pop(mb, {})
        if not grads:  # the loss (last stage of the last language segment)
            if out.requires_grad:
                torch.autograd.backward(out)
            return
        g = None
        for t in grads.values():  # a branch: the output's gradient is the sum over its consumers
            g = t if g is None else g + t
        loss = self._stage_losses.pop(mb, None)
        if loss is not None and loss.requires_grad:  # its own loss and its consumers' gradient together
            torch.autograd.backward([loss, out], [None, g.to(out.dtype)])
        elif out.requires_grad:
            torch.autograd.backward(out, g.to(out.dtype))

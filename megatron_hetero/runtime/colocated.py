"""The three-phase colocated schedule: executes a rank's `plan.colocated.ColocatedTable`.

Per step (the table's phases; see `plan/colocated.py` for who does what):
  phase 1: each encoder stage runs forward once over this rank's encoder-DP share of the step
           (pipelined encoders pass the whole share stage to stage), then the encoder's colocated
           boundary moves its tokens into the language model's layout. The boundary output is
           detached: the language phase starts from a leaf that accumulates its gradient.
  phase 2: optional offload of the encoders' state to host memory; Megatron-core's forward-backward
           function runs the language model's micro-batches (1F1B when pp > 1) from those leaves.
  phase 3: offloaded state comes back; boundary backward (gradients into each encoder's layout) and
           one encoder backward per encoder (stage by stage, last to first, when pp > 1).
With output modules (heads after the language model), phase 2 runs a forward-only pass of the
language model first, the heads' boundary forward, forward+backward and boundary backward, and then
the full 1F1B whose last stage adds <hidden, head gradient> to its loss (`plan/colocated.py` says why).
Then each module reduces its gradients over its own DP x CP group and steps its own optimizer.
No encoder collective ever runs while the language model's pipeline is in flight.

The schedule knows no model: the stage runner builds inputs and runs each stage's forward.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

from megatron_hetero.compat.device import get_device
from megatron_hetero.layout.spec import Edge
from megatron_hetero.plan.batch import megatron_micro_batch
from megatron_hetero.plan.colocated import (
    BoundaryCall,
    Collective,
    EncoderBackward,
    EncoderForward,
    LanguagePhase,
    OutputStep,
    StateMove,
)
from megatron_hetero.plan.actions import Recv, Send
from megatron_hetero.plan.rank_plan import RankPlan
from megatron_hetero.plan.boundary_rank import BoundaryPlanCache
from megatron_hetero.runtime.boundary import Boundary
from megatron_hetero.runtime.config import RuntimeConfig
from megatron_hetero.runtime.faults import fault_point
from megatron_hetero.runtime.loss_scale import loss_scale_of
from megatron_hetero.runtime.module_state import ModuleState
from megatron_hetero.runtime.offload import Offloader
from megatron_hetero.runtime.stage_runner import LossSum, StageRunner
from megatron_hetero.runtime.optimizer_step import ModelStep, step_modules
from megatron_hetero.runtime.step import (
    StepResult,
    global_loss_parts,
    loss_normaliser,
    resident_memory,
    run_collective,
)
from megatron_hetero.runtime.trace import MEGATRON_P2P_METHODS, boundary_args
from megatron_hetero.runtime.wire import p2p


def colocated_boundaries(plan: RankPlan, config: RuntimeConfig, topo, runner: StageRunner) -> dict[str, Boundary]:
    """Edge -> this rank's `Boundary` of every colocated edge (encoders into the first language
    module, it into the output heads), one call per step over the global batch: what the schedule
    runs and `dryrun` plans. Builds plans only (no communication)."""
    lang = plan.roles.first_language
    edges = [Edge(n, lang) for n in plan.roles.encoders] + [Edge(lang, n) for n in plan.roles.outputs]
    out: dict[str, Boundary] = {}
    plans = BoundaryPlanCache(plan.layout, plan.rank)  # this rank's boundary plans, shared by the edges
    for edge in edges:
        t = runner.edge_tensor(edge)
        out[str(edge)] = Boundary(
            plan.layout,
            edge,
            batch=plan.global_batch,
            hidden=t.hidden,
            seq=t.seq,
            dst_seq=t.dst_seq,
            dst_offset=t.dst_offset,
            dtype=t.dtype,
            timeout_s=config.comm_timeout_s,
            device=get_device(),
            topology=topo,
            headers=t.seq is None,
            plans=plans,
        )
    return out


class ColocatedSchedule:
    """Runs training steps of the three-phase schedule on this rank."""

    def __init__(
        self, plan: RankPlan, config: RuntimeConfig, topo, states: dict[str, ModuleState], runner: StageRunner
    ) -> None:
        if plan.colocated is None:
            raise ValueError("the colocated schedule needs a colocated rank plan")
        self.plan, self.config, self.topo, self.states, self.runner = plan, config, topo, states, runner
        self.model_step: Optional[ModelStep] = None  # the step's whole-model optimizer step, once taken
        self.lang_name = plan.roles.first_language
        self.lang = states[self.lang_name]
        self.boundaries: dict[str, Boundary] = colocated_boundaries(plan, config, topo, runner)
        self.offloaders = {n: Offloader(states[n].state_tensors) for n in plan.roles.encoders}
        # Resident state changes between the phases only when the table moves state (offload); else it
        # is read once per step (at phase 1, as before) and reported for all three phases.
        self._moves_state = any(isinstance(a, StateMove) for _, actions in plan.colocated.phases for a in actions)
        lm = plan.modules[self.lang_name]
        self.forward_backward = get_forward_backward_func(pp_size=lm.pp, vp_size=None)
        self.schedule_kwargs = {"pg_collection": self.lang.pgs}
        if lm.pp > 1:
            self.schedule_kwargs["p2p_communicator"] = P2PCommunicator(
                pp_group=self.lang.pgs.pp, config=self.lang.module.config
            )
            config.tracer.wrap_methods(
                self.schedule_kwargs["p2p_communicator"], MEGATRON_P2P_METHODS, "wait", f"{self.lang_name} pipeline"
            )

    def close(self) -> None:
        """Nothing to release: pipeline and boundary messages complete within their step."""

    def step(self, step: int, train: bool = True) -> StepResult:
        """One step over the global samples [step*G, (step+1)*G) of the runner's current data.
        train=False (evaluation): the same tables, but no gradient reduction and no optimizer step;
        the gradients computed are discarded (the next step zeroes them)."""
        self._train = train
        self._iteration = step + 1 if train else None  # 1-based, for fault injection (runtime/faults.py)
        first = step * self.plan.global_batch
        for s in self.states.values():
            s.zero_grad()
        # --fp16: every backward starts from the loss times the whole model's one loss scale (1.0 otherwise)
        self._loss_scale = loss_scale_of(self.states)
        self._io: dict[str, tuple[Optional[torch.Tensor], torch.Tensor]] = {}  # encoder -> (stage input, output)
        self._received: dict[str, torch.Tensor] = {}  # encoder -> pipeline input of this stage
        self._out_grad: dict[str, torch.Tensor] = {}  # encoder -> received gradient of this stage's output
        self._edge_out: dict[str, Optional[torch.Tensor]] = {}  # edge -> boundary output
        self._leaves: dict[str, torch.Tensor] = {}  # encoder -> detached boundary output (LLM input)
        self._loss_sums: dict[str, list[torch.Tensor]] = {}
        self._lang_out: list[torch.Tensor] = []  # phase 2a: the last stage's output per micro-batch
        self._lang_leaf: Optional[torch.Tensor] = None  # their concatenation, the output boundaries' input
        memory: dict[str, dict[str, int]] = {}

        def read(key: str) -> None:
            memory[key] = (
                resident_memory(self.states) if self._moves_state or not memory else dict(next(iter(memory.values())))
            )

        with contextlib.ExitStack() as no_sync:
            if not train:  # --overlap-grad-reduce: evaluation's backward launches no reduction
                for s in self.states.values():
                    no_sync.enter_context(s.no_sync())
            for phase, actions in self.plan.colocated.phases:
                for a in actions:
                    if isinstance(a, LanguagePhase):
                        read("phase2")
                    self._run(a, first)
                if phase in ("phase 1", "phase 3"):
                    read(phase.replace(" ", ""))
        counted = {
            m
            for m in self.runner.loss_modules()
            if m in self.plan.modules and self.plan.modules[m].last_stage and self.plan.modules[m].coord.tp == 0
        }
        extras = self.runner.aux_losses(step)
        loss_tokens = self.runner.loss_tokens(step)
        loss, parts, aux = global_loss_parts(
            tuple(self.runner.loss_modules()),
            self._loss_sums,
            counted,
            extras,
            loss_tokens,
            self.plan.rank,
        )
        ms, self.model_step = self.model_step, None
        return StepResult(
            loss=loss,
            memory=memory,
            loss_parts=parts,
            aux_loss=aux,
            grad_norm=ms.grad_norm if ms is not None else None,
            skipped=ms.skipped if ms is not None else False,
            no_loss_tokens=loss_tokens == 0,
        )

    # -- one action ---------------------------------------------------------------------------------
    def _run(self, a, first: int) -> None:
        if isinstance(a, Recv):
            assert a.peer_rank is not None and a.rows is not None, a
            shape, dtype = self.runner.stage_tensor(a.module, a.rows)
            buf = torch.empty(shape, dtype=dtype, device=get_device())
            self._p2p(a, {}, {a.peer_rank: buf})
            if a.forward:
                self._received[a.module] = buf.requires_grad_(True)
            else:
                self._out_grad[a.module] = buf
        elif isinstance(a, EncoderForward):
            fault_point("encoder-forward", self.plan.rank, self._iteration)
            inp = self._received.pop(a.module, None)
            samples = range(first + a.rows.start, first + a.rows.stop)
            with self.config.tracer.span(
                "encoder-forward", a.__str__, lambda: {"module": a.module, "stage": a.stage, "mb": 0}
            ):
                self._io[a.module] = (inp, self.runner.forward(a.module, samples, {}, inp))
            self.config.tracer.mark_backward(
                self._io[a.module][1],
                "encoder-backward",
                lambda: f"backward {a.module}/{a.stage}",
                lambda: {"module": a.module, "stage": a.stage, "mb": 0},
            )
        elif isinstance(a, Send):
            assert a.peer_rank is not None, a
            inp, out = self._io[a.module]
            if a.forward:
                t = out.detach()
            else:
                t = inp.grad if inp.grad is not None else torch.zeros_like(inp)
            self._p2p(a, {a.peer_rank: t.contiguous()}, {})
        elif isinstance(a, EncoderBackward):
            _, out = self._io[a.module]
            torch.autograd.backward(out, self._out_grad.pop(a.module))
        elif isinstance(a, BoundaryCall):
            fault_point("boundary-send", self.plan.rank, self._iteration, when=a.src and a.direction == "forward")
            fault_point("boundary-recv", self.plan.rank, self._iteration, when=a.dst and a.direction == "forward")
            with self.config.tracer.span("boundary", a.__str__, lambda: boundary_args(self.boundaries[a.edge], a)):
                self._boundary(a)
        elif isinstance(a, StateMove):
            with self.config.tracer.span("offload", a.__str__):
                for n in a.modules:
                    getattr(self.offloaders[n], a.kind)()
        elif isinstance(a, LanguagePhase):
            with self.config.tracer.span("schedule", a.__str__):
                self._language_phase(a, first)
        elif isinstance(a, OutputStep):
            self._output_step(a, first)
        elif isinstance(a, Collective):
            if not self._train and a.kind in ("grad-sync", "optimizer"):
                return  # evaluation: gradients are discarded, weights stay
            if a.kind == "grad-sync":
                fault_point("grad-reduce", self.plan.rank, self._iteration)
                with self.config.tracer.span("grad-reduce", "gradient reduction (each module over its DP x CP)"):
                    for s in self.states.values():
                        run_collective(
                            f"module {s.name}: gradient reduction over its DP x CP group (ranks "
                            f"{dist.get_process_group_ranks(s.pgs.dp_cp)})",
                            self.plan.rank,
                            s.finalize_grads,
                        )
            elif a.kind == "optimizer":
                fault_point("optimizer", self.plan.rank, self._iteration)
                with self.config.tracer.span("optimizer", "optimizer step"):
                    self.model_step = step_modules(self.states, self.plan.layout.names, self.plan.rank)
            # 'loss-reduce' runs after the table (the step's result)
        else:  # pragma: no cover - the tables hold only these
            raise AssertionError(f"unknown action {a!r}")

    def _p2p(self, a, sends: dict, recvs: dict) -> None:
        with self.config.tracer.span("wait", a.__str__):
            p2p(
                sends,
                recvs,
                what=f"{a.module} pipeline {'activation' if a.forward else 'gradient'}",
                edge=f"{a.module} stage link",
                timeout_s=self.config.comm_timeout_s,
            )

    def _output_step(self, a: OutputStep, first: int) -> None:
        """An output module's forward and backward over its DP share; its loss joins the step's."""
        samples = range(first + a.rows.start, first + a.rows.stop)
        out = self.runner.forward(a.module, samples, {self.lang_name: self._leaves[a.module]}, None)
        assert isinstance(out, LossSum), f"output module {a.module} returned no loss"
        self._loss_sums.setdefault(a.module, []).append(out.loss_sum.detach())
        if out.loss_sum.requires_grad:
            loss = out.loss_sum / loss_normaliser(self.runner.loss_tokens(first // self.plan.global_batch))
            torch.autograd.backward(loss * self._loss_scale)

    def _output_boundary(self, a: BoundaryCall) -> None:
        """The language model -> output module edge: forward from the concatenated phase-2a outputs of
        the language model's last stage; backward leaves their gradient in `_lang_leaf.grad`."""
        bnd, out = self.boundaries[a.edge], a.edge.split("->")[1]
        if a.direction == "forward":
            x = None
            if a.src:
                if self._lang_leaf is None:
                    self._lang_leaf = torch.cat(self._lang_out).requires_grad_(True)
                x = self._lang_leaf
            y = bnd(x)
            self._edge_out[a.edge] = y
            if a.dst:
                self._leaves[out] = y.detach().requires_grad_(True)
            return
        y = self._edge_out.pop(a.edge)
        if a.dst:
            leaf = self._leaves.pop(out)
            torch.autograd.backward(y, leaf.grad if leaf.grad is not None else torch.zeros_like(leaf))
        elif a.src:
            Boundary.backward_source(y)

    def _boundary(self, a: BoundaryCall) -> None:
        if a.edge.split("->")[0] == self.lang_name:
            return self._output_boundary(a)
        bnd = self.boundaries[a.edge]
        enc = a.edge.split("->")[0]
        if a.direction == "forward":
            y = bnd(self._io[enc][1] if a.src else None)
            self._edge_out[a.edge] = y
            if a.dst:
                self._leaves[enc] = y.detach().requires_grad_(True)
            return
        y = self._edge_out.pop(a.edge)
        if a.dst:
            leaf = self._leaves[enc]
            torch.autograd.backward(y, leaf.grad if leaf.grad is not None else torch.zeros_like(leaf))
        elif a.src:
            Boundary.backward_source(y)

    def _language_phase(self, a: LanguagePhase, first: int) -> None:
        plan, runner, name = self.plan, self.runner, a.module
        lm = plan.modules[name]
        leaves = self._leaves
        loss_tokens = loss_normaliser(runner.loss_tokens(first // plan.global_batch))  # 1 when none
        mbs = a.micro_batch_size
        loss_sums = self._loss_sums.setdefault(name, [])
        encoders = set(plan.roles.encoders)
        lang_out = self._lang_out
        # The output modules' gradient of this stage's hidden states (phase 2b), scaled as the loss sum.
        scale = self._loss_scale
        head_grad = None
        if not a.forward_only and self._lang_leaf is not None:
            g = self._lang_leaf.grad
            head_grad = (g if g is not None else torch.zeros_like(self._lang_leaf)) * loss_tokens / scale
        # The loss sum is divided by the step's loss tokens in Megatron's backward (grad_scale_func),
        # which also scales the MoE load-balancing loss's gradient (per-token convention); under --fp16
        # it is multiplied by the loss scale there too, as Megatron's optimizer.scale_loss would (the
        # output modules' gradient above carries the scale already, hence its division).
        config = self.lang.module.config
        config.grad_scale_func = lambda t: t / loss_tokens * scale
        # --overlap-grad-reduce: Megatron's schedule runs every backward but the last micro-batch's
        # inside the module's no_sync (evaluation: the whole step is inside it already, see `step`)
        overlap = self._train and self.lang.ddp is not None and self.lang.ddp.ddp_config.overlap_grad_reduce
        if overlap:
            config.no_sync_func = self.lang.ddp.no_sync

        def forward_step(data_iterator, model):
            i = next(data_iterator)
            samples = megatron_micro_batch(first, plan.global_batch, lm.dp, lm.coord.dp, mbs, i)
            inputs = (
                {n: t[i * mbs : (i + 1) * mbs] for n, t in leaves.items() if n in encoders} if lm.first_stage else {}
            )
            fault_point("llm-1f1b", plan.rank, self._iteration, when=not a.forward_only and i == a.micro_batches // 2)
            with torch.set_grad_enabled(not a.forward_only):
                out = runner.forward(name, samples, inputs, None)
            if not isinstance(out, LossSum):
                return out, None

            def loss_func(loss_sum: torch.Tensor):
                if a.forward_only:
                    lang_out.append(out.output.detach())
                    return loss_sum, out.tokens, {}
                loss_sums.append(loss_sum.detach())
                total = loss_sum
                if head_grad is not None:
                    total = total + (out.output * head_grad[i * mbs : (i + 1) * mbs]).sum()
                return total, out.tokens, {"loss_sum": loss_sum.detach()}

            return out.loss_sum, loss_func

        pp_ranks = dist.get_process_group_ranks(self.lang.pgs.pp)
        tp = self.lang.pgs.tp.size()
        run_collective(
            f"module {name}: {'1F1B pipeline' if lm.pp > 1 else 'forward-backward'} of {a.micro_batches} "
            f"micro-batches over its PP group (ranks {pp_ranks})",
            plan.rank,
            lambda: self.forward_backward(
                forward_step_func=self.config.tracer.wrap_forward_step(forward_step, "llm", name),
                data_iterator=iter(range(a.micro_batches)),
                model=[runner.model(name)],
                num_microbatches=a.micro_batches,
                # Megatron's whole sequence: its P2P shapes divide by cp (and by tp under SP) themselves
                seq_length=runner.stage_tensor(name, mbs)[0][0] * lm.cp * (tp if config.sequence_parallel else 1),
                micro_batch_size=mbs,
                forward_only=a.forward_only,
                **self.schedule_kwargs,
            ),
        )
        config.grad_scale_func = None
        if overlap:
            config.no_sync_func = None

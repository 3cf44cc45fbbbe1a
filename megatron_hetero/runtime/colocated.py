"""The three-phase colocated schedule (every module on the same ranks, each on its own grid).

Per step, for a global batch of G samples:
  phase 1: each encoder runs forward once over this rank's encoder-DP share of the batch
           (samples [d*G/dp, (d+1)*G/dp) of the step; an encoder with pp > 1 passes the whole share
           from stage to stage), then its colocated boundary moves the tokens
           into the language model's layout (first stage, this rank's LLM-DP share, this CP rank's
           placeholder positions). The boundary output is detached: the LLM phase starts from a
           leaf that accumulates its gradient.
           With offload on, encoder parameters, gradient buffers and optimizer state then go to host.
  phase 2: Megatron-core's forward-backward function for the language model (1F1B when pp > 1)
           over its micro-batches, fed from the detached encoder tokens.
  phase 3: offloaded state comes back; boundary backward (gradients into each encoder's layout) and
           one encoder backward per encoder (stage by stage, last to first, when pp > 1).
Then each module reduces its gradients over its own DP x CP group and steps its own optimizer.
No encoder collective ever runs while the LLM pipeline is in flight.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

from megatron_hetero.compat.device import get_device
from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.runtime.boundary import Boundary
from megatron_hetero.runtime.module_state import ModuleState
from megatron_hetero.runtime.offload import Offloader
from megatron_hetero.runtime.wire import p2p
from megatron_hetero.training import data as data_mod
from megatron_hetero.training.setup import JobConfig


@dataclass
class StepResult:
    loss: float
    memory: dict[str, dict[str, int]]  # phase -> module -> resident state bytes on this rank


def encoder_boundaries(layout: HeteroLayout, job: JobConfig, batch: int, timeout_s: float,
                       topology=None) -> dict[str, Boundary]:
    """One boundary per encoder edge: encoder tokens [b, n, llm_hidden] into the language model's
    layout, CP-sharded over the text sequence at the encoder's placeholder span."""
    out = {}
    for name, enc in job.spec.encoders.items():
        edge = next(e for e in layout.edges if e.src == name)
        out[name] = Boundary(layout, edge, batch=batch, hidden=job.spec.hidden_size, seq=enc.tokens,
                             dst_seq=job.spec.seq_length, dst_offset=enc.offset, timeout_s=timeout_s,
                             device=get_device(), topology=topology)
    return out


def loss_contribution(lang_state: ModuleState, reported: list, last_stage: bool) -> torch.Tensor:
    """This rank's share of the step's loss sum: last-stage ranks with TP rank 0 (TP replicas hold
    the same per-token loss; DP and CP ranks hold different tokens)."""
    total = torch.zeros(1, dtype=torch.float64)
    if last_stage and lang_state.pgs.tp.rank() == 0:
        for r in reported:
            total += r["loss_sum"].double().cpu()
    return total


class ColocatedSchedule:
    """Runs training steps of the three-phase schedule on this rank."""

    def __init__(self, layout: HeteroLayout, job: JobConfig, topo, states: dict[str, ModuleState]) -> None:
        self.layout, self.job, self.topo, self.states = layout, job, topo, states
        self.encoders = list(job.spec.encoders)
        self.lang_name = next(m.name for m in layout.modules if m.name not in job.spec.encoders)
        self.lang = states[self.lang_name]
        self.dcfg = job.spec.data_config()
        self.boundaries = encoder_boundaries(layout, job, job.global_batch_size, job.comm_timeout_s)
        self.offloaders = {n: Offloader(states[n].state_tensors) for n in self.encoders} if job.offload_encoder else {}
        self.loss_tokens = data_mod.loss_tokens_per_sample(self.dcfg) * job.global_batch_size
        lm = layout.module(self.lang_name)
        self.micro_batches = job.llm_micro_batches(lm)
        self.config = self.lang.module.config
        self.forward_backward = get_forward_backward_func(pp_size=lm.pp, vp_size=None)
        self.schedule_kwargs = {"pg_collection": self.lang.pgs}
        if lm.pp > 1:
            self.schedule_kwargs["p2p_communicator"] = P2PCommunicator(pp_group=self.lang.pgs.pp, config=self.config)

    def _memory(self) -> dict[str, int]:
        return {n: s.resident_bytes() for n, s in self.states.items()}

    def step(self, step: int) -> StepResult:
        job, dev = self.job, get_device()
        first = step * job.global_batch_size
        memory = {}
        for s in self.states.values():
            s.zero_grad()
        # phase 1: encoders forward + colocated boundary
        enc_out: dict[str, Optional[torch.Tensor]] = {}
        enc_leaf: dict[str, torch.Tensor] = {}
        stage_io: dict[str, tuple] = {}
        for name in self.encoders:
            m, c = self.layout.module(name), self.topo.coord(name)
            share = job.global_batch_size // m.dp
            if c.pp == 0:
                inp = data_mod.batch(self.dcfg, first + c.dp * share, share)["features"][name].to(dev)
            else:  # a pipelined encoder: the whole share flows through its stages once (no interleaving)
                inp = self._stage_recv(name, -1, (self.job.spec.encoders[name].tokens, share,
                                                  self.job.spec.encoders[name].hidden_size))
            out = self.states[name].model(inp)
            if c.pp < m.pp - 1:
                self._stage_send(name, +1, out.detach())
            stage_io[name] = (inp, out)
            y = self.boundaries[name](out if c.pp == m.pp - 1 else None)
            enc_out[name] = y
            if self.boundaries[name].is_dst:
                enc_leaf[name] = y.detach().requires_grad_(True)
        memory["phase1"] = self._memory()
        for off in self.offloaders.values():
            off.offload()
        # phase 2: the language model's own schedule (1F1B when pp > 1)
        memory["phase2"] = self._memory()
        reported = self._llm_phase(first, enc_leaf)
        # phase 3: boundary backward + encoder backward
        for off in self.offloaders.values():
            off.restore()
        for name in reversed(self.encoders):
            bnd = self.boundaries[name]
            if name in enc_leaf:
                grad = enc_leaf[name].grad
                torch.autograd.backward(enc_out[name], grad if grad is not None else torch.zeros_like(enc_leaf[name]))
            elif bnd.is_src:
                Boundary.backward_source(enc_out[name])
            self._encoder_pipeline_backward(name, stage_io[name])
        memory["phase3"] = self._memory()
        for s in self.states.values():
            s.finalize_grads()
        for s in self.states.values():
            s.step()
        loss = loss_contribution(self.lang, reported, self.lang.module.last_stage)
        dist.all_reduce(loss)
        return StepResult(loss=float(loss.item()) / self.loss_tokens, memory=memory)

    def _stage_peer(self, name: str, delta: int) -> int:
        """The rank holding the same (tp, cp, dp) coordinates in the encoder's next/previous stage."""
        return self.topo.rank + delta * self.layout.module(name).stage_size

    def _stage_send(self, name: str, delta: int, tensor: torch.Tensor) -> None:
        peer = self._stage_peer(name, delta)
        p2p({peer: tensor.contiguous()}, {}, what=f"{name} pipeline", edge=f"{name} stage link",
            timeout_s=self.job.comm_timeout_s)

    def _stage_recv(self, name: str, delta: int, shape: tuple[int, ...]) -> torch.Tensor:
        peer = self._stage_peer(name, delta)
        buf = torch.empty(shape, dtype=torch.float32, device=get_device())
        p2p({}, {peer: buf}, what=f"{name} pipeline", edge=f"{name} stage link", timeout_s=self.job.comm_timeout_s)
        return buf.requires_grad_(True)

    def _encoder_pipeline_backward(self, name: str, io: tuple) -> None:
        """Stages before the last: receive the output gradient from the next stage and run backward;
        every stage but the first sends its input gradient to the previous one."""
        m, c = self.layout.module(name), self.topo.coord(name)
        if m.pp == 1 or m.frozen:  # a frozen trunk has no graph before the last stage's projector
            return
        inp, out = io
        if c.pp < m.pp - 1:
            grad = self._stage_recv(name, +1, tuple(out.shape)).detach()
            torch.autograd.backward(out, grad)
        if c.pp > 0:
            g = inp.grad if inp.grad is not None else torch.zeros_like(inp)
            self._stage_send(name, -1, g)

    def _llm_phase(self, first: int, enc_leaf: dict[str, torch.Tensor]) -> list:
        job, lang, dev = self.job, self.lang.module, get_device()
        lm = self.layout.module(self.lang_name)
        share = job.global_batch_size // lm.dp
        start = first + self.topo.coord(self.lang_name).dp * share
        mbs, dcfg, loss_tokens = job.micro_batch_size, self.dcfg, self.loss_tokens
        idx = lang.cp_positions()

        def forward_step(data_iterator, model):
            i = next(data_iterator)
            b = data_mod.batch(dcfg, start + i * mbs, mbs)
            labels = b["labels"][:, idx].to(dev)
            mask = b["loss_mask"][:, idx].to(dev)
            hidden = None
            if lang.first_stage:
                enc = {n: t[i * mbs:(i + 1) * mbs] for n, t in enc_leaf.items()}
                hidden = lang.embed(b["tokens"].to(dev), enc)
            out = model(hidden, labels if lang.last_stage else None)

            def loss_func(per_token: torch.Tensor):
                s = (per_token * mask).sum()
                return s / loss_tokens, mask.sum().to(torch.int), {"loss_sum": s.detach()}

            return out, loss_func

        return self.forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter(range(self.micro_batches)),
            model=[self.lang.model],
            num_microbatches=self.micro_batches,
            seq_length=job.spec.seq_length,
            micro_batch_size=mbs,
            forward_only=False,
            **self.schedule_kwargs,
        )

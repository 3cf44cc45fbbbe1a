"""The tiny LLaVA model's stage runner: what the schedules call to build a micro-batch's inputs and
run a stage (`runtime.stage_runner.StageRunner`).

Data comes from `models/data.py` by global sample index, so every layout sees the same samples.
Tensors crossing edges are `[rows, tokens, hidden]`: encoder tokens (from the projector) and, between
language segments, the hidden states of this CP rank's positions; between pipeline stages Megatron's
`[seq, rows, hidden]`.
"""
from __future__ import annotations

from typing import Mapping, Optional, Union

import torch

from megatron_hetero.compat.device import get_device
from megatron_hetero.layout.spec import Edge
from megatron_hetero.models import data as data_mod
from megatron_hetero.models.llava import LlavaSpec
from megatron_hetero.plan.rank_plan import RankPlan
from megatron_hetero.runtime.module_state import ModuleState
from megatron_hetero.runtime.stage_runner import EdgeTensor, LossSum


class LlavaStageRunner:
    """Stage runner of `models/llava.py` on one rank (see the module docstring)."""

    def __init__(self, spec: LlavaSpec, plan: RankPlan, states: dict[str, ModuleState]) -> None:
        self.spec, self.plan, self.states = spec, plan, states
        self.dcfg = spec.data_config()
        self._loss_tokens = data_mod.loss_tokens_per_sample(self.dcfg) * plan.global_batch
        self.device = get_device()

    def loss_modules(self) -> tuple[str, ...]:
        return (self.plan.roles.last_language,)

    def loss_tokens(self, step: int) -> int:
        return self._loss_tokens  # the placeholder spans are the same for every sample

    def edge_tensor(self, edge: Edge) -> EdgeTensor:
        spec = self.spec
        if edge.src in spec.encoders:
            enc = spec.encoders[edge.src]
            return EdgeTensor(seq=enc.tokens, hidden=spec.hidden_size, dst_seq=spec.seq_length, dst_offset=enc.offset)
        return EdgeTensor(seq=spec.seq_length, hidden=spec.hidden_size)

    def stage_tensor(self, module: str, rows: int) -> tuple[tuple[int, ...], torch.dtype]:
        spec = self.spec
        if module in spec.encoders:
            enc = spec.encoders[module]
            return (enc.tokens, rows, enc.hidden_size), torch.float32
        return (spec.seq_length // self.plan.modules[module].cp, rows, spec.hidden_size), torch.float32

    def model(self, module: str) -> torch.nn.Module:
        return self.states[module].model

    def forward(self, module: str, samples: range, inputs: Mapping[str, torch.Tensor],
                stage_input: Optional[torch.Tensor]) -> Union[torch.Tensor, LossSum]:
        if module in self.spec.encoders:
            return self._encoder(module, samples, stage_input)
        return self._language(module, samples, inputs, stage_input)

    def _encoder(self, module: str, samples: range, stage_input: Optional[torch.Tensor]) -> torch.Tensor:
        x = stage_input
        if x is None:  # the first stage reads this rank's features
            x = data_mod.batch(self.dcfg, samples.start, len(samples))["features"][module].to(self.device)
        return self.states[module].model(x)

    def _language(self, module: str, samples: range, inputs: Mapping[str, torch.Tensor],
                  stage_input: Optional[torch.Tensor]) -> Union[torch.Tensor, LossSum]:
        lang, model, me = self.states[module].module, self.states[module].model, self.plan.modules[module]
        b = data_mod.batch(self.dcfg, samples.start, len(samples))
        hidden = None
        if lang.first_stage:
            hidden = lang.embed(b["tokens"].to(self.device), dict(inputs))
        elif stage_input is not None:
            lang.set_input_tensor(stage_input)
        elif inputs:  # the previous language segment's hidden states, [rows, seq, hidden]
            (x,) = inputs.values()
            lang.set_input_tensor(x.transpose(0, 1).contiguous())
        if not lang.last_stage:
            out = model(hidden, None)
            return out.transpose(0, 1).contiguous() if me.last_stage else out  # a segment's end crosses an edge
        idx = lang.cp_positions()
        labels = b["labels"][:, idx].to(self.device)
        mask = b["loss_mask"][:, idx].to(self.device)
        per_token = model(hidden, labels)
        return LossSum((per_token * mask).sum(), mask.sum().to(torch.int))

"""The stage runner for image-caption data: `LlavaStageRunner` with its samples from an energon
captioning dataset (`models.energon_data.CaptionBatches`) instead of the synthetic `models.data`.

Everything else (encoder and language stages, edge and stage tensors, the loss) is LlavaStageRunner's
own code; this class changes where a micro-batch's samples come from (`batch`) and the per-step
normaliser (`loss_tokens`: the caption tokens of that step's whole global batch, which every rank can
count because every rank reads the whole global batch, see energon_data's docstring).

`caption_runner_factory(data, spec, global_batch)` is what a trainer plugs in:
    runner = factory(plan, states) if factory else None
    schedule = make_schedule(plan, job, topo, states, runner=runner)
"""
from __future__ import annotations

import contextlib
from typing import Callable, Mapping, Optional, Union

import torch

from megatron_hetero.models import llava_runner as _llava_runner
from megatron_hetero.models.energon_data import CaptionBatches, CaptionDataConfig
from megatron_hetero.models.llava import LlavaSpec
from megatron_hetero.models.llava_runner import LlavaStageRunner
from megatron_hetero.models.tokenizer import load_tokenizer
from megatron_hetero.plan.rank_plan import RankPlan
from megatron_hetero.runtime.module_state import ModuleState
from megatron_hetero.runtime.stage_runner import LossSum

# LlavaStageRunner gets a `batch(samples)` method (the one place it reads data) in the merge; until
# then its two reads go through `llava_runner.data_mod.batch`, which `forward` redirects below.
_HAS_BATCH_HOOK = "batch" in vars(LlavaStageRunner)


class _DataRedirect:
    """Stands in for `models.data` inside LlavaStageRunner's stage code: `batch(cfg, start, count)`."""

    def __init__(self, runner: "CaptionStageRunner") -> None:
        self._runner = runner

    def batch(self, cfg, start: int, count: int) -> dict:
        return self._runner.batch(range(start, start + count))


class CaptionStageRunner(LlavaStageRunner):
    """`LlavaStageRunner` over caption data (see the module docstring)."""

    def __init__(self, spec: LlavaSpec, plan: RankPlan, states: dict[str, ModuleState], data: CaptionBatches) -> None:
        super().__init__(spec, plan, states)
        if data.global_batch != plan.global_batch:
            raise ValueError(f"caption data global batch {data.global_batch} != plan's {plan.global_batch}")
        self.data = data

    def batch(self, samples: range) -> dict:
        return self.data.batch(samples)

    def loss_tokens(self, step: int) -> int:
        return self.data.loss_tokens(step)

    def forward(self, module: str, samples: range, inputs: Mapping[str, torch.Tensor],
                stage_input: Optional[torch.Tensor]) -> Union[torch.Tensor, LossSum]:
        if _HAS_BATCH_HOOK:
            return super().forward(module, samples, inputs, stage_input)
        with _redirect_data(self):
            return super().forward(module, samples, inputs, stage_input)


@contextlib.contextmanager
def _redirect_data(runner: CaptionStageRunner):
    saved = _llava_runner.data_mod
    _llava_runner.data_mod = _DataRedirect(runner)
    try:
        yield
    finally:
        _llava_runner.data_mod = saved


def caption_runner_factory(data: CaptionDataConfig, spec: LlavaSpec,
                           global_batch: int) -> Callable[[RankPlan, dict[str, ModuleState]], CaptionStageRunner]:
    """A function (plan, states) -> CaptionStageRunner for one rank. `data` must be resolved
    (`energon_data.resolve_config`) and `spec` made by `energon_data.caption_spec`, both in the
    launching process, so every rank shapes samples the same way. The loader opens on the rank."""
    (encoder,) = spec.encoders

    def make(plan: RankPlan, states: dict[str, ModuleState]) -> CaptionStageRunner:
        batches = CaptionBatches(data, load_tokenizer(data.tokenizer_model), encoder=encoder,
                                 seq_length=spec.seq_length, global_batch=global_batch)
        return CaptionStageRunner(spec, plan, states, batches)

    return make

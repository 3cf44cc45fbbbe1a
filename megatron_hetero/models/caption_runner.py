"""The stage runner for image-caption data: `LlavaStageRunner` with its samples from an energon
captioning dataset (`models.energon_data.CaptionBatches`) instead of the synthetic `models.data`.

Everything else (encoder and language stages, edge and stage tensors, the loss) is LlavaStageRunner's
own code; this class changes where a micro-batch's samples come from (`batch`) and the per-step
normaliser (`loss_tokens`: the caption tokens of that step's whole global batch, which every rank can
count because every rank reads the whole global batch, see energon_data's docstring).

`caption_runner_factory(data, spec, global_batch)` is what a trainer plugs in:
    runner = factory(plan, states) if factory else None
    schedule = make_schedule(plan, job, topo, states, runner=runner)
and `caption_job_data(args, spec)` what `train --data-path DIR` does in the launching process: the
resolved `CaptionDataConfig` and the model spec fitted to the data and the tokenizer.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping, Optional, Union

import torch

from megatron_hetero.models import llava_runner as _llava_runner
from megatron_hetero.models.energon_data import CaptionBatches, CaptionDataConfig, caption_spec, resolve_config
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


def caption_job_data(args: Any, spec: LlavaSpec) -> tuple[LlavaSpec, Optional[CaptionDataConfig]]:
    """`train`'s data flags -> (spec, data config), in the launching process (and on every rank under
    torchrun/srun: deterministic). Without --data-path: (spec, None), the synthetic data (--mock-data).
    With it: the dataset's image format resolved (`energon_data.resolve_config`), and `spec` with the
    encoder's tokens/feature_dim from the data and the vocabulary from the tokenizer
    (`energon_data.caption_spec`). Flags read (absent ones count as not given): data_path,
    tokenizer_model, mock_data, patch_size, data_prompt, seed, vocab_size, encoder_tokens,
    encoder_feature_dim. ValueError for conflicting or impossible values."""
    path = getattr(args, "data_path", None)
    if not path:
        if getattr(args, "tokenizer_model", None):
            raise ValueError("--tokenizer-model applies to --data-path (the synthetic data has no text)")
        return spec, None
    if getattr(args, "mock_data", False):
        raise ValueError(f"--mock-data and --data-path {path}: give one (synthetic or real data)")
    cfg = resolve_config(CaptionDataConfig(
        path=str(path), tokenizer_model=getattr(args, "tokenizer_model", None),
        seed=int(getattr(args, "seed", 1234)), patch_size=int(getattr(args, "patch_size", None) or 4),
        prompt=getattr(args, "data_prompt", None) or ""))
    for flag, given, derived in (("--encoder-tokens", getattr(args, "encoder_tokens", None), cfg.image_tokens),
                                 ("--encoder-feature-dim", getattr(args, "encoder_feature_dim", None), cfg.feature_dim)):
        if given is not None and given != derived:
            h, w = cfg.image_size
            raise ValueError(f"{flag} {given}: --data-path {path} gives {derived} ({h}x{w} images, {cfg.channels} "
                             f"channel(s), --patch-size {cfg.patch_size}: tokens = (H/p)*(W/p), features = C*p*p); "
                             f"leave it out or change --patch-size")
    tok = load_tokenizer(cfg.tokenizer_model)
    return caption_spec(spec, cfg, tok, vocab_size=getattr(args, "vocab_size", None)), cfg

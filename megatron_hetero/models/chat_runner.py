"""The stage runner for conversation data with image tiles: `LlavaStageRunner` with its samples from
`models.chat_batches.ChatBatches` (a variable number of image tiles per sample).

As for captions (`models.caption_runner.CaptionStageRunner`), this class changes where a
micro-batch's samples come from (`batch`: the lazy `ChatRowBatch`, whose keys are the batch contract
of `chat_batches`: tokens, labels, loss_mask, image_mask, features [n_tiles, T, F], tiles), the
per-step normaliser (`loss_tokens`: the assistant tokens of the step's whole global batch, text only),
and adds `image_tiles(samples)` ({encoder: tiles per row}, no image decoded), which every rank asks
to size the encoder's boundary messages. The model side reads the variable-tiles mode from
`EncoderSpec.max_tiles` (`chat_spec`).

Evaluation (`set_eval(True)`): `batch`, `loss_tokens` and `image_tiles` read the held-out split
(`chat_batches.chat_heldout`: stored order, global sample i is held-out sample i mod N), and the loss
stage counts correct ANSWERS (`chat_eval.answer_hits`: teacher-forced, every token of an assistant
answer the argmax, its closing end-of-turn marker not scored) on the ranks that count the loss
(`caption_runner.gathered_eval_ids`: TP rank 0, CP rank 0 after the gathers). `take_eval_counts()`
returns and resets this rank's (hits, answers); the trainer sums them over the world.

`chat_runner_factory(data, spec, global_batch)` is what a trainer plugs in (as
`caption_runner_factory`), `chat_job_data(...)` fits the spec to the data in the launching process.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

import torch

from megatron_hetero.models.caption_config import CaptionDataConfig
from megatron_hetero.models.caption_runner import gathered_eval_ids
from megatron_hetero.models.chat_batches import ChatBatches, ChatIndex, chat_heldout, tiles_of
from megatron_hetero.models.chat_default import chat_template_for
from megatron_hetero.models.chat_eval import answer_hits
from megatron_hetero.models.chat_template import ChatTemplate
from megatron_hetero.models.chat_tokens import marker_tokenizer
from megatron_hetero.models.energon_data import VOCAB_MULTIPLE
from megatron_hetero.models.llava import LlavaSpec
from megatron_hetero.models.llava_runner import LlavaStageRunner
from megatron_hetero.models.tokenizer import CaptionTokenizer, load_tokenizer
from megatron_hetero.plan.rank_plan import RankPlan
from megatron_hetero.runtime.module_state import ModuleState


def end_of_turn_ids(tok: CaptionTokenizer, template: ChatTemplate) -> list[int]:
    """The token ids of the template's end-of-turn marker (its `eos_token`, e.g. ChatML's
    `<|im_end|>`) as `tokenize_conversation` tokenises it; [] when the template names none."""
    eos = template.eos_token
    if not eos:
        return []
    mtok, _ = marker_tokenizer(tok.tokenizer)
    return list(mtok.encode(eos, add_special_tokens=False).ids)


class ChatStageRunner(LlavaStageRunner):
    """`LlavaStageRunner` over conversation data with image tiles (see the module docstring)."""

    def __init__(
        self,
        spec: LlavaSpec,
        plan: RankPlan,
        states: dict[str, ModuleState],
        data: ChatBatches,
        heldout: Optional[ChatBatches] = None,
    ) -> None:
        super().__init__(spec, plan, states)
        if data.global_batch != plan.global_batch:
            raise ValueError(f"conversation data global batch {data.global_batch} != plan's {plan.global_batch}")
        self.data = data
        self._heldout = heldout  # opened on first use unless given (see chat_runner_factory)
        self.end_ids = end_of_turn_ids(data.tok, data.template)
        self._counts = [0, 0]  # (correct answers, answers) of the evaluation so far on this rank

    def heldout(self) -> ChatBatches:
        """The held-out split's batches (`chat_batches.chat_heldout`), opened once."""
        if self._heldout is None:
            d = self.data
            self._heldout = chat_heldout(
                d.cfg, d.tok, d.template, encoder=d.encoder, seq_length=d.seq_length, global_batch=d.global_batch
            )
        return self._heldout

    def heldout_size(self) -> int:
        """Samples of the held-out split (one evaluation pass covers them once)."""
        return self.heldout().source.samples_per_epoch

    def _source(self) -> ChatBatches:
        return self.heldout() if self.evaluating else self.data

    def batch(self, samples: range):
        return self._source().batch(samples)

    def loss_tokens(self, step: int) -> int:
        return self._source().loss_tokens(step)

    def image_tiles(self, samples: range) -> dict[str, list[int]]:
        """{encoder: tiles per row} of the global samples `samples`, no image decoded (= batch's tiles)."""
        return self._source().image_tiles(samples)

    # -- answer accuracy -------------------------------------------------------------------------
    def eval_logits(self, module: str, logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> None:
        got = gathered_eval_ids(self, module, logits, labels, mask)
        if got is None:
            return
        _, ids, labels, mask = got
        hits, answers = answer_hits(ids, labels, mask, self.end_ids)
        self._counts[0] += hits
        self._counts[1] += answers

    def take_eval_counts(self) -> tuple[int, int]:
        out, self._counts = tuple(self._counts), [0, 0]
        return out


def max_sample_tiles(cfg: CaptionDataConfig, tile: int, split: Optional[str] = None) -> int:
    """The most tiles any sample of the split has (from the JSON sizes / image headers: no image is
    decoded), before any cut at --seq-length."""
    index = ChatIndex(cfg.path, split or cfg.split)
    try:
        return max((sum(tiles_of(s, tile) for s in index.record(p).sizes) for p in range(len(index))), default=0)
    finally:
        index.close()


def chat_spec(
    spec: LlavaSpec,
    cfg: CaptionDataConfig,
    tok: CaptionTokenizer,
    *,
    max_tiles: int,
    vocab_size: Optional[int] = None,
) -> LlavaSpec:
    """`spec` (ONE encoder) fitted to conversation data: the encoder's `tokens` = T (per tile),
    `feature_dim` = F, `max_tiles` = the most tiles a sample feeds it (>= 1: the variable-tiles mode of
    `planner.model.EncoderSpec`), and the vocabulary from the tokenizer (padded up to a multiple of
    128, or `vocab_size` if given and large enough). ValueError for another number of encoders, a
    --seq-length that holds no tile, or a `vocab_size` that is too small."""
    if len(spec.encoders) != 1:
        raise ValueError(f"conversation data feeds one image encoder; the layout has encoders {sorted(spec.encoders)}")
    ((name, enc),) = spec.encoders.items()
    if spec.seq_length < cfg.image_tokens + 1:
        raise ValueError(
            f"--seq-length {spec.seq_length}: too short for any image (one tile is {cfg.image_tokens} tokens)"
        )
    if vocab_size is None:
        vocab_size = -(-tok.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    elif vocab_size < tok.vocab_size:
        raise ValueError(
            f"--vocab-size {vocab_size} is smaller than the tokenizer's {tok.vocab_size} tokens ({tok.name})"
        )
    fits = spec.seq_length // cfg.image_tokens  # no sample can carry more tiles than its positions hold
    enc = replace(enc, tokens=cfg.image_tokens, feature_dim=cfg.feature_dim, max_tiles=max(1, min(max_tiles, fits)))
    return replace(spec, vocab_size=vocab_size, encoders={name: enc})


def chat_runner_factory(
    data: CaptionDataConfig, spec: LlavaSpec, global_batch: int, heldout: bool = False
) -> Callable[[RankPlan, dict[str, ModuleState]], ChatStageRunner]:
    """A function (plan, states) -> ChatStageRunner for one rank. `data` comes from
    `chat_batches.resolve_chat_config` and `spec` from `chat_spec`, both in the launching process.
    `heldout`: open the held-out split first (as `caption_runner_factory`)."""
    (encoder,) = spec.encoders

    def make(plan: RankPlan, states: dict[str, ModuleState]) -> ChatStageRunner:
        tok = load_tokenizer(data.tokenizer_model)
        template = chat_template_for(data.tokenizer_model)
        held = (
            chat_heldout(data, tok, template, encoder=encoder, seq_length=spec.seq_length, global_batch=global_batch)
            if heldout
            else None
        )
        batches = ChatBatches(
            data, tok, template, encoder=encoder, seq_length=spec.seq_length, global_batch=global_batch
        )
        return ChatStageRunner(spec, plan, states, batches, heldout=held)

    return make

"""The stage runner for conversation data with image tiles: `LlavaStageRunner` with its samples from
`data.chat_batches.ChatBatches` (a variable number of image tiles per sample).

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
returns and resets this rank's (hits, answers); the trainer sums them over the world. On the
digits conversations `take_eval_parts()` gives the same per image question (`chat_eval.question_hits`
with `digits_chat.IMAGE_QUESTIONS`): the answers that can only be right by reading the images.

A Qwen2.5-VL tower reads the conversations at native resolution (`chat_batches`' module docstring):
each image through the tower's image processor (`native_processor`: --image-processor's
Qwen2VLImageProcessor config, else Qwen's bounds scaled to the tower's patch), the encoder's
`tokens` 1 (a tile is one merged token), `max_tiles` the most merged tokens a sample has, and
`image_grids(samples)` each row's images' (rows, cols) for the tower and the M-RoPE ids.

`chat_runner_factory(data, spec, global_batch)` is what a trainer plugs in (as
`caption_runner_factory`), `chat_job_data(...)` fits the spec to the data in the launching process.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Iterator, Optional

import torch

from megatron_hetero.config.data import CaptionDataConfig, DataRequest
from megatron_hetero.models.caption_runner import gathered_eval_ids
from megatron_hetero.data.chat_batches import (
    DEFAULT_TILE,
    ChatBatches,
    HELDOUT_SPLIT,
    ChatIndex,
    chat_heldout,
    resolve_chat_config,
    resolve_native_config,
    tiles_of,
)
from megatron_hetero.data.image_processor_config import read_preprocessor_config
from megatron_hetero.data.qwen_image_processor import QwenImageProcessor
from megatron_hetero.data.chat_default import chat_template_for
from megatron_hetero.models.chat_eval import answer_hits, question_hits
from megatron_hetero.data.digits_chat import IMAGE_QUESTIONS
from megatron_hetero.data.chat_template import ChatTemplate
from megatron_hetero.data.chat_tokens import (
    ChatTokens,
    conversation_vocab_size,
    marker_tokenizer,
    tokenize_conversation,
)
from megatron_hetero.data.dataset_trust import check_dataset
from megatron_hetero.data.energon_data import VOCAB_MULTIPLE
from megatron_hetero.models.llava import LlavaSpec
from megatron_hetero.models.llava_runner import LlavaStageRunner
from megatron_hetero.data.tokenizer import CaptionTokenizer, load_tokenizer
from megatron_hetero.plan.rank_plan import RankPlan
from megatron_hetero.runtime.module_state import ModuleState


#: the samples (stored order) `data_seq_length` reads when --seq-length is not given
SEQ_PROBE = 256
#: a sequence length taken from the data is a multiple of this (context and sequence parallelism split it)
SEQ_MULTIPLE = 8


def end_of_turn_ids(tok: CaptionTokenizer, template: ChatTemplate) -> list[int]:
    """The token ids of the template's end-of-turn marker (its `eos_token`, e.g. ChatML's
    `<|im_end|>`) as `tokenize_conversation` tokenises it; [] when the template names none."""
    eos = template.eos_token
    if not eos:
        return []
    mtok, _ = marker_tokenizer(tok.tokenizer, extra=template.markers)
    return list(mtok.encode(eos, add_special_tokens=False).ids)


class ChatStageRunner(LlavaStageRunner):
    """`LlavaStageRunner` over conversation data with image tiles (see the module docstring)."""

    accuracy_name = ("answer accuracy", "held-out answers")

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
        self._parts = {p: [0, 0] for p in IMAGE_QUESTIONS}  # the same, per image question
        self._marker_tok: Any = None  # the tokenizer with the template's markers, built on first count

    def heldout(self) -> ChatBatches:
        """The held-out split's batches (`chat_batches.chat_heldout`), opened once."""
        if self._heldout is None:
            d = self.data
            self._heldout = chat_heldout(
                d.cfg,
                d.tok,
                d.template,
                encoder=d.encoder,
                seq_length=d.seq_length,
                global_batch=d.global_batch,
                native=d.native,
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

    def image_grids(self, samples: range) -> Optional[dict[str, list[list[tuple[int, int]]]]]:
        """Native resolution: {encoder: per row its images' (rows, cols) of merged tokens}, from the
        sizes (no image decoded, nothing on the wire); None for tiles."""
        return None if self.data.native is None else self._source().image_grids(samples)

    # -- answer accuracy -------------------------------------------------------------------------
    def eval_logits(self, module: str, logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> None:
        got = gathered_eval_ids(self, module, logits, labels, mask)
        if got is None:
            return
        _, ids, labels, mask = got
        hits, answers = answer_hits(ids, labels, mask, self.end_ids)
        self._counts[0] += hits
        self._counts[1] += answers
        if self._marker_tok is None:
            self._marker_tok, _ = marker_tokenizer(self.data.tok.tokenizer, extra=self.data.template.markers)
        for part, (h, n) in question_hits(ids, labels, mask, self._marker_tok, IMAGE_QUESTIONS, self.end_ids).items():
            self._parts[part][0] += h
            self._parts[part][1] += n

    def take_eval_counts(self) -> tuple[int, int]:
        out, self._counts = tuple(self._counts), [0, 0]
        return out

    def take_eval_parts(self) -> dict[str, tuple[int, int]]:
        """This rank's {part: (hits, answers)} of the answers to the digits conversations' image
        questions (`digits_chat.IMAGE_QUESTIONS`: "digit named", "two digits named"; 0 answers on other
        data) since the last call; resets them."""
        out = {p: (h, n) for p, (h, n) in self._parts.items()}
        self._parts = {p: [0, 0] for p in IMAGE_QUESTIONS}
        return out


def native_processor(cfg: CaptionDataConfig, enc) -> Optional[QwenImageProcessor]:
    """The Qwen image processor a Qwen2.5-VL encoder `enc` reads conversations through (--image-processor's
    Qwen2VLImageProcessor config, else `QwenImageProcessor.for_tower`); None for another encoder.
    ValueError when its patch, merge or temporal patch size is not the tower's."""
    if enc.kind != "qwen2.5-vl":
        return None
    sizes = (enc.patch_size, enc.merge_size, enc.temporal_patch_size)
    if not cfg.image_processor:
        return QwenImageProcessor.for_tower(*sizes)
    where = f"--image-processor {cfg.image_processor}"
    proc = QwenImageProcessor.from_dict(read_preprocessor_config(cfg.image_processor), where)
    proc.check_tower(*sizes, where=where)
    return proc


def _counter(cfg: CaptionDataConfig, tile: int, native: Optional[QwenImageProcessor]) -> Callable[[Any], int]:
    """Tiles (native resolution: merged tokens) of an image of size (H, W), no pixel read."""
    if native is not None:
        return lambda s: native.merged_grid(s)[0] * native.merged_grid(s)[1]
    return lambda s: tiles_of(s, tile, cfg.max_image_tiles)


def max_sample_tiles(
    cfg: CaptionDataConfig, tile: int, split: Optional[str] = None, native: Optional[QwenImageProcessor] = None
) -> int:
    """The most tiles (native: merged tokens) any sample of the split has (from the JSON sizes / image
    headers: no image is decoded), before any cut at --seq-length."""
    index = ChatIndex(cfg.path, split or cfg.split)
    count = _counter(cfg, tile, native)
    try:
        return max((sum(count(s) for s in index.record(p).sizes) for p in range(len(index))), default=0)
    finally:
        index.close()


def _stored_conversations(
    cfg: CaptionDataConfig,
    tok: CaptionTokenizer,
    template: ChatTemplate,
    tile: int,
    native: Optional[QwenImageProcessor] = None,
) -> Iterator[tuple[Any, ChatTokens]]:
    """(record, tokenised conversation) of the split's samples in stored order (no image decoded)."""
    index = ChatIndex(cfg.path, cfg.split)
    count = _counter(cfg, tile, native)
    try:
        for pos in range(len(index)):
            rec = index.record(pos)
            counts = [count(s) * cfg.image_tokens for s in rec.sizes]
            try:
                yield rec, tokenize_conversation(rec.messages, counts, tok, template)
            except ValueError as exc:
                raise ValueError(f"sample {rec.key}: {exc}") from None
    finally:
        index.close()


def first_image_end(
    cfg: CaptionDataConfig,
    tok: CaptionTokenizer,
    template: ChatTemplate,
    tile: int,
    probe: int = 32,
    native: Optional[QwenImageProcessor] = None,
) -> Optional[int]:
    """The fewest sequence positions that keep an image: over the split's first `probe` samples with
    images (stored order), the smallest end of a first image's placeholder run; None without images."""
    ends: list[int] = []
    for rec, ct in _stored_conversations(cfg, tok, template, tile, native):
        if len(ends) >= probe:
            break
        if rec.images:
            start, length = ct.image_spans[0]
            ends.append(start + length)
    return min(ends) if ends else None


def data_seq_length(
    cfg: CaptionDataConfig,
    tok: CaptionTokenizer,
    template: ChatTemplate,
    tile: int,
    probe: int = SEQ_PROBE,
    native: Optional[QwenImageProcessor] = None,
) -> int:
    """The sequence length `train` takes from conversation data when --seq-length is not given: the
    one that holds the longest of the split's first `probe` conversations (stored order) whole, i.e.
    its tokens - 1 (the last token is only a label), rounded up to a multiple of `SEQ_MULTIPLE`."""
    longest = 0
    for k, (_, ct) in enumerate(_stored_conversations(cfg, tok, template, tile, native)):
        if k >= probe:
            break
        longest = max(longest, len(ct) - 1)
    return max(SEQ_MULTIPLE, -(-longest // SEQ_MULTIPLE) * SEQ_MULTIPLE)


def check_first_batch(
    cfg: CaptionDataConfig, tok: CaptionTokenizer, template: ChatTemplate, spec: LlavaSpec, global_batch: int
) -> None:
    """ValueError when `spec.seq_length` cuts every answer of the run's first global batch (step 0,
    the run's sample order: `ChatBatches`), so that step would hold no loss token. The message names
    --seq-length and the tokens the batch's samples need: the --seq-length that reaches the earliest
    answer (its first token's position), and the one that holds the longest conversation whole. A
    batch without any answer (no assistant turn) is not the length's doing: not refused."""
    ((encoder, enc),) = spec.encoders.items()
    data = ChatBatches(
        cfg,
        tok,
        template,
        encoder=encoder,
        seq_length=spec.seq_length,
        global_batch=global_batch,
        num_workers=0,
        native=native_processor(cfg, enc),
    )
    try:
        if data.loss_tokens(0):
            return
        chats = [data.conversation(i)[1] for i in range(global_batch)]
    finally:
        data.close()
    starts = [ct.mask.index(1) for ct in chats if 1 in ct.mask]
    if not starts:
        return
    reach, whole = min(starts), max(len(ct) - 1 for ct in chats)
    raise ValueError(
        f"--seq-length {spec.seq_length}: cuts every answer of the first global batch ({global_batch} samples "
        f"of --data-path {cfg.path}): its samples need --seq-length {reach} to reach the earliest answer, "
        f"{whole} to hold the longest conversation whole; give one of those or more, or leave --seq-length "
        "out to take it from the data"
    )


def chat_spec(
    spec: LlavaSpec,
    cfg: CaptionDataConfig,
    tok: CaptionTokenizer,
    *,
    max_tiles: int,
    vocab_size: Optional[int] = None,
    template: Optional[ChatTemplate] = None,
    native: Optional[QwenImageProcessor] = None,
) -> LlavaSpec:
    """`spec` (ONE encoder) fitted to conversation data: the encoder's `tokens` = T (per tile),
    `feature_dim` = F, `max_tiles` = the most tiles a sample feeds it (>= 1: the variable-tiles mode
    of `config.model.EncoderSpec`; at most what fits after the encoder's offset, as `data.samples`
    checks the reserved span [offset, offset + max_tiles*T) against --seq-length), and the
    vocabulary from the tokenizer (padded up to a multiple of 128, or `vocab_size` if given and large
    enough). A Qwen2.5-VL tower (`native`: its image processor) takes T = 1 (a tile is one merged
    token), F = the processor's merged token, `max_tiles` the most merged tokens a sample has.
    ValueError for another number of encoders, a Qwen2.5-VL tower without `native` (or `native` for
    another tower), a --seq-length that holds no tile, or a `vocab_size` that is too small."""
    if len(spec.encoders) != 1:
        raise ValueError(f"conversation data feeds one image encoder; the layout has encoders {sorted(spec.encoders)}")
    ((name, enc),) = spec.encoders.items()
    if (enc.kind == "qwen2.5-vl") != (native is not None):  # native resolution: the tower's processor
        raise ValueError(
            f"encoder {name} ({enc.kind}): conversation data reads images through the Qwen image processor "
            "for a Qwen2.5-VL tower, and only for it"
        )
    if spec.seq_length < enc.offset + cfg.image_tokens:
        raise ValueError(
            f"--seq-length {spec.seq_length}: too short for any image (one tile is {cfg.image_tokens} tokens)"
        )
    template = template if template is not None else chat_template_for(cfg.tokenizer_model)
    # the ids the conversations use: the tokenizer's and the markers it is given (`marker_tokenizer`)
    ids = conversation_vocab_size(tok.tokenizer, template.markers)
    if vocab_size is None:
        vocab_size = -(-ids // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    elif vocab_size < ids:
        raise ValueError(
            f"--vocab-size {vocab_size} is smaller than the {ids} token ids of the conversations ({tok.name} "
            "with the template's turn markers)"
        )
    fits = (spec.seq_length - enc.offset) // cfg.image_tokens  # the reserved span [offset, offset + K*T) fits
    feature_dim = cfg.feature_dim if native is None else native.feature_dim
    enc = replace(enc, tokens=cfg.image_tokens, feature_dim=feature_dim, max_tiles=max(1, min(max_tiles, fits)))
    if native is not None:  # a tile is one merged token; each image's grid comes from the data
        enc = replace(enc, image_rows=0)
    return replace(spec, vocab_size=vocab_size, encoders={name: enc})


def chat_runner_factory(
    data: CaptionDataConfig, spec: LlavaSpec, global_batch: int, heldout: bool = False
) -> Callable[[RankPlan, dict[str, ModuleState]], ChatStageRunner]:
    """A function (plan, states) -> ChatStageRunner for one rank. `data` comes from
    `chat_batches.resolve_chat_config` and `spec` from `chat_spec`, both in the launching process.
    `heldout`: open the held-out split first (as `caption_runner_factory`)."""
    ((encoder, enc),) = spec.encoders.items()
    native = native_processor(data, enc)

    def make(plan: RankPlan, states: dict[str, ModuleState]) -> ChatStageRunner:
        tok = load_tokenizer(data.tokenizer_model)
        template = chat_template_for(data.tokenizer_model)
        kw = dict(encoder=encoder, seq_length=spec.seq_length, global_batch=global_batch, native=native)
        held = chat_heldout(data, tok, template, **kw) if heldout else None  # type: ignore[arg-type]
        batches = ChatBatches(data, tok, template, **kw)  # type: ignore[arg-type]
        return ChatStageRunner(spec, plan, states, batches, heldout=held)

    return make


def chat_job_data(
    req: DataRequest, spec: LlavaSpec, global_batch: Optional[int] = None
) -> tuple[LlavaSpec, CaptionDataConfig]:
    """`train --data-path DIR` on a conversation dataset, in the launching process (as
    `caption_runner.caption_job_data` for captions): the resolved config (`resolve_chat_config`: the
    tile side `DEFAULT_TILE`, or a CLIP encoder's image side with its patch size and RGB; channels from
    the data) and `spec` fitted to it (`chat_spec`: T, F, the most tiles a training or held-out
    sample has, the tokenizer's vocabulary; a Qwen2.5-VL tower: native resolution through
    `native_processor`, `resolve_native_config`). Without --seq-length (nor a checkpoint's model: `--load`)
    the sequence length is the data's (`data_seq_length`). ValueError for a --seq-length that would
    cut every image (`first_image_end`) or, given `global_batch`, every answer of the first global
    batch (`check_first_batch`), --mock-data with it, --data-prompt
    (caption-only), a dataset that names code (conversation data runs none, even when trusted),
    --encoder-tokens/--encoder-feature-dim that differ from the data's."""
    path, tokenizer_model = str(req.data_path), req.tokenizer_model
    if req.mock_data:
        raise ValueError(f"--mock-data and --data-path {path}: give one (synthetic or real data)")
    if req.prompt:
        raise ValueError(f"--data-prompt: applies to caption data; --data-path {path} holds conversations")
    trust = req.trust_code
    if check_dataset(path, trust=trust):  # refused unless trusted; trusted, it would still not run
        raise ValueError(f"--data-path {path}: the dataset names code; conversation data is read by index only")
    clip = next((e for e in spec.encoders.values() if e.kind == "clip"), None)
    tile = round(clip.tokens**0.5) * clip.patch_size if clip else DEFAULT_TILE
    patch = req.patch_size or DataRequest.patch_size
    base = CaptionDataConfig(
        path=path,
        tokenizer_model=tokenizer_model,
        trust_code=trust,
        seed=int(req.seed),
        patch_size=clip.patch_size if clip else int(patch),
        channels=3 if clip else None,
        image_processor=req.image_processor,
        num_workers=int(req.num_workers),
        max_image_tiles=int(req.max_image_tiles),
    )
    qwen = next((e for e in spec.encoders.values() if e.kind == "qwen2.5-vl"), None)
    native = native_processor(base, qwen) if qwen is not None and len(spec.encoders) == 1 else None
    cfg = resolve_native_config(base, native) if native else resolve_chat_config(base, tile=tile)
    tile = cfg.image_size[0]  # --image-processor: its output size (native: one merged token's side)
    for flag, given, derived in (
        ("--encoder-tokens", req.encoder_tokens, cfg.image_tokens),
        ("--encoder-feature-dim", req.encoder_feature_dim, native.feature_dim if native else cfg.feature_dim),
    ):
        if given is not None and given != derived:
            raise ValueError(
                f"{flag} {given}: --data-path {path} gives {derived} per image tile ({tile}x{tile} tiles, "
                f"{cfg.channels} channel(s), --patch-size {cfg.patch_size}); leave it out or change --patch-size"
            )
    tok = load_tokenizer(cfg.tokenizer_model)
    template = chat_template_for(cfg.tokenizer_model)
    if not req.seq_length_given:  # the data's (--load: the checkpoint's)
        seq = data_seq_length(cfg, tok, template, tile, native=native)
        shift = seq - spec.seq_length  # output heads keep their span before the end of the sequence
        outputs = {n: replace(o, offset=o.offset + shift) for n, o in spec.outputs.items()}
        spec = replace(spec, seq_length=seq, outputs=outputs)
    end = first_image_end(cfg, tok, template, tile, native=native)
    if end is not None and spec.seq_length < end:
        raise ValueError(
            f"--seq-length {spec.seq_length}: too short for the images of --data-path {path}: the first "
            f"image of a sample ends at position {end} at the earliest (every image would be cut)"
        )
    max_tiles = max_sample_tiles(cfg, tile, native=native)
    try:  # the held-out samples run through the same model
        max_tiles = max(max_tiles, max_sample_tiles(cfg, tile, split=HELDOUT_SPLIT, native=native))
    except ValueError:  # no held-out split: evaluation says so when asked for
        pass
    spec = chat_spec(spec, cfg, tok, max_tiles=max_tiles, vocab_size=req.vocab_size, template=template, native=native)
    if global_batch is not None:
        check_first_batch(cfg, tok, template, spec, global_batch)
    return spec, cfg

"""`train --data-path DIR` on the spoken-digits dataset (`data digits --speech`): the stage runner
(`SpeechStageRunner`, `ChatStageRunner` over `data.speech_batches.SpeechBatches`), its factory, and
`speech_job_data` (the spec fitted to the data, in the launching process).

The layout names two encoders: the image encoder (any name) and `audio`, the speech encoder. On this
data `audio` is Whisper's speech encoder (`models.whisper_encoder`) unless --audio-model-type says
otherwise; its tokens are chunks of `SPEECH_CHUNK` speech tokens (two log-mel frames each: feature_dim
2 * the data's mel bins), a clip as many chunks as its length needs. Both encoders carry a variable
number of tiles / chunks per sample (`EncoderSpec.max_tiles`); their tokens enter the language model
at their own placeholders (`image_mask` per encoder).

Evaluation counts whole answers as for conversations (`chat_eval`) and, per modality
(`speech_eval.modality_hits`), the digit shown and the digit said: `take_eval_parts()` returns and
resets this rank's {part: (hits, answers)}; the trainer sums them over the world.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Optional

import torch

from megatron_hetero.config.data import CaptionDataConfig, DataRequest
from megatron_hetero.models.caption_runner import gathered_eval_ids
from megatron_hetero.data.chat_batches import DEFAULT_TILE, HELDOUT_SPLIT, resolve_chat_config, tiles_of
from megatron_hetero.data.chat_default import chat_template_for
from megatron_hetero.models.chat_eval import answer_hits
from megatron_hetero.models.chat_runner import SEQ_MULTIPLE, SEQ_PROBE, ChatStageRunner
from megatron_hetero.data.chat_template import ChatTemplate
from megatron_hetero.data.chat_tokens import conversation_vocab_size, marker_tokenizer
from megatron_hetero.data.dataset_trust import check_dataset
from megatron_hetero.data.energon_data import VOCAB_MULTIPLE
from megatron_hetero.models.llava import LlavaSpec
from megatron_hetero.data.speech_batches import (
    AUDIO,
    SpeechBatches,
    SpeechIndex,
    clip_chunks,
    speech_heldout,
    speech_info,
    tokenize_speech_conversation,
)
from megatron_hetero.models.speech_eval import PARTS, modality_hits
from megatron_hetero.data.tokenizer import CaptionTokenizer, load_tokenizer
from megatron_hetero.plan.rank_plan import RankPlan
from megatron_hetero.runtime.module_state import ModuleState

#: speech tokens of one chunk (0.64 s of audio: 64 log-mel frames of 10 ms)
SPEECH_CHUNK = 32


class SpeechStageRunner(ChatStageRunner):
    """`ChatStageRunner` over the spoken-digits data, with per-modality held-out accuracy."""

    def __init__(
        self,
        spec: LlavaSpec,
        plan: RankPlan,
        states: dict[str, ModuleState],
        data: SpeechBatches,
        heldout: Optional[SpeechBatches] = None,
    ) -> None:
        super().__init__(spec, plan, states, data, heldout=heldout)
        self._parts = {p: [0, 0] for p in PARTS}

    def heldout(self) -> SpeechBatches:
        if self._heldout is None:
            d = self.data
            assert isinstance(d, SpeechBatches)
            self._heldout = speech_heldout(
                d.cfg,
                d.tok,
                d.template,
                encoder=d.encoder,
                audio=d.audio,
                speech_tokens=d.speech_tokens,
                mel_bins=d.mel_bins,
                seq_length=d.seq_length,
                global_batch=d.global_batch,
            )
        return self._heldout  # type: ignore[return-value]

    def eval_logits(self, module: str, logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> None:
        got = gathered_eval_ids(self, module, logits, labels, mask)
        if got is None:
            return
        _, ids, labels, mask = got
        hits, answers = answer_hits(ids, labels, mask, self.end_ids)
        self._counts[0] += hits
        self._counts[1] += answers
        mtok, _ = marker_tokenizer(self.data.tok.tokenizer, extra=self.data.template.markers)
        for part, (h, n) in modality_hits(ids, labels, mask, mtok, self.end_ids).items():
            self._parts[part][0] += h
            self._parts[part][1] += n

    def take_eval_parts(self) -> dict[str, tuple[int, int]]:
        """This rank's {"digit shown" / "digit said": (hits, answers)} since the last call; resets them."""
        out = {p: (h, n) for p, (h, n) in self._parts.items()}
        self._parts = {p: [0, 0] for p in PARTS}
        return out


def _encoder_names(spec: LlavaSpec) -> str:
    """The image encoder's name; ValueError unless the layout has exactly it and `audio`."""
    names = sorted(spec.encoders)
    if AUDIO not in spec.encoders or len(names) != 2:
        raise ValueError(
            f"spoken-digits data feeds two encoders, an image encoder and `{AUDIO}` (the speech encoder); "
            f"the layout has encoders {names} (e.g. --hetero-edge 'vision->language' --hetero-edge "
            f"'{AUDIO}->language')"
        )
    return next(n for n in names if n != AUDIO)


def _records(cfg: CaptionDataConfig, split: str, bins: int, probe: Optional[int] = None):
    index = SpeechIndex(cfg.path, split, bins)
    try:
        for pos in range(len(index) if probe is None else min(probe, len(index))):
            yield index.record(pos)
    finally:
        index.close()


def speech_data_shape(
    cfg: CaptionDataConfig,
    tok: CaptionTokenizer,
    template: ChatTemplate,
    bins: int,
    speech_tokens: int = SPEECH_CHUNK,
    probe: int = SEQ_PROBE,
) -> dict[str, int]:
    """What the spec takes from the data, nothing decoded: `seq_length` (the longest of the train
    split's first `probe` conversations whole, minus its last token, rounded up to `SEQ_MULTIPLE`),
    `max_tiles` and `max_chunks` (the most image tiles / speech chunks any train or held-out sample has)."""
    tile = cfg.image_size[0]
    longest = max_tiles = max_chunks = 0
    splits = [(cfg.split, None)]
    try:
        SpeechIndex(cfg.path, HELDOUT_SPLIT, bins).close()
        splits.append((HELDOUT_SPLIT, None))
    except ValueError:  # no held-out split: evaluation says so when asked for
        pass
    for split, _ in splits:
        for k, rec in enumerate(_records(cfg, split, bins)):
            tiles = [tiles_of(s, tile, cfg.max_image_tiles) for s in rec.sizes]
            chunks = [clip_chunks(f, speech_tokens) for f in rec.frames]
            max_tiles, max_chunks = max(max_tiles, sum(tiles)), max(max_chunks, sum(chunks))
            if split == cfg.split and k < probe:
                try:
                    ct, _ = tokenize_speech_conversation(
                        rec.messages,
                        [t * cfg.image_tokens for t in tiles],
                        [c * speech_tokens for c in chunks],
                        tok,
                        template,
                    )
                except ValueError as exc:
                    raise ValueError(f"sample {rec.key}: {exc}") from None
                longest = max(longest, len(ct) - 1)
    seq = max(SEQ_MULTIPLE, -(-longest // SEQ_MULTIPLE) * SEQ_MULTIPLE)
    return {"seq_length": seq, "max_tiles": max_tiles, "max_chunks": max_chunks}


def speech_spec(
    spec: LlavaSpec,
    cfg: CaptionDataConfig,
    tok: CaptionTokenizer,
    template: ChatTemplate,
    *,
    bins: int,
    max_tiles: int,
    max_chunks: int,
    whisper: bool = True,
    vocab_size: Optional[int] = None,
    speech_tokens: int = SPEECH_CHUNK,
) -> LlavaSpec:
    """`spec` (an image encoder and `audio`) fitted to the spoken-digits data: the image encoder's
    tokens per tile and features from `cfg`, at offset 1, `max_tiles` of them at most; `audio` (Whisper's
    encoder when `whisper`) `speech_tokens` per chunk of 2 * `bins` features, right after the image
    encoder's span, `max_chunks` at most; each encoder's most tiles clipped to what fits in
    --seq-length; the vocabulary from the tokenizer (as `chat_runner.chat_spec`). ValueError for
    other encoders, a --seq-length that holds no tile or chunk, or a too small `vocab_size`."""
    image = _encoder_names(spec)
    venc, aenc = spec.encoders[image], spec.encoders[AUDIO]
    v_off = 1
    v_fits = (spec.seq_length - v_off) // cfg.image_tokens
    v_tiles = max(1, min(max_tiles, v_fits))
    a_off = v_off + v_tiles * cfg.image_tokens
    a_fits = (spec.seq_length - a_off) // speech_tokens
    if v_fits < 1 or a_fits < 1:
        raise ValueError(
            f"--seq-length {spec.seq_length}: too short for an image tile ({cfg.image_tokens} tokens) and a "
            f"speech chunk ({speech_tokens} tokens) side by side"
        )
    ids = conversation_vocab_size(tok.tokenizer, template.markers)
    if vocab_size is None:
        vocab_size = -(-ids // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    elif vocab_size < ids:
        raise ValueError(
            f"--vocab-size {vocab_size} is smaller than the {ids} token ids of the conversations ({tok.name} "
            "with the template's turn markers)"
        )
    venc = replace(venc, tokens=cfg.image_tokens, feature_dim=cfg.feature_dim, offset=v_off, max_tiles=v_tiles)
    if whisper and aenc.kind != "whisper":
        aenc = replace(aenc, kind="whisper", activation="gelu", patch_size=0)
    aenc = replace(
        aenc, tokens=speech_tokens, feature_dim=2 * bins, offset=a_off, max_tiles=max(1, min(max_chunks, a_fits))
    )
    return replace(spec, vocab_size=vocab_size, encoders={image: venc, AUDIO: aenc})


def speech_runner_factory(
    data: CaptionDataConfig, spec: LlavaSpec, global_batch: int, heldout: bool = False
) -> Callable[[RankPlan, dict[str, ModuleState]], SpeechStageRunner]:
    """A function (plan, states) -> SpeechStageRunner for one rank (`data`, `spec` from
    `speech_job_data`, in the launching process). `heldout`: open the held-out split first."""
    image = _encoder_names(spec)
    audio = spec.encoders[AUDIO]
    kw: dict[str, Any] = dict(
        encoder=image,
        audio=AUDIO,
        speech_tokens=audio.tokens,
        mel_bins=audio.feature_dim // 2,
        seq_length=spec.seq_length,
        global_batch=global_batch,
    )

    def make(plan: RankPlan, states: dict[str, ModuleState]) -> SpeechStageRunner:
        tok = load_tokenizer(data.tokenizer_model)
        template = chat_template_for(data.tokenizer_model)
        held = speech_heldout(data, tok, template, **kw) if heldout else None
        return SpeechStageRunner(spec, plan, states, SpeechBatches(data, tok, template, **kw), heldout=held)

    return make


def speech_job_data(
    req: DataRequest, spec: LlavaSpec, global_batch: Optional[int] = None
) -> tuple[LlavaSpec, CaptionDataConfig]:
    """`train --data-path DIR` on a spoken-digits dataset, in the launching process: the resolved
    config (`chat_batches.resolve_chat_config`, kind "speech": the image encoder's tiles) and `spec`
    fitted to it (`speech_spec`; without --seq-length, nor --load, the data's: `speech_data_shape`).
    ValueError for --mock-data with it, --data-prompt, a dataset that names code, encoders other than
    an image encoder and `audio`, --encoder-tokens / --encoder-feature-dim that differ from the image
    tiles', or a first global batch without a loss token."""
    path = str(req.data_path)
    if req.mock_data:
        raise ValueError(f"--mock-data and --data-path {path}: give one (synthetic or real data)")
    if req.prompt:
        raise ValueError(f"--data-prompt: applies to caption data; --data-path {path} holds conversations")
    trust = req.trust_code
    if check_dataset(path, trust=trust):
        raise ValueError(f"--data-path {path}: the dataset names code; spoken-digits data is read by index only")
    image = _encoder_names(spec)
    bins = int(speech_info(path)["mel_bins"])
    patch = int(req.patch_size or DataRequest.patch_size)
    cfg = resolve_chat_config(
        CaptionDataConfig(
            path=path,
            tokenizer_model=req.tokenizer_model,
            trust_code=trust,
            seed=int(req.seed),
            patch_size=patch,
            num_workers=int(req.num_workers),
            max_image_tiles=int(req.max_image_tiles),
        ),
        tile=DEFAULT_TILE,
    )
    cfg = replace(cfg, kind="speech")
    for flag, given, derived in (
        ("--encoder-tokens", req.encoder_tokens, cfg.image_tokens),
        ("--encoder-feature-dim", req.encoder_feature_dim, cfg.feature_dim),
    ):
        if given is not None and given != derived:
            raise ValueError(
                f"{flag} {given}: --data-path {path} gives {derived} per image tile of encoder {image} (the "
                f"speech chunks are {SPEECH_CHUNK} tokens of {2 * bins} features); leave it out"
            )
    tok = load_tokenizer(cfg.tokenizer_model)
    template = chat_template_for(cfg.tokenizer_model)
    shape = speech_data_shape(cfg, tok, template, bins)
    if not req.seq_length_given:
        seq = shape["seq_length"]
        shift = seq - spec.seq_length
        outputs = {n: replace(o, offset=o.offset + shift) for n, o in spec.outputs.items()}
        spec = replace(spec, seq_length=seq, outputs=outputs)
    spec = speech_spec(
        spec,
        cfg,
        tok,
        template,
        bins=bins,
        max_tiles=shape["max_tiles"],
        max_chunks=shape["max_chunks"],
        whisper=req.audio_model_type is None,
        vocab_size=req.vocab_size,
    )
    if global_batch is not None:
        data = SpeechBatches(
            cfg,
            tok,
            template,
            encoder=image,
            speech_tokens=SPEECH_CHUNK,
            mel_bins=bins,
            seq_length=spec.seq_length,
            global_batch=global_batch,
            num_workers=0,
        )
        try:
            empty = not data.loss_tokens(0)
        finally:
            data.close()
        if empty:
            raise ValueError(
                f"--seq-length {spec.seq_length}: cuts every answer of the first global batch of --data-path "
                f"{path}; leave --seq-length out to take it from the data ({shape['seq_length']})"
            )
    return spec, cfg

"""The speech part of `convert`: a Hugging Face Whisper folder's encoder <-> the `audio` module.

In (`hf-to-checkpoint --audio HF_DIR`, beside --vision and --language): a `WhisperModel` (tensors
under `encoder.`) or `WhisperForConditionalGeneration` (`model.encoder.`) folder; its encoder becomes
the `audio` module (`models.whisper_encoder`), an `EncoderSpec(kind="whisper")` whose tokens follow
the image's in the text (offset = the vision encoder's offset + tokens); the decoder and the
projection head are not read. The audio projector starts from the family's initialisation.
Out (`checkpoint-to-hf`): OUT/audio (a `WhisperModel` config.json and the encoder's tensors under
`encoder.`: the same bytes that came in) and OUT/audio_projector (LLaVA's projector names).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Optional
from megatron_hetero.models.hf_whisper_config import whisper_config_json, whisper_fields

AUDIO = "audio"
AUDIO_PROJECTOR = "audio_projector"


def audio_prefix(shapes: dict, where: str) -> str:
    """`model.encoder.` (WhisperForConditionalGeneration) or `encoder.` (WhisperModel)."""
    from megatron_hetero.models.hf_whisper_names import WHISPER_PREFIXES

    for prefix in reversed(WHISPER_PREFIXES):  # the longer one first
        if any(n.startswith(prefix) for n in shapes):
            return prefix
    raise ValueError(f"{where}: no Whisper encoder tensors (names under 'encoder.' or 'model.encoder.')")


def with_audio(spec, cfg: dict, where: str, seq_length_given: bool):
    """`spec` with an `audio` Whisper encoder after the vision one's tokens; a default sequence length
    grows to hold both (a given one must already)."""
    from megatron_hetero.models.llava import EncoderSpec

    vision = spec.encoders["vision"]
    enc = EncoderSpec(offset=vision.offset + vision.tokens, **whisper_fields(cfg, where))
    need = enc.offset + enc.tokens
    if need > spec.seq_length:
        if seq_length_given:
            raise ValueError(
                f"--seq-length {spec.seq_length} cannot hold the image's and the speech's tokens (positions up to {need})"
            )
        spec = dataclasses.replace(spec, seq_length=need + 64)
    return dataclasses.replace(spec, encoders={**spec.encoders, AUDIO: enc})


def check_audio(source, enc) -> str:
    """The folder's encoder names and shapes against `enc` (decoder and head ignored); its prefix."""
    from megatron_hetero.models.hf_names import check_tensors
    from megatron_hetero.models.hf_whisper_names import expected_whisper

    prefix = audio_prefix(source.shapes, source.where)
    check_tensors(source.shapes, expected_whisper(enc, prefix), source.where, lambda n: not n.startswith(prefix))
    return prefix


def audio_to_ours(source, enc, prefix: str) -> dict:
    from megatron_hetero.models.hf_whisper_names import whisper_to_ours

    return whisper_to_ours(source.read, enc, prefix)


def audio_parts(sd: dict, enc, saved: Optional[dict]) -> SimpleNamespace:
    """The audio module's state dict -> {tensors: {audio, audio_projector}, configs: {audio}}."""
    from megatron_hetero.models import hf_names
    from megatron_hetero.models.hf_whisper_names import whisper_to_hf

    cfg = dict(saved) if saved is not None else whisper_config_json(enc)
    cfg["architectures"] = ["WhisperModel"]  # the tensors go out under `encoder.`
    return SimpleNamespace(
        tensors={AUDIO: whisper_to_hf(sd, enc), AUDIO_PROJECTOR: hf_names.projector_to_hf(sd)},
        configs={AUDIO: cfg},
    )


def audio_origin(folder: Optional[str | Path]) -> dict:
    return {AUDIO: str(folder)} if folder else {}

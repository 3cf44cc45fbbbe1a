"""The cost model's workload of `megatron-hetero search`'s flags: `train`'s model with the model flags
given, or a preset (`--encoder`/`--llm`, a Qwen2.5-VL tower preset, a Whisper preset for
`--audio-encoder`) whose sizes the model flags override. Pure: no torch."""

from __future__ import annotations

import dataclasses

from megatron_hetero.cli.model_flags import MODEL_FLAGS, flag
from megatron_hetero.cli.train_door import model_flags
from megatron_hetero.layout.flags import value
from megatron_hetero.planner.model import encoder_model_spec, qwen_encoder_spec, workload
from megatron_hetero.config.model import spec_from_flags
from megatron_hetero.planner.presets import (
    ENCODER_PRESETS,
    LLM_PRESETS,
    SPEECH_PRESETS,
    TOKENS_PER_STEP,
    TOWER_PRESETS,
)
from megatron_hetero.planner.workload import ModelSpec, Workload


def uses_presets(args) -> bool:
    return args.encoder is not None or args.llm is not None


def _tower_spec(base, args, llm_hidden: int):
    """A tower preset (`presets.TOWER_PRESETS`, an `EncoderSpec`) with the encoder flags given, as the
    cost model's encoder (`planner.model.qwen_encoder_spec`: priced over its patches, its windows)."""

    sizes = {
        "num_layers": args.encoder_num_layers,
        "hidden_size": args.encoder_hidden_size,
        "num_attention_heads": args.encoder_num_attention_heads,
        "ffn_hidden_size": args.encoder_ffn_hidden_size,
        "tokens": args.encoder_tokens,
    }
    e = dataclasses.replace(base, **{k: v for k, v in sizes.items() if v is not None})
    if e.tokens != round(e.tokens**0.5) ** 2:
        raise ValueError(f"--encoder-tokens {e.tokens}: the {base.kind} preset's images are square (a square count)")
    full = tuple(i for i in e.fullatt_block_indexes if i < e.num_layers)
    return qwen_encoder_spec("vision", dataclasses.replace(e, fullatt_block_indexes=full), llm_hidden)


def _preset_spec(base, args, side: str, seq: int):
    names = {
        "encoder": (
            "encoder_num_layers",
            "encoder_hidden_size",
            "encoder_ffn_hidden_size",
            "encoder_num_attention_heads",
        ),
        "llm": ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads"),
    }[side]
    layers, hidden, ffn, heads = (getattr(args, n) for n in names)

    def pick(v, d):
        return d if v is None else v

    vocab = base.vocab if side == "encoder" or args.vocab_size is None else args.vocab_size
    return ModelSpec(
        base.name.split("-")[0] if side == "encoder" else "language",
        pick(layers, base.num_layers),
        pick(hidden, base.hidden),
        pick(ffn, base.ffn_hidden),
        pick(heads, base.heads),
        seq,
        kind=base.kind,
        vocab=vocab,
        gated=base.gated,
    )


def workload_from_args(args):
    """The cost model's workload: `train`'s model (config.model.spec_from_flags, costed by
    planner.model.workload) with the model flags given, or, with --encoder/--llm, a preset whose
    sizes the model flags override."""

    audio = _audio_encoder(args)
    if not uses_presets(args):
        spec = spec_from_flags(model_flags(args))
        enc = spec.encoders["vision"]
        # train's encoders: an MLP of 4 * hidden, one input of encoder_tokens per sample
        for name, v in (("encoder_ffn_hidden_size", 4 * enc.hidden_size), ("images_per_sample", 1)):
            if getattr(args, name) not in (None, v):
                raise ValueError(
                    f"{flag(name)} {getattr(args, name)} applies to the --encoder/--llm presets; "
                    f"`train` runs encoders with an MLP of 4 * --encoder-hidden-size "
                    f"(= {4 * enc.hidden_size}) and one input of --encoder-tokens per sample"
                )
        if audio is not None:  # train's `audio` module: the --encoder-* sizes, Whisper's structure
            whisper = dataclasses.replace(enc, kind="whisper", activation="gelu", patch_size=0)
            spec = dataclasses.replace(spec, encoders={**spec.encoders, "audio": whisper})
        return workload(
            spec,
            value(args, MODEL_FLAGS["global_batch_size"]),
            value(args, MODEL_FLAGS["micro_batch_size"]),
            inputs={"audio": args.audio_chunks or 1} if audio is not None else None,
        )

    def given(value, default):
        return default if value is None else value

    seq = given(args.seq_length, 8192)
    llm = _preset_spec(LLM_PRESETS[given(args.llm, "14B")], args, "llm", seq)
    if args.encoder in TOWER_PRESETS:
        enc = _tower_spec(TOWER_PRESETS[args.encoder], args, llm.hidden)
    else:
        enc_base = ENCODER_PRESETS[given(args.encoder, "1B")]
        enc = _preset_spec(enc_base, args, "encoder", given(args.encoder_tokens, enc_base.seq))
    gbs = given(args.global_batch_size, max(1, TOKENS_PER_STEP // max(seq, 1)))
    extra = (encoder_model_spec("audio", SPEECH_PRESETS[audio], llm.hidden),) if audio is not None else ()
    return Workload(
        enc,
        llm,
        global_batch=gbs,
        micro_batch=given(args.micro_batch_size, 1),
        images_per_sample=given(args.images_per_sample, 1),
        extra_encoders=extra,
        extra_inputs=(given(args.audio_chunks, 1),) if extra else (),
    )


def _audio_encoder(args):
    """--audio-encoder's value, checked against the model it joins: 'whisper' (train's model) or a
    Whisper preset (with --encoder/--llm); None without one. ValueError for a mismatch or bad chunks."""
    audio = getattr(args, "audio_encoder", None)
    chunks = getattr(args, "audio_chunks", None)
    if audio is None:
        if chunks is not None:
            raise ValueError("--audio-chunks applies to a speech encoder: give --audio-encoder")
        return None
    if chunks is not None and chunks < 1:
        raise ValueError(f"--audio-chunks must be >= 1, got {chunks}")
    if uses_presets(args) and audio == "whisper":
        raise ValueError(
            "--audio-encoder whisper is train's encoder (the --encoder-* sizes); with --encoder/--llm presets "
            "choose a Whisper preset (whisper-tiny ... whisper-large-v3)"
        )
    if not uses_presets(args) and audio != "whisper":
        raise ValueError(
            f"--audio-encoder {audio} is a preset: give --encoder/--llm presets too, or --audio-encoder whisper "
            "for train's model (every encoder with the --encoder-* sizes)"
        )
    return audio

"""The model `megatron-hetero train` runs, as Megatron-style flag values, and its cost-model workload.

One set of sizes for every subcommand: `train` builds the model from a `ModelArgs`, `search` plans
the same `ModelArgs` (`workload_for`), so `search` without model flags plans the model `train` runs
without them. Pure: no torch (the planner stays importable and fast without it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

DEFAULT_NUM_LAYERS = 2  # language-model layers when neither --num-layers nor the layout's segments say
SIZE_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "seq_length",
    "vocab_size",
    "encoder_num_layers",
    "encoder_hidden_size",
    "encoder_num_attention_heads",
    "encoder_tokens",
    "encoder_feature_dim",
)


@dataclass(frozen=True)
class ModelArgs:
    """Sizes and batch of the LLaVA-style model (the defaults are `train`'s: `models.llava.LlavaSpec`
    and `EncoderSpec`, one copy of them per encoder module).

    num_layers None: DEFAULT_NUM_LAYERS, or what the layout's language segments (`layers`) cover.
    micro_batch_size None: train picks one per layout (`training.job.default_micro_batch_size`); the
    cost model takes 1.
    """

    num_layers: Optional[int] = None
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: Optional[int] = None
    seq_length: int = 32
    vocab_size: int = 128
    encoder_num_layers: int = 2
    encoder_hidden_size: int = 32
    encoder_num_attention_heads: int = 4
    encoder_tokens: int = 8
    encoder_feature_dim: int = 24
    global_batch_size: int = 8
    micro_batch_size: Optional[int] = None

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_namespace(cls, args: Any) -> "ModelArgs":
        """The values `args` (an argparse namespace with Megatron flag names) sets; None means default."""
        given = {n: getattr(args, n) for n in cls.field_names() if getattr(args, n, None) is not None}
        return cls(**given)

    def validate(self) -> None:
        """ValueError for sizes train cannot build (batch sizes: `training.setup.validate_job`)."""
        for name in SIZE_FIELDS:
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
        if self.encoder_hidden_size % self.encoder_num_attention_heads:
            raise ValueError(
                f"--encoder-hidden-size {self.encoder_hidden_size} is not divisible by "
                f"--encoder-num-attention-heads {self.encoder_num_attention_heads}"
            )


def _ffn(hidden: int, ffn: Optional[int]) -> int:
    return 4 * hidden if ffn is None else ffn


def workload(model: ModelArgs, encoder: str = "vision", micro_batch: Optional[int] = None):
    """The cost model's `Workload` of `model` with one encoder module named `encoder`, trained as
    `train` trains it: fp32 with Adam (fp32 weights and main grads: 4 + 4 bytes, two fp32 moments: 8
    bytes, no distributed optimizer), one encoder input of `encoder_tokens` tokens per sample.
    micro_batch: the cost model's micro-batch (samples per replica of the largest language DP;
    default `model.micro_batch_size` or 1)."""
    from megatron_hetero.planner.workload import ModelSpec, Workload

    model.validate()
    h, eh = model.hidden_size, model.encoder_hidden_size
    enc_layer = 4 * eh**2 + 2 * eh * _ffn(eh, None)
    # the encoder's non-layer parameters (patch embedding, positions, projector) count with its layers
    extra = (model.encoder_feature_dim + 1) * eh + model.encoder_tokens * eh + (eh + 1) * h + (h + 1) * h
    enc = ModelSpec(
        encoder,
        model.encoder_num_layers,
        eh,
        _ffn(eh, None),
        model.encoder_num_attention_heads,
        model.encoder_tokens,
        kind="encoder",
        params=int(model.encoder_num_layers * enc_layer + extra),
    )
    layers = DEFAULT_NUM_LAYERS if model.num_layers is None else model.num_layers
    llm = ModelSpec(
        "language",
        layers,
        h,
        _ffn(h, model.ffn_hidden_size),
        model.num_attention_heads,
        model.seq_length,
        kind="llm",
        vocab=model.vocab_size,
    )
    mb = micro_batch if micro_batch is not None else 1 if model.micro_batch_size is None else model.micro_batch_size
    return Workload(
        enc,
        llm,
        global_batch=model.global_batch_size,
        micro_batch=mb,
        images_per_sample=1,
        dtype_bytes=4,
        weight_bytes=4.0,
        grad_bytes=4.0,
        optimizer_bytes=8.0,
        distributed_optimizer=False,
    )


def workload_for(spec: Any, global_batch: int, micro_batch: int):
    """The cost model's workload of a `models.llava.LlavaSpec` with one encoder (see `workload`)."""
    if len(spec.encoders) != 1:
        raise ValueError(f"the cost model takes one encoder; the model has {sorted(spec.encoders)}")
    ((name, e),) = spec.encoders.items()
    model = ModelArgs(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        ffn_hidden_size=spec.ffn_hidden_size,
        seq_length=spec.seq_length,
        vocab_size=spec.vocab_size,
        encoder_num_layers=e.num_layers,
        encoder_hidden_size=e.hidden_size,
        encoder_num_attention_heads=e.num_attention_heads,
        encoder_tokens=e.tokens,
        encoder_feature_dim=e.feature_dim,
        global_batch_size=global_batch,
        micro_batch_size=micro_batch,
    )
    return workload(model, encoder=name)

"""A Whisper speech encoder module from Megatron-core parts + the LLaVA projector.

Input: `[b, tokens, 2 * mel]`, each speech token's two log-mel frames side by side (frames 2t and
2t + 1, each `mel` values): every encoder here takes `[b, tokens, feature]` and gives `[b, tokens,
llm_hidden]`, and conv2's stride 2 makes one token of two frames, so `feature_dim` = 2 * mel bins and
the data's token counts are the encoder's (`mel_features` takes Hugging Face's `input_features`
`[b, mel, frames]` as they are). The trunk is Whisper's encoder:

* `conv1` (kernel 3, padding 1) -> GELU -> `conv2` (kernel 3, stride 2, padding 1) -> GELU: `frames`
  log-mel frames become ceil(frames / 2) speech tokens (torch convolutions, replicated over TP as
  Megatron's CLIP patch convolution is);
* plus the first tokens rows of the sinusoidal position table `positions` (Whisper's
  `embed_positions`: fixed, never trains, but converted and written back);
* Megatron-core's `TransformerBlock` of pre-LN layers (`models.layer_specs.encoder_layer_spec`:
  bidirectional attention, LayerNorm, exact GELU MLP, biases) on the module's TP group, with its
  final LayerNorm = Whisper's `layer_norm`.

Whisper's k_proj has no bias; Megatron's fused QKV has one. Its key part is held at zero (zeroed at
build, its gradient zeroed by a hook): a key bias adds the same q.b to every key of a query's row,
which softmax cancels, so it carries nothing, and a round trip returns Whisper's tensors exactly.

Hugging Face's encoder insists on exactly 2 * max_source_positions frames (30 s); this one takes any
frames <= 2 * tokens (a clip's own length: its token count follows the clip) and gives Hugging
Face's `last_hidden_state` on a full-length input (on a shorter clip: Hugging Face's layers run on
that clip alone). One pipeline stage, cp 1.
"""

from __future__ import annotations

import math

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_block import TransformerBlock

from megatron_hetero.layout.spec import ModuleLayout
from megatron_hetero.layout.validate import check_heads
from megatron_hetero.models.one_stage_encoder import OneStageEncoder
from megatron_hetero.models.layer_specs import encoder_layer_spec


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's position table [length, channels]: sin then cos over log-spaced timescales."""
    if channels % 2 or channels < 4:
        raise ValueError(f"a Whisper encoder needs an even hidden size >= 4 for its positions, got {channels}")
    increment = math.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-increment * torch.arange(channels // 2))
    scaled = torch.arange(length).view(-1, 1) * inv.view(1, -1)
    return torch.cat([scaled.sin(), scaled.cos()], dim=1)


def speech_tokens(frames: int) -> int:
    """Speech tokens of a clip of `frames` log-mel frames (conv2's stride 2, padding 1)."""
    return (frames - 1) // 2 + 1


def mel_bins(enc) -> int:
    """The log-mel bins of a Whisper `EncoderSpec` (its feature_dim holds two frames)."""
    if enc.feature_dim % 2:
        raise ValueError(f"a Whisper encoder's feature_dim is 2 * mel bins (two frames a token), got {enc.feature_dim}")
    return enc.feature_dim // 2


def mel_to_pairs(mel: torch.Tensor) -> torch.Tensor:
    """Hugging Face's `input_features` [b, mel, frames] (frames even) -> [b, frames/2, 2*mel]."""
    b, bins, frames = mel.shape
    if frames % 2:
        raise ValueError(f"log-mel input needs an even number of frames (two a speech token), got {frames}")
    return mel.transpose(1, 2).reshape(b, frames // 2, 2 * bins)


def pairs_to_mel(x: torch.Tensor, bins: int) -> torch.Tensor:
    """[b, tokens, 2*mel] -> [b, mel, 2*tokens] (the inverse of `mel_to_pairs`)."""
    b, tokens, f = x.shape
    if f != 2 * bins:
        raise ValueError(
            f"speech features must be [b, tokens, {2 * bins}] (two frames of {bins} bins), got {list(x.shape)}"
        )
    return x.reshape(b, 2 * tokens, bins).transpose(1, 2)


class WhisperEncoderModule(OneStageEncoder):
    """[b, tokens, 2*mel] frame pairs -> Whisper encoder -> projector -> [b, tokens, llm_hidden].
    `enc`: an `EncoderSpec` (feature_dim = 2 * mel bins, tokens = max_source_positions)."""

    def __init__(
        self,
        name: str,
        enc,
        llm_hidden: int,
        m: ModuleLayout,
        pgs: ProcessGroupCollection,
        seed: int,
        impl: str = "local",
    ) -> None:
        super().__init__()
        from megatron_hetero.models.llava import build_projector, freeze_trunk

        self._one_stage(name, m, "a Whisper encoder")
        check_heads(m, enc.num_attention_heads)
        self.max_tokens, self.mel = enc.tokens, mel_bins(enc)
        h = enc.hidden_size
        config = self._config(enc, m, torch.nn.functional.gelu)
        self.conv1 = torch.nn.Conv1d(self.mel, h, kernel_size=3, padding=1)
        self.conv2 = torch.nn.Conv1d(h, h, kernel_size=3, stride=2, padding=1)
        self.positions = torch.nn.Embedding(enc.tokens, h)
        self.decoder = TransformerBlock(
            config, encoder_layer_spec(impl), pre_process=True, post_process=True, pg_collection=pgs
        )
        self.projector = build_projector(enc, llm_hidden, m, pgs)
        self._init(seed, pgs)
        with torch.no_grad():
            self.positions.weight.copy_(sinusoids(enc.tokens, h))
        self.positions.weight.requires_grad_(False)
        for layer in self.decoder.layers:
            bias = layer.self_attention.linear_qkv.bias
            mask = self._key_mask(bias, h // enc.num_attention_heads)
            with torch.no_grad():
                bias.masked_fill_(mask, 0.0)
            bias.register_hook(lambda g, mask=mask: g.masked_fill(mask, 0.0))
        if self.frozen:
            freeze_trunk(self)

    @staticmethod
    def _key_mask(bias: torch.Tensor, head_dim: int) -> torch.Tensor:
        """True on the key part of this rank's fused QKV bias ([heads, (q, k, v), d] per TP shard)."""
        mask = torch.zeros(bias.numel() // (3 * head_dim), 3, head_dim, dtype=torch.bool)
        mask[:, 1] = True
        return mask.reshape(bias.shape)

    def mel_features(self, input_features: torch.Tensor) -> torch.Tensor:
        """Hugging Face's `input_features` [b, mel, frames] -> `last_hidden_state` [b, tokens, h]."""
        if input_features.dim() != 3 or input_features.shape[1] != self.mel:
            raise ValueError(
                f"encoder {self.name}: log-mel input must be [b, {self.mel}, frames], got {list(input_features.shape)}"
            )
        frames = input_features.shape[2]
        if not 1 <= frames <= 2 * self.max_tokens:
            raise ValueError(
                f"encoder {self.name}: {frames} log-mel frames; this encoder takes 1..{2 * self.max_tokens} "
                f"({self.max_tokens} positions)"
            )
        x = torch.nn.functional.gelu(self.conv1(input_features))
        x = torch.nn.functional.gelu(self.conv2(x))  # [b, h, tokens]
        tokens = x.shape[2]
        x = x.permute(2, 0, 1) + self.positions.weight[:tokens].unsqueeze(1)  # [tokens, b, h]
        return self.decoder(x.contiguous(), attention_mask=None).transpose(0, 1).contiguous()

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """[b, tokens, 2*mel] frame pairs -> what the projector reads [b, tokens, h]."""
        return self.mel_features(pairs_to_mel(x, self.mel))

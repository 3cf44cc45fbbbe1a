"""A SigLIP vision encoder module: Megatron-core's `CLIPViTModel` siglip variant + the LLaVA projector.

Input: the encoder features `[b, tokens, 3 * p * p]` the data produces (as for the CLIP encoder,
`models.clip_encoder`: non-overlapping p x p patches in row-major order, each flattened as
(channel, row, column)), put back together into the image `[b, 3, H, W]`. Megatron's
`CLIPViTModel(model_subtype="siglip")` then computes: the patch convolution WITH bias, learned
absolute positions over the patches (no class token), no `ln_pre`, the pre-norm LayerNorm layers
(here with `activation`: Hugging Face's `gelu_pytorch_tanh`, gelu's tanh approximation), and its
post LayerNorm. The post LayerNorm is taken out of the ViT and held here as `ln_post` (the same
module: Megatron's forward runs it last, this module runs it at the same point), so that

* with `post_norm` (a whole tower read at LLaVA's feature layer -1) the features are
  `ln_post(ViT)`: Hugging Face's `SiglipVisionModel.last_hidden_state`, exactly Megatron's siglip
  forward;
* without it (a tower cut at another feature layer) they are the last kept layer's output, Hugging
  Face's `hidden_states[k]`; `ln_post` is then kept for the round trip only and never trains.

`head` (with `pooling_head`) holds SigLIP's attention-pooling head under Hugging Face's own names
(`probe`, `attention` = torch's MultiheadAttention, `layernorm`, `mlp.fc1/fc2`): LLaVA does not use
it, so it never trains, but it is converted, saved and written back (a round trip returns every
tensor of the tower) and `pooled` computes Hugging Face's `pooler_output` with it.

All `tokens` features go to the projector (Megatron's `MultimodalProjector`): there is no class
token to drop.

Pixels from the tower's own preprocessing (`data.image_processor`, a `SiglipImageProcessor`
config): `pixel_features(pixels)` takes `[b, 3, S, S]` straight into the tower's convolution. S is
the tower's Hugging Face `image_size`, which may exceed the g * p square the encoder is built for by
up to p - 1 (so400m-patch14-384: 384 for 27 * 14 = 378): the "valid" stride-p convolution never
reads those last rows and columns, so they are cut off first and the result is Hugging Face's.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from megatron.core.models.vision.clip_vit_model import CLIPViTModel
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_hetero.compat import clip_vit_norm_kwargs
from megatron_hetero.layout.spec import ModuleLayout
from megatron_hetero.models.clip_encoder import patches_to_image
from megatron_hetero.models.one_stage_encoder import OneStageEncoder
from megatron_hetero.models.layer_specs import encoder_layer_spec
from megatron_hetero.models.llava import build_projector, freeze_trunk


def siglip_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP activation of a Hugging Face `hidden_act` name (gelu_pytorch_tanh: gelu's tanh form)."""
    table: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "gelu_pytorch_tanh": functools.partial(torch.nn.functional.gelu, approximate="tanh"),
        "gelu": torch.nn.functional.gelu,
    }
    return table[name]


class PoolingHeadMLP(torch.nn.Module):
    """fc1 -> activation -> fc2 (the head's MLP, Hugging Face's names)."""

    def __init__(self, hidden: int, ffn: int, act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fc1, self.fc2, self.act = torch.nn.Linear(hidden, ffn), torch.nn.Linear(ffn, hidden), act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class PoolingHead(torch.nn.Module):
    """SigLIP's multi-head attention pooling: one learned query (`probe`) attends over the tokens,
    then a pre-norm MLP with a residual; returns [b, h]."""

    def __init__(self, hidden: int, heads: int, ffn: int, eps: float, act) -> None:
        super().__init__()
        self.probe = torch.nn.Parameter(torch.zeros(1, 1, hidden))
        self.attention = torch.nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.layernorm = torch.nn.LayerNorm(hidden, eps=eps)
        self.mlp = PoolingHeadMLP(hidden, ffn, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        query = self.probe.expand(x.shape[0], -1, -1)
        pooled = self.attention(query, x, x, need_weights=False)[0]
        pooled = pooled + self.mlp(self.layernorm(pooled))
        return pooled[:, 0]


class SiglipEncoderModule(OneStageEncoder):
    """[b, tokens, 3*p*p] patch features -> SigLIP ViT (-> ln_post with `post_norm`) -> projector ->
    [b, tokens, llm_hidden]. One pipeline stage, cp 1; TP on the module's own TP group."""

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
        """`impl`: --transformer-impl (`models.layer_specs.encoder_layer_spec`)."""
        super().__init__()

        self._one_stage(name, m, "a SigLIP encoder")
        self.patch = enc.patch_size
        self.grid = round(enc.tokens**0.5)
        self.post_norm = enc.post_norm
        act = siglip_activation(enc.activation)
        config = self._config(enc, m, act)
        side = self.grid * self.patch
        self.vit = CLIPViTModel(
            config,
            encoder_layer_spec(impl),
            add_class_token=False,
            class_token_len=0,
            patch_dim=self.patch,
            img_h=side,
            img_w=side,
            model_subtype="siglip",
            pg_collection=pgs,
            **clip_vit_norm_kwargs(),
        )
        # Megatron's post LayerNorm, run here (after the ViT, where its forward runs it) when post_norm
        self.ln_post = self.vit.ln_post
        self.vit.ln_post = None
        ffn = enc.ffn_hidden_size or 4 * enc.hidden_size
        if enc.pooling_head:
            self.head = PoolingHead(enc.hidden_size, enc.num_attention_heads, ffn, enc.norm_epsilon, act)
        self.projector = build_projector(enc, llm_hidden, m, pgs)
        self._init(seed, pgs)
        kept = [self.head] if enc.pooling_head else []
        if not self.post_norm:
            kept.append(self.ln_post)
        for part in kept:  # outside LLaVA's features: never trains
            for p in part.parameters():
                p.requires_grad_(False)
        if self.frozen:
            freeze_trunk(self)

    def image(self, x: torch.Tensor) -> torch.Tensor:
        """[b, g*g, 3*p*p] patches -> [b, 3, g*p, g*p] (`patches_to_image`)."""
        return patches_to_image(x, self.grid, self.patch)

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        """[b, tokens, 3*p*p] -> the last kept layer's output [b, tokens, h] (hidden_states[k])."""
        return self.vit(self.image(x).contiguous())

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """What LLaVA's projector reads [b, tokens, h]: ln_post(trunk) with post_norm, else the trunk."""
        return self._normed(self.trunk(x))

    def pixel_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """[b, 3, S, S] pixel images (e.g. `image_processor.ImageProcessor.batch`; S from g * p, the
        square the encoder is built for, to g * p + p - 1, the tower's image size whose last rows and
        columns the convolution never reads) -> what `features` gives [b, tokens, h] (Hugging Face's
        `last_hidden_state` with post_norm, else `hidden_states[k]`)."""
        side = self.grid * self.patch
        if (
            pixels.dim() != 4
            or pixels.shape[1] != 3
            or pixels.shape[2] != pixels.shape[3]
            or not side <= pixels.shape[2] < side + self.patch
        ):
            raise ValueError(
                f"encoder {self.name}: pixels must be [b, 3, S, S] with {side} <= S <= {side + self.patch - 1} "
                f"(the tower's image size: {self.grid} x {self.grid} patches of {self.patch}), got "
                f"{list(pixels.shape)}"
            )
        return self._normed(self.vit(pixels[:, :, :side, :side].contiguous()))

    def _normed(self, h: torch.Tensor) -> torch.Tensor:
        return self.ln_post(h) if self.post_norm else h

    def pooled(self, x: torch.Tensor) -> torch.Tensor:
        """Hugging Face's `pooler_output` [b, h]: the pooling head over ln_post(trunk)."""
        if not hasattr(self, "head"):
            raise ValueError(f"module {self.name}: this SigLIP tower has no pooling head")
        return self.head(self.ln_post(self.trunk(x)))

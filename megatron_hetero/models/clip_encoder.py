"""A CLIP-style vision encoder module: Megatron-core's `CLIPViTModel` + the LLaVA projector.

Input: the encoder features `[b, tokens, 3 * p * p]` that the data produces (`data.samples`,
`data.energon_data.patchify`: an image cut into non-overlapping p x p patches in row-major order,
each flattened as (channel, row, column)). They are put back together into the image
`[b, 3, H, W]` and fed to `CLIPViTModel` (patch convolution without bias, a class token at position
0, learned absolute positions, `ln_pre`, pre-norm LayerNorm transformer layers with quick-GELU,
bidirectional attention), all Megatron-core's own; its output `[b, 1 + tokens, h]` is Hugging
Face's `CLIPVisionModel.last_hidden_state` (`features`). LLaVA's feature selection ("default":
drop the class token) leaves `tokens` patch features, which the projector (Megatron's
`MultimodalProjector`, linear -> GELU -> linear) maps to the language model's hidden size.

Pixels from the tower's own preprocessing (`data.image_processor`, which reads the Hugging Face
`preprocessor_config.json`): `image_processor.to_patches(pixels, p)` gives exactly these features
(`image` below undoes it with a reshape, so the convolution sees the processor's pixels bit for bit),
and `pixel_features(pixels)` takes `[b, 3, H, W]` directly. Either way the patch embedding is the
tower's own convolution; the data only reshapes.

`ln_post` (Hugging Face's `post_layernorm`) is kept for the pooled class-token output (`pooled`):
LLaVA does not use it, so it never trains (requires_grad False) but it is converted and saved so a
checkpoint round trip returns every tensor of the original tower.
"""

from __future__ import annotations

import torch
from megatron.core.models.vision.clip_vit_model import CLIPViTModel
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_hetero.compat import clip_vit_norm_kwargs
from megatron_hetero.layout.spec import ModuleLayout
from megatron_hetero.models.one_stage_encoder import OneStageEncoder
from megatron_hetero.models.layer_specs import encoder_layer_spec
from megatron_hetero.models.llava import build_projector, freeze_trunk


def patches_to_image(x: torch.Tensor, grid: int, patch: int) -> torch.Tensor:
    """[b, g*g, 3*p*p] patches (row-major, each flattened (c, i, j)) -> the image [b, 3, g*p, g*p]: the
    inverse of the data's patchify (`image_processor.to_patches`), a reshape without arithmetic."""
    b, g, p = x.shape[0], grid, patch
    return x.reshape(b, g, g, 3, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, 3, g * p, g * p)


def activation(name: str):
    from megatron.core.activations import quick_gelu

    return {"quick_gelu": quick_gelu, "gelu": torch.nn.functional.gelu}[name]


class ClipEncoderModule(OneStageEncoder):
    """[b, tokens, 3*p*p] patch features -> CLIP ViT -> drop the class token -> projector ->
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

        self._one_stage(name, m, "a CLIP encoder")
        self.patch = enc.patch_size
        self.grid = round(enc.tokens**0.5)
        config = self._config(enc, m, activation(enc.activation))
        layer_spec = encoder_layer_spec(impl)
        side = self.grid * self.patch
        self.vit = CLIPViTModel(
            config,
            layer_spec,
            add_class_token=True,
            class_token_len=1,
            patch_dim=self.patch,
            img_h=side,
            img_w=side,
            model_subtype="clip",
            pg_collection=pgs,
            **clip_vit_norm_kwargs(),
        )
        self.ln_post = torch.nn.LayerNorm(enc.hidden_size, eps=enc.norm_epsilon)
        self.projector = build_projector(enc, llm_hidden, m, pgs)
        self._init(seed, pgs)
        for p in self.ln_post.parameters():
            p.requires_grad_(False)
        if self.frozen:
            freeze_trunk(self)

    def image(self, x: torch.Tensor) -> torch.Tensor:
        """[b, g*g, 3*p*p] patches -> [b, 3, g*p, g*p] (`patches_to_image`)."""
        return patches_to_image(x, self.grid, self.patch)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """[b, tokens, 3*p*p] -> the ViT's last hidden states [b, 1 + tokens, h] (class token first)."""
        return self.vit(self.image(x).contiguous())

    def pixel_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """[b, 3, H, W] pixel images (e.g. `image_processor.ImageProcessor.batch`, H = W = the tower's
        image size) -> the ViT's last hidden states [b, 1 + tokens, h], as `features` gives for
        `image_processor.to_patches(pixels, patch)`."""
        side = self.grid * self.patch
        if pixels.dim() != 4 or tuple(pixels.shape[1:]) != (3, side, side):
            raise ValueError(
                f"encoder {self.name}: pixels must be [b, 3, {side}, {side}] (the tower's image size), "
                f"got {list(pixels.shape)}"
            )
        return self.vit(pixels.contiguous())

    def pooled(self, x: torch.Tensor) -> torch.Tensor:
        """Hugging Face's `pooler_output`: ln_post of the class token's last hidden state [b, h]."""
        return self.ln_post(self.features(x)[:, 0])

    def projected(self, x: torch.Tensor) -> torch.Tensor:
        """LLaVA's "default" selection: the patch tokens [b, tokens, h] (the class token dropped)."""
        return self.features(x)[:, 1:]

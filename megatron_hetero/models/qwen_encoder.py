"""The Qwen2.5-VL vision tower as an encoder module of the model family (`EncoderSpec.kind`
"qwen2.5-vl").

Input: `[b, tokens, feature]`, every encoder's shape here: one image a sample at the spec's fixed
size, `tokens` merged tokens in `image_rows` rows, each token's features its merge**2 patches side
by side (`feature = merge**2 * 3 * temporal_patch * patch**2`), which is the Qwen image processor's
patch order (`data.qwen_image_processor`: patches in merge blocks). The module flattens them to
the tower's `[b * tokens * merge**2, 3 * T * p * p]` with `grid_thw` one row `(1, merge * rows,
merge * cols)` per sample, runs `models.qwen_vision.QwenVisionTower` (its merger projects into the
language model's width) and returns `[b, tokens, llm_hidden]`, the tokens in the image's row-major
order. TP, DP and PP on the module's layout; cp 1 (refused: `models.architecture.check_qwen`).

Pipeline stages (pp > 1, fixed-size images only): the blocks split evenly over the stages, the
first stage holds the patch embedding, the last `ln_q` and the merger. Between stages goes
`[tokens * merge**2, b, h]` (the runtime's `[seq, b, h]`: `LlavaStageRunner.stage_tensor`): each
sample's patches in the tower's window order (a fixed-size image's windows are its own, so the b
images stay apart). The rotary angles, window order and attention masks are recomputed on every
stage from the spec's image grid, never sent. Native resolution (`max_tiles`) has no one shape
between stages and keeps pp 1.

Frozen (`frozen: true` in the layout): the blocks and the patch embedding stop taking gradients,
the merger (`ln_q`, `merger`: the tower's projector) trains, as a frozen LLaVA tower's projector does.

The language model's M-RoPE ids for this image: `models.qwen_positions.mrope_ids`.

Native resolution (`max_tiles` K >= 1, the variable image tokens of docs/variable-tokens.md): a
sample carries 0..K tiles, each a band of `image_rows` x cols merged tokens, and its n tiles are ONE
image of n * image_rows rows (`tile_grid_thw`): images of different heights in one batch, the tower's
windows and full attention over each whole image; the M-RoPE ids follow each sample's image
(`models.qwen_positions.batch_mrope_ids`). On conversation data (`data.chat_batches` native
resolution) a tile is ONE merged token (`tokens` 1) and the runner also hands each sample's images'
(rows, cols) (`grids`, from the data on every rank: not on the wire): each image is its own grid
row (`images_grid_thw`), any size, several a sample (`models.qwen_positions.grid_mrope_ids`).

Image data (`train --data-path`, `models.caption_runner`) gives pixel blocks instead: each token's
features the `[C, merge*p, merge*p]` pixels it covers (`energon_data.patchify` at patch merge * p,
C 1 or 3, scaled to [-1, 1]); `blocks_to_patches` cuts them into the processor order above (grey
repeated to RGB, each patch repeated over the temporal patch, as the Qwen image processor repeats a
still frame).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_hetero.layout.spec import ModuleLayout
from megatron_hetero.models.architecture import PP_NATIVE_REASON
from megatron_hetero.models.init import deterministic_init
from megatron_hetero.models.qwen_positions import image_grid
from megatron_hetero.models.qwen_vision import QwenVisionSpec, QwenVisionTower


def tower_spec(enc, llm_hidden: int) -> QwenVisionSpec:
    """The tower's shape of a Qwen2.5-VL `EncoderSpec` (its merger projects to `llm_hidden`)."""
    return QwenVisionSpec(
        hidden_size=enc.hidden_size,
        depth=enc.num_layers,
        num_heads=enc.num_attention_heads,
        intermediate_size=enc.ffn_hidden_size or 4 * enc.hidden_size,
        out_hidden_size=llm_hidden,
        patch_size=enc.patch_size,
        temporal_patch_size=enc.temporal_patch_size,
        spatial_merge_size=enc.merge_size,
        window_size=enc.window_size,
        fullatt_block_indexes=tuple(enc.fullatt_block_indexes),
        hidden_act=enc.activation,
    )


def grid_thw(enc, images: int) -> torch.Tensor:
    """[images, 3] (1, merge * rows, merge * cols): the tower's grid of `images` images of the spec."""
    rows, cols = image_grid(enc)
    return torch.tensor([[1, enc.merge_size * rows, enc.merge_size * cols]] * images)


def tile_grid_thw(enc, tiles: Sequence[int], total: int) -> torch.Tensor:
    """[images, 3]: one image per sample with n >= 1 tiles, (1, merge * rows * n, merge * cols) (native
    resolution: a sample's tiles are bands of its image, top to bottom); `total` the tiles given."""
    rows, cols = image_grid(enc)
    counts = [int(n) for n in tiles if n]
    if any(n < 0 for n in tiles) or sum(counts) != total:
        raise ValueError(f"tile counts {list(tiles)} do not add up to the {total} tiles given")
    return torch.tensor([[1, enc.merge_size * rows * n, enc.merge_size * cols] for n in counts])


def images_grid_thw(enc, grids: Sequence[Sequence[tuple[int, int]]], total: int) -> torch.Tensor:
    """[images, 3] (1, merge * rows, merge * cols) of every image of the samples `grids` (per sample
    its images' (rows, cols) of merged tokens), sample by sample; `total` the merged tokens given."""
    flat = [(int(h), int(w)) for g in grids for h, w in g]
    if any(h < 1 or w < 1 for h, w in flat) or sum(h * w for h, w in flat) != total:
        raise ValueError(f"image grids {[list(g) for g in grids]} do not add up to the {total} merged tokens given")
    m = enc.merge_size
    return torch.tensor([[1, m * h, m * w] for h, w in flat], dtype=torch.long).reshape(-1, 3)


class QwenEncoderModule(torch.nn.Module):
    """[b, tokens, merge**2 * 3*T*p*p] -> the Qwen2.5-VL tower -> [b, tokens, llm_hidden] (module docstring)."""

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
        """`impl`: --transformer-impl; the tower is built from Megatron's local layers ("local" only)."""
        super().__init__()
        if impl != "local":
            raise ValueError(f"module {name}: the Qwen2.5-VL tower is built from local layers, not {impl}")
        if m.pp > 1 and enc.max_tiles:
            raise ValueError(f"module {name}: {PP_NATIVE_REASON}, got {m.arithmetic()}")
        self.name, self.enc, self.frozen = name, enc, m.frozen
        self.tower = QwenVisionTower(tower_spec(enc, llm_hidden), m, pgs, name)  # refuses cp > 1
        self.first, self.last = self.tower.first, self.tower.last
        # blocks by global index (`init.global_name`): every pp starts from the same weights
        deterministic_init(
            self.named_parameters(),
            seed=seed,
            module=name,
            tp_rank=pgs.tp.rank(),
            tp_size=pgs.tp.size(),
            layer_offset=self.tower.first_layer,
        )
        if self.frozen:
            for n, p in self.named_parameters():
                if not n.startswith(("tower.merger.", "tower.ln_q.")):
                    p.requires_grad_(False)

    def trainable(self) -> bool:
        return any(p.requires_grad for p in self.parameters())

    def forward(
        self,
        x: torch.Tensor,
        tiles: Optional[Sequence[int]] = None,
        grids: Optional[Sequence[Sequence[tuple[int, int]]]] = None,
    ) -> torch.Tensor:
        """`x` [b, tokens, features]: b images of the spec's size (a later pipeline stage: the stage
        before's `[tokens * merge**2, b, h]`, `stage_forward`); with variable image tokens
        (`max_tiles`) `x` is the call's tiles and `tiles` the samples' tile counts: a sample's n tiles
        (bands of `image_rows` rows) are one image n times as tall (`tile_grid_thw`). With `grids`
        (per sample its images' (rows, cols) of merged tokens, e.g. the Qwen image processor's
        conversation data) the tiles are the images' merged tokens one after the other, image by
        image (`spec tokens` 1: a tile is one merged token) and each image is its own grid
        (`images_grid_thw`)."""
        if not self.first:
            return self.stage_forward(x)
        if x.shape[-1] in pixel_widths(self.enc):
            x = blocks_to_patches(x, self.enc)
        b, n, f = x.shape
        unit = self.enc.merge_size**2
        if n != self.enc.tokens or f % unit:
            raise ValueError(
                f"encoder {self.name}: features must be [b, {self.enc.tokens}, merge**2 * patch], got {list(x.shape)}"
            )
        patches = x.reshape(b * n * unit, f // unit)
        # frozen: the graph still runs through the blocks (the merger after them trains); the
        # frozen parameters take no gradient
        if grids is not None:
            grid = images_grid_thw(self.enc, grids, b * n)
        elif tiles is None:
            grid = grid_thw(self.enc, b)
        else:
            grid = tile_grid_thw(self.enc, tiles, b)
        out = self.tower(patches, grid)  # [b * n, llm_hidden]; before the last stage [N, 1, h]
        return out.view(b, n, -1) if self.last else self._to_stage(out, b)

    def stage_forward(self, x: torch.Tensor) -> torch.Tensor:
        """A later pipeline stage: `x` [tokens * merge**2, b, h] from the stage before (each sample's
        patches in window order) -> the next stage's [tokens * merge**2, b, h], or on the last stage
        the merged tokens [b, tokens, llm_hidden] in the image's row-major order."""
        patches = self.enc.stage_tokens
        if x.dim() != 3 or x.shape[0] != patches:
            raise ValueError(
                f"encoder {self.name}: a later tower stage takes [{patches}, b, h] (tokens * merge**2 patches "
                f"of each image), got {list(x.shape)}"
            )
        b = x.shape[1]
        hidden = x.transpose(0, 1).reshape(b * patches, 1, x.shape[2])  # images one after the other
        out = self.tower(None, grid_thw(self.enc, b), hidden=hidden)
        return out.view(b, self.enc.tokens, -1) if self.last else self._to_stage(out, b)

    @staticmethod
    def _to_stage(out: torch.Tensor, b: int) -> torch.Tensor:
        """The tower's [b * P, 1, h] (window order, image by image) -> the runtime's [P, b, h]."""
        return out.view(b, -1, out.shape[-1]).transpose(0, 1).contiguous()


def pixel_widths(enc) -> tuple[int, int]:
    """Feature widths of pixel-block features (grey, RGB): C * (merge * patch)**2."""
    side = enc.merge_size * enc.patch_size
    return side * side, 3 * side * side


def blocks_to_patches(x: torch.Tensor, enc) -> torch.Tensor:
    """[b, tokens, C*(m*p)**2] pixel blocks (each `[C, m*p, m*p]` flattened) -> [b, tokens, m*m*3*T*p*p]
    in the Qwen image processor's order (the m x m patches row-major, each `[3, T, p, p]`)."""
    b, n, f = x.shape
    m, p, t = enc.merge_size, enc.patch_size, enc.temporal_patch_size
    c = f // (m * p) ** 2
    y = x.reshape(b, n, c, m, p, m, p).permute(0, 1, 3, 5, 2, 4, 6)  # [b, n, m, m, C, p, p]
    if c == 1:
        y = y.expand(-1, -1, -1, -1, 3, -1, -1)
    y = y.unsqueeze(5).expand(-1, -1, -1, -1, -1, t, -1, -1)  # [b, n, m, m, 3, T, p, p]
    return y.reshape(b, n, m * m * 3 * t * p * p)

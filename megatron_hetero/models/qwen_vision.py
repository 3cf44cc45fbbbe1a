"""The Qwen2.5-VL vision tower from Megatron-core parts, on its module's own layout.

Input: the reference's flattened patches `[patches, in_channels * temporal_patch * patch * patch]`
(what Qwen2.5-VL's image processor emits as `pixel_values`, images of any sizes one after the other)
and `grid_thw` `[images, 3]` (frames, rows, columns of patches per image). Output: the merged tokens
`[patches / merge**2, out_hidden]` in the input's order (each image's tokens row-major over its
merge x merge blocks): transformers' `Qwen2_5_VisionTransformerPretrainedModel` output.

Built from: a Conv3d patch embedding without bias (kernel = stride = (temporal_patch, patch, patch),
replicated over TP like CLIP's), Megatron's local GPT layers (RMSNorm, attention with biases and
the 2-D rotary angles of `qwen_vision_windows.rotary_freqs` in the reference's window order, SwiGLU
MLP with biases; TP column/row parallel on the module's TP group), and the patch merger: RMSNorm,
then Megatron's MLP projector (column-, row-parallel, exact GELU) over the merge x merge blocks.
Window attention: layers not in `fullatt_block_indexes` attend within windows, the others within
whole frames: a boolean mask per kind over the one packed sequence (memory s**2: fine for the
short sequences of tests and CPU runs; GPU runs want a varlen kernel, not built).

Layout: TP, DP and PP on the module's layout (PP: the blocks split over stages; the first stage holds
the patch embedding, the last the merger; every stage computes the window order, masks and rotary
angles from `grid_thw`; the caller hands the hidden states [N, 1, h] between stages); cp 1 (refused
otherwise, with the reason).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

import torch
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import get_submodules
from megatron.core.transformer.transformer_block import TransformerBlock

from megatron_hetero.layout.spec import ModuleLayout
from megatron_hetero.models import qwen_vision_windows as win
from megatron_hetero.models.architecture import CP_REASON


@dataclasses.dataclass(frozen=True)
class QwenVisionSpec:
    """The tower's shape (Hugging Face `Qwen2_5_VLVisionConfig` field names)."""

    hidden_size: int
    depth: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    in_channels: int = 3
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    hidden_act: str = "silu"

    @classmethod
    def from_hf(cls, cfg: Any) -> "QwenVisionSpec":
        """From a `Qwen2_5_VLVisionConfig` (or its dict)."""
        d = cfg if isinstance(cfg, dict) else cfg.to_dict()
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: d[k] for k in names if k in d}
        kw["fullatt_block_indexes"] = tuple(kw.get("fullatt_block_indexes", ()))
        return cls(**kw)

    def check(self) -> None:
        if self.hidden_act != "silu":
            raise ValueError(f"Qwen2.5-VL vision tower: hidden_act {self.hidden_act!r} is not supported (silu)")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(
                f"Qwen2.5-VL vision tower: head dim {self.hidden_size}/{self.num_heads} must be a multiple of 4"
            )
        if self.window_size % (self.spatial_merge_size * self.patch_size):
            raise ValueError(
                f"Qwen2.5-VL vision tower: window_size {self.window_size} is not a multiple of "
                f"spatial_merge_size * patch_size = {self.spatial_merge_size * self.patch_size}"
            )
        bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"Qwen2.5-VL vision tower: fullatt_block_indexes {bad} outside 0..{self.depth - 1}")


def _layer_spec():
    """Megatron's local GPT layer with RMSNorm, attention taking an arbitrary boolean mask."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.arbitrary
    return spec


class QwenVisionTower(torch.nn.Module):
    """[patches, C*T*P*P] + grid_thw -> [patches / merge**2, out_hidden] (see the module docstring)."""

    def __init__(
        self, spec: QwenVisionSpec, m: ModuleLayout, pgs: ProcessGroupCollection, name: str = "vision"
    ) -> None:
        super().__init__()
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        from megatron_hetero.models.llava import transformer_config

        spec.check()
        if spec.depth % m.pp:
            raise ValueError(f"module {name}: the tower's {spec.depth} blocks do not split over pp({m.pp})")
        if m.cp != 1:
            raise ValueError(f"module {name}: {CP_REASON}, got {m.arithmetic()}")
        self.spec, self.name, self.tp_group = spec, name, pgs.tp
        self.first, self.last = pgs.pp.rank() == 0, pgs.pp.rank() == m.pp - 1
        k = (spec.temporal_patch_size, spec.patch_size, spec.patch_size)
        if self.first:
            self.patch_embed = torch.nn.Conv3d(spec.in_channels, spec.hidden_size, kernel_size=k, stride=k, bias=False)
        config = transformer_config(
            num_layers=spec.depth,
            hidden=spec.hidden_size,
            heads=spec.num_heads,
            ffn=spec.intermediate_size,
            m=m,
            normalization="RMSNorm",
            layernorm_epsilon=1e-6,
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            bias_activation_fusion=False,
            add_bias_linear=True,
            apply_rope_fusion=False,
        )
        self.blocks = TransformerBlock(config, _layer_spec(), post_layer_norm=False, pg_collection=pgs)
        self.first_layer = self.blocks.layers[0].layer_number - 1  # this stage's first block (global index)
        full = set(spec.fullatt_block_indexes)
        # the attention of this stage's blocks: True full (each image whole), False windowed; only
        # their masks are built in `forward`
        self.mask_kinds = sorted({self.first_layer + i in full for i in range(len(self.blocks.layers))})
        unit = spec.spatial_merge_size**2
        if not self.last:
            return
        self.ln_q = WrappedTorchNorm(config, spec.hidden_size, eps=1e-6)
        merger_cfg = transformer_config(
            num_layers=1,
            hidden=spec.out_hidden_size,
            heads=spec.num_heads,
            ffn=spec.hidden_size * unit,
            m=m,
            activation_func=torch.nn.functional.gelu,
            bias_activation_fusion=False,
            add_bias_linear=True,
        )
        mlp = get_submodules(get_gpt_layer_local_spec().submodules.mlp)
        self.merger = MultimodalProjector(merger_cfg, mlp, "mlp", input_size=spec.hidden_size * unit, tp_group=pgs.tp)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None
    ) -> dict:
        """Megatron's sharded state of each part (`dist_checkpointing`: the blocks' and the merger's
        TP shards as such, the patch embedding and `ln_q` replicated), as a `MegatronModule` gives."""
        from megatron.core.transformer.utils import sharded_state_dict_default

        out: dict = {}
        for name, child in self.named_children():
            out.update(
                sharded_state_dict_default(child, f"{prefix}{name}.", sharded_offsets, metadata, tp_group=self.tp_group)
            )
        return out

    def stage_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This pipeline stage's part of a whole-tower state (`convert.hf_qwen_vision.hf_to_tower`'s
        names, blocks by global index) under this module's names (blocks by local index)."""
        mine = {k for k in self.state_dict() if not k.endswith("_extra_state")}
        out = {}
        for k, v in state.items():
            mt = re.match(r"blocks\.layers\.(\d+)\.(.*)", k)
            local = f"blocks.layers.{int(mt.group(1)) - self.first_layer}.{mt.group(2)}" if mt else k
            if local in mine:
                out[local] = v
        return out

    def forward(
        self, patches: Optional[torch.Tensor], grid_thw: torch.Tensor, hidden: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """First stage: `patches` [N, C*T*P*P]; a later stage: `hidden` [N, 1, h] from the stage before,
        in window order (`patches` unused). `grid_thw` is index arithmetic: keep it on the CPU (read
        there without a device sync; the angles and masks built from it move to the hidden states'
        device). Returns [N, 1, h] in window order on a stage before the
        last, the merged tokens [N / merge**2, out_hidden] in the input's order on the last."""
        s = self.spec
        merge, unit = s.spatial_merge_size, s.spatial_merge_size**2
        win.check_grid(grid_thw, merge)
        n = int((grid_thw[:, 0] * grid_thw[:, 1] * grid_thw[:, 2]).sum())
        order, windows = win.window_index(grid_thw, merge, s.window_size // merge // s.patch_size)
        if self.first:
            width = s.in_channels * s.temporal_patch_size * s.patch_size**2
            if patches is None or patches.dim() != 2 or patches.shape != (n, width):
                raise ValueError(
                    f"patches must be [{n}, {width}] for grid_thw {grid_thw.tolist()}, "
                    f"got {None if patches is None else list(patches.shape)}"
                )
            x = patches.view(-1, s.in_channels, s.temporal_patch_size, s.patch_size, s.patch_size)
            x = self.patch_embed(x.to(self.patch_embed.weight.dtype)).view(n, -1)
            x = x.view(n // unit, unit, -1)[order].reshape(n, 1, -1)  # [s, b=1, h], window order
        else:
            if hidden is None or hidden.shape[0] != n:
                raise ValueError(f"module {self.name}: a later tower stage needs the hidden states [{n}, 1, h]")
            x = hidden
        freqs = win.rotary_freqs(grid_thw, merge, s.hidden_size // s.num_heads).to(x.device)
        freqs = freqs.view(n // unit, unit, -1)[order].reshape(n, -1)
        rope = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
        masks = {
            kind: win.segment_mask(win.image_lengths(grid_thw) if kind else windows).to(x.device)
            for kind in self.mask_kinds
        }
        full = set(s.fullatt_block_indexes)
        for i, layer in enumerate(self.blocks.layers):
            x, _ = layer(x, attention_mask=masks[self.first_layer + i in full], rotary_pos_emb=rope)
        if not self.last:
            return x
        merged = self.ln_q(x).reshape(n // unit, 1, -1)
        out = self.merger(merged).reshape(n // unit, -1)
        return out[torch.argsort(order)]

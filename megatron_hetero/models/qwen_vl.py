"""Qwen2.5-VL's language model on Megatron-core: a Qwen2.5 decoder (`GPTModel`: RMSNorm, SwiGLU, QKV
bias, grouped-query attention) with Megatron's M-RoPE (`position_embedding_type="mrope"`, the three
`mrope_section` channel groups of temporal, height and width ids from `models.qwen_mrope`), and the
whole forward of `Qwen2_5_VLForConditionalGeneration` with `models.qwen_vision.QwenVisionTower`:
text embeddings, the tower's merged tokens written at the image tokens (batch-major order, as
transformers' `masked_scatter`), the decoder on those with the M-RoPE ids.

Layout: the language model's TP on its module's TP group, PP (each stage computes the M-RoPE ids
from the tokens) and CP (the decoder input and labels cut to the CP rank's load-balanced chunks, the
ids whole: Megatron's M-RoPE cuts its angles to the same chunks; outputs are the rank's chunks). Handing the stages' tensors over is
the caller's (the runner's schedules are not wired to this model yet).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_hetero.layout.spec import ModuleLayout
from megatron_hetero.models.qwen_mrope import rope_index
from megatron_hetero.models.hf_names import language_to_ours


@dataclasses.dataclass(frozen=True)
class QwenTextSpec:
    """The language model's shape (Hugging Face `Qwen2_5_VLTextConfig` field names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    mrope_section: tuple[int, int, int]
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 128000

    @classmethod
    def from_hf(cls, cfg: Any) -> "QwenTextSpec":
        d = cfg if isinstance(cfg, dict) else cfg.to_dict()
        scaling = d.get("rope_scaling") or {}
        if "mrope_section" not in scaling:
            raise ValueError("Qwen2.5-VL text config: rope_scaling has no mrope_section")
        names = {f.name for f in dataclasses.fields(cls)} - {"mrope_section"}
        return cls(mrope_section=tuple(scaling["mrope_section"]), **{k: d[k] for k in names if k in d})

    def names_view(self) -> SimpleNamespace:
        """What `models.hf_names.language_to_ours` reads of a spec."""
        return SimpleNamespace(
            num_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_key_value_heads,
            kv_channels=None,
            hidden_size=self.hidden_size,
            untie_embeddings_and_output_weights=not self.tie_word_embeddings,
            add_qkv_bias=True,
        )


def build_language(spec: QwenTextSpec, m: ModuleLayout, pgs: ProcessGroupCollection, seq_length: int) -> GPTModel:
    """The Qwen2.5 decoder with M-RoPE on the module's layout (TP, PP: this rank's stage, CP)."""
    from megatron_hetero.models.layer_specs import language_layer_spec
    from megatron_hetero.models.llava import transformer_config

    if m.cp > 1 and seq_length % (2 * m.cp):
        raise ValueError(f"module {m.name}: sequence length {seq_length} is not divisible by 2*cp = {2 * m.cp}")
    if spec.num_hidden_layers % m.pp:
        raise ValueError(f"module {m.name}: {spec.num_hidden_layers} layers do not split over pp({m.pp})")
    head_dim = spec.hidden_size // spec.num_attention_heads
    if 2 * sum(spec.mrope_section) != head_dim:
        raise ValueError(f"mrope_section {list(spec.mrope_section)} must sum to head_dim / 2 = {head_dim // 2}")
    config = transformer_config(
        num_layers=spec.num_hidden_layers,
        hidden=spec.hidden_size,
        heads=spec.num_attention_heads,
        ffn=spec.intermediate_size,
        m=m,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        bias_activation_fusion=False,
        add_bias_linear=False,
        add_qkv_bias=True,
        num_query_groups=spec.num_key_value_heads,
        apply_rope_fusion=False,
        mrope_section=list(spec.mrope_section),
    )
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=language_layer_spec("local", None, "RMSNorm"),
        vocab_size=spec.vocab_size,
        max_sequence_length=seq_length,
        pre_process=pgs.pp.rank() == 0,
        post_process=pgs.pp.rank() == m.pp - 1,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="mrope",
        rotary_base=int(spec.rope_theta),
        pg_collection=pgs,
    )
    # Megatron builds its M-RoPE with the global CP group (`parallel_state`); the module's own CP group
    # cuts the angles to this rank's chunks
    gpt.rotary_pos_emb.cp_group = pgs.cp
    return gpt


def language_from_hf(get: Callable[[str], torch.Tensor], spec: QwenTextSpec) -> dict[str, torch.Tensor]:
    """`GPTModel` state (whole tensors) of a `Qwen2_5_VLForConditionalGeneration` state dict read by
    `get` (names `model.language_model.*`, `lm_head.weight`)."""

    def legacy(name: str) -> torch.Tensor:
        return get(name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name)

    return {k.removeprefix("gpt."): v for k, v in language_to_ours(legacy, spec.names_view()).items()}


class QwenVLLanguage(torch.nn.Module):
    """The language side on its own module: tokens [b, s] + the tower's merged tokens [n, h] (from any
    layout: the same tensor on every rank of the language module) + grid_thw -> logits [b, s, vocab]
    (this TP rank's vocabulary columns), or the per-token loss [b, s] with `labels`."""

    def __init__(self, language: GPTModel, image_token: int, vision_start: int, merge: int) -> None:
        super().__init__()
        self.language, self.merge = language, merge
        self.image_token, self.vision_start = image_token, vision_start

    def position_ids(self, tokens: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """[3, b, s] M-RoPE ids (`models.qwen_mrope.rope_index`)."""
        return rope_index(
            tokens, grid_thw, image_token=self.image_token, vision_start=self.vision_start, merge=self.merge
        )

    def forward(
        self,
        tokens: torch.Tensor,
        images: Optional[torch.Tensor],
        grid_thw: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        hidden: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """First stage: `images` placed into the text embeddings; a later pipeline stage: `hidden`
        [s, b, h] from the stage before (`images` unused). Every stage computes the same M-RoPE ids
        from the tokens (Megatron's rotary embedding runs per stage). Returns the stage's output
        [s, b, h], or on the last stage the logits / the per-token loss."""
        pos = self.position_ids(tokens, grid_thw).to(tokens.device)
        cp = self.language.config.context_parallel_size
        if cp > 1 and labels is not None:  # this CP rank's load-balanced chunks (the ids stay whole:
            labels = labels[:, self._cp_positions(tokens.shape[1], tokens.device)]  # Megatron cuts the angles)
        if not self.language.pre_process:
            if hidden is None:
                raise ValueError("a later pipeline stage needs the hidden states of the stage before")
            self.language.set_input_tensor(hidden)
            return self.language(None, pos, None, labels=labels)
        assert images is not None
        emb = self.language.embedding(input_ids=tokens, position_ids=None).transpose(0, 1)  # [b, s, h]
        mask = tokens == self.image_token
        if int(mask.sum()) != images.shape[0]:
            raise ValueError(f"the text holds {int(mask.sum())} image tokens, the tower made {images.shape[0]}")
        emb = emb.masked_scatter(mask.unsqueeze(-1), images.to(emb.dtype))
        if cp > 1:
            emb = emb[:, self._cp_positions(tokens.shape[1], tokens.device)]
        # GPTModel: logits [b, s, vocab], or the per-token loss [b, s] with labels
        return self.language(None, pos, None, decoder_input=emb.transpose(0, 1).contiguous(), labels=labels)

    def _cp_positions(self, s: int, device) -> torch.Tensor:
        from megatron_hetero.models.cp_attention import cp_chunk_positions

        group = self.language.pg_collection.cp
        return cp_chunk_positions(s, group.rank(), group.size(), device=device)


class QwenVL(torch.nn.Module):
    """Both modules on the same ranks: the tower, then `QwenVLLanguage` on its merged tokens."""

    def __init__(self, tower: torch.nn.Module, language: GPTModel, image_token: int, vision_start: int) -> None:
        super().__init__()
        self.tower = tower
        self.lm = QwenVLLanguage(language, image_token, vision_start, tower.spec.spatial_merge_size)

    def position_ids(self, tokens: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        return self.lm.position_ids(tokens, grid_thw)

    def forward(
        self, tokens: torch.Tensor, patches: torch.Tensor, grid_thw: torch.Tensor, labels: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        return self.lm(tokens, self.tower(patches, grid_thw), grid_thw, labels)

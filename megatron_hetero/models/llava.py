"""A LLaVA-style model assembled from Megatron-core parts, one module per layout module, from its
description (`config.model.LlavaSpec`: sizes and architecture; this file derives the Megatron
TransformerConfig fields, the dtype and the synthetic data's shape from it).

- Encoder module (`vision`, `audio`, ...): patch embedding (a replicated linear map of the input
  features) + learned positions, a Megatron `TransformerBlock` (local spec, bidirectional), and a
  Megatron `MultimodalProjector` (MLP) to the language model's hidden size, all on the encoder's own
  grid. The projector belongs to its encoder's module and always trains: `frozen` on an encoder
  freezes its trunk (LLaVA stage 1 and 2 semantics). With PP > 1 the patch embedding sits on the
  first stage and the projector on the last.
- Language module (`language`, or pipeline segments `language_a`, `language_b`, ... with `layers`):
  a Megatron `GPTModel` (local spec, learned absolute positions, untied output layer) over its
  layers (with `hybrid_layer_pattern`: Megatron's `HybridModel` over the pattern's layers, one
  module, `models.hybrid_lm`), with the context-parallel attention of `compat` so CP works without Transformer Engine.
  The first segment's first stage builds its input: text embeddings of the whole sequence, cut to
  this CP rank's load-balanced chunks, with the encoders' tokens put at their placeholder positions.
- Sequence parallelism (`sequence_parallel`, train's `--sequence-parallel`): a language module with
  tp > 1 is built with Megatron's `sequence_parallel=True`, so between its layers (and between its
  pipeline stages) each TP rank holds `[s_local/tp, b, h]` (s_local: this CP rank's positions). The
  first stage's input is assembled whole (text embeddings, encoder tokens at their placeholders) and
  then scattered along the sequence over the module's TP group (`to_sequence_shards`, Megatron's
  `scatter_to_sequence_parallel_region`; its backward all-gathers the gradient, so every TP replica
  hands the full gradient back to the encoders' boundary); hidden states that leave the module (a
  segment's end, the output heads' span) are all-gathered over TP first (`from_sequence_shards`;
  backward: each TP rank keeps its own chunk of the replicated gradient). So every tensor between
  modules stays full-sequence and TP-replicated. Encoders, projectors and output heads keep SP off
  (Megatron-LM's LLaVA does the same for the vision model and its projector).

- Mixture of experts: with `num_experts` the language model's MLPs are Megatron MoE layers (local
  spec, `SequentialMLP` experts, top-k router with the load-balancing auxiliary loss, alltoall token
  dispatcher) on the module's expert groups (`ep`, `expt_tp`, `expt_dp` of its
  `ProcessGroupCollection`). Expert k of layer l is initialised from its *global* expert index, so
  every EP sharding starts from the same weights.
- Output modules (`generator`, ...: modules after the language model): a Megatron MLP (column- then
  row-parallel on the module's TP group) from the language model's final hidden states at the
  positions [offset, offset + tokens) to an `out_dim` representation, with its own loss (squared
  error against a deterministic per-sample target, summed; normalised like the language loss).

Tensors between modules are `[batch, tokens, hidden]` (the boundary layout); inside modules
Megatron's `[seq, batch, hidden]`.
"""

from __future__ import annotations

import re
from typing import Optional

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.spec_utils import get_submodules
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hetero.layout.spec import ModuleLayout
from megatron_hetero.models.cp_attention import cp_chunk_positions
from megatron_hetero.models.image_tokens import gather_cp_chunks, place_by_mask
from megatron_hetero.models.init import deterministic_init
from megatron_hetero.models.layer_specs import encoder_layer_spec, language_layer_spec
from megatron_hetero.models.llava_checks import check_encoder_cp
from megatron_hetero.data.samples import DataConfig, EncoderInput
from megatron_hetero.config.model import EncoderSpec, LlavaSpec, OutputSpec, segment_layers
from megatron_hetero.models.qwen_positions import mrope_ids


def dtype_of(spec: LlavaSpec) -> torch.dtype:
    """The dtype of parameters and of every tensor between stages and modules."""
    return torch.bfloat16 if spec.bf16 else torch.float16 if spec.fp16 else torch.float32


def moe_kwargs(spec: LlavaSpec, m: ModuleLayout) -> dict:
    """The TransformerConfig fields of the language model's MoE layers on layout `m` ({} if dense)."""
    if not spec.num_experts:
        return {}
    return dict(
        num_moe_experts=spec.num_experts,
        moe_router_topk=spec.moe_router_topk,
        moe_aux_loss_coeff=spec.moe_aux_loss_coeff,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_router_load_balancing_type="aux_loss" if spec.moe_aux_loss_coeff > 0 else "none",
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        add_bias_linear=False,
        expert_model_parallel_size=m.ep,
        expert_tensor_parallel_size=m.expt_tp,
    )


def language_config_kwargs(spec: LlavaSpec) -> dict:
    """The TransformerConfig fields of the language model's architecture."""
    import torch.nn.functional as F

    return dict(
        normalization=spec.normalization,
        layernorm_epsilon=spec.norm_epsilon,
        gated_linear_unit=spec.swiglu,
        activation_func=F.silu if spec.swiglu else F.gelu,
        bias_activation_fusion=False,
        add_bias_linear=spec.add_bias_linear,
        add_qkv_bias=spec.add_qkv_bias,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.kv_channels,
        apply_rope_fusion=False,
        mrope_section=list(spec.mrope_section) if spec.mrope_section else None,
    )


def data_config(spec: LlavaSpec) -> DataConfig:
    """The synthetic data's shape of the model: its text, and each encoder's tokens and features."""
    return DataConfig(
        seq_length=spec.seq_length,
        vocab_size=spec.vocab_size,
        encoders={n: EncoderInput(e.tokens, e.feature_dim, e.offset, e.max_tiles) for n, e in spec.encoders.items()},
        seed=spec.seed,
        documents=spec.documents,
        pack_documents=spec.pack_documents,
    )


def transformer_config(
    *,
    num_layers: int,
    hidden: int,
    heads: int,
    ffn: Optional[int],
    m: ModuleLayout,
    dtype: torch.dtype = torch.float32,
    recompute: bool = False,
    **extra,
) -> TransformerConfig:
    """Megatron config of one module on its own layout (fp32, no dropout, per-token loss: gradients
    are summed, not averaged, over DP x CP because the loss is already normalised globally);
    `recompute`: a transformer block's config, which takes the module's activation recompute
    (`m.recompute`, Megatron's recompute fields) if it has one."""
    if recompute and m.recompute is not None:
        extra = {**m.recompute.config_kwargs(), **extra}
    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=ffn,
        tensor_model_parallel_size=m.tp,
        context_parallel_size=m.cp,
        pipeline_model_parallel_size=m.pp,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        calculate_per_token_loss=True,
        **extra,
    )


_EXPERT = re.compile(r"(^|\.)experts\.local_experts\.(\d+)\.")


def _is_expert(name: str) -> bool:
    return _EXPERT.search(name) is not None


def global_expert_name(name: str, first_expert: int) -> str:
    """`...experts.local_experts.3.x` with this EP rank's first global expert index added."""
    return _EXPERT.sub(
        lambda mt: f"{mt.group(1)}experts.local_experts.{int(mt.group(2)) + first_expert}.", name, count=1
    )


def build_projector(
    enc: "EncoderSpec", llm_hidden: int, m: ModuleLayout, pgs: ProcessGroupCollection
) -> MultimodalProjector:
    """An encoder's projector: Megatron's MLP projector [.., enc.hidden_size] -> [.., llm_hidden] on the
    encoder module's TP group (column- then row-parallel)."""
    config = transformer_config(num_layers=1, hidden=llm_hidden, heads=enc.num_attention_heads, ffn=llm_hidden, m=m)
    mlp = get_submodules(get_gpt_layer_local_spec().submodules.mlp)
    return MultimodalProjector(config, mlp, "mlp", input_size=enc.hidden_size, tp_group=pgs.tp)


def freeze_trunk(module: torch.nn.Module) -> None:
    """A frozen encoder: every parameter but its projector's stops taking gradients."""
    for n, p in module.named_parameters():
        if not n.startswith("projector."):
            p.requires_grad_(False)


class EncoderModule(torch.nn.Module):
    """One encoder stage: [b, n, feature] -> (trunk) -> [b, n, llm_hidden] on the last stage."""

    def __init__(
        self,
        name: str,
        enc: EncoderSpec,
        llm_hidden: int,
        m: ModuleLayout,
        pgs: ProcessGroupCollection,
        seed: int,
        impl: str = "local",
    ) -> None:
        """`impl`: --transformer-impl (`models.layer_specs.encoder_layer_spec`)."""
        super().__init__()
        check_encoder_cp(name, enc, m, impl)
        if enc.num_layers % m.pp:
            raise ValueError(f"module {name}: {enc.num_layers} encoder layers do not split over pp({m.pp})")
        self.name = name
        self.frozen = m.frozen
        self.pp_rank, self.pp_size = pgs.pp.rank(), m.pp
        self.first, self.last = self.pp_rank == 0, self.pp_rank == m.pp - 1
        self.cp_rank, self.cp_size, self.cp_group = pgs.cp.rank(), m.cp, pgs.cp
        config = transformer_config(
            num_layers=enc.num_layers,
            hidden=enc.hidden_size,
            heads=enc.num_attention_heads,
            ffn=None,
            m=m,
            recompute=True,
        )
        layer_spec = encoder_layer_spec(impl)
        if self.first:
            self.patch_embed = torch.nn.Linear(enc.feature_dim, enc.hidden_size)
            self.position = torch.nn.Parameter(torch.empty(enc.tokens, enc.hidden_size))
        self.trunk = TransformerBlock(
            config,
            layer_spec,
            post_layer_norm=self.last,
            pre_process=self.first,
            post_process=self.last,
            pg_collection=pgs,
        )
        if self.last:
            self.projector = build_projector(enc, llm_hidden, m, pgs)
        offset = self.trunk.layers[0].layer_number - 1 if len(self.trunk.layers) else 0
        deterministic_init(
            self.named_parameters(),
            seed=seed,
            module=name,
            tp_rank=pgs.tp.rank(),
            tp_size=pgs.tp.size(),
            layer_offset=offset,
        )
        if self.frozen:
            freeze_trunk(self)

    def trainable(self) -> bool:
        return any(p.requires_grad for p in self.parameters())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """First stage: features [b, n, f]; later stages: hidden [n, b, h]. Returns [n, b, h] or, on
        the last stage, the projected tokens [b, n, llm_hidden]. With cp > 1 (one stage) each CP rank
        holds its load-balanced chunks of the n tokens, n/cp of them, and the CP attention gathers
        K and V over the CP group (bidirectional)."""
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.frozen):
            if self.first:
                x = self.patch_embed(x) + self.position  # [b, n, h]
                if self.cp_size > 1:  # this CP rank's load-balanced chunks of the n tokens
                    x = x.index_select(1, cp_chunk_positions(x.shape[1], self.cp_rank, self.cp_size).to(x.device))
                x = x.transpose(0, 1).contiguous()
            else:
                self.trunk.set_input_tensor(x)  # a non-first TransformerBlock reads its input from here
            x = self.trunk(x, attention_mask=None)
        if not self.last:
            return x
        if self.frozen:
            x = x.detach()
        return self.projector(x).transpose(0, 1).contiguous()


class LanguageModule(torch.nn.Module):
    """One language-model segment stage (a Megatron GPTModel over the segment's layers)."""

    def __init__(
        self,
        name: str,
        spec: LlavaSpec,
        m: ModuleLayout,
        pgs: ProcessGroupCollection,
        first_segment: bool,
        last_segment: bool,
        last_segment_feeds_outputs: bool = False,
        sequence_parallel: bool = False,
    ) -> None:
        """`sequence_parallel`: the job's --sequence-parallel (on only where tp > 1, as in Megatron)."""
        super().__init__()
        layers = segment_layers(m, spec)
        n_layers = layers.size
        if n_layers % m.pp and "|" not in (spec.hybrid_layer_pattern or ""):
            raise ValueError(f"module {name}: {n_layers} layers do not split over pp({m.pp})")
        if spec.seq_length % (2 * m.cp) and m.cp > 1:
            raise ValueError(f"module {name}: --seq-length {spec.seq_length} is not divisible by 2*cp = {2 * m.cp}")
        self.name, self.spec, self.frozen = name, spec, m.frozen
        self.cp_rank, self.cp_size, self.cp_group = pgs.cp.rank(), m.cp, pgs.cp
        pp_rank = pgs.pp.rank()
        self.first_stage = first_segment and pp_rank == 0
        self.last_stage = last_segment and pp_rank == m.pp - 1
        arch = language_config_kwargs(spec)
        arch.update(moe_kwargs(spec, m))
        config = transformer_config(
            num_layers=n_layers,
            hidden=spec.hidden_size,
            heads=spec.num_attention_heads,
            ffn=spec.ffn_hidden_size,
            m=m,
            recompute=True,
            sequence_parallel=sequence_parallel and m.tp > 1,
            **arch,
        )
        self.config = config
        self.tp_group = pgs.tp
        layer_spec = language_layer_spec(spec.transformer_impl, spec.num_experts, spec.normalization)
        if spec.hybrid_layer_pattern is not None:  # Megatron's HybridModel (`models.hybrid_lm`)
            from megatron_hetero.models.hybrid_lm import build_hybrid_model

            self.gpt = build_hybrid_model(config, spec, pgs, self.first_stage, self.last_stage)
        else:
            self.gpt = GPTModel(
                config=config,
                transformer_layer_spec=layer_spec,
                vocab_size=spec.vocab_size,
                max_sequence_length=spec.seq_length,
                pre_process=self.first_stage,
                post_process=self.last_stage,
                share_embeddings_and_output_weights=not spec.untie_embeddings_and_output_weights,
                position_embedding_type=spec.position_embedding_type,
                rotary_base=spec.rotary_base,
                rope_scaling=spec.rope_scaling,
                rope_scaling_factor=spec.rope_scaling_factor,
                # the first stage scatters its assembled input itself (`embed`), as Megatron's LLaVA does
                scatter_embedding_sequence_parallel=False,
                pg_collection=pgs,
            )
        self.model_type = self.gpt.model_type  # what Megatron's schedules look up on the wrapped model
        # M-RoPE (`models.qwen_positions.mrope_ids`): every stage rotates by the same fixed ids [3, 1, S];
        # Megatron builds its M-RoPE with the global CP group, the module's own cuts the angles
        self.mrope_ids: Optional[torch.Tensor] = None
        if spec.position_embedding_type == "mrope":
            self.mrope_ids = mrope_ids(spec, spec.seq_length)  # on the CPU, also under dryrun's meta device
            self.gpt.rotary_pos_emb.cp_group = pgs.cp
        local_offset = self.gpt.decoder.layers[0].layer_number - 1 if len(self.gpt.decoder.layers) else 0
        dense = [(n, p) for n, p in self.named_parameters() if not _is_expert(n)]
        deterministic_init(
            dense,
            seed=spec.seed,
            module="language",
            tp_rank=pgs.tp.rank(),
            tp_size=pgs.tp.size(),
            layer_offset=layers.start + local_offset,
        )
        experts = [(n, p) for n, p in self.named_parameters() if _is_expert(n)]
        if experts:  # global expert index: local index + ep_rank * experts per EP rank
            local = spec.num_experts // pgs.ep.size()
            experts = [(global_expert_name(n, pgs.ep.rank() * local), p) for n, p in experts]
            deterministic_init(
                experts,
                seed=spec.seed,
                module="language",
                tp_rank=pgs.expt_tp.rank(),
                tp_size=pgs.expt_tp.size(),
                layer_offset=layers.start + local_offset,
            )
        self.last_hidden: Optional[torch.Tensor] = None  # the decoder's output of the last forward
        if self.last_stage and last_segment_feeds_outputs:
            self.gpt.decoder.register_forward_hook(self._keep_hidden)
        if self.frozen:
            for p in self.parameters():
                p.requires_grad_(False)

    def _keep_hidden(self, module, args, output) -> None:
        # [s_local, b, h] after the final layer norm (gathered over TP under SP); carries the graph
        self.last_hidden = self.from_sequence_shards(output)

    @property
    def sequence_parallel(self) -> bool:
        return bool(self.config.sequence_parallel)

    def to_sequence_shards(self, x: torch.Tensor) -> torch.Tensor:
        """[s_local, b, h], the same on every TP rank -> this TP rank's [s_local/tp, b, h] under sequence
        parallelism (no communication forward; backward all-gathers the gradient over TP); x otherwise."""
        return scatter_to_sequence_parallel_region(x, group=self.tp_group) if self.sequence_parallel else x

    def from_sequence_shards(self, x: torch.Tensor) -> torch.Tensor:
        """This TP rank's [s_local/tp, b, h] -> [s_local, b, h] on every TP rank under sequence parallelism
        (all-gather over TP forward; backward: the gradient, the same on every TP rank, cut to this
        rank's chunk, no communication); x otherwise."""
        if not self.sequence_parallel:
            return x
        return gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=self.tp_group)

    def trainable(self) -> bool:
        return any(p.requires_grad for p in self.parameters())

    def cp_positions(self) -> torch.Tensor:
        """Text positions this CP rank holds (Megatron's load-balanced chunks c and 2cp-1-c)."""
        return cp_chunk_positions(self.spec.seq_length, self.cp_rank, self.cp_size)

    def embed(
        self,
        tokens: torch.Tensor,
        encoder_tokens: dict[str, torch.Tensor],
        image_mask: Optional[dict[str, torch.Tensor]] = None,
        position_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Decoder input [s_local, b, h]: text embeddings at this CP rank's positions, with each
        encoder's tokens ([b, n_local, h], the boundary's output for this CP rank) at its placeholders;
        under sequence parallelism then this TP rank's [s_local/tp, b, h] of it (`to_sequence_shards`).
        A variable encoder's tokens (`image_mask`: its placeholders [b, S]) go where its mask is set
        (`models.image_tokens.place_by_mask`, after `gather_cp_chunks` with cp > 1). `position_ids`
        [b, S]: the text positions (packed documents: restarting after each EOD); default 0..S-1."""
        b, s = tokens.shape
        pos = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, -1) if position_ids is None else position_ids
        emb = self.gpt.embedding(input_ids=tokens, position_ids=pos)  # [s, b, h]
        for name in sorted(image_mask or {}):
            got = encoder_tokens[name]
            if self.cp_size > 1:
                got = gather_cp_chunks(got, self.cp_group, self.cp_size)
            emb = place_by_mask(emb, got, image_mask[name].to(tokens.device), f"module {self.name}: encoder {name}")
        idx = self.cp_positions().to(tokens.device)
        local = emb.index_select(0, idx)
        for name, enc in self.spec.encoders.items():
            if enc.max_tiles:
                continue
            where = torch.nonzero((idx >= enc.offset) & (idx < enc.offset + enc.tokens)).flatten()
            got = encoder_tokens[name]
            if where.numel() == 0 and got.numel() == 0:  # this CP rank's chunks hold none of its placeholders
                continue
            if got.dim() != 3 or got.shape[1] != where.numel():
                raise ValueError(
                    f"module {self.name}: encoder {name} delivered {tuple(got.shape)} to CP rank "
                    f"{self.cp_rank}, its chunks hold {where.numel()} placeholders"
                )
            local = local.index_copy(0, where, got.transpose(0, 1).to(local.dtype))
        return self.to_sequence_shards(local)

    def set_input_tensor(self, tensor) -> None:
        """Megatron's pipeline schedules hand a non-first stage its input here."""
        self.gpt.set_input_tensor(tensor)

    def set_mrope_ids(self, ids: torch.Tensor) -> None:
        """The next forward's M-RoPE ids [3, b, S] (native-resolution images: each row its own image
        size, `models.qwen_positions.batch_mrope_ids`), set by the runner before each call."""
        self.mrope_ids = ids

    def forward(
        self,
        hidden: Optional[torch.Tensor],
        labels: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """hidden: [s_local, b, h] decoder input on the first stage (None elsewhere); returns [s_local, b, h], or the per-token loss
        [b, s_local] on the last stage (labels at this CP rank's positions). Under sequence parallelism
        the hidden states are this TP rank's [s_local/tp, b, h] (the loss is over all of s_local).
        `attention_mask` [b, 1, S, S] bool (True: masked) over the whole sequence, e.g. packed
        documents' block-diagonal causal mask (None: causal); the CP attention takes its own rows."""
        pos = None if self.mrope_ids is None else self.mrope_ids.to(self.gpt.rotary_pos_emb.inv_freq.device)
        return self.gpt(None, pos, attention_mask, decoder_input=hidden, labels=labels)


class OutputModule(torch.nn.Module):
    """An output head on its own layout: [b, tokens, llm_hidden] -> MLP (Megatron's column- then
    row-parallel linear on the module's TP group) -> [b, tokens, out_dim]."""

    def __init__(
        self, name: str, out: OutputSpec, llm_hidden: int, m: ModuleLayout, pgs: ProcessGroupCollection, seed: int
    ) -> None:
        super().__init__()
        self.name, self.spec, self.frozen = name, out, m.frozen
        config = transformer_config(
            num_layers=1, hidden=out.out_dim, heads=m.tp, ffn=out.hidden_size, m=m
        )  # heads unused
        self.config = config
        mlp = get_submodules(get_gpt_layer_local_spec().submodules.mlp)
        self.head = MultimodalProjector(config, mlp, "mlp", input_size=llm_hidden, tp_group=pgs.tp)
        deterministic_init(
            self.named_parameters(), seed=seed, module=name, tp_rank=pgs.tp.rank(), tp_size=pgs.tp.size()
        )
        if self.frozen:
            for p in self.parameters():
                p.requires_grad_(False)

    def trainable(self) -> bool:
        return any(p.requires_grad for p in self.parameters())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)

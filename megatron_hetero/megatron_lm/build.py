"""Megatron's own VLM parts, one module at a time, from Megatron's own arguments.

`pretrain_vlm.model_provider` builds one `LLaVAModel` on Megatron's global parallel state. Here the
same `LLaVAModel` class is built twice with its encoder/decoder split (`add_encoder`/`add_decoder`,
as Megatron's own pipeline split of LLaVA does), each on its module's `ProcessGroupCollection`:
  * `vision`: `add_encoder=True, add_decoder=False`: CLIP ViT + MLP projector (returns the image
    embeddings `[img_seq, b, h_language]`);
  * `language`: `add_encoder=False, add_decoder=True` with pre/post-process by the module's pipeline
    stage: the GPT language model, whose first stage takes the image embeddings via
    `set_input_tensor` and puts them at the image token, as the whole model does.
The configurations follow `model_provider` (same arguments, same overrides: vision CP 1 and PP 1,
projector CP 1, `vision_model_type` clip, ...); only the parallel degrees come from the layout.
Parameter names are those of the whole model (`vision_model.*`, `vision_projection.*`,
`language_model.*`), so checkpoints and reference weights map one to one.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

import torch

from megatron_hetero.compat.device import get_device
from megatron_hetero.layout.spec import ModuleLayout
from megatron_hetero.megatron_lm.precision import to_model_dtype

VISION_MODEL_TYPE = "clip"


def num_image_embeddings(args: Any) -> int:
    from megatron.core.models.vision.clip_vit_model import get_num_image_embeddings

    return get_num_image_embeddings(
        args.img_h,
        args.img_w,
        args.patch_dim,
        VISION_MODEL_TYPE,
        args.disable_vision_class_token,
        class_token_len=1,
        pixel_shuffle=False,
        use_tile_tags=False,
    )


def vlm_sizes(args: Any) -> None:
    """What `model_provider` sets on `args` before building (idempotent): the text length of the data
    (`dataloader_seq_length`), the vision sequence (`seq_length`, `encoder_seq_length`), the language
    sequence (`decoder_seq_length` = text + image tokens; no padding: CP 1 and no SP with a layout)."""
    n_img = num_image_embeddings(args)
    if args.dataloader_seq_length is None:
        args.dataloader_seq_length = args.seq_length
    args.seq_length = args.encoder_seq_length = n_img
    args.decoder_seq_length = args.dataloader_seq_length + n_img
    args.max_position_embeddings = max(args.max_position_embeddings, args.decoder_seq_length)


def module_config(args: Any, m: ModuleLayout, num_layers: int):
    """Megatron's `core_transformer_config_from_args(args)` on module `m`'s degrees with `num_layers`
    layers (the module's, or its segment's, share of the model)."""
    from megatron.training.arguments import core_transformer_config_from_args

    cfg = core_transformer_config_from_args(args)
    cfg.tensor_model_parallel_size = m.tp
    cfg.pipeline_model_parallel_size = m.pp
    cfg.context_parallel_size = m.cp
    cfg.expert_model_parallel_size = m.ep
    cfg.expert_tensor_parallel_size = m.expt_tp
    cfg.num_layers = num_layers
    # --decoder-first/last-pipeline-num-layers: the module's own pipeline (the driver moved them off
    # Megatron's arguments; `driver.check_uneven_pipeline` allows them on the one language module)
    for attr, field in (
        ("hetero_decoder_first_pipeline_num_layers", "num_layers_in_first_pipeline_stage"),
        ("hetero_decoder_last_pipeline_num_layers", "num_layers_in_last_pipeline_stage"),
    ):
        setattr(cfg, field, getattr(args, attr, None) if m.pp > 1 else None)
    # --sequence-parallel: Megatron's SP in the modules with tp > 1 (as Megatron ignores it at tp 1)
    cfg.sequence_parallel = bool(getattr(args, "hetero_sequence_parallel", False)) and m.tp > 1
    # The schedules normalise the loss per token over the global batch and sum gradients over DP.
    cfg.calculate_per_token_loss = True
    return cfg


def _configs(args: Any, m: ModuleLayout):
    """(language, vision, projector) configs as `model_provider` derives them, on module `m`'s degrees."""
    lang = module_config(args, m, args.decoder_num_layers if args.decoder_num_layers is not None else args.num_layers)
    vision = deepcopy(lang)
    vision.num_layers = args.encoder_num_layers
    vision.first_pipeline_num_layers = None
    vision.last_pipeline_num_layers = None
    vision.num_layers_in_first_pipeline_stage = None  # one stage (the language module's split is its own)
    vision.num_layers_in_last_pipeline_stage = None
    vision.vision_model_type = VISION_MODEL_TYPE
    vision.context_parallel_size = 1
    vision.sequence_parallel = False
    vision.tp_comm_overlap = False
    vision.pipeline_model_parallel_size = 1
    proj = deepcopy(lang)
    proj.context_parallel_size = 1
    proj.sequence_parallel = False
    proj.tp_comm_overlap = False
    proj.pipeline_model_parallel_size = 1
    proj.num_layers_in_first_pipeline_stage = None
    proj.num_layers_in_last_pipeline_stage = None
    return lang, vision, proj


def _specs(args: Any):
    from megatron.core.models.multimodal.llava_spec import (
        decoder_model_with_local_default_spec,
        decoder_model_with_transformer_engine_default_spec,
    )
    from megatron.core.models.vision.vit_layer_specs import (
        get_vit_layer_with_local_spec,
        get_vit_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.spec_utils import import_module

    if args.spec is not None:
        lang = import_module(args.spec)
    elif args.transformer_impl == "transformer_engine":
        lang = decoder_model_with_transformer_engine_default_spec(args.num_experts, args.moe_grouped_gemm)
    else:
        lang = decoder_model_with_local_default_spec(args.num_experts, args.moe_grouped_gemm)
    vit = (
        get_vit_layer_with_transformer_engine_spec()
        if args.transformer_impl == "transformer_engine"
        else get_vit_layer_with_local_spec()
    )
    return lang, vit


def build_vlm_module(args: Any, m: ModuleLayout, pgs) -> torch.nn.Module:
    """Module `m` (`vision` or `language`) of Megatron's LLaVA on this rank, on the compute device."""
    from megatron.core.enums import ModelType
    from megatron.core.models.multimodal.llava_model import LLaVAModel
    from megatron.core.transformer.spec_utils import get_submodules

    if args.padded_vocab_size % m.tp:
        raise ValueError(
            f"module {m.name}: padded vocabulary {args.padded_vocab_size} is not divisible by "
            f"tp({m.tp}); raise --make-vocab-size-divisible-by"
        )
    lang_cfg, vis_cfg, proj_cfg = _configs(args, m)
    lang_spec, vit_spec = _specs(args)
    is_vision = m.name == "vision"
    pp_rank, pp = pgs.pp.rank(), m.pp
    model = LLaVAModel(
        language_transformer_config=proj_cfg if is_vision else lang_cfg,
        language_transformer_layer_spec=lang_spec,
        language_vocab_size=args.padded_vocab_size,
        language_max_sequence_length=args.decoder_seq_length,
        vision_transformer_config=vis_cfg,
        vision_transformer_layer_spec=vit_spec,
        drop_vision_class_token=args.disable_vision_class_token,
        vision_projection_config=proj_cfg,
        vision_projection_layer_spec=deepcopy(get_submodules(lang_spec.submodules.mlp)),
        vision_projection_type="mlp",
        parallel_output=True,
        language_position_embedding_type=args.position_embedding_type,
        language_rotary_percent=args.rotary_percent,
        language_rope_scaling=args.use_rope_scaling,
        pre_process=is_vision or pp_rank == 0,
        post_process=is_vision or pp_rank == pp - 1,
        add_encoder=is_vision,
        add_decoder=not is_vision,
        img_h=args.img_h,
        img_w=args.img_w,
        patch_dim=args.patch_dim,
        pg_collection=pgs,
    )
    model.freeze(
        freeze_language_model=args.freeze_LM and not is_vision,
        freeze_vision_model=args.freeze_ViT and is_vision,
        freeze_vision_projection=False,
    )
    if m.frozen:
        for n, p in model.named_parameters():
            if not n.startswith("vision_projection."):
                p.requires_grad_(False)
    model.model_type = ModelType.encoder_or_decoder
    return to_model_dtype(model, args).to(get_device())  # --bf16/--fp16: as Float16Module casts it

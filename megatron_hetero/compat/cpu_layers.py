"""CPU table entries (:mod:`.cpu`) for Megatron-core's model layers: the global memory buffer, default
attention masks, tensor-parallel layers and mappings, the torch norm under sequence parallelism, rotary
embeddings and their CP slice, tied embeddings and the CLIP ViT's position ids.
"""

from __future__ import annotations

import copy
import functools
from typing import List

from ._patching import MARK, rebind_function, wrap_call, wrap_method
from .table import CPU, MCORE_0_19, Patch, Spot
from .torch_on_cpu import _tensor_cuda_is_identity
from .cpu_entry import _redirect_torch_in, _MC, _EMB, _LM, _torch_in, _redirect


def _tied_embedding_cuda_call() -> None:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    wrap_method(LanguageModule, "setup_embeddings_and_output_layer", lambda fn: wrap_call(fn, _tensor_cuda_is_identity))


def _clip_vit_cuda_call() -> None:
    from megatron.core.models.vision.clip_vit_model import CLIPViTModel

    wrap_method(CLIPViTModel, "__init__", lambda fn: wrap_call(fn, _tensor_cuda_is_identity))


def _rope_cp_slice_on_cpu() -> None:
    _redirect_torch_in("megatron.core.models.common.embeddings.rope_utils")()
    rebind_function(
        [
            "megatron.core.models.common.embeddings.rope_utils",
            "megatron.core.models.common.embeddings.rotary_pos_embedding",
            "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
        ],
        "get_pos_emb_on_this_cp_rank",
        lambda fn: wrap_call(fn, _tensor_cuda_is_identity),
    )


def _torch_norm_sequence_parallel() -> None:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    current = vars(WrappedTorchNorm)["__new__"]
    original = current.__func__ if isinstance(current, staticmethod) else current
    if hasattr(original, MARK):
        return

    @functools.wraps(original)
    def __new__(cls, config, hidden_size, *args, **kwargs):
        if not getattr(config, "sequence_parallel", False):
            return original(cls, config, hidden_size, *args, **kwargs)
        local = copy.copy(config)
        local.sequence_parallel = False
        norm = original(cls, local, hidden_size, *args, **kwargs)
        # finalize_model_grads all-reduces these over TP (each rank saw only its sequence shard).
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    setattr(__new__, MARK, original)
    WrappedTorchNorm.__new__ = staticmethod(__new__)


#: LAYER_PATCHES: a part of :data:`.cpu.PATCHES` (reason CPU).
LAYER_PATCHES: List[Patch] = [
    _redirect(
        "cpu.global_memory_buffer",
        f"{_MC}.utils",
        f"{_MC}.utils: GlobalMemoryBuffer.get_tensor "
        "(device=torch.cuda.current_device(); used by DotProductAttention.forward)",
        ("torch.cuda.current_device()",),
        "remove when Megatron-core's GlobalMemoryBuffer takes a device",
        spots=(
            Spot(
                f"{_MC}.utils:GlobalMemoryBuffer.get_tensor",
                "method",
                params=("self", "tensor_shape", "dtype", "name"),
                uses=("torch.cuda.current_device()",),
            ),
        ),
    ),
    _redirect(
        "cpu.default_causal_mask",
        f"{_MC}.transformer.utils",
        f"{_MC}.transformer.utils: get_default_causal_mask, get_sliding_window_causal_mask "
        "(device='cuda'; used when attention_mask is None)",
        ('device="cuda"',),
        "remove when the default masks are built on the device of the attention scores",
        spots=(Spot(f"{_MC}.transformer.utils:get_default_causal_mask", params=("sq",), uses=('device="cuda"',)),),
    ),
    _redirect(
        "cpu.tensor_parallel_layers",
        f"{_MC}.tensor_parallel.layers",
        f"{_MC}.tensor_parallel.layers: VocabParallelEmbedding / ColumnParallelLinear / "
        "RowParallelLinear.__init__ without use_cpu_initialization, "
        "LinearWithGradAccumulationAndAsyncCommunication (SP all-gather buffer) "
        "(device=torch.cuda.current_device())",
        ("device=torch.cuda.current_device()",),
        "remove when the tensor-parallel layers allocate on a configured device (CPU included)",
    ),
    _redirect(
        "cpu.tensor_parallel_mappings",
        f"{_MC}.tensor_parallel.mappings",
        f"{_MC}.tensor_parallel.mappings: _gather_along_first_dim, _reduce_scatter_along_first_dim, "
        "_gather_along_last_dim, ... (device=torch.cuda.current_device(); SP regions and the CP K/V gather)",
        ("device=torch.cuda.current_device()",),
        "remove when the mappings allocate their outputs on the input's device",
    ),
    Patch(
        name="cpu.torch_norm_sequence_parallel",
        reason=CPU,
        spot=f"{_MC}.transformer.torch_norm: WrappedTorchNorm.__new__ asserts not sequence_parallel "
        "(the local spec's norm without apex)",
        action="build the torch norm from a config copy with sequence_parallel=False and tag its "
        "params sequence_parallel=True (finalize_model_grads all-reduces them over TP)",
        targets=MCORE_0_19,
        removal="remove when WrappedTorchNorm supports sequence parallelism (a GPU without apex hits the "
        "same assert; this entry is applied only without CUDA, as before)",
        spots=(
            Spot(
                f"{_MC}.transformer.torch_norm:WrappedTorchNorm.__new__",
                "staticmethod",
                params=("cls", "config", "hidden_size"),
                uses=("not config.sequence_parallel",),
            ),
        ),
        apply=_torch_norm_sequence_parallel,
    ),
    _redirect(
        "cpu.rotary_embedding",
        f"{_EMB}.rotary_pos_embedding",
        f"{_EMB}.rotary_pos_embedding: RotaryEmbedding.__init__ without use_cpu_initialization, get_emb "
        "(device=torch.cuda.current_device())",
        ("torch.cuda.current_device()",),
        "remove when RotaryEmbedding builds inv_freq on the device of its input",
    ),
    Patch(
        name="cpu.rope_cp_slice",
        reason=CPU,
        spot=f"{_EMB}.rope_utils: get_pos_emb_on_this_cp_rank "
        "(torch.tensor(..., pin_memory=True).cuda(); RoPE slice for CP > 1)",
        action="torch -> _TorchOnCpu (drops pin_memory) and tensor.cuda() is the identity during the call "
        "(rebound in rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding)",
        targets=MCORE_0_19,
        removal="remove when get_pos_emb_on_this_cp_rank builds its index on pos_emb.device",
        spots=(
            _torch_in(f"{_EMB}.rope_utils", "pin_memory=True"),
            Spot(
                f"{_EMB}.rope_utils:get_pos_emb_on_this_cp_rank",
                params=("pos_emb", "seq_dim", "cp_group"),
                uses=("pin_memory=True", ".cuda(non_blocking=True)"),
            ),
            Spot(f"{_EMB}.rotary_pos_embedding:get_pos_emb_on_this_cp_rank"),
            Spot(f"{_EMB}.yarn_rotary_pos_embedding:get_pos_emb_on_this_cp_rank"),
        ),
        apply=_rope_cp_slice_on_cpu,
    ),
    Patch(
        name="cpu.tied_embeddings_cuda",
        reason=CPU,
        spot=f"{_LM}: LanguageModule.setup_embeddings_and_output_layer (weight.data.cuda(); tied embeddings "
        "with PP > 1)",
        action="tensor.cuda() is the identity during the call",
        targets=MCORE_0_19,
        removal="remove when the tied output layer stays on the device of the embedding weight",
        spots=(
            Spot(
                f"{_LM}:LanguageModule.setup_embeddings_and_output_layer",
                "method",
                params=("self",),
                uses=("weight.data = weight.data.cuda()",),
            ),
        ),
        apply=_tied_embedding_cuda_call,
    ),
    Patch(
        name="cpu.clip_vit_position_ids_cuda",
        reason=CPU,
        spot=f"{_MC}.models.vision.clip_vit_model: CLIPViTModel.__init__ (torch.arange(...).cuda() for position_ids)",
        action="tensor.cuda() is the identity during the call",
        targets=MCORE_0_19,
        removal="remove when CLIPViTModel registers position_ids as a buffer on the model's device",
        spots=(
            Spot(
                f"{_MC}.models.vision.clip_vit_model:CLIPViTModel.__init__",
                "method",
                params=("self", "transformer_config", "transformer_layer_spec"),
                uses=("torch.arange(self.seq_length).expand(1, -1).cuda()",),
            ),
        ),
        apply=_clip_vit_cuda_call,
    ),
]

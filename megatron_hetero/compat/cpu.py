"""Redirections that make Megatron-core 0.16.1 run on CPU with gloo.

:func:`apply_cpu_compat` is the only entry point. It does nothing when CUDA is available, and is
idempotent. It never copies Megatron code: each patch either swaps the name ``torch`` inside one
Megatron module for a thin redirect (``_TorchOnCpu``), or wraps one Megatron function so that a
CUDA-only call inside it has a CPU meaning while that function runs (plus one logging filter).
:data:`PATCHES` lists every patch with the upstream spot it covers; nothing else is touched, and
``torch`` itself is only modified (``Tensor.cuda``/``Tensor.type``) for the duration of the wrapped
Megatron calls.

The set is what a Megatron-core ``GPTModel`` (local spec, explicit ``pg_collection``) needs for
forward/backward with TP, SP, PP (1F1B via ``get_forward_backward_func``) and CP (with
:mod:`megatron_hetero.models.cp_attention`), Megatron ``DistributedDataParallel`` and the
non-distributed fp32 Megatron optimizer, ``CLIPViTModel``, and ``dist_checkpointing.save`` (torch_dist
format; loading needs nothing); see
``tests/test_compat.py``. The stand-ins themselves live in :mod:`.torch_on_cpu`. Every entry was checked to be needed by one of those cases. Not covered
(they still fail on CPU): the distributed optimizer and fp16/bf16 optimizers
(``param.type() == 'torch.cuda.*'`` checks in ``optimizer/optimizer.py`` and
``optimizer/distrib_optimizer.py``), CUDA graphs, the upstream bridge communicator, and
interleaved (VPP) schedules were not verified (on gloo they need ``batch_p2p_comm=False``).

Side effect to know: on CPU the "CUDA" generator is the CPU generator, so
``model_parallel_cuda_manual_seed(seed)`` reseeds the CPU generator with ``seed`` (on GPU it leaves
the CPU generator alone).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import logging
from typing import Callable, List

import torch

from ._patching import MARK, Patch, rebind_function, swapped, wrap_call, wrap_method
from .torch_on_cpu import _TORCH_ON_CPU, _tensor_cuda_is_identity, _tensor_type_reports_cuda

__all__ = ["apply_cpu_compat", "cpu_compat_applied", "PATCHES", "Patch"]

_APPLIED = False


# --------------------------------------------------------------------------------------------
# The patches
# --------------------------------------------------------------------------------------------


def _redirect_torch_in(module_name: str) -> Callable[[], None]:
    def apply() -> None:
        module = importlib.import_module(module_name)
        if not hasattr(module.torch, MARK):
            module.torch = _TORCH_ON_CPU

    return apply


def _cpu_rng_state_functions() -> None:
    random = importlib.import_module("megatron.core.tensor_parallel.random")

    def make_get(original):
        @functools.wraps(original)
        def _get_cuda_rng_state(device="cuda", clone=False, graph_safe=False):
            if graph_safe:
                raise RuntimeError("CUDA-graph-safe RNG states need CUDA")
            return torch.get_rng_state()

        return _get_cuda_rng_state

    def make_set(original):
        @functools.wraps(original)
        def _set_cuda_rng_state(new_state, device=-1, graph_safe=False):
            if graph_safe:
                raise RuntimeError("CUDA-graph-safe RNG states need CUDA")
            torch.set_rng_state(new_state)

        return _set_cuda_rng_state

    rebind_function([random.__name__], "_get_cuda_rng_state", make_get)
    rebind_function([random.__name__], "_set_cuda_rng_state", make_set)


class _DropCpuRngWarning(logging.Filter):
    """On CPU the tracked "CUDA" generator *is* the CPU generator, so the tracker's check that
    random ops inside ``fork()`` left the CPU generator alone always fires with dropout > 0."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _silence_cpu_rng_warning() -> None:
    logger = logging.getLogger("megatron.core.tensor_parallel.random")
    if not any(isinstance(f, _DropCpuRngWarning) for f in logger.filters):
        logger.addFilter(_DropCpuRngWarning())


def _tied_embedding_cuda_call() -> None:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    wrap_method(
        LanguageModule,
        "setup_embeddings_and_output_layer",
        lambda fn: wrap_call(fn, _tensor_cuda_is_identity),
    )


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


def _clip_grads_type_check() -> None:
    rebind_function(
        ["megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer"],
        "clip_grad_by_total_norm_fp32",
        lambda fn: wrap_call(fn, _tensor_type_reports_cuda),
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


def _moe_split_sizes_on_cpu() -> None:
    """`maybe_move_tensor_to_cpu(t, as_numpy=True)` converts only CUDA tensors; on CPU the split
    sizes stay tensors, which `all_to_all_single` rejects. Convert CPU tensors too when asked."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu
    if getattr(original, MARK, None) is not None:
        return

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    setattr(maybe_move_tensor_to_cpu, MARK, original)
    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _cuda_type_names() -> contextlib.AbstractContextManager:
    """`tensor.type()` (no argument) names CPU float tensors as their CUDA types, e.g.
    'torch.BFloat16Tensor' -> 'torch.cuda.BFloat16Tensor'; every other use of `.type` is untouched."""
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)
            if name in ("torch.FloatTensor", "torch.HalfTensor", "torch.BFloat16Tensor"):
                return "torch.cuda." + name[len("torch."):]
            return name
        return original(self, dtype, non_blocking, **kwargs)

    return swapped(torch.Tensor, "type", type_)


def _float16_optimizer_on_cpu() -> None:
    from megatron.core.optimizer import optimizer as opt

    cls = opt.Float16OptimizerWithFloat16Params
    if not hasattr(cls.__init__, MARK):
        cls.__init__ = wrap_call(cls.__init__, _cuda_type_names)


PATCHES: List[Patch] = [
    Patch(
        "megatron.core.optimizer.optimizer: Float16OptimizerWithFloat16Params.__init__ accepts only "
        "parameters whose type() is torch.cuda.{Half,BFloat16,Float}Tensor (--bf16 mixed precision)",
        "during __init__, tensor.type() names CPU float tensors by their CUDA type names",
        _float16_optimizer_on_cpu,
    ),
    Patch(
        "megatron.core.transformer.moe.moe_utils: maybe_move_tensor_to_cpu(as_numpy=True) leaves CPU "
        "tensors as tensors (alltoall dispatcher split sizes; all_to_all_single wants a sequence)",
        "CPU tensors become numpy arrays when as_numpy (rebound in token_dispatcher)",
        _moe_split_sizes_on_cpu,
    ),
    Patch(
        "megatron.core.transformer.moe.token_dispatcher: MoEAlltoAllTokenDispatcher "
        "(torch.cuda.Stream(), current_stream, stream context, record_event; device-to-host split sizes)",
        "torch -> _TorchOnCpu (one synchronous CPU stream)",
        _redirect_torch_in("megatron.core.transformer.moe.token_dispatcher"),
    ),
    Patch(
        "megatron.core.transformer.moe.router: TopKRouter.gating/__init__ (weights moved to "
        "torch.cuda.current_device(); expert-bias buffers on it)",
        "torch -> _TorchOnCpu",
        _redirect_torch_in("megatron.core.transformer.moe.router"),
    ),
    Patch(
        "megatron.core.transformer.moe.moe_utils / experts: aux-loss tracker and expert buffers "
        "(device='cuda', torch.cuda.current_device())",
        "torch -> _TorchOnCpu",
        lambda: (_redirect_torch_in("megatron.core.transformer.moe.moe_utils")(),
                 _redirect_torch_in("megatron.core.transformer.moe.experts")()),
    ),
    Patch(
        "megatron.core.tensor_parallel.random: _get_cuda_rng_state, _set_cuda_rng_state",
        "read/write the CPU generator state (the CUDA generator does not exist)",
        _cpu_rng_state_functions,
    ),
    Patch(
        "megatron.core.tensor_parallel.random: CudaRNGStatesTracker.add, "
        "model_parallel_cuda_manual_seed (torch.cuda.get_rng_state / manual_seed)",
        "torch -> _TorchOnCpu: tracker states are CPU generator states",
        _redirect_torch_in("megatron.core.tensor_parallel.random"),
    ),
    Patch(
        "megatron.core.tensor_parallel.random: CudaRNGStatesTracker.fork logs "
        "'CPU RNG state changed within GPU RNG context'",
        "logging filter drops that one message (on CPU the two generators are one)",
        _silence_cpu_rng_warning,
    ),
    Patch(
        "megatron.core.utils: GlobalMemoryBuffer.get_tensor "
        "(device=torch.cuda.current_device(); used by DotProductAttention.forward)",
        "torch -> _TorchOnCpu",
        _redirect_torch_in("megatron.core.utils"),
    ),
    Patch(
        "megatron.core.transformer.utils: get_default_causal_mask, "
        "get_sliding_window_causal_mask (device='cuda'; used when attention_mask is None)",
        "torch -> _TorchOnCpu",
        _redirect_torch_in("megatron.core.transformer.utils"),
    ),
    Patch(
        "megatron.core.tensor_parallel.layers: VocabParallelEmbedding / ColumnParallelLinear / "
        "RowParallelLinear.__init__ without use_cpu_initialization, "
        "LinearWithGradAccumulationAndAsyncCommunication (SP all-gather buffer) "
        "(device=torch.cuda.current_device())",
        "torch -> _TorchOnCpu",
        _redirect_torch_in("megatron.core.tensor_parallel.layers"),
    ),
    Patch(
        "megatron.core.tensor_parallel.mappings: _gather_along_first_dim, "
        "_reduce_scatter_along_first_dim, _gather_along_last_dim, ... "
        "(device=torch.cuda.current_device(); SP regions and the CP K/V gather)",
        "torch -> _TorchOnCpu",
        _redirect_torch_in("megatron.core.tensor_parallel.mappings"),
    ),
    Patch(
        "megatron.core.transformer.torch_norm: WrappedTorchNorm.__new__ asserts "
        "not sequence_parallel (the local spec's norm without apex)",
        "build the torch norm from a config copy with sequence_parallel=False and tag its "
        "params sequence_parallel=True (finalize_model_grads all-reduces them over TP)",
        _torch_norm_sequence_parallel,
    ),
    Patch(
        "megatron.core.models.common.embeddings.rotary_pos_embedding: RotaryEmbedding.__init__ "
        "without use_cpu_initialization, get_emb (device=torch.cuda.current_device())",
        "torch -> _TorchOnCpu",
        _redirect_torch_in("megatron.core.models.common.embeddings.rotary_pos_embedding"),
    ),
    Patch(
        "megatron.core.models.common.embeddings.rope_utils: get_pos_emb_on_this_cp_rank "
        "(torch.tensor(..., pin_memory=True).cuda(); RoPE slice for CP > 1)",
        "torch -> _TorchOnCpu (drops pin_memory) and tensor.cuda() is the identity during the call "
        "(rebound in rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding)",
        _rope_cp_slice_on_cpu,
    ),
    Patch(
        "megatron.core.models.common.language_module.language_module: "
        "LanguageModule.setup_embeddings_and_output_layer (weight.data.cuda(); tied embeddings "
        "with PP > 1)",
        "tensor.cuda() is the identity during the call",
        _tied_embedding_cuda_call,
    ),
    Patch(
        "megatron.core.models.vision.clip_vit_model: CLIPViTModel.__init__ "
        "(torch.arange(...).cuda() for position_ids)",
        "tensor.cuda() is the identity during the call",
        _clip_vit_cuda_call,
    ),
    Patch(
        "megatron.core.pipeline_parallel.p2p_communication: P2PCommunicator._communicate, "
        "_communicate_shapes (device=torch.cuda.current_device(), torch.cuda.synchronize())",
        "torch -> _TorchOnCpu",
        _redirect_torch_in("megatron.core.pipeline_parallel.p2p_communication"),
    ),
    Patch(
        "megatron.core.pipeline_parallel.schedules: forward_backward_no_pipelining, "
        "forward_backward_pipelining_without_interleaving, ..._with_interleaving "
        "(total_num_tokens = torch.zeros(..., device='cuda'))",
        "torch -> _TorchOnCpu",
        _redirect_torch_in("megatron.core.pipeline_parallel.schedules"),
    ),
    Patch(
        "megatron.core.distributed.param_and_grad_buffer: _ParamAndGradBuffer.__init__ "
        "(param_data / grad_data buffers on torch.cuda.current_device(); Megatron DDP)",
        "torch -> _TorchOnCpu",
        _redirect_torch_in("megatron.core.distributed.param_and_grad_buffer"),
    ),
    Patch(
        "megatron.core.optimizer.optimizer: MegatronOptimizer / FP32Optimizer.__init__, "
        "get_loss_scale (device='cuda', torch.cuda.current_device())",
        "torch -> _TorchOnCpu",
        _redirect_torch_in("megatron.core.optimizer.optimizer"),
    ),
    Patch(
        "megatron.core.optimizer.clip_grads: get_grad_norm_fp32, clip_grad_by_total_norm_fp32, "
        "count_zeros_fp32 (device='cuda')",
        "torch -> _TorchOnCpu",
        _redirect_torch_in("megatron.core.optimizer.clip_grads"),
    ),
    Patch(
        "megatron.core.optimizer.clip_grads: clip_grad_by_total_norm_fp32 asserts "
        "param.grad.type() == 'torch.cuda.FloatTensor'",
        "tensor.type() reports the CUDA type name during the call (rebound in clip_grads and "
        "optimizer.optimizer, which imported it by name)",
        _clip_grads_type_check,
    ),
    Patch(
        "megatron.core.dist_checkpointing.strategies.filesystem_async: FileSystemWriterAsync."
        "preload_tensors (torch.cuda.synchronize(); every dist_checkpointing.save)",
        "torch -> _TorchOnCpu (synchronising is a no-op on CPU)",
        _redirect_torch_in("megatron.core.dist_checkpointing.strategies.filesystem_async"),
    ),
    Patch(
        "megatron.core.dist_checkpointing.strategies.state_dict_saver: verify_global_md_reuse, "
        "save_state_dict_async_finalize (torch.tensor(..., device='cuda' | torch.cuda.current_device()) for "
        "the all-reduce of plan reuse and write failures; every dist_checkpointing.save)",
        "torch -> _TorchOnCpu (the flags are CPU tensors, reduced over gloo)",
        _redirect_torch_in("megatron.core.dist_checkpointing.strategies.state_dict_saver"),
    ),
]


def apply_cpu_compat() -> None:
    """Apply every patch in :data:`PATCHES` when CUDA is not available; a no-op otherwise.

    Idempotent: a second call (or a call after ``importlib.reload`` of this module) changes nothing.
    Call it before building Megatron models on a CPU-only machine (the fork launcher's parent
    process is the right place: the patched modules are then inherited by every rank).
    """
    global _APPLIED
    if _APPLIED or torch.cuda.is_available():
        return
    for patch in PATCHES:
        patch.apply()
    _APPLIED = True


def cpu_compat_applied() -> bool:
    """Whether :func:`apply_cpu_compat` has patched Megatron in this process."""
    return _APPLIED

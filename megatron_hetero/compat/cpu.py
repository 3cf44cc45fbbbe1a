"""Redirections that make Megatron-core 0.16.1 run on CPU with gloo (reason :data:`~.table.CPU`).

:func:`apply_cpu_compat` (called by :func:`megatron_hetero.compat.apply_compat`) is the only entry
point. It does nothing when CUDA is available, refuses a Megatron-core that is not a target of every
entry (:mod:`.table`), and is idempotent. It never copies Megatron code: each patch either swaps the name ``torch`` inside one
Megatron module for a thin redirect (``_TorchOnCpu``), or wraps one Megatron function so that a
CUDA-only call inside it has a CPU meaning while that function runs (plus one logging filter).
:data:`PATCHES` lists every patch as a table entry (upstream spots, target versions, removal
condition); nothing else is touched, and
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
from typing import Any, Callable, List, Tuple

import torch

from ._patching import MARK, rebind_function, swapped, wrap_call, wrap_method
from .table import CPU, MCORE_0_16_1, Patch, Spot, check_targets
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
                return "torch.cuda." + name[len("torch.") :]
            return name
        return original(self, dtype, non_blocking, **kwargs)

    return swapped(torch.Tensor, "type", type_)


def _float16_optimizer_on_cpu() -> None:
    from megatron.core.optimizer import optimizer as opt

    cls = opt.Float16OptimizerWithFloat16Params
    if not hasattr(cls.__init__, MARK):
        cls.__init__ = wrap_call(cls.__init__, _cuda_type_names)


_MC = "megatron.core"
_RNG = f"{_MC}.tensor_parallel.random"
_EMB = f"{_MC}.models.common.embeddings"
_LM = f"{_MC}.models.common.language_module.language_module"
_CKPT = f"{_MC}.dist_checkpointing.strategies"


def _torch_in(module: str, *uses: str) -> Spot:
    """The global name ``torch`` of ``module``, whose source still holds ``uses``."""
    return Spot(f"{module}:torch", "torch", uses=uses)


def _redirect(name: str, module: str, spot: str, uses: Tuple[str, ...], removal: str, **extra: Any) -> Patch:
    """An entry that swaps the name ``torch`` in ``module`` for the CPU redirect."""
    return Patch(
        name=name,
        reason=CPU,
        spot=spot,
        action="torch -> _TorchOnCpu",
        targets=MCORE_0_16_1,
        removal=removal,
        spots=(_torch_in(module, *uses), *extra.pop("spots", ())),
        apply=_redirect_torch_in(module),
        **extra,
    )


#: Megatron-core spots redirected on a machine without CUDA (reason CPU), each with its targets,
#: its spots and its removal condition (:mod:`.table`).
PATCHES: List[Patch] = [
    Patch(
        name="cpu.float16_optimizer_type_names",
        reason=CPU,
        spot=f"{_MC}.optimizer.optimizer: Float16OptimizerWithFloat16Params.__init__ accepts only parameters "
        "whose type() is torch.cuda.{Half,BFloat16,Float}Tensor (--bf16 mixed precision)",
        action="during __init__, tensor.type() names CPU float tensors by their CUDA type names",
        targets=MCORE_0_16_1,
        removal="remove when Float16OptimizerWithFloat16Params checks param.dtype (or accepts CPU tensor types)",
        spots=(
            Spot(
                f"{_MC}.optimizer.optimizer:Float16OptimizerWithFloat16Params.__init__",
                "method",
                params=("self", "optimizer", "config", "grad_scaler", "init_state_fn"),
                uses=('param.type() in ["torch.cuda.HalfTensor", "torch.cuda.BFloat16Tensor"]',),
            ),
        ),
        apply=_float16_optimizer_on_cpu,
    ),
    Patch(
        name="cpu.moe_split_sizes_numpy",
        reason=CPU,
        spot=f"{_MC}.transformer.moe.moe_utils: maybe_move_tensor_to_cpu(as_numpy=True) leaves CPU tensors as "
        "tensors (alltoall dispatcher split sizes; all_to_all_single wants a sequence)",
        action="CPU tensors become numpy arrays when as_numpy (rebound in token_dispatcher)",
        targets=MCORE_0_16_1,
        removal="remove when maybe_move_tensor_to_cpu honours as_numpy for tensors already on the CPU",
        spots=(
            Spot(
                f"{_MC}.transformer.moe.moe_utils:maybe_move_tensor_to_cpu",
                params=("tensor", "as_numpy", "record_stream"),
                uses=("and tensor.is_cuda:",),
            ),
            Spot(f"{_MC}.transformer.moe.token_dispatcher:maybe_move_tensor_to_cpu"),
        ),
        apply=_moe_split_sizes_on_cpu,
    ),
    _redirect(
        "cpu.moe_token_dispatcher",
        f"{_MC}.transformer.moe.token_dispatcher",
        f"{_MC}.transformer.moe.token_dispatcher: MoEAlltoAllTokenDispatcher (torch.cuda.Stream(), "
        "current_stream, stream context, record_event; device-to-host split sizes)",
        ("torch.cuda.Stream", "torch.cuda.current_stream"),
        "remove when the alltoall dispatcher takes its streams from the device of its tensors",
    ),
    _redirect(
        "cpu.moe_router",
        f"{_MC}.transformer.moe.router",
        f"{_MC}.transformer.moe.router: TopKRouter.gating/__init__ (weights moved to "
        "torch.cuda.current_device(); expert-bias buffers on it)",
        ("torch.cuda.current_device()",),
        "remove when TopKRouter keeps its weight and buffers on the device of its config/input",
    ),
    Patch(
        name="cpu.moe_utils_and_experts",
        reason=CPU,
        spot=f"{_MC}.transformer.moe.moe_utils / experts: aux-loss tracker and expert buffers "
        "(device='cuda', torch.cuda.current_device())",
        action="torch -> _TorchOnCpu (in both modules)",
        targets=MCORE_0_16_1,
        removal="remove when the MoE aux-loss tracker and the expert modules allocate on the model's device",
        spots=(
            _torch_in(f"{_MC}.transformer.moe.moe_utils", 'device="cuda"'),
            _torch_in(f"{_MC}.transformer.moe.experts", "torch.cuda.current_device()"),
        ),
        apply=lambda: (
            _redirect_torch_in(f"{_MC}.transformer.moe.moe_utils")(),
            _redirect_torch_in(f"{_MC}.transformer.moe.experts")(),
        ),
    ),
    Patch(
        name="cpu.rng_state_functions",
        reason=CPU,
        spot=f"{_RNG}: _get_cuda_rng_state, _set_cuda_rng_state",
        action="read/write the CPU generator state (the CUDA generator does not exist)",
        targets=MCORE_0_16_1,
        removal="remove when the RNG tracker keeps the states of the current device's generator (CPU included)",
        spots=(
            Spot(f"{_RNG}:_get_cuda_rng_state", params=("device", "clone", "graph_safe"), uses=("torch.cuda",)),
            Spot(f"{_RNG}:_set_cuda_rng_state", params=("new_state", "device", "graph_safe"), uses=("torch.cuda",)),
        ),
        apply=_cpu_rng_state_functions,
    ),
    _redirect(
        "cpu.rng_tracker",
        _RNG,
        f"{_RNG}: CudaRNGStatesTracker.add, model_parallel_cuda_manual_seed (torch.cuda.get_rng_state / manual_seed)",
        ("torch.cuda.get_rng_state", "torch.cuda.manual_seed"),
        "remove with cpu.rng_state_functions (a device-agnostic RNG tracker)",
        spots=(
            Spot(f"{_RNG}:CudaRNGStatesTracker.add", "method", params=("self", "name", "seed")),
            Spot(f"{_RNG}:model_parallel_cuda_manual_seed", params=("seed",)),
        ),
    ),
    Patch(
        name="cpu.rng_warning_filter",
        reason=CPU,
        spot=f"{_RNG}: CudaRNGStatesTracker.fork logs 'CPU RNG state changed within GPU RNG context'",
        action="logging filter drops that one message (on CPU the two generators are one)",
        targets=MCORE_0_16_1,
        removal="remove with cpu.rng_tracker (or when fork() no longer compares the CPU generator)",
        spots=(
            Spot(
                f"{_RNG}:CudaRNGStatesTracker.fork",
                "method",
                params=("self", "name"),
                uses=("CPU RNG state changed within GPU RNG context",),
            ),
        ),
        apply=_silence_cpu_rng_warning,
    ),
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
        targets=MCORE_0_16_1,
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
        targets=MCORE_0_16_1,
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
        targets=MCORE_0_16_1,
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
        targets=MCORE_0_16_1,
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
    _redirect(
        "cpu.p2p_communication",
        f"{_MC}.pipeline_parallel.p2p_communication",
        f"{_MC}.pipeline_parallel.p2p_communication: P2PCommunicator._communicate, _communicate_shapes "
        "(device=torch.cuda.current_device(), torch.cuda.synchronize())",
        ("device=torch.cuda.current_device()", "torch.cuda.synchronize()"),
        "remove when P2PCommunicator allocates its receive buffers on a configured device",
    ),
    _redirect(
        "cpu.schedules",
        f"{_MC}.pipeline_parallel.schedules",
        f"{_MC}.pipeline_parallel.schedules: forward_backward_no_pipelining, "
        "forward_backward_pipelining_without_interleaving, ..._with_interleaving "
        "(total_num_tokens = torch.zeros(..., device='cuda'))",
        ('total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")',),
        "remove when the schedules count tokens on the device of the loss",
    ),
    _redirect(
        "cpu.param_and_grad_buffer",
        f"{_MC}.distributed.param_and_grad_buffer",
        f"{_MC}.distributed.param_and_grad_buffer: _ParamAndGradBuffer.__init__ "
        "(param_data / grad_data buffers on torch.cuda.current_device(); Megatron DDP)",
        ("device=torch.cuda.current_device()",),
        "remove when Megatron DDP's buffers are allocated on the parameters' device",
    ),
    _redirect(
        "cpu.optimizer",
        f"{_MC}.optimizer.optimizer",
        f"{_MC}.optimizer.optimizer: MegatronOptimizer / FP32Optimizer.__init__, get_loss_scale "
        "(device='cuda', torch.cuda.current_device())",
        ('device="cuda"',),
        "remove when the Megatron optimizers keep their flags and loss scale on the parameters' device",
    ),
    _redirect(
        "cpu.clip_grads",
        f"{_MC}.optimizer.clip_grads",
        f"{_MC}.optimizer.clip_grads: get_grad_norm_fp32, clip_grad_by_total_norm_fp32, count_zeros_fp32 "
        "(device='cuda')",
        ('device="cuda"',),
        "remove when the gradient-norm helpers reduce on the gradients' device",
    ),
    Patch(
        name="cpu.clip_grads_type_check",
        reason=CPU,
        spot=f"{_MC}.optimizer.clip_grads: clip_grad_by_total_norm_fp32 asserts "
        "param.grad.type() == 'torch.cuda.FloatTensor'",
        action="tensor.type() reports the CUDA type name during the call (rebound in clip_grads and "
        "optimizer.optimizer, which imported it by name)",
        targets=MCORE_0_16_1,
        removal="remove when clip_grad_by_total_norm_fp32 checks grad.dtype instead of the CUDA type name",
        spots=(
            Spot(
                f"{_MC}.optimizer.clip_grads:clip_grad_by_total_norm_fp32",
                params=("parameters", "max_norm", "total_norm"),
                uses=('param.grad.type() == "torch.cuda.FloatTensor"',),
            ),
            Spot(f"{_MC}.optimizer.optimizer:clip_grad_by_total_norm_fp32"),
        ),
        apply=_clip_grads_type_check,
    ),
    _redirect(
        "cpu.dist_ckpt_filesystem_async",
        f"{_CKPT}.filesystem_async",
        f"{_CKPT}.filesystem_async: FileSystemWriterAsync.preload_tensors (torch.cuda.synchronize(); every "
        "dist_checkpointing.save)",
        ("torch.cuda.synchronize()",),
        "remove when preload_tensors synchronises only CUDA tensors",
        spots=(
            Spot(
                f"{_CKPT}.filesystem_async:FileSystemWriterAsync.preload_tensors",
                "staticmethod",
                params=("write_buckets",),
                uses=("torch.cuda.synchronize()",),
            ),
        ),
    ),
    _redirect(
        "cpu.dist_ckpt_state_dict_saver",
        f"{_CKPT}.state_dict_saver",
        f"{_CKPT}.state_dict_saver: verify_global_md_reuse, save_state_dict_async_finalize "
        "(torch.tensor(..., device='cuda' | torch.cuda.current_device()) for the all-reduce of plan reuse and "
        "write failures; every dist_checkpointing.save)",
        ('device="cuda"', "device=torch.cuda.current_device()"),
        "remove when the saver's flags are created on the device of the default process group's backend",
        spots=(
            Spot(f"{_CKPT}.state_dict_saver:verify_global_md_reuse", uses=('device="cuda"',)),
            Spot(
                f"{_CKPT}.state_dict_saver:save_state_dict_async_finalize", uses=("device=torch.cuda.current_device()",)
            ),
        ),
    ),
]


def apply_cpu_compat() -> None:
    """Apply every patch in :data:`PATCHES` when CUDA is not available; a no-op otherwise.

    Refuses (:class:`~.table.UnsupportedMegatronVersion`, nothing patched) when the installed
    Megatron-core is not a target of every patch. Idempotent: a second call (or a call after
    ``importlib.reload`` of this module) changes nothing. Called by
    :func:`megatron_hetero.compat.apply_compat` at the entry points (in the fork launcher's parent
    process: the patched modules are then inherited by every rank).
    """
    global _APPLIED
    if _APPLIED or torch.cuda.is_available():
        return
    check_targets(PATCHES)
    for patch in PATCHES:
        patch.apply()
    _APPLIED = True


def cpu_compat_applied() -> bool:
    """Whether :func:`apply_cpu_compat` has patched Megatron in this process."""
    return _APPLIED

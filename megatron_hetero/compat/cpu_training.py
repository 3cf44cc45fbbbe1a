"""CPU table entries (:mod:`.cpu`) for Megatron-core's training machinery: pipeline p2p and schedules,
DDP's parameter and gradient buffers, the optimizers (fp32 and float16 wrappers) and gradient clipping.
"""

from __future__ import annotations

import contextlib
from typing import List

import torch

from ._patching import MARK, rebind_function, swapped, wrap_call, wrap_method
from .table import CPU, MCORE_0_19, Patch, Spot
from .torch_on_cpu import _tensor_cuda_is_identity, _tensor_type_reports_cuda
from .cpu_entry import _MC, _redirect


def _clip_grads_type_check() -> None:
    rebind_function(
        ["megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer"],
        "clip_grad_by_total_norm_fp32",
        lambda fn: wrap_call(fn, _tensor_type_reports_cuda),
    )


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


def _distributed_optimizer_on_cpu() -> None:
    from megatron.core.optimizer import distrib_optimizer as dopt

    cls = dopt.DistributedOptimizer
    if not hasattr(cls.__init__, MARK):
        cls.__init__ = wrap_call(cls.__init__, _cuda_type_names)


def _distributed_optimizer_gather_on_cpu() -> None:
    from megatron.core.optimizer import distrib_optimizer as dopt

    wrap_method(
        dopt.DistributedOptimizer, "get_parameter_state_dp_zero", lambda fn: wrap_call(fn, _tensor_cuda_is_identity)
    )


def _grad_scaler_load_on_cpu() -> None:
    from megatron.core.optimizer import grad_scaler as gs

    wrap_method(gs.DynamicGradScaler, "load_state_dict", lambda fn: wrap_call(fn, _tensor_cuda_is_identity))


#: TRAINING_PATCHES: a part of :data:`.cpu.PATCHES` (reason CPU).
TRAINING_PATCHES: List[Patch] = [
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
    Patch(
        name="cpu.float16_optimizer_type_names",
        reason=CPU,
        spot=f"{_MC}.optimizer.optimizer: Float16OptimizerWithFloat16Params.__init__ accepts only parameters "
        "whose type() is torch.cuda.{Half,BFloat16,Float}Tensor (--bf16 mixed precision)",
        action="during __init__, tensor.type() names CPU float tensors by their CUDA type names",
        targets=MCORE_0_19,
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
        name="cpu.distributed_optimizer_type_names",
        reason=CPU,
        spot=f"{_MC}.optimizer.distrib_optimizer: DistributedOptimizer.__init__ and "
        "_build_model_and_main_param_groups accept only parameters whose type() is "
        "torch.cuda.{Half,BFloat16,Float}Tensor (--use-distributed-optimizer)",
        action="during __init__, tensor.type() names CPU float tensors by their CUDA type names",
        targets=MCORE_0_19,
        removal="remove when DistributedOptimizer checks param.dtype (or accepts CPU tensor types)",
        spots=(
            Spot(
                f"{_MC}.optimizer.distrib_optimizer:DistributedOptimizer.__init__",
                "method",
                params=("self", "optimizer", "config", "grad_scaler", "init_state_fn"),
                uses=('param.type() in ["torch.cuda.HalfTensor", "torch.cuda.BFloat16Tensor"]',),
            ),
            Spot(
                f"{_MC}.optimizer.distrib_optimizer:DistributedOptimizer._build_model_and_main_param_groups",
                "method",
                uses=('model_param.type() == "torch.cuda.FloatTensor"',),
            ),
        ),
        apply=_distributed_optimizer_on_cpu,
    ),
    _redirect(
        "cpu.grad_scaler",
        f"{_MC}.optimizer.grad_scaler",
        f"{_MC}.optimizer.grad_scaler: MegatronGradScaler / DynamicGradScaler.__init__ (the loss scale and its "
        "factors as device='cuda' tensors; --fp16)",
        ("device='cuda'",),
        "remove when Megatron's grad scalers keep the loss scale on a configured device",
    ),
    Patch(
        name="cpu.grad_scaler_load",
        reason=CPU,
        spot=f"{_MC}.optimizer.grad_scaler: DynamicGradScaler.load_state_dict moves the saved scale with "
        "state_dict['scale'].cuda(torch.cuda.current_device()) (--fp16, resuming a checkpoint)",
        action="tensor.cuda() is the identity during the call",
        targets=MCORE_0_19,
        removal="remove when the grad scaler loads its scale onto a configured device",
        spots=(
            Spot(
                f"{_MC}.optimizer.grad_scaler:DynamicGradScaler.load_state_dict",
                "method",
                params=("self", "state_dict"),
                uses=("state_dict['scale'].cuda(torch.cuda.current_device())",),
            ),
        ),
        apply=_grad_scaler_load_on_cpu,
    ),
    _redirect(
        "cpu.distrib_optimizer",
        f"{_MC}.optimizer.distrib_optimizer",
        f"{_MC}.optimizer.distrib_optimizer: DistributedOptimizer.load_state_dict, get_parameter_state_dp_zero "
        "(state shards and gather buffers on torch.cuda.current_device(); the distributed optimizer's "
        "checkpoint state, save and load)",
        ("device=torch.cuda.current_device()",),
        "remove when the distributed optimizer allocates its state on the parameters' device",
    ),
    Patch(
        name="cpu.distrib_optimizer_gather",
        reason=CPU,
        spot=f"{_MC}.optimizer.distrib_optimizer: DistributedOptimizer.get_parameter_state_dp_zero moves each "
        "DP shard to the GPU with send_tensor.cuda() before gathering it (the fully_reshardable checkpoint "
        "format, save)",
        action="tensor.cuda() is the identity during the call",
        targets=MCORE_0_19,
        removal="remove when the gather sends from the device of the data-parallel group's backend",
        spots=(
            Spot(
                f"{_MC}.optimizer.distrib_optimizer:DistributedOptimizer.get_parameter_state_dp_zero",
                "method",
                params=("self", "use_gloo_comm", "empty_data", "return_on_all_ranks"),
                uses=("send_tensor = send_tensor.cuda()",),
            ),
        ),
        apply=_distributed_optimizer_gather_on_cpu,
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
        targets=MCORE_0_19,
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
]

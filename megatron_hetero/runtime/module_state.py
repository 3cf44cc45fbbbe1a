"""Per-module training state on one rank: the module wrapped in Megatron DDP on the module's own
groups, its own Megatron optimizer, and gradient finalisation over the module's own DP x CP group.

With `OptimConfig.use_distributed_optimizer` the module's optimizer is Megatron's DistributedOptimizer
over the module's DP x CP group: DDP reduce-scatters the gradients over that group (each DP x CP rank
keeps the gradient shard of its part of the flat buffer), the optimizer updates only that shard of the
fp32 parameters (so the Adam moments are 1/(dp x cp) of the module's), and the updated parameters are
all-gathered over the same group. Its gradient norm is reduced over the module's whole rank set
(`pgs.intra_dist_opt`: tp x cp x dp x pp), so every rank of the module holds the whole module's norm,
as with the non-distributed optimizer.

With `OptimConfig.overlap_grad_reduce` (Megatron's --overlap-grad-reduce) DDP splits the gradients into
buckets of `ddp_bucket_size` elements (Megatron's default without it) and its backward hooks launch each
bucket's asynchronous reduction as soon as the bucket's gradients are complete, during the module's last
backward of the step: the schedules run every earlier backward inside `no_sync()`, and `finalize_grads`
waits for the launched reductions (Megatron launches them there itself in the first step, where it
counts each parameter's gradients). Without it nothing changes: one bucket, reduced in `finalize_grads`.

With `OptimConfig.overlap_param_gather` as well (and the distributed optimizer) the optimizer step
sends nothing: DDP's forward pre-hooks all-gather each bucket of updated parameter shards over the
DP x CP group in the next forward, bucket by bucket (the next bucket's all-gather in flight while the
current one computes). Forwards outside a training step (evaluation) and checkpoints gather first,
synchronously (`params_gathered`, `gather_params`).

A frozen module (no trainable parameter on this rank) gets no DDP wrapper and no optimizer: it holds
no gradient buffer and no optimizer state, and its step is a no-op.
"""

from __future__ import annotations

import contextlib
import copy
from typing import TYPE_CHECKING, Iterator, Optional

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_hetero.compat.fixes import param_groups_gathered_over
from megatron_hetero.config.optim import OptimConfig

if TYPE_CHECKING:
    from megatron_hetero.runtime.loss_scale import LossScaler


class ModuleState:
    """A module on this rank with its DDP wrapper and optimizer (or neither, if frozen)."""

    def __init__(
        self,
        name: str,
        module: torch.nn.Module,
        pgs: ProcessGroupCollection,
        optim: OptimConfig,
        loss_scaler: Optional["LossScaler"] = None,
    ) -> None:
        """`loss_scaler` (--fp16): this rank's one loss scaler, which the module's optimizer uses
        instead of a scaler of its own (`runtime.loss_scale`); frozen modules keep it too."""
        self.name = name
        self.loss_scaler = loss_scaler
        self.module = module
        self.pgs = pgs
        self.trainable = any(p.requires_grad for p in module.parameters())
        #: whether the optimizer (if any) is Megatron's DistributedOptimizer (checkpoints ask)
        self.distributed_optimizer = optim.use_distributed_optimizer
        self.ddp: Optional[DistributedDataParallel] = None
        self.optimizer = None
        #: of the last `step`: the learning rate it ran at, and this module's gradient norm (before
        #: clipping; over the module's own model-parallel group, so the same on every rank of it)
        self.last_lr: Optional[float] = None
        self.last_grad_norm: Optional[float] = None
        if self.trainable:
            config = self._config(module)
            distributed = optim.use_distributed_optimizer
            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=optim.grad_reduce_in_fp32, use_distributed_optimizer=distributed
            )
            bucket_size = None  # one bucket, reduced after the last backward (finalize_grads)
            if optim.overlap_grad_reduce:
                ddp_config.overlap_grad_reduce = True
                # Megatron's resolution (training.py resolve_ddp_bucket_size): --ddp-bucket-size, or
                # max(4e7, 1e6 x DP); DDP itself makes stages after the first one bucket
                ddp_config.bucket_size = optim.ddp_bucket_size or max(40_000_000, 1_000_000 * pgs.dp_cp.size())
                bucket_size = ddp_config.bucket_size if pgs.pp.rank() == 0 else None
                if optim.overlap_param_gather:
                    ddp_config.overlap_param_gather = True  # DDP registers its forward pre-hooks
            self.ddp = DistributedDataParallel(
                config,
                ddp_config,
                module,
                pg_collection=pgs,
                full_param_layout=self._param_layout(module, pgs, ddp_config, bucket_size) if distributed else None,
            )
            opt_pgs = pgs
            if getattr(module, "frozen", False) and pgs.pp.size() > 1:
                # A frozen encoder trains only its projector, on its last stage; the frozen stages
                # build no optimizer, so Megatron's grad-norm all-reduce over mp = tp x pp (the
                # distributed optimizer's over the whole module) would wait for them forever. Over
                # the last stage's TP (x DP x CP) group it is the same norm.
                opt_pgs = copy.copy(pgs)
                opt_pgs.mp = pgs.tp
                opt_pgs.intra_dist_opt = pgs.tp_dp_cp
            with param_groups_gathered_over(pgs.tp_dp_cp):
                self.optimizer = get_megatron_optimizer(
                    OptimizerConfig(
                        optimizer=optim.optimizer,
                        lr=optim.lr,
                        weight_decay=optim.weight_decay,
                        adam_beta1=optim.adam_beta1,
                        adam_beta2=optim.adam_beta2,
                        adam_eps=optim.adam_eps,
                        clip_grad=optim.clip_grad,
                        min_lr=optim.min_lr,
                        bf16=optim.bf16,
                        fp16=optim.fp16,
                        params_dtype=torch.bfloat16 if optim.bf16 else torch.float16 if optim.fp16 else torch.float32,
                        loss_scale=optim.loss_scale,
                        initial_loss_scale=optim.initial_loss_scale,
                        min_loss_scale=optim.min_loss_scale,
                        loss_scale_window=optim.loss_scale_window,
                        hysteresis=optim.hysteresis,
                        use_distributed_optimizer=distributed,
                    ),
                    [self.ddp],
                    pg_collection=opt_pgs,
                    use_gloo_process_groups=False,
                )
            if optim.fp16:
                if loss_scaler is None:
                    raise ValueError(f"module {name}: --fp16 needs the rank's loss scaler")
                for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                    if getattr(opt, "grad_scaler", None) is not None:
                        opt.grad_scaler = loss_scaler  # one scale for the whole model (runtime.loss_scale)

    @staticmethod
    def _param_layout(
        module: torch.nn.Module,
        pgs: ProcessGroupCollection,
        ddp_config: DistributedDataParallelConfig,
        bucket_size: Optional[int] = None,
    ):
        """The distributed optimizer's layout of the module's flat parameter buffers, as Megatron's DDP
        would compute it itself (`bucket_size` None: one bucket, no --overlap-grad-reduce; buckets padded
        for the DP x CP group)."""
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        params = [p for p in module.parameters() if p.requires_grad]
        return DistributedOptimizer.compute_full_param_layout(
            params, bucket_size, pgs.dp_cp.size(), ddp_config, expert_data_parallel_world_size=pgs.expt_dp.size()
        )

    @staticmethod
    def _config(module: torch.nn.Module):
        for m in module.modules():
            cfg = getattr(m, "config", None)
            if cfg is not None and hasattr(cfg, "calculate_per_token_loss"):
                return cfg
        raise AssertionError(f"{type(module).__name__} has no Megatron config")

    @property
    def model(self) -> torch.nn.Module:
        """What the schedule runs: the DDP wrapper when trainable (its hooks fill main_grad)."""
        return self.ddp if self.ddp is not None else self.module

    def no_sync(self, when: bool = True):
        """The context of a backward that must not launch this module's gradient reduction: DDP's
        `no_sync()` under --overlap-grad-reduce when `when`; else (frozen, no overlap) nothing."""
        if when and self.ddp is not None and self.ddp.ddp_config.overlap_grad_reduce:
            return self.ddp.no_sync()
        return contextlib.nullcontext()

    def gather_params(self) -> None:
        """--overlap-param-gather: all-gather the parameters updated by the last optimizer step now
        (at the end of training, before a checkpoint; Megatron-LM's `force_param_sync`): one
        synchronous all-gather per bucket of the module's updated shards over its DP x CP group (no
        forward or backward runs); the forward pre-hooks stay. Else nothing."""
        if self.ddp is not None and self.ddp.ddp_config.overlap_param_gather:
            self.optimizer.prepare_model_params_for_param_sync()
            with torch.no_grad():
                self.ddp.start_param_sync(force_sync=True)

    @contextlib.contextmanager
    def params_gathered(self) -> Iterator[None]:
        """--overlap-param-gather: the context of forwards that are not a training step's (evaluation):
        DDP's forward pre-hooks removed and the parameters of the last optimizer step all-gathered
        first (one synchronous all-gather per bucket over the module's DP x CP group; no backward
        traffic), the hooks back on exit, as Megatron-LM's `disable_forward_pre_hook` /
        `enable_forward_pre_hook` around its evaluation. Else (no overlap, frozen) nothing."""
        if self.ddp is None or not self.ddp.ddp_config.overlap_param_gather:
            yield
            return
        self.optimizer.prepare_model_params_for_param_sync()
        self.ddp.disable_forward_pre_hook(param_sync=True)
        try:
            yield
        finally:
            self.ddp.enable_forward_pre_hook()

    def zero_grad(self) -> None:
        if self.ddp is not None:
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()

    def finalize_grads(self) -> None:
        """Reduce gradients over this module's own DP x CP group (summed: the loss is normalised by the
        global token count already); then, under sequence parallelism (the module's config), sum the
        gradients of the parameters in the sequence-parallel region (layer norms, row-parallel biases:
        Megatron tags them `sequence_parallel`) over the module's TP group, one all-reduce of their
        flattened main grads, with Megatron-core's own function (`finalize_model_grads` runs the same
        two in this order). With untied embeddings that is the whole of Megatron's
        `finalize_model_grads` (its embedding all-reduces are no-ops)."""
        if self.ddp is not None:
            self.ddp.finish_grad_sync()
            config = self._config(self.module)
            if getattr(config, "sequence_parallel", False) and self.pgs.tp.size() > 1:
                from megatron.core.distributed.finalize_model_grads import (
                    _allreduce_non_tensor_model_parallel_grads,
                )

                _allreduce_non_tensor_model_parallel_grads([self.ddp], config, self.pgs.tp)

    def step(self) -> None:
        """This module's optimizer alone (clipped by its own norm): the profiler times it. Training
        steps the whole model at once (`runtime.optimizer_step.step_modules`: one global norm).
        Records `last_lr` and `last_grad_norm`."""
        if self.optimizer is not None:
            self.last_lr = self.current_lr()
            ok, grad_norm, _ = self.optimizer.step()
            if not ok:
                raise RuntimeError(f"module {self.name}: optimizer step skipped (non-finite gradients?)")
            if grad_norm is None:  # a lone FP32Optimizer computes the norm only when it clips
                grad_norm = self.optimizer.get_grad_norm()
            self.last_grad_norm = float(grad_norm)

    def current_lr(self) -> Optional[float]:
        """The learning rate the next step runs at (the first parameter group that has parameters)."""
        if self.optimizer is None:
            return None
        for group in self.optimizer.param_groups:
            if group["params"]:
                return float(group["lr"])
        return None

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor of parameters, gradient buffers and optimizer state this module holds here."""
        out = [p.data for p in self.module.parameters()]
        if self.ddp is not None:
            for buf in self.ddp.buffers + self.ddp.expert_parallel_buffers:
                out.append(buf.grad_data)
                if buf.param_data is not None:
                    out.append(buf.param_data)
        if self.optimizer is not None:
            for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                inner = getattr(opt, "optimizer", None)
                if inner is None:
                    continue
                for st in inner.state.values():
                    out.extend(v for v in st.values() if isinstance(v, torch.Tensor))
        return out

    def optimizer_state_bytes(self) -> int:
        """Bytes of this module's optimizer state on this rank: the per-parameter tensors of the torch
        optimizer inside the Megatron one (Adam's two moments; SGD without momentum holds none),
        without the step counters. With the distributed optimizer these cover only this rank's shard
        of the module's DP x CP group (0 before the first step: the state is created lazily)."""
        total = 0
        if self.optimizer is not None:
            for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                inner = getattr(opt, "optimizer", None)
                for st in inner.state.values() if inner is not None else ():
                    total += sum(
                        v.numel() * v.element_size()
                        for k, v in st.items()
                        if k != "step" and isinstance(v, torch.Tensor)
                    )
        return total

    def resident_bytes(self) -> int:
        """Bytes of this module's state whose storage is allocated right now (offload frees it)."""
        seen, total = set(), 0
        for t in self.state_tensors():
            st = t.untyped_storage()
            if st.data_ptr() in seen:
                continue
            seen.add(st.data_ptr())
            total += st.nbytes()
        return total

"""The optimizer section of a job (`OptimConfig`, Megatron's flag names) and the optimizer and precision
rules every front end checks (`check_optimizer_flags`). Pure: no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from megatron_hetero.layout.flags import flag_field


#: the optimizers a layout run builds (Megatron's names)
OPTIMIZERS = ("adam", "sgd")


@dataclass(frozen=True)
class OptimConfig:
    """Megatron optimizer settings shared by all modules (Megatron flag names; `train`'s flags are
    generated from the fields, `layout.flags`)."""

    optimizer: str = flag_field("adam", group="training", choices=list(OPTIMIZERS))
    lr: float = flag_field(1e-3, group="training")
    weight_decay: float = flag_field(0.0, group="training")
    adam_beta1: float = flag_field(0.9, group="training")
    adam_beta2: float = flag_field(0.999, group="training")
    adam_eps: float = flag_field(1e-8, group="training")
    clip_grad: float = flag_field(0.0, group="training")
    # bf16 parameters: Megatron's mixed-precision optimizer with fp32 main weights (--bf16 sets the
    # model's precision too: `config.model.LlavaSpec.bf16`)
    bf16: bool = flag_field(
        False,
        "bf16 parameters and compute, fp32 main weights in the optimizer (Megatron's mixed precision)",
        group="training",
    )
    # fp16 parameters and compute with Megatron's loss scaler: ONE scale for the whole model on every
    # rank (`runtime.loss_scale`; --fp16 sets the model's precision too: `LlavaSpec.fp16`)
    fp16: bool = flag_field(
        False,
        "fp16 parameters and compute, fp32 main weights, the loss scaled by one (dynamic) loss scale for "
        "the whole model (Megatron's mixed precision)",
        group="training",
    )
    loss_scale: Optional[float] = flag_field(
        None, "--fp16: a constant loss scale (a positive power of 2); default: the dynamic loss scale", group="training"
    )
    initial_loss_scale: float = flag_field(
        2.0**32, "--fp16: the dynamic loss scale to start from (default 2**32)", group="training"
    )
    min_loss_scale: float = flag_field(
        1.0, "--fp16: the dynamic loss scale's floor (default {default})", group="training"
    )
    loss_scale_window: float = flag_field(
        1000,
        "--fp16: double the loss scale after this many steps without inf/nan (default {default})",
        group="training",
    )
    hysteresis: int = flag_field(
        2, "--fp16: halve the loss scale after this many steps with inf/nan (default {default})", group="training"
    )
    # Megatron's DistributedOptimizer per module: each module's optimizer state (Adam moments, and the
    # fp32 main weights under --bf16) is sharded over the module's own DP x CP group; gradients are
    # reduce-scattered and the updated parameters all-gathered over that group instead of one
    # all-reduce (`runtime.module_state`)
    use_distributed_optimizer: bool = flag_field(
        False,
        "shard each module's optimizer state over the module's own DP x CP group (Megatron's distributed "
        "optimizer: reduce-scatter of gradients, all-gather of parameters); the losses do not change",
        group="training",
    )
    # Megatron's --overlap-grad-reduce per module: DDP's backward hooks launch each bucket's asynchronous
    # reduction (all-reduce, or reduce-scatter with the distributed optimizer) during the module's last
    # backward of the step; every earlier backward runs inside the module's `ddp.no_sync()` (the
    # schedules), and `ModuleState.finalize_grads` waits for them (`runtime.module_state`)
    overlap_grad_reduce: bool = flag_field(
        False,
        "reduce each module's gradient buckets asynchronously during its last backward of the step "
        "(Megatron DDP's overlap); the losses do not change",
        group="training",
    )
    # Megatron's --ddp-bucket-size (elements per gradient bucket; Megatron's default when unset:
    # max(40M, 1M x the module's DP size), one bucket for the tiny model)
    ddp_bucket_size: Optional[int] = flag_field(
        None,
        "--overlap-grad-reduce: parameters (elements) per gradient bucket (default: Megatron's, max(4e7, 1e6 x DP))",
        group="training",
    )
    # Megatron's --overlap-param-gather (with the distributed optimizer and --overlap-grad-reduce): the
    # optimizer step leaves the parameter all-gather to DDP's forward pre-hooks of the next forward;
    # the end of training gathers first (`ModuleState.gather_params`; no checkpoints: training.setup)
    overlap_param_gather: bool = flag_field(
        False,
        "--use-distributed-optimizer --overlap-grad-reduce: all-gather each module's updated parameters "
        "bucket by bucket in the next forward (DDP's forward pre-hooks) instead of in the optimizer step",
        group="training",
    )
    # the floor of a decaying learning-rate schedule (param groups carry it; the job's schedule sets it
    # from its --min-lr: `config.lr_schedule.LRSchedule.min_lr`)
    min_lr: float = 0.0
    # gradients accumulated and reduced in fp32 (Megatron's --accumulate-allreduce-grads-in-fp32, which
    # its validate_args sets for bf16); False: in the parameters' dtype (Megatron's fp16 default)
    grad_reduce_in_fp32: bool = True

    def validate(self) -> None:
        """ValueError naming the flag: the rules every front end keeps (`check_optimizer_flags`), then
        train's own (Megatron's scripts take these from Megatron's parser)."""
        check_optimizer_flags(self)
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if self.clip_grad < 0:
            raise ValueError(f"--clip-grad must be >= 0, got {self.clip_grad}")
        if self.loss_scale is not None and not self.loss_scale > 0:
            raise ValueError(f"--loss-scale must be > 0, got {self.loss_scale}")
        if not 0 < self.min_loss_scale <= self.initial_loss_scale:
            raise ValueError(
                f"--min-loss-scale {self.min_loss_scale} and --initial-loss-scale {self.initial_loss_scale}: "
                f"need 0 < min <= initial"
            )
        if not self.loss_scale_window >= 1:
            raise ValueError(f"--loss-scale-window must be >= 1, got {self.loss_scale_window}")
        if not isinstance(self.hysteresis, int) or self.hysteresis < 1:
            raise ValueError(f"--hysteresis must be a positive integer, got {self.hysteresis!r}")
        if self.ddp_bucket_size is not None:
            if not self.overlap_grad_reduce:
                raise ValueError(
                    f"--ddp-bucket-size {self.ddp_bucket_size} needs --overlap-grad-reduce (without it each "
                    f"module's gradients are reduced as one bucket after its last backward)"
                )
            if not isinstance(self.ddp_bucket_size, int) or self.ddp_bucket_size < 1:
                raise ValueError(f"--ddp-bucket-size must be a positive integer, got {self.ddp_bucket_size!r}")


def check_optimizer_flags(settings: Any) -> None:
    """The optimizer and precision rules of every front end, on Megatron's flag names: `OptimConfig`
    (train's flags) and Megatron's parsed arguments (the Megatron-LM scripts, `megatron_lm.checks`)
    both carry them as attributes (one missing reads as Megatron's default). ValueError naming the flag."""
    optimizer = getattr(settings, "optimizer", "adam")
    fp16, bf16 = bool(getattr(settings, "fp16", False)), bool(getattr(settings, "bf16", False))
    loss_scale = getattr(settings, "loss_scale", None)
    distributed = bool(getattr(settings, "use_distributed_optimizer", False))
    overlap_grad_reduce = bool(getattr(settings, "overlap_grad_reduce", False))
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"--optimizer must be adam or sgd, got {optimizer!r}")
    if bf16 and fp16:
        raise ValueError("--bf16 and --fp16 exclude each other")
    if loss_scale is not None and not fp16:
        raise ValueError(f"--loss-scale {loss_scale} needs --fp16 (bf16 and fp32 train with the loss unscaled)")
    if getattr(settings, "overlap_param_gather", False) and not (distributed and overlap_grad_reduce):
        raise ValueError(
            "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce (as in Megatron: "
            "the parameters it all-gathers in the next forward are the distributed optimizer's shards)"
        )
    if distributed and optimizer != "adam":
        raise ValueError(
            f"--use-distributed-optimizer needs --optimizer adam, got {optimizer} (Megatron's "
            f"DistributedOptimizer supports Adam-style optimizers only)"
        )

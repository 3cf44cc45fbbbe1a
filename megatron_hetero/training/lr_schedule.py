"""A job's learning-rate schedule (`config.lr_schedule.LRSchedule`) on a module's optimizer: Megatron-core's
`OptimizerParamScheduler`. Importing this module does not import torch.
"""

from __future__ import annotations

from megatron_hetero.config.lr_schedule import LRSchedule


def build_scheduler(
    optimizer, schedule: LRSchedule, lr: float, weight_decay: float, train_iters: int, override: bool = False
):
    """Megatron's `OptimizerParamScheduler` on one module's Megatron optimizer (sets the rate of
    iteration 1 already). `override`: a checkpoint's schedule values are replaced by these
    (Megatron's --override-opt-param-scheduler); otherwise they must match."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=lr,
        min_lr=schedule.min_lr,
        lr_warmup_steps=schedule.lr_warmup_iters,
        lr_decay_steps=schedule.decay_iters(train_iters),
        lr_decay_style=schedule.lr_decay_style,
        start_wd=weight_decay,
        end_wd=weight_decay,
        wd_incr_steps=max(train_iters, 1),
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=override,
    )

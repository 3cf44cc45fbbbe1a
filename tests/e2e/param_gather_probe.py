"""A `tests/megatron_fork.py` probe (`MEGATRON_FORK_PROBE`): counts each Megatron DDP bucket group's
parameter all-gathers on this rank by where they were dispatched, so a test can tell the
--overlap-param-gather path (the next forward's pre-hooks) from the optimizer step's gather.

`report()`: one line `param-gather probe rank R: {"hook": N, "step": N, "forced": N, "other": N}`:
`hook`: dispatched from a forward pre-hook (`finish_param_sync`), `step`: inside the distributed
optimizer's `step_with_ready_grads` (Megatron's path without the flag), `forced`: synchronous
`force_sync` gathers (before evaluation, a checkpoint, the end), `other`: anything else.
"""

from __future__ import annotations

import json
import os

COUNTS = {"hook": 0, "step": 0, "forced": 0, "other": 0}
_WHERE = {"hook": False, "step": False}


def install() -> None:
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup as Group
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    start, finish, step = Group.start_param_sync, Group.finish_param_sync, DistributedOptimizer.step_with_ready_grads

    def start_param_sync(self, *a, force_sync: bool = False, **k):
        kind = "forced" if force_sync else "hook" if _WHERE["hook"] else "step" if _WHERE["step"] else "other"
        COUNTS[kind] += 1
        return start(self, *a, force_sync=force_sync, **k)

    def within(flag: str, fn):
        def wrapped(*a, **k):
            _WHERE[flag] = True
            try:
                return fn(*a, **k)
            finally:
                _WHERE[flag] = False

        return wrapped

    Group.start_param_sync = start_param_sync
    Group.finish_param_sync = within("hook", finish)
    DistributedOptimizer.step_with_ready_grads = within("step", step)


def report() -> str:
    return f"param-gather probe rank {os.environ.get('RANK')}: {json.dumps(COUNTS)}"

"""One layout's training state of a patched Megatron-LM script (`ScriptSession`): what the driver's
steps 3-5 build (`driver.py`'s module docstring) on every rank, and `destroy()` to take it down
again, so that `--hetero-autotune` can build the script's model under another layout in the same
processes (`megatron_lm/autotune.py`).

A session holds: Megatron's reference model, optimizer and scheduler (built with
`setup_model_and_optimizer`, which loads `--load` into them; kept for `--save`), the layout's process
groups (`runtime.topology.Topology`), each served module's part in Megatron DDP with its own
optimizer and Megatron scheduler, the stage runner, the schedule and Megatron's front end (log
lines, evaluation, checkpoints). Building one is collective over the world; so is `destroy`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch.distributed as dist

from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.megatron_lm import checkpoints, precision
from megatron_hetero.megatron_lm import weights as weights_mod
from megatron_hetero.megatron_lm.front_end import ScriptFrontEnd
from megatron_hetero.megatron_lm.log import Evaluator, print_last
from megatron_hetero.plan.rank_plan import rank_plan
from megatron_hetero.runtime.config import OptimConfig, RuntimeConfig
from megatron_hetero.runtime.module_state import ModuleState
from megatron_hetero.runtime.schedules import schedule_for
from megatron_hetero.training.config import JobConfig

PREFIX = "megatron-hetero megatron-lm"


def optim_config(args: Any) -> OptimConfig:
    """The modules' optimizer settings from Megatron's arguments."""
    return OptimConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,  # by the whole model's norm (runtime/optimizer_step.py)
        use_distributed_optimizer=bool(args.use_distributed_optimizer),  # per module's DP x CP group
        overlap_grad_reduce=bool(getattr(args, "overlap_grad_reduce", False)),  # DDP's bucket overlap
        # the all-gather of the updated parameters in the next forward (DDP's forward pre-hooks)
        overlap_param_gather=bool(getattr(args, "overlap_param_gather", False)),
        ddp_bucket_size=getattr(args, "ddp_bucket_size", None),
        **precision.optim_fields(args),  # --bf16, --fp16 and the loss-scale flags
    )


class ScriptSession:
    """Everything one rank trains the script's model with under `layout` (module docstring), from
    iteration `start` (0, or the checkpoint's under `args.load`). `tracer`: a recording tracer for
    the schedule (`--hetero-autotune`'s windows); `job`: the `JobConfig` a `--hetero-autotune` run
    prices and moves (`megatron_lm.autotune.cost_job`; `training.autotune_run` reads `session.job`),
    None otherwise. The `model` is the script's `driver.ScriptModel`."""

    def __init__(
        self,
        model,
        args: Any,
        layout: HeteroLayout,
        datasets_provider: Callable,
        model_provider: Callable,
        tracer=None,
        job: Optional[JobConfig] = None,
    ) -> None:
        from megatron.training.training import get_optimizer_param_scheduler

        from megatron_hetero.compat import ensure_global_memory_buffer
        from megatron_hetero.megatron_lm.checks import check_uneven_pipeline
        from megatron_hetero.runtime.topology import Topology

        ensure_global_memory_buffer()
        self.args, self.layout, self.job = args, layout, job
        source = None
        if args.load or args.hetero_init == "reference":
            source = weights_mod.ReferenceSource.build(model_provider, keep=bool(args.save))
        self.source = source
        if model.prepare is not None:
            model.prepare(args)  # what the model provider sets on args, also without it
        self.topo = topo = Topology.build(layout, timeout_s=args.hetero_comm_timeout)
        try:
            plan = rank_plan(
                layout, topo.rank, args.global_batch_size, args.micro_batch_size, args.hetero_offload_encoder
            )
            optim = optim_config(args)
            scaler = precision.loss_scaler(optim)  # --fp16: one loss scale for every module of the rank
            if source is not None and args.load:  # --fp16: the checkpoint's loss scale (Megatron's grad_scaler)
                precision.restore_loss_scale(scaler, source.grad_scaler)
            states: dict[str, ModuleState] = {}
            schedulers: dict[str, Any] = {}
            self.split = split = check_uneven_pipeline(args, layout)  # (module, layers per stage) or None
            for m in layout.modules:
                if not topo.serves(m.name):
                    continue
                pgs = topo.pg_collection(m.name)
                part = model.build(args, layout, m, pgs, model_provider)
                first = model.first_layer(layout, m)
                if split is not None and m.name == split[0] and pgs.tp.rank() == 0 and pgs.dp.rank() == 0:
                    held = weights_mod.stage_layers(part, first)  # what Megatron built, the weights' offsets
                    print(
                        f"{PREFIX}: module {m.name}: pipeline stage {pgs.pp.rank()} holds layers "
                        f"{held.start}-{held.stop - 1}",
                        flush=True,
                    )
                if source is not None:
                    weights_mod.copy_into(part, source, pgs, first_layer=first)
                states[m.name] = ModuleState(m.name, part, pgs, optim, loss_scaler=scaler)
                if source is not None and args.load:
                    weights_mod.copy_optimizer_state(part, states[m.name].optimizer, source, pgs, first_layer=first)
            if source is not None:
                source.release()
            for name, s in states.items():
                if s.optimizer is not None:
                    schedulers[name] = get_optimizer_param_scheduler(s.optimizer)
            self.start = start = source.iteration if source is not None else 0
            if start:  # resume: the schedule where the saving run left it
                for sched in schedulers.values():
                    sched.step(increment=start * args.global_batch_size)
            self.plan, self.states = plan, states
            self.runner = runner = model.runner(args, plan, states, datasets_provider)
            config = RuntimeConfig(
                comm_timeout_s=args.hetero_comm_timeout, schedule=getattr(args, "hetero_schedule", "1f1b")
            )
            if tracer is not None:
                config = dataclasses.replace(config, tracer=tracer)
            self.schedule = schedule_for(plan, config, topo, states, runner)
            save = None
            if source is not None and source.kept is not None:  # --save: Megatron's checkpoint of the reference model
                first_layers = {m.name: model.first_layer(layout, m) for m in layout.modules}

                def save(iteration: int) -> None:
                    checkpoints.save_reference_checkpoint(source, iteration, states, first_layers)

                schedulers = {**schedulers, "<reference>": source.kept[2]}  # the reference scheduler follows
            self.schedulers = schedulers
            self.saves = save is not None
            self.front = ScriptFrontEnd(
                args, states, Evaluator(self.schedule, runner, states, args, start), save, train_iters=args.train_iters
            )
        except BaseException:
            self.destroy()
            raise

    def describe(self) -> str:
        """The line each session prints when it starts training."""
        layout = self.layout
        return (
            f"{PREFIX}: training with {layout.placement} layout "
            + ", ".join(f"{m.name} tp{m.tp}·pp{m.pp}·dp{m.dp}@{m.ranks}" for m in layout.modules)
            + f", from iteration {self.start}"
        )

    def announce(self) -> None:
        """Megatron's last rank prints the pipeline split (uneven flags) and `describe()`."""
        if self.split is not None:
            print_last(f"{PREFIX}: module {self.split[0]}: pipeline stages hold {self.split[1]} layers")
        print_last(self.describe())

    def loop_schedule(self):
        """The schedule `training.loop.run_loop` steps."""
        return self.schedule

    def loop_spec(self, start: int, end: int, final_save: bool = True):
        """The `LoopSpec` of iterations [start, end) with the run's checkpoints (Megatron-LM's
        schedulers count samples: each step advances them by the global batch)."""
        from megatron_hetero.training.loop import LoopSpec

        a = self.args
        return LoopSpec(
            start=start,
            train_iters=end,
            scheduler_increment=a.global_batch_size,
            save=a.save if self.saves else None,
            save_interval=a.save_interval,
            rank=self.topo.rank,
            final_save=final_save,
        )

    def finish(self) -> None:
        """After the last step: --overlap-param-gather's last parameters gathered, the schedule
        closed, and a world barrier (collective)."""
        for state in self.states.values():
            state.gather_params()
        self.schedule.close()
        dist.barrier()

    def destroy(self) -> None:
        """The layout's process groups destroyed; the reference model let go (collective)."""
        if self.source is not None:
            self.source.kept = None
        self.topo.destroy()


def reference_session_args(args: Any, load: Optional[str]) -> None:
    """`args` set for a session that resumes the whole run from Megatron's checkpoint under `load`
    (optimizer, scheduler, RNG and iteration: none of --finetune / --no-load-optim / --no-load-rng)."""
    args.load = load
    args.finetune = False
    args.no_load_optim = False
    args.no_load_rng = False

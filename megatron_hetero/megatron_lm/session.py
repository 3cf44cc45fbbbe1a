"""A patched Megatron-LM script's model spec (`ScriptSpec`, a `training.session.ModelSpec`) and
`script_session`, its `training.session.Session`: what the driver's steps 3-5 build (`driver.py`'s
module docstring) on every rank, and `destroy()` to take it down again, so that `--hetero-autotune`
can build the script's model under another layout in the same processes (`megatron_lm/autotune.py`).

A session holds: Megatron's reference model, optimizer and scheduler (built with
`setup_model_and_optimizer`, which loads `--load` into them; kept for `--save`), the layout's process
groups (`runtime.topology.Topology`), each served module's part in Megatron DDP with its own
optimizer and Megatron scheduler, the stage runner, the schedule and Megatron's front end (log
lines, evaluation, checkpoints). Building one is collective over the world; so is `destroy`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.megatron_lm import checkpoints, precision, weights as weights_mod
from megatron_hetero.megatron_lm.front_end import ScriptFrontEnd
from megatron_hetero.megatron_lm.log import Evaluator, print_last
from megatron_hetero.config.optim import OptimConfig
from megatron_hetero.runtime.config import RuntimeConfig
from megatron_hetero.runtime.module_state import ModuleState
from megatron_hetero.config.job import Job
from megatron_hetero.training.session import Session
from megatron_hetero.compat import ensure_global_memory_buffer
from megatron_hetero.megatron_lm.checks import check_uneven_pipeline

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


class ScriptSpec:
    """The script's model as a `training.session.ModelSpec` (module docstring): `model` is the
    script's `driver.ScriptModel`, `args` Megatron's arguments (read here, inside the scripts' door),
    the providers the script's own. (The `JobConfig` a `--hetero-autotune` run prices and moves is the
    session's `job`, from the validated `Job`.)"""

    barrier_at_finish = True  # the script's ranks meet before Megatron's teardown
    meter = None  # no --log-memory for the scripts

    def __init__(
        self,
        model,
        args: Any,
        datasets_provider: Callable,
        model_provider: Callable,
    ) -> None:
        self.model, self.args = model, args
        self.datasets_provider, self.model_provider = datasets_provider, model_provider
        self.comm_timeout_s = args.hetero_comm_timeout
        self.global_batch_size, self.micro_batch_size = args.global_batch_size, args.micro_batch_size
        self.offload_encoder = args.hetero_offload_encoder
        self.scheduler_increment = args.global_batch_size  # Megatron-LM's schedulers count samples
        self.save_interval = args.save_interval
        self.source: Optional[weights_mod.ReferenceSource] = None
        self.split: Optional[tuple] = None  # (module, layers per stage) of the uneven pipeline flags
        self.save: Optional[Callable[[int], None]] = None  # --save: Megatron's checkpoint of the reference model

    @property
    def save_dir(self) -> Optional[str]:
        """--save when the run has Megatron's checkpoint writer (the reference model was kept)."""
        return self.args.save if self.save is not None else None

    def prepare(self, layout: HeteroLayout) -> None:
        """The attention buffer; with --load or --hetero-init reference, Megatron's own model on the
        reference layout (`weights.ReferenceSource`, collective); what the model provider sets on args."""

        ensure_global_memory_buffer()
        args = self.args
        if args.load or args.hetero_init == "reference":
            self.source = weights_mod.ReferenceSource.build(self.model_provider, keep=bool(args.save))
        if self.model.prepare is not None:
            self.model.prepare(args)  # what the model provider sets on args, also without it

    def build_states(self, plan, topo) -> tuple[dict, dict, int]:
        """Each served module's part built from Megatron's arguments on its own groups, the reference
        weights (and with --load its optimizer state) copied in, Megatron DDP, optimizer and scheduler;
        with --save the reference model's scheduler follows the modules' (`"<reference>"`)."""
        from megatron.training.training import get_optimizer_param_scheduler

        args, model, source, layout = self.args, self.model, self.source, plan.layout
        optim = optim_config(args)
        scaler = precision.loss_scaler(optim)  # --fp16: one loss scale for every module of the rank
        if source is not None and args.load:  # --fp16: the checkpoint's loss scale (Megatron's grad_scaler)
            precision.restore_loss_scale(scaler, source.grad_scaler)
        states: dict[str, ModuleState] = {}
        schedulers: dict[str, Any] = {}
        self.split = split = check_uneven_pipeline(args, layout)
        for m in layout.modules:
            if not topo.serves(m.name):
                continue
            pgs = topo.pg_collection(m.name)
            part = model.build(args, layout, m, pgs, self.model_provider)
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
        start = source.iteration if source is not None else 0
        if start:  # resume: the schedule where the saving run left it
            for sched in schedulers.values():
                sched.step(increment=start * args.global_batch_size)
        if source is not None and source.kept is not None:
            first_layers = {m.name: model.first_layer(layout, m) for m in layout.modules}
            kept = source

            def save(iteration: int) -> None:
                checkpoints.save_reference_checkpoint(kept, iteration, states, first_layers)

            self.save = save
            schedulers = {**schedulers, "<reference>": source.kept[2]}  # the reference scheduler follows
        return states, schedulers, start

    def build_runner(self, plan, states: dict):
        return self.model.runner(self.args, plan, states, self.datasets_provider)

    def runtime_config(self, plan) -> RuntimeConfig:
        args = self.args
        return RuntimeConfig(comm_timeout_s=args.hetero_comm_timeout, schedule=getattr(args, "hetero_schedule", "1f1b"))

    def front_end(self, session) -> ScriptFrontEnd:
        """Megatron's log lines, evaluation (`log.Evaluator`) and checkpoint writer."""
        args = self.args
        evaluator = Evaluator(session.schedule, session.runner, session.states, args, session.start)
        return ScriptFrontEnd(args, session.states, evaluator, self.save, train_iters=args.train_iters)

    def describe(self, session) -> str:
        """The line each session prints when it starts training."""
        layout = session.layout
        return (
            f"{PREFIX}: training with {layout.placement} layout "
            + ", ".join(f"{m.name} tp{m.tp}·pp{m.pp}·dp{m.dp}@{m.ranks}" for m in layout.modules)
            + f", from iteration {session.start}"
        )

    def announce(self, session) -> None:
        """Megatron's last rank prints the pipeline split (uneven flags) and `describe()`."""
        if self.split is not None:
            print_last(f"{PREFIX}: module {self.split[0]}: pipeline stages hold {self.split[1]} layers")
        print_last(self.describe(session))

    def finish(self, session) -> None:
        """Nothing beyond the session's own (parameters gathered, schedule closed, barrier)."""

    def release(self) -> None:
        """The reference model let go."""
        if self.source is not None:
            self.source.kept = None


def script_session(
    model,
    args: Any,
    job: Job,
    datasets_provider: Callable,
    model_provider: Callable,
    tracer=None,
) -> Session:
    """The `Session` the script's model trains with under the validated `job` (`ScriptSpec`; its
    `JobConfig` is the one `--hetero-autotune` prices, None without), from iteration `session.start`
    (0, or the checkpoint's under `args.load`). `tracer`: a recording tracer for the schedule
    (`--hetero-autotune`'s windows). Collective over the world."""
    return Session(job, ScriptSpec(model, args, datasets_provider, model_provider), tracer=tracer)


def reference_session_args(args: Any, load: Optional[str]) -> None:
    """`args` set for a session that resumes the whole run from Megatron's checkpoint under `load`
    (optimizer, scheduler, RNG and iteration: none of --finetune / --no-load-optim / --no-load-rng)."""
    args.load = load
    args.finetune = False
    args.no_load_optim = False
    args.no_load_rng = False

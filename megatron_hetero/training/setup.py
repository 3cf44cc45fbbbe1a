"""Per-rank setup of a heterogeneous LLaVA-style job: groups, modules, boundaries, optimizers.

Everything is validated before any process group exists (`validate_job`), so a bad layout or
batch configuration is rejected with a ValueError in the launching process.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_hetero.layout.spec import HeteroLayout, Recompute
from megatron_hetero.layout.validate import check_heads, check_recompute
from megatron_hetero.data import synthetic
from megatron_hetero.models.llava_checks import check_sequence_parallel, validate_model
from megatron_hetero.models.llava import EncoderModule, LanguageModule, LlavaSpec, OutputModule, data_config
from megatron_hetero.config.model import language_modules
from megatron_hetero.plan.rank_plan import RankPlan, check_rank_plans
from megatron_hetero.plan.schedule import check_schedule_choice
from megatron_hetero.runtime.module_state import ModuleState
from megatron_hetero.config.job import Job, JobConfig, job_recompute, JobDraft
from megatron_hetero.checkpoint.loadable import check_loadable
from megatron_hetero.checkpoint.pretrained import check_converted, is_converted
from megatron_hetero.compat.device import get_device
from megatron_hetero.models.clip_encoder import ClipEncoderModule
from megatron_hetero.models.qwen_encoder import QwenEncoderModule
from megatron_hetero.models.siglip_encoder import SiglipEncoderModule
from megatron_hetero.models.whisper_encoder import WhisperEncoderModule
from megatron_hetero.runtime.loss_scale import LossScaler
from megatron_hetero.training.autotune_checks import check_autotune
from megatron_hetero.training.writers import check_logging


def validate_job(draft: JobDraft) -> Job:
    """Every user error of the job `draft` (its layout and `JobConfig`, as a door made them), as
    ValueError with the arithmetic, before any group is created; the validated `Job` (which carries
    the rank plans' checked arithmetic: each rank then builds its own plan without computing it
    again). Once per process: the doors call it (`cli.train`)."""
    layout, job = draft.layout, draft.config
    spec = job.spec
    job.optim.validate()
    job.schedule.validate(job.optim.lr, job.train_iters)
    if spec.bf16 != job.optim.bf16:
        raise ValueError("--bf16 must set both the model's and the optimizer's precision")
    recompute = job_recompute(job)
    if recompute is not None:
        check_recompute(recompute, "--recompute-granularity/--recompute-method/--recompute-num-layers")
    if spec.fp16 != job.optim.fp16:
        raise ValueError("--fp16 must set both the model's and the optimizer's precision")
    if not isinstance(job.save_interval, int) or job.save_interval < 0:
        raise ValueError(f"--save-interval must be >= 0, got {job.save_interval!r}")
    if job.save_interval and not job.save:
        raise ValueError(f"--save-interval {job.save_interval} needs --save DIR")
    if not isinstance(job.log_interval, int) or job.log_interval < 0:
        raise ValueError(f"--log-interval must be >= 0, got {job.log_interval!r}")
    if not isinstance(job.eval_interval, int) or job.eval_interval < 0:
        raise ValueError(f"--eval-interval must be >= 0, got {job.eval_interval!r}")
    if job.eval_iters is not None and (not isinstance(job.eval_iters, int) or job.eval_iters < 1):
        raise ValueError(f"--eval-iters must be a positive integer, got {job.eval_iters!r}")

    check_logging(job)  # --tensorboard-dir, --wandb-*: the packages and the folders
    if job.autotune is not None:
        check_autotune(draft)
    if job.eval_iters is not None and not job.eval_interval:
        raise ValueError(f"--eval-iters {job.eval_iters} needs --eval-interval N (evaluate every N iterations)")
    synthetic.validate(data_config(spec))
    tiled = sorted(n for n, e in spec.encoders.items() if e.max_tiles and n in layout.names)
    if layout.boundary_mode == "hierarchical" and tiled:
        raise ValueError(
            f"boundary_mode hierarchical needs a fixed sequence length on every edge, but encoder(s) {tiled} "
            "send a variable number of image tokens (--encoder-max-tiles); use boundary_mode direct"
        )
    for name in ("global_batch_size", "micro_batch_size", "train_iters"):
        v = getattr(job, name)
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
    if spec.hidden_size % spec.num_attention_heads:
        raise ValueError(
            f"--hidden-size {spec.hidden_size} is not divisible by --num-attention-heads {spec.num_attention_heads}"
        )
    langs = language_modules(layout, spec)
    known = set(spec.encoders) | set(spec.outputs) | {m.name for m in langs}
    for m in layout.modules:
        if m.name not in known:
            raise ValueError(
                f"module {m.name} is neither an encoder ({sorted(spec.encoders)}), an output module "
                f"({sorted(spec.outputs)}) nor a language module"
            )
    if not isinstance(job.sequence_parallel, bool):
        raise ValueError(f"--sequence-parallel is a switch (True/False), got {job.sequence_parallel!r}")
    # experts (ep, expt_tp) and output modules
    validate_model(layout, spec, sequence_parallel=job.sequence_parallel)
    if job.sequence_parallel:
        check_sequence_parallel(layout, spec)
    for name in spec.encoders:
        if name not in layout.names:
            raise ValueError(f"encoder {name} has no module in the layout (modules are {layout.names})")
        edges = [e for e in layout.edges if e.src == name]
        if [e.dst for e in edges] != [langs[0].name]:
            raise ValueError(
                f"encoder {name} must have exactly one edge, '{name} -> {langs[0].name}' "
                f"(the first language module); it has {[str(e) for e in edges]}"
            )
    for a, b in zip(langs, langs[1:]):
        if not any(e.src == a.name and e.dst == b.name for e in layout.edges):
            raise ValueError(f"language segments {a.name} and {b.name} need the edge '{a.name} -> {b.name}'")
    for m in layout.modules:
        g = job.global_batch_size
        if g % m.dp:
            raise ValueError(
                f"module {m.name}: --global-batch-size {g} is not divisible by dp({m.dp}) (remainder {g % m.dp})"
            )
        check_heads(m, spec.encoders.get(m.name, spec).num_attention_heads)
    for m in langs:
        if m.cp > 1 and spec.seq_length % (2 * m.cp):
            raise ValueError(f"module {m.name}: --seq-length {spec.seq_length} is not divisible by 2*cp = {2 * m.cp}")
    if job.offload_encoder and layout.placement != "colocated":
        raise ValueError("--hetero-offload-encoder applies to the colocated schedule only")
    check_schedule_choice(job.hetero_schedule, layout)
    # Batch arithmetic and the schedule tables (colocated phases, disjoint 1F1B per stage): arithmetic on
    # module degrees, once per process; each rank then builds only its own plan (`rank_plan`).
    checked = check_rank_plans(layout, job.global_batch_size, job.micro_batch_size, job.offload_encoder)
    for name, enc in spec.encoders.items():
        m = layout.module(name)
        if enc.num_layers % m.pp:
            raise ValueError(f"module {name}: {enc.num_layers} encoder layers do not split over pp({m.pp})")
    if job.save:
        from pathlib import Path

        p = Path(job.save)
        if p.exists() and not p.is_dir():
            raise ValueError(f"--save {job.save}: exists and is not a directory")
    if job.load_fallback and not job.load:
        raise ValueError("--load-fallback needs --load DIR")
    for flag, on in (
        ("--finetune", job.finetune),
        ("--no-load-optim", job.no_load_optim),
        ("--no-load-rng", job.no_load_rng),
    ):
        if on and not job.load:
            raise ValueError(f"{flag} applies to --load DIR (none given)")
    if job.load:
        (check_converted if is_converted(job.load) else check_loadable)(job.load, draft)
    return Job(layout, job, checked)


def build_module(
    name: str,
    layout: HeteroLayout,
    spec: LlavaSpec,
    pgs,
    recompute: Optional[Recompute] = None,
    sequence_parallel: bool = False,
    device: Optional[torch.device] = None,
) -> torch.nn.Module:
    """The module `name` for this rank's stage, on the compute device; `recompute`: the job's
    activation recompute, for a module whose layout sets none of its own; `sequence_parallel`: the
    job's --sequence-parallel (language modules with tp > 1 only: `models.llava`). `device`: where
    it ends (default the compute device; `torch.device("meta")` for `dryrun`, which builds it under
    a meta-device context: the same module code, shapes and dtypes, no storage)."""

    m = layout.module(name)
    if m.recompute is None and recompute is not None:
        m = m.replace(recompute=recompute)
    if name in spec.encoders and spec.encoders[name].kind == "clip":
        mod = ClipEncoderModule(name, spec.encoders[name], spec.hidden_size, m, pgs, spec.seed, spec.transformer_impl)
    elif name in spec.encoders and spec.encoders[name].kind == "siglip":
        mod = SiglipEncoderModule(name, spec.encoders[name], spec.hidden_size, m, pgs, spec.seed, spec.transformer_impl)
    elif name in spec.encoders and spec.encoders[name].kind == "whisper":
        mod = WhisperEncoderModule(
            name, spec.encoders[name], spec.hidden_size, m, pgs, spec.seed, spec.transformer_impl
        )
    elif name in spec.encoders and spec.encoders[name].kind == "qwen2.5-vl":
        mod = QwenEncoderModule(name, spec.encoders[name], spec.hidden_size, m, pgs, spec.seed, spec.transformer_impl)
    elif name in spec.encoders:
        mod = EncoderModule(name, spec.encoders[name], spec.hidden_size, m, pgs, spec.seed, spec.transformer_impl)
    elif name in spec.outputs:
        mod = OutputModule(name, spec.outputs[name], spec.hidden_size, m, pgs, spec.seed)
    else:
        langs = language_modules(layout, spec)
        mod = LanguageModule(
            name,
            spec,
            m,
            pgs,
            first_segment=langs[0].name == name,
            last_segment=langs[-1].name == name,
            last_segment_feeds_outputs=bool(layout.consumers(langs[-1].name)),
            sequence_parallel=sequence_parallel,
        )
    if spec.bf16 or spec.fp16:
        # Megatron's mixed precision: bf16 (fp16) parameters and compute; the optimizer keeps fp32 main
        # weights (OptimConfig.bf16, .fp16). Initialised in fp32 (the same values in every layout), then cast.
        dtype = torch.bfloat16 if spec.bf16 else torch.float16
        mod = mod.to(dtype)
        for sub in mod.modules():
            cfg = getattr(sub, "config", None)
            if cfg is not None and hasattr(cfg, "pipeline_dtype"):
                cfg.bf16, cfg.fp16 = spec.bf16, spec.fp16
                cfg.params_dtype, cfg.pipeline_dtype = dtype, dtype
    return mod.to(device if device is not None else get_device())


def build_modules(
    plan: RankPlan, job: JobConfig, topo, device: Optional[torch.device] = None
) -> dict[str, tuple[torch.nn.Module, object]]:
    """Every module this rank serves (its plan's) as (module, its ProcessGroupCollection of `topo`),
    in the layout's order: what `build_states` wraps and `dryrun` builds on the meta device."""
    out = {}
    for m in plan.layout.modules:
        if plan.serves(m.name):
            pgs = topo.pg_collection(m.name)
            out[m.name] = (
                build_module(m.name, plan.layout, job.spec, pgs, job_recompute(job), job.sequence_parallel, device),
                pgs,
            )
    return out


def build_states(plan: RankPlan, job: JobConfig, topo) -> dict[str, ModuleState]:
    """Every module this rank serves (its plan's), wrapped with DDP and its optimizer (none if frozen),
    on the module's groups of `topo`."""
    import dataclasses

    optim = dataclasses.replace(job.optim, min_lr=job.schedule.min_lr)  # the param groups' floor (the scheduler's)
    # --fp16: one loss scaler on this rank for every module it serves (runtime.loss_scale)
    scaler = LossScaler(optim) if optim.fp16 else None
    return {
        name: ModuleState(name, module, pgs, optim, loss_scaler=scaler)
        for name, (module, pgs) in build_modules(plan, job, topo).items()
    }

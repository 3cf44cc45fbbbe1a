"""What `train --hetero-autotune` checks before any rank starts (`check_autotune`, called by
`training.setup.validate_job`) and the pieces of a job on another layout it is built from: the
base cost profile, the workload, the job on a candidate layout. Imports no torch at module level.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.config.autotune import parse_fix
from megatron_hetero.config.job import Job, JobDraft
from megatron_hetero.planner.hardware import Profile
from megatron_hetero.planner.hardware_presets import load_hardware
from megatron_hetero.planner.model import workload
from megatron_hetero.planner.layout_cost import candidate_for, cost_micro_batch, train_micro_batch
from megatron_hetero.config.model import language_modules


def encoder_names(layout: HeteroLayout, spec) -> tuple[str, ...]:
    """The layout's encoder modules in the model's order (the cost model's first encoder, then its
    extra encoders: `planner.layout_cost.candidate_for`)."""
    return tuple(n for n in spec.encoders if n in layout.names)


def module_names(layout: HeteroLayout, spec) -> tuple[str, str]:
    """(first encoder module name, language module name as the candidate's layouts name it)."""

    enc = encoder_names(layout, spec)[0]
    langs = [m.name for m in language_modules(layout, spec)]
    llm = langs[0] if len(langs) == 1 else langs[0].rsplit("_", 1)[0]
    return enc, llm


def check_autotune(draft: JobDraft) -> None:
    """ValueError (before any rank starts) for a job `draft` (its layout and `JobConfig`, not
    validated yet) `--hetero-autotune` cannot tune: no --save (the switch goes through a checkpoint
    there), --trace (the autotune traces its own windows), a model the cost model does not price
    (fixed image tokens, no output modules), or a bad setting (`AutotuneConfig.validate`,
    --autotune-fix, --autotune-profile)."""
    layout, job = draft.layout, draft.config
    tune = job.autotune
    if tune is None:
        return
    tune.validate(job.train_iters)
    if not job.save:
        raise ValueError("--hetero-autotune needs --save DIR: a layout switch goes through a checkpoint there")
    if job.trace:
        raise ValueError(
            "--hetero-autotune records its own measuring windows; leave out --trace (trace the chosen layout, "
            "autotune-layout.yaml, in a run of its own)"
        )

    spec = job.spec
    try:
        if spec.outputs:
            raise ValueError(f"the cost model does not price output modules ({sorted(spec.outputs)})")
        workload_of(draft)
        candidate_for(layout, spec, job.offload_encoder)
        enc, llm = module_names(layout, spec)
        encs = encoder_names(layout, spec)
        fixes = parse_fix(tune.autotune_fix)
        unknown = sorted(set(fixes) - {*encs, llm})
        if unknown:
            raise ValueError(f"--autotune-fix names {unknown}; the modules are {', '.join(encs)} and {llm}")
        base_profile(tune)
    except ValueError as exc:
        raise ValueError(f"--hetero-autotune: {exc}") from None


def base_profile(tune):
    """The profile the run is calibrated from: --autotune-profile, or the --autotune-hardware preset."""

    if tune.autotune_profile:
        return Profile.load(tune.autotune_profile)
    return Profile.from_hardware(load_hardware(tune.autotune_hardware))


def job_on(run: Job | JobDraft, layout: HeteroLayout, wl, load: Optional[str]) -> JobDraft:
    """The run's job `run` (the running `Job`; only its config is read) moved to `layout`, as a
    `JobDraft` for the check to validate: its config with the micro-batch of the cost model's
    `wl.micro_batch` samples per replica (`layout_cost.train_micro_batch`) and, with `load`, resuming
    that checkpoint whole (optimizer, schedulers, RNG and data position: none of the weights-only
    options); without, a job that loads nothing (the candidates' check before the switch checkpoint
    exists)."""

    job = run.config
    out = dataclasses.replace(job, micro_batch_size=train_micro_batch(layout, job.spec, wl.micro_batch))
    if load is None:
        out = dataclasses.replace(out, load=None, finetune=False, pretrained_checkpoint=None)
    else:
        out = dataclasses.replace(
            out,
            load=load,
            load_fallback=False,
            finetune=False,
            no_load_optim=False,
            no_load_rng=False,
            pretrained_checkpoint=None,
        )
    return JobDraft(layout, out)


def variable_inputs(spec) -> dict[str, int]:
    """Inputs per sample the cost model prices for each encoder with a variable number of tiles or
    speech chunks (`--encoder-max-tiles`, conversation and spoken-digits data): the most a sample
    holds, as the memory model does. The calibration to the run's measured spans scales the encoder
    term, so the worst case sets how the candidates compare, not the predicted seconds alone."""
    return {n: e.max_tiles for n, e in spec.encoders.items() if e.max_tiles}


def workload_of(job: Job | JobDraft):
    """The cost model's `Workload` of `job` (the running `Job`, or a `JobDraft` before validation):
    its config run on its layout (its micro-batch as the cost model counts it; variable tiles priced
    at `variable_inputs`)."""

    config = job.config
    micro = cost_micro_batch(job.layout, config.spec, config.micro_batch_size)
    return workload(config.spec, config.global_batch_size, micro, inputs=variable_inputs(config.spec))


def carry_settings(src: HeteroLayout, dst: HeteroLayout, spec) -> HeteroLayout:
    """`dst` (a candidate's layout) with what `src`, the run's layout, says of its modules besides
    their degrees and ranks: `frozen` (a frozen encoder stays frozen: the switch must not change
    training), `recompute` and `role`. A module takes the settings of `src`'s module of its name; a
    language segment of `dst` that `src` does not have (language_a, language_b) those of `src`'s
    first language module."""

    by_name = {m.name: m for m in src.modules}
    first_language = language_modules(src, spec)[0]
    mods = []
    for m in dst.modules:
        same = by_name.get(m.name)
        if same is None and m.name not in spec.encoders:
            same = first_language
        if same is not None:
            m = dataclasses.replace(
                m, frozen=same.frozen, recompute=same.recompute, role=same.role if same.name == m.name else m.role
            )
        mods.append(m)
    return dataclasses.replace(dst, modules=tuple(mods))

"""`--load` checked in the launching process, before any rank starts (`check_loadable`): the checkpoint
to resume from, every file against the manifest, each torch_dist folder's `.metadata` and common state
(0.19's `common_state` bytes or 0.16.1's `common.pt`) through the restricted unpicklers, and the model,
batch, data and schedule against this job.
"""

from __future__ import annotations

from pathlib import Path

from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.checkpoint.files import (
    STATE_FILE,
    select_checkpoint,
)
from megatron_hetero.checkpoint.keys import logical_models
from megatron_hetero.checkpoint.records import spec_record, data_position


def load_note(root: str | Path, fallback: bool) -> str | None:
    """What `--load root` resumes from when it is not simply the marker's checkpoint (after
    `check_loadable` passed), for the CLI to print."""
    return select_checkpoint(root, fallback)[2]


def read_torch_files(d: Path, state: dict) -> None:
    """Read every torch_dist folder of checkpoint `d` (each folder of a manifest entry named
    `.metadata` or `common.pt`) the way the ranks will: metadata.json, `.metadata` and the common state
    through the restricted unpicklers (`safe_unpickle.check_folder`), so a crafted or damaged file
    stops the job before a rank starts."""
    from megatron_hetero.checkpoint import safe_unpickle

    names = (safe_unpickle.METADATA_FILE, safe_unpickle.LEGACY_COMMON_FILE)
    for folder in sorted({(d / rel).parent for rel in state.get("files", {}) if Path(rel).name in names}):
        safe_unpickle.check_folder(folder)


def check_loadable(root: str | Path, layout: HeteroLayout, job) -> int:
    """Everything about `--load` that can be checked before a rank starts; returns the iteration to
    resume from. ValueError naming the file or the mismatch. With `job.load_fallback`, a checkpoint
    before an incomplete or damaged newest one (`load_note` says which and why)."""
    d, state, note = select_checkpoint(root, getattr(job, "load_fallback", False))
    it = state["iteration"]
    read_torch_files(d, state)
    problems = []
    saved_spec, spec = state.get("model"), spec_record(job.spec)
    if saved_spec != spec:
        saved_d = saved_spec if isinstance(saved_spec, dict) else {}
        diffs = [
            f"{k}: {saved_d.get(k)!r} in the checkpoint, {spec.get(k)!r} now"
            for k in sorted(set(spec) | set(saved_d))
            if saved_d.get(k) != spec.get(k)
        ]
        problems.append("the model differs (" + "; ".join(diffs) + ")")
    saved_models = state.get("modules", {})
    now = logical_models(layout)
    if set(saved_models) != set(now):
        problems.append(f"the checkpoint holds the models {sorted(saved_models)}, this layout has {sorted(now)}")
    if state.get("global_batch_size") != job.global_batch_size:
        problems.append(
            f"--global-batch-size {job.global_batch_size}, the checkpoint's data position is in "
            f"batches of {state.get('global_batch_size')} (changing the batch size needs the data "
            f"loader's sample position)"
        )
    data = state.get("data", {})
    if data.get("next_sample") != it * state.get("global_batch_size", 0):
        problems.append(f"data position {data!r} is not iteration {it} x global batch")
    now_data = data_position(job, it)
    for key in ("kind", "dataset"):
        if data.get(key) != now_data.get(key):
            problems.append(f"the data differs: {key} {data.get(key)!r} in the checkpoint, {now_data.get(key)!r} now")
    for name in set(saved_models) & set(now):
        rec = saved_models[name]
        if rec.get("optimizer") not in (None, job.optim.optimizer):
            problems.append(f"model {name}: saved with --optimizer {rec.get('optimizer')}, now {job.optim.optimizer}")
    if not getattr(job, "override_opt_param_scheduler", False):
        from megatron_hetero.checkpoint.scheduler_state import schedule_mismatch

        current = job.schedule.scheduler_config(job.optim.lr, job.train_iters)
        for rec in saved_models.values():
            if rec.get("scheduler_config"):
                diffs = schedule_mismatch(rec["scheduler_config"], current)
                if diffs:
                    problems.append(
                        "the learning-rate schedule differs ("
                        + "; ".join(diffs)
                        + "); pass --override-opt-param-scheduler to use this job's"
                    )
                    break
    if it >= job.train_iters:
        problems.append(f"the checkpoint is at iteration {it}, --train-iters is {job.train_iters}: nothing to train")
    if problems:
        raise ValueError(f"--load {root} (iteration {it}, {d / STATE_FILE}): " + "; ".join(problems))
    return it

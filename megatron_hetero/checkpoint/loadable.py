"""`--load` checked in the launching process, before any rank starts (`check_loadable`): the checkpoint
to resume from, every file against the manifest, each torch_dist folder's `.metadata` and common state
(0.19's `common_state` bytes or 0.16.1's `common.pt`) through the restricted unpicklers, and the model,
batch, data and schedule against this job.
"""

from __future__ import annotations

from pathlib import Path

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


PRECISION_FIELDS = ("bf16", "fp16")
# where the data puts the encoders' tokens and how it packs sequences: no parameter depends on them, so a
# run from the weights only (--finetune, converted weights) takes the job's (e.g. captions, then
# conversations with a variable number of image tiles)
DATA_FIELDS = (
    "encoders.offset",
    "encoders.max_tiles",
    "documents",
    "pack_documents",
    "reset_position_ids",
    "reset_attention_mask",
)


# position embeddings with no table of positions: no parameter's size depends on --seq-length
NO_POSITION_TABLE = ("rope", "mrope")


def weights_only_fields(now: dict) -> tuple[str, ...]:
    """The recorded model's fields a run from the weights only (--finetune, converted weights) may
    change, for the model `now` (a `spec_record`): `DATA_FIELDS`; the sequence length (and the output
    heads' offsets from its end) when the model has no position table; when every encoder is a
    Qwen2.5-VL tower, its image tokens, their rows and its `feature_dim`: the tower has no position
    table (2-D RoPE) and its features are a data format (pixel blocks, grey or RGB, or the image
    processor's patches: `models.qwen_encoder.blocks_to_patches`) before one patch embedding of the
    same size (e.g. captions of fixed-size images, then conversations at native resolution)."""
    out = DATA_FIELDS
    if now.get("position_embedding_type") in NO_POSITION_TABLE:
        out += ("seq_length", "outputs")
    encoders = now.get("encoders") or {}
    if encoders and all(isinstance(e, dict) and e.get("kind") == "qwen2.5-vl" for e in encoders.values()):
        out += ("encoders.tokens", "encoders.image_rows", "encoders.feature_dim")
    return out


def model_differences(saved: object, now: dict, ignore: tuple[str, ...] = ()) -> list[str]:
    """'field: saved in the checkpoint, now now' for every field of the recorded model `saved` (a
    `spec_record`) that differs from `now`, fields of `ignore` left out (a missing fp16 is False)."""
    saved_d = dict(saved) if isinstance(saved, dict) else {}
    now = dict(now)
    for d in (saved_d, now):
        d.setdefault("fp16", False)
        for k in ignore:
            if k.startswith("encoders.") and isinstance(d.get("encoders"), dict):
                d["encoders"] = {n: {f: v for f, v in e.items() if f != k[9:]} for n, e in d["encoders"].items()}
            d.pop(k, None)
    return [
        f"{k}: {saved_d.get(k)!r} in the checkpoint, {now.get(k)!r} now"
        for k in sorted(set(now) | set(saved_d))
        if saved_d.get(k) != now.get(k)
    ]


def weights_only(job) -> bool:
    """--finetune: the checkpoint's model weights only (iteration 0, a fresh optimizer, scheduler,
    data position and RNG)."""
    return bool(getattr(job, "finetune", False))


def loads_optimizer(job) -> bool:
    """Whether `--load` restores the optimizer and its scheduler (not with --finetune or --no-load-optim)."""
    return not (weights_only(job) or getattr(job, "no_load_optim", False))


def loads_rng(job) -> bool:
    """Whether `--load` restores the RNG states (not with --finetune or --no-load-rng)."""
    return not (weights_only(job) or getattr(job, "no_load_rng", False))


def check_loadable(root: str | Path, draft) -> int:
    """Everything about `--load` that can be checked before a rank starts, for the job `draft` (a
    `config.job.JobDraft`: its layout and `JobConfig`, not validated yet); returns the iteration
    to resume from (0 with --finetune). ValueError naming the file or the mismatch. With the config's
    `load_fallback`, a checkpoint before an incomplete or damaged newest one (`load_note` says which
    and why).

    A resume (no --finetune) continues the run exactly: the same model and precision (unless
    --no-load-optim: the fp32 main weights then come from the loaded weights), the same global batch
    (the data position is iteration x batch), the same data stream, and the checkpoint's learning-rate
    schedule (unless --override-opt-param-scheduler or --no-load-optim). --finetune takes the weights
    only: any batch, data, schedule, --train-iters and precision; the model must be the same but for
    `weights_only_fields` (a rope or mrope model may change --seq-length: it has no position table)."""
    layout, job = draft.layout, draft.config
    d, state, note = select_checkpoint(root, getattr(job, "load_fallback", False))
    it = state["iteration"]
    read_torch_files(d, state)
    problems = []
    saved_spec, spec = state.get("model"), spec_record(job.spec)
    finetune, with_optim = weights_only(job), loads_optimizer(job)
    ignore: tuple[str, ...] = () if with_optim else PRECISION_FIELDS
    if finetune:
        ignore += weights_only_fields(spec)
    diffs = model_differences(saved_spec, spec, ignore)
    if diffs:
        why = ""
        if with_optim and not model_differences(saved_spec, spec, PRECISION_FIELDS):
            why = (
                "; the optimizer state (fp32 main weights, Adam moments, --fp16's loss scale) is the saved "
                "precision's: pass --no-load-optim or --finetune to start it afresh in this one"
            )
        elif finetune and any(x.startswith("seq_length") for x in diffs):
            why = "; --seq-length sizes the learned absolute position table (change it with a rope or mrope model only)"
        problems.append("the model differs (" + "; ".join(diffs) + ")" + why)
    saved_models = state.get("modules", {})
    now = logical_models(layout)
    if finetune:
        if not set(now) <= set(saved_models):
            problems.append(f"the checkpoint holds the models {sorted(saved_models)}, this layout has {sorted(now)}")
    elif set(saved_models) != set(now):
        problems.append(f"the checkpoint holds the models {sorted(saved_models)}, this layout has {sorted(now)}")
    if finetune:
        if problems:
            raise ValueError(f"--load {root} --finetune (iteration {it}, {d / STATE_FILE}): " + "; ".join(problems))
        return 0
    if state.get("global_batch_size") != job.global_batch_size:
        problems.append(
            f"--global-batch-size {job.global_batch_size}, the checkpoint's data position is in "
            f"batches of {state.get('global_batch_size')} (a resume continues at iteration {it} x the batch; "
            f"pass --finetune to start from the weights at iteration 0)"
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
        if with_optim and rec.get("optimizer") not in (None, job.optim.optimizer):
            problems.append(
                f"model {name}: saved with --optimizer {rec.get('optimizer')}, now {job.optim.optimizer} "
                "(pass --no-load-optim to start the optimizer afresh)"
            )
    if with_optim and not getattr(job, "override_opt_param_scheduler", False):
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

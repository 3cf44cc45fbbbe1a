"""`train --load DIR` of a converted (weights-only) checkpoint.

A checkpoint written by `megatron-hetero convert hf-to-checkpoint` (`convert.hf_weights`, marked
`"origin": "convert"`) is a starting point, not a run to resume: it has no optimizer, scheduler,
data position or RNG, so `check_loadable`'s resume checks (batch size, data position, schedule)
do not apply. `check_converted` checks what does: the manifest (every file's bytes and sha256),
the recorded model against this job's (not its precision: converted fp32 weights load into a
`--bf16`/`--fp16` run, cast, the fresh optimizer's fp32 main weights taken from them; nor, for a
rope model, its sequence length), and the logical models against the layout's. Loading
then goes through `checkpoint.save_load.load_checkpoint` like any checkpoint (no optimizer state:
the optimizers start fresh; iteration 0).
"""

from __future__ import annotations

from pathlib import Path

ORIGIN = "convert"  # train_state.json's "origin" of a conversion's checkpoint


def is_converted(root: str | Path) -> bool:
    """True if the latest checkpoint under `root` is a conversion's (ValueError if unreadable)."""
    from megatron_hetero.checkpoint.files import read_train_state

    return read_train_state(root)[1].get("origin") == ORIGIN


def check_converted(root: str | Path, draft) -> int:
    """The checks of a converted checkpoint (module docstring) for the job `draft` (a
    `config.job.JobDraft`: its layout and `JobConfig`, not validated yet); returns 0.
    ValueError naming the file or the mismatch."""
    from megatron_hetero.checkpoint.files import STATE_FILE, read_train_state, verify_manifest
    from megatron_hetero.checkpoint.keys import logical_models
    from megatron_hetero.checkpoint.loadable import read_torch_files
    from megatron_hetero.checkpoint.records import spec_record

    layout, job = draft.layout, draft.config

    d, state = read_train_state(root)
    verify_manifest(d, state)
    read_torch_files(d, state)  # the ranks' restricted unpicklers, here first: a bad file stops the job now
    problems = []
    from megatron_hetero.checkpoint.loadable import PRECISION_FIELDS, model_differences, weights_only_fields

    # the precision is the job's: the fp32 (or bf16) weights are cast into a --bf16/--fp16 model, whose
    # fresh optimizer takes its fp32 main weights from them (as Megatron-LM's load without optimizer state)
    now = spec_record(job.spec)
    ignore: tuple[str, ...] = PRECISION_FIELDS + weights_only_fields(now)
    diffs = model_differences(state.get("model"), now, ignore)
    if diffs:
        problems.append(
            "the model differs (" + "; ".join(diffs) + "); give the recorded model's flags, or none to build it"
        )
    models, have = set(state.get("modules", {})), set(logical_models(layout))
    if not have <= models:
        problems.append(f"the checkpoint holds the models {sorted(models)}, this layout has {sorted(have)}")
    if problems:
        raise ValueError(f"--load {root} (converted weights, {d / STATE_FILE}): " + "; ".join(problems))
    return 0

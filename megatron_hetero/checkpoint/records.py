"""What a checkpoint's `train_state.json` records of the job as plain data, for a resume to compare: the
model sizes (`spec_record`) and the data loader's position (`data_position`).
"""

from __future__ import annotations

import dataclasses
import json


def spec_record(spec) -> dict:
    """The model sizes a checkpoint must agree on (not the random seed: it only drives the synthetic data)."""
    d = dataclasses.asdict(spec)
    d.pop("seed", None)
    if not d.get("fp16"):
        d.pop("fp16", None)  # the records of checkpoints before --fp16 existed (bf16 and fp32) stay as they were
    from megatron_hetero.models.architecture import drop_default_architecture

    drop_default_architecture(d)  # the tiny GPT's record stays what checkpoints before these options hold
    return json.loads(json.dumps(d))


def data_position(job, iteration: int) -> dict:
    """The loader's position after `iteration` steps, as plain data: the next global sample index (both
    data sources address samples by global index: step t reads samples [t*G, (t+1)*G)), and for
    energon data the stream's identity (split, shuffle, seed: the sample order), which a resume must
    match (the dataset's folder may move between jobs; its name is recorded for people)."""
    pos: dict = {"kind": "synthetic", "next_sample": iteration * job.global_batch_size, "iteration": iteration}
    cfg = getattr(job, "data", None)
    if cfg is not None:
        pos["kind"] = "energon"
        pos["dataset"] = {"split": cfg.split, "seed": cfg.seed, "shuffle": cfg.shuffle}
        pos["dataset_path"] = str(cfg.path)
    return pos

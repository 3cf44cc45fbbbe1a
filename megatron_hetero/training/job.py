"""The training job's run on forked ranks or as one launched rank, and the model a checkpoint records.

(`train`'s flags become a `config.job.JobConfig` at its door, `cli.train_door.job_from_args`.)
`recorded_spec`: `train --load DIR` without model-size flags builds the model the checkpoint
records (its `spec_record`), so a converted Llama/Qwen2 + CLIP model needs no flags repeated; the
flags given (`config.model.ModelFlags`, `config.arch.ArchFlags`) must agree with it.
`default_micro_batch_size`: the micro-batch a layout takes when none is given. `run_local` launches
`training.trainer.train_rank` on one forked rank per layout rank and merges their records;
`run_as_rank` runs one rank under torchrun/srun.
Importing this module does not import torch."""

from __future__ import annotations

from typing import Any, Optional

from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.plan.roles import language_modules
from megatron_hetero.config.model import ENCODER_FLAGS, LlavaSpec, ModelFlags
from megatron_hetero.config.arch import ArchFlags, apply_arch_flags
from megatron_hetero.config.job import Job
from megatron_hetero.checkpoint.files import read_train_state
from megatron_hetero.checkpoint.loadable import weights_only_fields
from megatron_hetero.checkpoint.pretrained import ORIGIN
from megatron_hetero.checkpoint.records import spec_record
from megatron_hetero.launch.rank_env import apply_rank_env, check_world_size


def default_micro_batch_size(layout: HeteroLayout, global_batch: int) -> int:
    """1 for colocated layouts; for disjoint ones the smallest micro-batch size b such that the
    micro-batches of G / (dp_first_language * b) samples split evenly over every module's DP."""
    if layout.placement == "colocated":
        return 1
    first = language_modules(layout)[0]
    dps = [m.dp for m in layout.modules]
    for b in range(1, max(global_batch // first.dp, 1) + 1):
        micro = global_batch // (first.dp * b)
        if micro >= 1 and global_batch % (first.dp * b) == 0 and all((global_batch // micro) % d == 0 for d in dps):
            return b
    return 1  # nothing fits: validation explains why with the arithmetic


def recorded_spec(
    spec: LlavaSpec, load: Optional[str], finetune: bool, model: ModelFlags, arch: ArchFlags
) -> LlavaSpec:
    """`spec`, or, when `load` names a checkpoint that records its model, that model (with this
    job's seed and precision: --bf16, --fp16). Model flags given next to --load (`model`, `arch`:
    sizes, architecture, MoE) must agree with the record: Megatron-LM users pass the full model
    flags, so a flag that says what the checkpoint records is accepted and every flag not given is
    filled from the record (`overlay_flags`); a given flag that differs is refused (ValueError naming
    its field and flag). With `finetune` (--finetune) or converted weights, a different --seq-length
    is a training choice when the recorded model has no position table (rope): it is taken."""
    import dataclasses

    if not load:
        return spec

    state = read_train_state(load)[1]
    record = state.get("model")
    if not isinstance(record, dict):
        return spec
    saved = LlavaSpec.from_record(record, seed=spec.seed)
    wanted = overlay_flags(model, arch, saved)

    weights_only = finetune or state.get("origin") == ORIGIN
    everything = spec_differences(saved, wanted)
    free = weights_only_fields(spec_record(saved)) if weights_only else ()
    diffs = [d for d in everything if not _among(d[0], free)]
    if diffs:
        named = "; ".join(f"{field} ({flag}): {a!r} in the checkpoint, {b!r} given" for field, flag, a, b in diffs)
        raise ValueError(
            f"--load {load}: the model flags given differ from the checkpoint's model ({named}); "
            "give the flags of the recorded model, or none (the record fills them)"
        )
    if everything:  # --finetune / converted weights: the job's data fields, sequence length, features
        saved = wanted
    return dataclasses.replace(saved, bf16=spec.bf16, fp16=spec.fp16)


def _among(field: str, fields: tuple[str, ...]) -> bool:
    """Whether the `spec_differences` field `field` ("seq_length", "encoders.NAME.FIELD",
    "outputs.NAME.offset") is one of the record fields `fields` ("encoders.FIELD": of every encoder)."""
    parts = field.split(".")
    if parts[0] == "encoders" and len(parts) == 3:
        return f"encoders.{parts[2]}" in fields
    return parts[0] in fields


def overlay_flags(model: ModelFlags, arch: ArchFlags, spec: LlavaSpec) -> LlavaSpec:
    """`spec` with the model flags given (`model`, `arch`) applied on top (a flag not given keeps
    `spec`'s value): the language model's sizes (--num-layers ...), every encoder's (--encoder-*), the
    MoE flags (with --num-experts) and the architecture flags (`config.arch.apply_arch_flags`).
    Output heads keep their span before the end of the sequence (`spec_on_layout`)."""
    import dataclasses

    out = dataclasses.replace(spec, **model.language)
    if model.encoder:
        out = dataclasses.replace(
            out, encoders={n: dataclasses.replace(e, **model.encoder) for n, e in out.encoders.items()}
        )
    if model.moe.get("num_experts") is not None:
        out = dataclasses.replace(out, **model.moe)
    if out.seq_length != spec.seq_length and out.outputs:
        shift = out.seq_length - spec.seq_length
        out = dataclasses.replace(
            out, outputs={n: dataclasses.replace(o, offset=o.offset + shift) for n, o in out.outputs.items()}
        )
    return apply_arch_flags(arch, out, model)


# the flag that sets a spec field, where it is not `--` + the field's name
_FIELD_FLAGS = {
    "add_bias_linear": "--disable-bias-linear",
    "untie_embeddings_and_output_weights": "--share-embeddings-and-output-weights",
    "rope_scaling": "--use-rope-scaling",
}
_ENCODER_FIELD_FLAGS = {"kind": "--vision-model-type", "patch_size": "--patch-dim"}


def spec_differences(saved: LlavaSpec, now: LlavaSpec) -> list[tuple[str, str, Any, Any]]:
    """(field, flag, saved value, value now) for every model field where `now` differs from `saved`
    (encoder fields as `encoders.NAME.FIELD`), sorted by field; the precision (bf16, fp16) is not a
    model field here (the job's own)."""
    import dataclasses

    out = []
    for f in dataclasses.fields(LlavaSpec):
        if f.name in ("seed", "bf16", "fp16", "encoders", "outputs"):
            continue
        a, b = getattr(saved, f.name), getattr(now, f.name)
        if a != b:
            out.append((f.name, _FIELD_FLAGS.get(f.name, "--" + f.name.replace("_", "-")), a, b))
    for name in sorted(set(saved.encoders) | set(now.encoders)):
        ea, eb = saved.encoders.get(name), now.encoders.get(name)
        if ea is None or eb is None:
            out.append((f"encoders.{name}", "the layout's modules", ea is not None, eb is not None))
            continue
        for f in dataclasses.fields(ea):
            a, b = getattr(ea, f.name), getattr(eb, f.name)
            if a != b:
                flag = _ENCODER_FIELD_FLAGS.get(f.name, "--encoder-" + f.name.replace("_", "-"))
                if f.name not in _ENCODER_FIELD_FLAGS and f.name not in ENCODER_FLAGS:
                    flag = "--vision-model-type"
                out.append((f"encoders.{name}.{f.name}", flag, a, b))
    for name in sorted(set(saved.outputs) | set(now.outputs)):
        oa, ob = saved.outputs.get(name), now.outputs.get(name)
        if oa != ob:
            out.append((f"outputs.{name}.offset", "--seq-length", oa, ob))
    return sorted(out)


def merge_records(per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per iteration: the global loss, the slowest rank's step time, the world's figures
    of rank 0's record (--log-throughput, --log-memory: `training/run_stats.py`, `memory_bytes`
    included) and `resident_bytes`: {rank: {phase: {module: bytes}}}, each rank's module state
    resident per phase of the step (`StepResult.memory`)."""
    out = []
    for i, rec in enumerate(per_rank[0]["records"]):
        step = max(r["records"][i]["step_time_s"] for r in per_rank)
        merged = {"iteration": rec["iteration"], "loss": rec["loss"], "step_time_s": step}
        for key in (
            "consumed_samples",
            "lr",
            "grad_norm",
            "grad_norm_per_module",
            "loss_parts",
            "aux_loss",
            "loss_scale",  # --fp16
            "eval_loss",
            "eval_accuracy",
            "eval_samples",
            "eval_accuracy_name",  # "caption accuracy" or "answer accuracy" (conversations)
            "eval_parts",  # spoken digits: {"digit shown" / "digit said": {accuracy, answers}}
            # --log-throughput, --log-memory, the writers (training/run_stats.py): already the world's
            "iteration_time_s",
            "tflops_per_rank",
            "tflops_per_rank_per_module",
            "state_bytes",
            "activation_peak_bytes",
            "activation_peak_bytes_total",
            "memory_bytes",  # --log-memory: {rank: {predicted, measured, ...}}
        ):
            if rec.get(key) is not None:
                merged[key] = rec[key]
        if rec.get("skipped"):  # non-finite gradients: no module stepped
            merged["skipped"] = True
        if rec.get("no_loss_tokens"):  # no loss token in the global batch: loss NaN, gradients 0
            merged["no_loss_tokens"] = True
        if "tokens" in rec:
            merged["tokens_per_s"] = rec["tokens"] / step if step > 0 else 0.0
        merged["resident_bytes"] = {str(rank): r["records"][i]["memory"] for rank, r in enumerate(per_rank)}
        out.append(merged)
    return out


class _LinesFromRanks:
    """A pipe the ranks' global rank 0 writes its iteration lines into (inherited over fork); a
    thread of this process copies them to sys.stdout as they come (so they show while training, and
    land in whatever sys.stdout is here, a capture included)."""

    def __init__(self) -> None:
        import os
        import threading

        self._r, self._w = os.pipe()
        self._thread = threading.Thread(target=self._copy, name="rank-lines", daemon=True)
        self._thread.start()

    def write(self, text: str) -> None:  # called in the rank
        import os

        data = text.encode()
        while data:
            data = data[os.write(self._w, data) :]

    def _copy(self) -> None:
        import os
        import sys

        with os.fdopen(self._r, "rb", buffering=0) as f:
            while True:
                chunk = f.read(65536)
                if not chunk:
                    return
                sys.stdout.write(chunk.decode(errors="replace"))
                sys.stdout.flush()

    def close(self) -> None:
        """After the ranks exited: the last writer end closes, the copy drains and ends."""
        import os

        os.close(self._w)
        self._thread.join(timeout=10)


def quiet_upstream_warnings() -> None:
    """Megatron-core and torch.distributed warn on every rank about CUDA-only features (fusions, CUDA
    graphs, deprecated collective names); hide those in the launcher's ranks (inherited by fork)."""
    import warnings

    for module in (r"megatron\..*", r"torch\.distributed\..*"):
        warnings.filterwarnings("ignore", category=UserWarning, module=module)
        warnings.filterwarnings("ignore", category=FutureWarning, module=module)
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=module)


def run_local(job: Job, timeout: float = 3600.0) -> list[dict[str, Any]]:
    """Fork one rank per layout rank of the validated `job` (`training.setup.validate_job`) on the
    local host (gloo on CPU, NCCL on GPU), train, and return the merged per-iteration records.
    `runtime.launcher.RankFailure` / `RankTimeout` when a rank fails or hangs."""
    import signal

    from megatron_hetero.compat import default_backend, require_compat
    from megatron_hetero.runtime.launcher import run_ranks
    from megatron_hetero.training.trainer import train_rank

    layout, config = job.layout, job.config
    require_compat("training.job.run_local")
    lines = _LinesFromRanks() if config.log_interval or config.progress else None
    try:
        # SIGTERM to this process reaches every rank (they lead their own process groups); with
        # --exit-signal-handler they stop after the same step and save, else they die of it
        per_rank = run_ranks(
            layout.world_size,
            train_rank,
            job,  # inherited over fork: each rank builds only its own plan from its checked arithmetic
            timeout=timeout,
            backend=default_backend(),
            forward_signals=(signal.SIGTERM,),
            pg_timeout=min(config.comm_timeout_s, timeout),
            log_write=lines.write if lines else None,
        )
    finally:
        if lines is not None:
            lines.close()
    return merge_records(per_rank)


def run_as_rank(job: Job, env, timeout_s: float) -> Optional[list[dict[str, Any]]]:
    """Run the validated `job` (`training.setup.validate_job`, once in this process) as the one rank
    `env` (a `launch.rank_env.RankEnv`: torchrun, srun) describes: join the job's process group
    through env:// (the launcher's rendezvous address, never a local default), train, and gather
    every rank's records. Returns the merged records on global rank 0, None elsewhere. ValueError
    (every rank says the same) before any group exists."""
    import socket
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from megatron_hetero.compat import default_backend, require_compat
    from megatron_hetero.training.trainer import train_rank

    check_world_size(env, job.layout.world_size)
    apply_rank_env(env)
    require_compat("training.job.run_as_rank")
    backend = default_backend()
    if backend == "gloo":
        torch.set_num_threads(1)  # as the fork launcher: ranks of one node share its cores
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    try:
        try:
            import sys

            def write(text: str) -> None:
                sys.stdout.write(text)
                sys.stdout.flush()

            result = train_rank(job, log_write=write)
        except Exception as exc:
            raise RuntimeError(
                f"rank {env.rank} on {socket.gethostname()} (local rank {env.local_rank}): {type(exc).__name__}: {exc}"
            ) from exc
        per_rank: list = [None] * env.world_size
        dist.all_gather_object(per_rank, result)
    finally:
        dist.destroy_process_group()
    return merge_records(per_rank) if env.rank == 0 else None

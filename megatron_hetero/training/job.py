"""A training job from `train`'s flags, and the local run of it on forked ranks.

`job_from_args` maps Megatron-style flag values (an argparse namespace, or any object with those
attribute names) and a layout to the `training.setup.JobConfig` the trainer runs: which modules are
encoders (every module except the language module(s): the sink of the module graph, or the modules
that declare `layers`, i.e. pipeline segments), each encoder with the `--encoder-*` sizes and its
placeholder span in the text following the previous one from position 1. `run_local` launches
`training.trainer.train_rank` on one forked rank per layout rank and merges their records.
`recorded_spec`: `train --load DIR` without model-size flags builds the model the checkpoint
records (its `spec_record`), so a converted Llama/Qwen2 + CLIP model needs no flags repeated.
Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Any, Optional

from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.plan.roles import language_layers, language_modules, roles
from megatron_hetero.training.model_args import DEFAULT_NUM_LAYERS, ModelArgs


def default_num_layers(layout: HeteroLayout) -> int:
    """What the language segments' `layers` cover, else DEFAULT_NUM_LAYERS."""
    return language_layers(layout, DEFAULT_NUM_LAYERS)


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


def resolve_model(model: ModelArgs, layout: HeteroLayout) -> ModelArgs:
    """`model` with the layout-dependent defaults filled in (num_layers, micro_batch_size)."""
    import dataclasses

    if model.num_layers is None:
        model = dataclasses.replace(model, num_layers=default_num_layers(layout))
    if model.micro_batch_size is None:
        model = dataclasses.replace(model, micro_batch_size=default_micro_batch_size(layout, model.global_batch_size))
    return model


def llava_spec(model: ModelArgs, layout: HeteroLayout, seed: int = 1234, moe: Optional[dict] = None):
    """The `models.llava.LlavaSpec` of `model` on `layout` (one encoder spec per module before the
    language model, one output head per module after it; `moe`: Megatron's MoE flags by dest name)."""
    from megatron_hetero.models.llava import EncoderSpec, LlavaSpec, OutputSpec

    model.validate()
    who = roles(layout)
    langs = list(who.language)
    encoders, offset = {}, 1
    for m in layout.modules:
        if m.name in langs or m.name in who.outputs:
            continue
        encoders[m.name] = EncoderSpec(
            num_layers=model.encoder_num_layers,
            hidden_size=model.encoder_hidden_size,
            num_attention_heads=model.encoder_num_attention_heads,
            tokens=model.encoder_tokens,
            feature_dim=model.encoder_feature_dim,
            offset=offset,
        )
        offset += model.encoder_tokens
    layers = default_num_layers(layout) if model.num_layers is None else model.num_layers
    # Output heads read the last positions of the text, each the 4 before the previous one's.
    outputs = {n: OutputSpec(tokens=4, offset=model.seq_length - 4 * (k + 1)) for k, n in enumerate(who.outputs)}
    moe = {k: v for k, v in (moe or {}).items() if v is not None}
    return LlavaSpec(
        num_layers=layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        ffn_hidden_size=model.ffn_hidden_size,
        vocab_size=model.vocab_size,
        seq_length=model.seq_length,
        encoders=encoders,
        seed=seed,
        outputs=outputs,
        **moe,
    )


SIZE_FLAGS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "ffn_hidden_size",
    "seq_length",
    "vocab_size",
    "encoder_num_layers",
    "encoder_hidden_size",
    "encoder_num_attention_heads",
    "encoder_tokens",
    "encoder_feature_dim",
    "num_experts",
)


def recorded_spec(args: Any, spec):
    """`spec`, or, when `args.load` names a checkpoint and no model-size flag was given, the model
    that checkpoint records (with this job's seed and bf16 choice)."""
    import dataclasses

    load = getattr(args, "load", None)
    from megatron_hetero.training.arch_args import arch_flags_given

    if not load or any(getattr(args, n, None) is not None for n in SIZE_FLAGS) or arch_flags_given(args):
        return spec
    from megatron_hetero.checkpoint.save_load import read_train_state
    from megatron_hetero.models.llava import LlavaSpec

    record = read_train_state(load)[1].get("model")
    if not isinstance(record, dict):
        return spec
    return dataclasses.replace(LlavaSpec.from_record(record, seed=spec.seed), bf16=spec.bf16)


def job_from_args(args: Any, layout: HeteroLayout):
    """The `JobConfig` of `train`'s flags (Megatron names: the model sizes of `ModelArgs`, and
    --train-iters --seed --optimizer --lr --weight-decay --clip-grad --adam-beta1/2 --adam-eps
    --lr-warmup-iters --lr-decay-style --lr-decay-iters --min-lr --save --save-interval --load --load-fallback
    --override-opt-param-scheduler --log-interval --eval-interval --eval-iters --hetero-offload-encoder --hetero-comm-timeout
    --exit-signal-handler; and
    `progress`, set by the CLI when stdout is a terminal) on `layout`. ValueError for invalid sizes."""
    from megatron_hetero.runtime.module_state import OptimConfig
    from megatron_hetero.training.setup import JobConfig

    model = resolve_model(ModelArgs.from_namespace(args), layout)
    moe = {
        k: getattr(args, k, None)
        for k in ("num_experts", "moe_router_topk", "moe_aux_loss_coeff", "moe_ffn_hidden_size")
    }
    spec = llava_spec(model, layout, seed=args.seed, moe=moe)
    from megatron_hetero.training.arch_args import apply_arch_args

    spec = apply_arch_args(args, spec)  # Megatron-LM's architecture flags (RMSNorm, swiglu, rope, CLIP, ...)
    recorded = recorded_spec(args, spec)  # --load without model flags: the model the checkpoint records
    if recorded is not spec:  # the data keeps the recorded vocabulary (a pretrained LM's)
        import copy

        args = copy.copy(args)
        args.vocab_size = recorded.vocab_size
    spec = recorded
    from megatron_hetero.models.caption_runner import caption_job_data

    spec, data = caption_job_data(args, spec)  # (spec, None) without --data-path
    bf16 = bool(getattr(args, "bf16", False))
    if bf16:
        import dataclasses

        spec = dataclasses.replace(spec, bf16=True)
    from megatron_hetero.training.lr_schedule import LRSchedule

    optim = OptimConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        bf16=bf16,
    )
    schedule = LRSchedule(
        lr_warmup_iters=getattr(args, "lr_warmup_iters", 0),
        lr_decay_style=getattr(args, "lr_decay_style", "constant"),
        lr_decay_iters=getattr(args, "lr_decay_iters", None),
        min_lr=getattr(args, "min_lr", 0.0),
    )
    return JobConfig(
        spec=spec,
        global_batch_size=model.global_batch_size,
        micro_batch_size=model.micro_batch_size,
        train_iters=args.train_iters,
        optim=optim,
        offload_encoder=args.hetero_offload_encoder,
        comm_timeout_s=args.hetero_comm_timeout,
        schedule=schedule,
        save=getattr(args, "save", None),
        save_interval=getattr(args, "save_interval", None) or 0,
        load=getattr(args, "load", None),
        load_fallback=bool(getattr(args, "load_fallback", False)),
        override_opt_param_scheduler=getattr(args, "override_opt_param_scheduler", False),
        log_interval=getattr(args, "log_interval", 1),
        progress=getattr(args, "progress", False),
        data=data,
        eval_interval=getattr(args, "eval_interval", None) or 0,
        eval_iters=getattr(args, "eval_iters", None),
        exit_signal_handler=bool(getattr(args, "exit_signal_handler", False)),
        trace=_trace_path(getattr(args, "trace", None)),
    )


def _trace_path(path: Optional[str]) -> Optional[str]:
    """`--trace FILE`: the absolute path (every rank writes into the same file's folder), its folder made."""
    if not path:
        return None
    from pathlib import Path

    p = Path(path).resolve()
    p.parent.mkdir(parents=True, exist_ok=True)
    return str(p)


def merge_records(per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per iteration: the global loss, the slowest rank's step time, per-rank memory."""
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
            "eval_loss",
            "eval_accuracy",
            "eval_samples",
        ):
            if rec.get(key) is not None:
                merged[key] = rec[key]
        if "tokens" in rec:
            merged["tokens_per_s"] = rec["tokens"] / step if step > 0 else 0.0
        merged["memory_bytes"] = {str(rank): r["records"][i]["memory"] for rank, r in enumerate(per_rank)}
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


def run_local(layout: HeteroLayout, job, timeout: float = 3600.0) -> list[dict[str, Any]]:
    """Validate `job` on `layout`, fork one rank per layout rank on the local host (gloo on CPU, NCCL on
    GPU), train, and return the merged per-iteration records. ValueError before any rank starts;
    `runtime.launcher.RankFailure` / `RankTimeout` when a rank fails or hangs."""
    import signal

    from megatron_hetero.compat import default_backend, require_compat
    from megatron_hetero.runtime.launcher import run_ranks
    from megatron_hetero.training.setup import validate_job
    from megatron_hetero.training.trainer import train_rank

    validate_job(layout, job)
    require_compat("training.job.run_local")
    lines = _LinesFromRanks() if job.log_interval or job.progress else None
    try:
        # SIGTERM to this process reaches every rank (they lead their own process groups); with
        # --exit-signal-handler they stop after the same step and save, else they die of it
        per_rank = run_ranks(
            layout.world_size,
            train_rank,
            layout,
            job,
            timeout=timeout,
            backend=default_backend(),
            forward_signals=(signal.SIGTERM,),
            pg_timeout=min(job.comm_timeout_s, timeout),
            log_write=lines.write if lines else None,
        )
    finally:
        if lines is not None:
            lines.close()
    return merge_records(per_rank)


def run_as_rank(layout: HeteroLayout, job, env, timeout_s: float) -> Optional[list[dict[str, Any]]]:
    """Run `job` as the one rank `env` (a `launch.rank_env.RankEnv`: torchrun, srun) describes:
    join the job's process group through env:// (the launcher's rendezvous address, never a local
    default), train, and gather every rank's records. Returns the merged records on global rank 0,
    None elsewhere. ValueError (every rank says the same) before any group exists."""
    import socket
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from megatron_hetero.compat import default_backend, require_compat
    from megatron_hetero.launch.rank_env import apply_rank_env, check_world_size
    from megatron_hetero.training.setup import validate_job
    from megatron_hetero.training.trainer import train_rank

    check_world_size(env, layout.world_size)
    validate_job(layout, job)
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

            result = train_rank(layout, job, log_write=write)
        except Exception as exc:
            raise RuntimeError(
                f"rank {env.rank} on {socket.gethostname()} (local rank {env.local_rank}): {type(exc).__name__}: {exc}"
            ) from exc
        per_rank: list = [None] * env.world_size
        dist.all_gather_object(per_rank, result)
    finally:
        dist.destroy_process_group()
    return merge_records(per_rank) if env.rank == 0 else None

"""Checkpoints of a heterogeneous job with Megatron-core `dist_checkpointing`, movable between layouts.

Directory (`--save DIR`, `--load DIR`; Megatron's names for the iteration folders and the marker):

    DIR/latest_checkpointed_iteration.txt      "10" and the sha256 of its train_state.json: the last
                                               COMPLETE checkpoint (written last, atomically)
    DIR/iter_0000012.saving/                   a save in progress (or killed): renamed when complete
    DIR/iter_0000010/train_state.json          iteration, consumed samples, data position, the layout
                                               it was saved under (YAML text), model sizes, per logical
                                               model: layout modules, optimizer kind and step counter,
                                               LR-scheduler state; a manifest (bytes + sha256 of every file),
                                               its own checksum
    DIR/iter_0000010/layout.yaml               the same layout, for people
    DIR/iter_0000010/<logical model>/          one dist_checkpointing (torch_dist) checkpoint per logical
                                               model (`vision`, `language`, ...): model + optimizer state
    DIR/iter_0000010/rng/                      per-rank RNG states (ShardedTensors of shape [world, n])

Layout independence: a *logical model* is an encoder module (its own name) or the language model
(`language`, whatever its segments are called: `language_a` with layers 0-5 and `language_b` with
layers 6-11 both save into `language/`). Every sharded key is `<logical>.<parameter name>` with the
GLOBAL layer index: Megatron's `sharded_state_dict` with `non_homogeneous_layers` writes one key per
layer numbered across pipeline stages (`layers.{layer_number - 1}`), TP shards are described by their
offsets in the full tensor, DP/CP replicas by replica ids, and a segment adds its first layer
(`layers: A-B` -> +A). Optimizer state keys are the model keys under `optimizer.state.<name>.`
(the distributed optimizer's too: Megatron's `fully_reshardable` format gathers its shards into the
same per-parameter tensors, plus `optimizer.state.param.<name>`, its fp32 main weights, which a
distributed optimizer loading a non-distributed checkpoint takes from the model's weights instead), so
Adam moments reshard with the parameters. So a checkpoint
saved under any TP/PP/DP/CP and placement (colocated or disjoint, segmented or not) loads under any
other layout of the same model.

Only ShardedTensors go through `dist_checkpointing` (its common state stays empty: Megatron-core 0.19
pickles it as one `common_state` bytes entry in rank 0's `.distcp` file, 0.16.1 into `common.pt`;
checkpoints of both load); the non-tensor state (Adam's step counter, the scheduler, the data
position) is in `train_state.json`, plain JSON. A save
writes into `iter_N.saving/`; rank 0 writes the train state (with the manifest) after every rank
finished its files (a barrier), renames the folder to `iter_N`, then replaces the marker (temp file +
`os.replace`): a save killed at any point leaves the previous checkpoint as the one that loads
(`checkpoint/files.py`: names, marker, manifest, which checkpoint `--load` takes, `--load-fallback`).

`check_loadable` (`checkpoint/loadable.py`, in the launching process, before any rank starts) picks the checkpoint, verifies
every file against the manifest (size and sha256; there are no checksums in the torch_dist format
itself), reads each `.metadata` and common state with the restricted unpicklers of `safe_unpickle`
(a crafted file is refused, nothing of it runs), and checks the model sizes, the optimizer, the batch
and the schedule against this job: any problem is a ValueError naming the file (exit 2). The ranks
load through the same restricted reads, after checking every tensor's shape against the metadata.

This file saves and loads (collective: every rank of the job calls `save_checkpoint` /
`load_checkpoint` together); the logical models and global keys are `checkpoint/keys.py`, the
sharded state dicts `checkpoint/sharded.py`, the recorded model and data position
`checkpoint/records.py`.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.checkpoint.files import (
    FORMAT,
    LAYOUT_FILE,
    RNG_DIR,
    VERSION,
    iteration_dir,
    publish,
    select_checkpoint,
    stage_dir,
    write_train_state,
)
from megatron_hetero.runtime.faults import fault_point, named_collective
from megatron_hetero.runtime.loss_scale import rank_loss_scaler
from megatron_hetero.checkpoint.keys import logical_models
from megatron_hetero.checkpoint.records import spec_record, data_position
from megatron_hetero.checkpoint.sharded import (
    model_sharded_state_dict,
    optimizer_is_stateless,
    optimizer_sharded_state_dict,
    MAIN_PARAM_PREFIX,
    MIXED_MAIN_PARAM_PREFIX,
    pop_main_params,
    put_main_params,
    rename_main_params,
    _common_steps,
    _put_common_steps,
    _rng_sharded_state_dict,
    _set_rng,
)


def _reached(point: str) -> None:
    """A point of a save (fault injection: tests replace this to kill the process there)."""


def _writer_results_in_process() -> None:
    """Saves here are synchronous, so the torch_dist writer's results travel inside this process: a
    plain queue instead of the spawn-mode Manager it would start (which re-imports `__main__` and
    outlives a forked rank that leaves with os._exit)."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    _quiet_async_save_notice()


class _AsyncSaveNotice(logging.Filter):
    """Drops Megatron-core 0.19's "MCore's async save is deprecated" warning: its synchronous save runs
    through the async writer and logs it once per process, though no save here is asynchronous."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("MCore's async save is deprecated")


def _quiet_async_save_notice() -> None:
    log = logging.getLogger("megatron.core.dist_checkpointing.strategies.torch")
    if not any(isinstance(f, _AsyncSaveNotice) for f in log.filters):
        log.addFilter(_AsyncSaveNotice())


def _guard(what: str, fn, *args, **kwargs):
    """Run a dist_checkpointing call; its failures (torch's CheckpointException derives from
    BaseException) become a ValueError naming `what`."""
    try:
        return fn(*args, **kwargs)
    except (KeyboardInterrupt, SystemExit):
        raise
    except ValueError as exc:
        if str(exc).startswith("checkpoint"):  # ours (safe_unpickle), naming the file already
            raise
        raise ValueError(f"{what}: ValueError: {str(exc)[:500]}") from exc
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:500]
        raise ValueError(f"{what}: {type(exc).__name__}: {first}") from exc


@named_collective(
    lambda root, iteration, *a, **k: (
        f"checkpoint save of iteration {iteration} under {root} (barriers and writes over the world)"
    )
)
def save_checkpoint(root: str | Path, iteration: int, job, topo, states: dict, schedulers: dict) -> Path:
    """Save iteration `iteration` of `job` (a `config.job.Job`: its layout and `JobConfig`) under
    `root` (see the module docstring); returns its directory."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_hetero.layout.yaml_io import dump_layout

    layout, config = job.layout, job.config

    _writer_results_in_process()
    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(root)
    d = stage_dir(root, iteration)  # renamed to iter_N once complete
    if rank == 0:
        if d.exists():  # an earlier save of this iteration that was killed
            shutil.rmtree(d)
        d.mkdir(parents=True)
    dist.barrier()
    _reached("staged")
    logical = logical_models(layout)
    per_module: dict[str, dict] = {}
    for name in sorted(logical):
        sd: dict = {}
        for mod_name in logical[name]:
            st = states.get(mod_name)
            if st is None:
                continue
            model_sd = model_sharded_state_dict(st, layout, config.spec)
            sd.update({f"{mod_name}.model.{k}": v for k, v in model_sd.items()})
            rec: dict[str, Any] = {}
            if st.optimizer is not None and optimizer_is_stateless(st, config.optim.optimizer):
                # Adam builds its state at its first step: under --fp16 every step so far may have been
                # skipped (non-finite gradients at the first loss scales), leaving none to save
                rec["common_steps"], rec["stateless"] = {}, True
            elif st.optimizer is not None:
                opt_sd, rest = optimizer_sharded_state_dict(st, model_sd, is_loading=False)
                sd[f"{mod_name}.optimizer"] = opt_sd
                rec["common_steps"] = _common_steps(rest)
            if mod_name in schedulers:
                rec["scheduler"] = schedulers[mod_name].state_dict()
            per_module[mod_name] = rec
        sub = d / name
        if rank == 0:
            sub.mkdir()
        dist.barrier()
        _guard(f"saving {sub}", dist_checkpointing.save, sd, str(sub))
        _reached(f"saved {name}")
        fault_point("ckpt-save", rank, iteration)  # runtime/faults.py: off unless MEGATRON_HETERO_FAULT asks
    if rank == 0:
        (d / RNG_DIR).mkdir()
    dist.barrier()
    _guard(f"saving {d / RNG_DIR}", dist_checkpointing.save, _rng_sharded_state_dict(rank, world), str(d / RNG_DIR))
    _reached("files written")
    gathered: list = [None] * world
    dist.all_gather_object(gathered, per_module)
    dist.barrier()  # every rank's files are written
    if rank == 0:
        merged: dict[str, dict] = {}
        for part in gathered:
            for mod_name, rec in part.items():
                merged.setdefault(mod_name, {}).update(rec)
        models = {}
        for name, mods in logical.items():
            recs = [merged.get(m, {}) for m in mods]
            steps = [r["common_steps"] for r in recs if r.get("common_steps")]
            sched = next((r["scheduler"] for r in recs if r.get("scheduler")), None)
            models[name] = {
                "layout_modules": mods,
                "frozen": {m: layout.module(m).frozen for m in mods},
                "optimizer": config.optim.optimizer if any("common_steps" in r for r in recs) else None,
                # its state then holds the fp32 main weights too (`optimizer.state.param.*`)
                "distributed_optimizer": bool(config.optim.use_distributed_optimizer),
                "common_steps": steps[0] if steps else {},
                # no optimizer state saved (every step skipped so far): a resume starts it afresh
                "optimizer_stateless": any(r.get("stateless") for r in recs),
                "scheduler": sched,
                "scheduler_config": config.schedule.scheduler_config(config.optim.lr, config.train_iters),
            }
        layout_text = dump_layout(layout)
        (d / LAYOUT_FILE).write_text(layout_text)
        state = {
            "format": FORMAT,
            "version": VERSION,
            "iteration": iteration,
            "consumed_samples": iteration * config.global_batch_size,
            "data": data_position(config, iteration),
            "global_batch_size": config.global_batch_size,
            "world_size": world,
            "layout": layout_text,
            "layout_dict": layout.to_dict(),
            "model": spec_record(config.spec),
            "modules": models,
        }
        scaler = rank_loss_scaler(states)
        if scaler is not None:  # --fp16: the whole model's one loss scale (the same on every rank)
            state["loss_scaler"] = scaler.record()
        state_sha = write_train_state(d, state)  # adds the manifest and its own checksum
        _reached("state written")
        publish(root, iteration, d, state_sha, reached=_reached)
    dist.barrier()
    return iteration_dir(root, iteration)


def load_checkpoint(root: str | Path, job, topo, states: dict, schedulers: dict) -> int:
    """Load the latest checkpoint under `root` into this rank's modules, optimizers, schedulers (and
    RNG, if saved under this very layout) of `job` (a `config.job.Job`: its layout and
    `JobConfig`; `load_weights` for a layout and model alone); returns its iteration. ValueError
    naming the directory. Its config's `finetune`: the model weights only, returns 0; `no_load_optim`:
    no optimizer, scheduler nor loss scale; `no_load_rng`: no RNG. A module whose optimizer starts afresh takes its fp32
    main weights (--bf16/--fp16) from the loaded model weights, cast to the model's precision (a
    checkpoint of another precision loads so: the model's weights are cast on load)."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, merge
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

    from megatron_hetero.checkpoint import safe_unpickle
    from megatron_hetero.checkpoint.scheduler_state import restore_scheduler

    # the launcher's choice again (same files, same answer; the hashes are cached or quick)
    from megatron_hetero.checkpoint.loadable import loads_optimizer, loads_rng, weights_only

    layout, config = job.layout, job.config
    d, state, _ = select_checkpoint(root, getattr(config, "load_fallback", False))
    # --finetune: the weights only, iteration 0; --no-load-optim: no optimizer nor scheduler state;
    # --no-load-rng: no RNG state (Megatron-LM's flags)
    it = 0 if weights_only(config) else state["iteration"]
    with_optim, with_rng = loads_optimizer(config), loads_rng(config)
    logical = logical_models(layout)
    # the checkpoint's precision is this job's model's (check_loadable compares the models; the job's
    # optimizer has the same precision: training.setup checks it; `convert` passes only the spec)
    mixed = bool(config.spec.bf16 or config.spec.fp16)
    for name in sorted(logical):
        saved = state["modules"][name]
        # Optimizer state moves with the parameters only if the same parameters train (a changed
        # `frozen`, e.g. LLaVA stage 1 -> 2, starts this model's optimizer afresh).
        same_frozen = set(saved.get("frozen", {}).values()) == {layout.module(m).frozen for m in logical[name]}
        sd: dict = {}
        rests: dict[str, dict] = {}
        popped: dict[str, list] = {}
        for mod_name in logical[name]:
            st = states.get(mod_name)
            if st is None:
                continue
            model_sd = model_sharded_state_dict(st, layout, config.spec)
            sd[f"{mod_name}.model"] = model_sd
            if (
                st.optimizer is not None
                and with_optim
                and saved.get("optimizer")
                and same_frozen
                and not saved.get("optimizer_stateless")
            ):
                opt_sd, rest = optimizer_sharded_state_dict(st, model_sd, is_loading=True)
                saved_distributed = bool(saved.get("distributed_optimizer"))
                if mixed and st.distributed_optimizer != saved_distributed:
                    # --bf16/--fp16: both optimizers saved the fp32 main weights, under their own keys
                    src, dst = (
                        (MAIN_PARAM_PREFIX, MIXED_MAIN_PARAM_PREFIX)
                        if st.distributed_optimizer
                        else (MIXED_MAIN_PARAM_PREFIX, MAIN_PARAM_PREFIX)
                    )
                    rename_main_params(opt_sd, src, dst)
                elif st.distributed_optimizer and not saved_distributed:
                    # fp32, saved by the non-distributed optimizer: the main weights are the model's
                    popped[mod_name] = pop_main_params(opt_sd)
                sd[f"{mod_name}.optimizer"] = opt_sd
                rests[mod_name] = rest
        flat = {}
        for mod_name in logical[name]:
            if f"{mod_name}.model" in sd:
                flat.update({f"{mod_name}.model.{k}": v for k, v in sd[f"{mod_name}.model"].items()})
            if f"{mod_name}.optimizer" in sd:
                flat[f"{mod_name}.optimizer"] = sd[f"{mod_name}.optimizer"]
        loaded = _guard(f"checkpoint {d / name} cannot be loaded", safe_unpickle.load, flat, d / name)
        for mod_name in logical[name]:
            st = states.get(mod_name)
            if st is None:
                continue
            prefix = f"{mod_name}.model."
            model = {k[len(prefix) :]: v for k, v in loaded.items() if k.startswith(prefix)}
            missing, unexpected = st.module.load_state_dict(model, strict=False)
            missing = [k for k in missing if not k.endswith("_extra_state")]
            if missing or unexpected:
                raise ValueError(
                    f"checkpoint {d / name}: module {mod_name} missing {missing[:5]}, unexpected {unexpected[:5]}"
                )
            if st.optimizer is not None and mod_name not in rests:
                # a fresh optimizer: its fp32 main weights (--bf16, --fp16) from the loaded model weights,
                # as Megatron-LM's load does without optimizer state (exact for a module that never
                # stepped; a module frozen before kept no main weights)
                st.optimizer.reload_model_params()
            if mod_name in popped:
                by_key = {v.key: model[k] for k, v in sd[f"{mod_name}.model"].items()}
                put_main_params(loaded[f"{mod_name}.optimizer"], popped[mod_name], by_key)
            if mod_name in rests:
                rest = rests[mod_name]
                dict_list_map_inplace(lambda v: v.unwrap() if isinstance(v, LocalNonpersistentObject) else v, rest)
                merge(rest, loaded[f"{mod_name}.optimizer"])
                _put_common_steps(rest, saved.get("common_steps", {}))
                st.optimizer.load_state_dict(rest)
            if with_optim and mod_name in schedulers and saved.get("scheduler"):
                restore_scheduler(schedulers[mod_name], saved["scheduler"])
    scaler = rank_loss_scaler(states)
    if (
        with_optim and scaler is not None and state.get("loss_scaler") is not None
    ):  # --fp16 (check_loadable compared the models)
        scaler.restore(state["loss_scaler"])
    same_layout = state.get("layout_dict") == layout.to_dict() and state.get("world_size") == dist.get_world_size()
    if with_rng and same_layout and (d / RNG_DIR).is_dir():
        rank, world = dist.get_rank(), dist.get_world_size()
        rng_sd = _rng_sharded_state_dict(rank, world)
        loaded = _guard(f"checkpoint {d / RNG_DIR} cannot be loaded", safe_unpickle.load, rng_sd, d / RNG_DIR)
        _set_rng(loaded)
    dist.barrier()
    return it


def load_weights(root: str | Path, layout: HeteroLayout, spec, topo, states: dict) -> int:
    """`load_checkpoint` of the latest checkpoint under `root` for a `layout` and model `spec` alone
    (no `JobConfig`: `convert`'s exports and the tests' model loads): the modules' weights, and their
    optimizers' state where `states` hold any; returns its iteration."""
    from types import SimpleNamespace

    return load_checkpoint(root, SimpleNamespace(layout=layout, config=SimpleNamespace(spec=spec)), topo, states, {})


def tensor_shapes(model_dir: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """key -> (global shape, dtype) of every tensor in one logical model's torch_dist checkpoint,
    sorted by key, read with the restricted unpickler; ValueError naming the file if it cannot be."""
    from megatron_hetero.checkpoint.safe_unpickle import tensors_metadata

    md = _guard(f"checkpoint {model_dir}: metadata cannot be read", tensors_metadata, model_dir)
    out = {}
    for key in sorted(md):
        t = md[key]
        out[key] = (tuple(t.global_shape), str(t.dtype).replace("torch.", ""))
    return out

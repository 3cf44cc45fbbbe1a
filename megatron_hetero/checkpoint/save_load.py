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
(non-distributed Megatron optimizer), so Adam moments reshard with the parameters. So a checkpoint
saved under any TP/PP/DP/CP and placement (colocated or disjoint, segmented or not) loads under any
other layout of the same model.

Only ShardedTensors go through `dist_checkpointing` (its common.pt stays empty); the non-tensor state
(Adam's step counter, the scheduler, the data position) is in `train_state.json`, plain JSON. A save
writes into `iter_N.saving/`; rank 0 writes the train state (with the manifest) after every rank
finished its files (a barrier), renames the folder to `iter_N`, then replaces the marker (temp file +
`os.replace`): a save killed at any point leaves the previous checkpoint as the one that loads
(`checkpoint_files`: names, marker, manifest, which checkpoint `--load` takes, `--load-fallback`).

`check_loadable` (in the launching process, before any rank starts) picks the checkpoint, verifies
every file against the manifest (size and sha256; there are no checksums in the torch_dist format
itself), reads each `.metadata` and `common.pt` with the restricted unpicklers of `safe_unpickle`
(a crafted file is refused, nothing of it runs), and checks the model sizes, the optimizer, the batch
and the schedule against this job: any problem is a ValueError naming the file (exit 2). The ranks
load through the same restricted reads, after checking every tensor's shape against the metadata.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any

from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.plan import roles as plan_roles
from megatron_hetero.checkpoint.files import (  # noqa: F401 - re-exported names
    FORMAT,
    LAYOUT_FILE,
    RNG_DIR,
    STATE_FILE,
    TRACKER,
    VERSION,
    iteration_dir,
    manifest,
    publish,
    read_tracker,
    read_train_state,
    select_checkpoint,
    stage_dir,
    verify_manifest,
    write_train_state,
)
from megatron_hetero.runtime.faults import fault_point, named_collective

LANGUAGE = "language"

_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")


# ---------------------------------------------------------------------------------------------------
# names (pure)
# ---------------------------------------------------------------------------------------------------


def logical_models(layout: HeteroLayout) -> dict[str, list[str]]:
    """logical model -> its layout modules: each encoder is its own; every language module (one, or
    the pipeline segments) is `language`."""
    langs = [m.name for m in plan_roles.language_modules(layout)]
    out: dict[str, list[str]] = {}
    for m in layout.modules:
        out.setdefault(LANGUAGE if m.name in langs else m.name, []).append(m.name)
    return out


def logical_of(layout: HeteroLayout, module: str) -> str:
    return next(k for k, mods in logical_models(layout).items() if module in mods)


def global_key(logical: str, key: str, layer_offset: int) -> str:
    """`decoder.layers.3.x` of a segment starting at layer A -> `<logical>.decoder.layers.{3+A}.x`."""
    if layer_offset:
        key = _LAYER.sub(lambda m: f"{m.group(1)}layers.{int(m.group(2)) + layer_offset}.", key, count=1)
    return f"{logical}.{key}"


def _reached(point: str) -> None:
    """A point of a save (fault injection: tests replace this to kill the process there)."""


def load_note(root: str | Path, fallback: bool) -> str | None:
    """What `--load root` resumes from when it is not simply the marker's checkpoint (after
    `check_loadable` passed), for the CLI to print."""
    return select_checkpoint(root, fallback)[2]


def read_torch_files(d: Path, state: dict) -> None:
    """Read every `.metadata` and `common.pt` of checkpoint `d` the way the ranks will (restricted
    unpicklers, `safe_unpickle`), so a crafted or damaged one stops the job before a rank starts."""
    from megatron_hetero.checkpoint import safe_unpickle

    for rel in sorted(state.get("files", {})):
        p = d / rel
        if p.name == safe_unpickle.METADATA_FILE:
            safe_unpickle.read_dcp_metadata(p.parent)
        elif p.name == "common.pt":
            safe_unpickle.safe_torch_load(p)


def spec_record(spec) -> dict:
    """The model sizes a checkpoint must agree on (not the random seed: it only drives the synthetic data)."""
    d = dataclasses.asdict(spec)
    d.pop("seed", None)
    from megatron_hetero.models.architecture import drop_default_architecture

    drop_default_architecture(d)  # the tiny GPT's record stays what checkpoints before these options hold
    return json.loads(json.dumps(d))


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


# ---------------------------------------------------------------------------------------------------
# sharded state dicts (torch from here on)
# ---------------------------------------------------------------------------------------------------


def _layer_offset(layout: HeteroLayout, module: str, spec) -> int:
    from megatron_hetero.models.llava import segment_layers

    if logical_of(layout, module) != LANGUAGE:
        return 0
    return segment_layers(layout.module(module), spec).start


def model_sharded_state_dict(state, layout: HeteroLayout, spec) -> dict:
    """This rank's part of module `state.name`, keyed by layout-independent global names; dict keys
    are the module's own `state_dict` names (what `load_state_dict` takes back)."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedObject
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint, sharded_state_dict_default

    mod, pgs = state.module, state.pgs
    metadata = {"dp_cp_group": pgs.dp_cp, "non_homogeneous_layers": True}
    own = {n: p for n, p in mod.named_parameters(recurse=False)}
    sd = make_sharded_tensors_for_checkpoint(own, "", tp_group=pgs.tp, dp_cp_group=pgs.dp_cp) if own else {}
    # Megatron modules built without a `tp_group` attribute (the projector) fall back to the global
    # parallel_state group, which a per-module grid does not have: lend them the module's TP group.
    lent = [m for m in mod.modules() if isinstance(m, MegatronModule) and not hasattr(m, "tp_group")]
    for m in lent:
        m.tp_group = pgs.tp
    try:
        for name, child in mod.named_children():
            sd.update(sharded_state_dict_default(child, f"{name}.", (), metadata, tp_group=pgs.tp))
    finally:
        for m in lent:
            del m.tp_group
    logical, offset = logical_of(layout, state.name), _layer_offset(layout, state.name, spec)
    out = {}
    for k, v in sd.items():
        if isinstance(v, ShardedObject) and k.endswith("_extra_state"):
            if v.data is not None and not _empty_extra_state(v.data):
                raise NotImplementedError(f"module {state.name}: {k} holds extra state; checkpoints do not save it yet")
            continue
        assert isinstance(v, ShardedBase), (k, type(v))
        v.key = global_key(logical, v.key, offset)
        out[k] = v
    return out


def _empty_extra_state(obj) -> bool:
    import io

    import torch

    if isinstance(obj, io.BytesIO):
        return len(obj.getvalue()) == 0
    return isinstance(obj, torch.Tensor) and obj.numel() == 0


def _split_sharded(sd: dict) -> tuple[dict, dict]:
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    return extract_matching_values(sd, lambda v: isinstance(v, ShardedBase))


def optimizer_sharded_state_dict(state, model_sd: dict, is_loading: bool) -> tuple[dict, dict]:
    """(ShardedTensors of the optimizer state, the rest: param groups and the common step counter)."""
    osd = state.optimizer.sharded_state_dict(model_sd, is_loading, metadata={"chained_optim_avoid_prefix": True})
    return _split_sharded(osd)


def _common_steps(rest: dict) -> dict[str, float]:
    """{'' or chained index: Adam's step counter} found in the optimizer's non-sharded part."""
    import torch

    out = {}
    inners = rest.items() if rest and all(isinstance(k, int) for k in rest) else [("", rest)]
    for tag, inner in inners:
        step = inner.get("state", {}).get("common_step")
        if step is not None:
            out[str(tag)] = float(step.item() if isinstance(step, torch.Tensor) else step)
    return out


def _put_common_steps(rest: dict, steps: dict[str, float]) -> None:
    import torch

    for tag, step in steps.items():
        inner = rest if tag == "" else rest[int(tag)]
        inner.setdefault("state", {})["common_step"] = torch.tensor(step, dtype=torch.float32)


def _rng_sharded_state_dict(rank: int, world: int) -> dict:
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.tensor_parallel import random as mrandom

    states = {"torch": torch.get_rng_state(), "accelerator": mrandom._get_cuda_rng_state()}
    for name, st in mrandom.get_cuda_rng_tracker().get_states().items():
        states[f"tracker.{name}"] = st
    return {
        k: ShardedTensor.from_rank_offsets(
            f"rng.{k}", v.detach().cpu().clone().unsqueeze(0), (0, rank, world), replica_id=0
        )
        for k, v in states.items()
    }


def _set_rng(loaded: dict) -> None:
    import torch
    from megatron.core.tensor_parallel import random as mrandom

    torch.set_rng_state(loaded["torch"][0])
    mrandom._set_cuda_rng_state(loaded["accelerator"][0])
    tracker = {k[len("tracker.") :]: v[0] for k, v in loaded.items() if k.startswith("tracker.")}
    if tracker:
        mrandom.get_cuda_rng_tracker().set_states(tracker)


def _writer_results_in_process() -> None:
    """Saves here are synchronous, so the torch_dist writer's results travel inside this process: a
    plain queue instead of the spawn-mode Manager it would start (which re-imports `__main__` and
    outlives a forked rank that leaves with os._exit)."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


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


# ---------------------------------------------------------------------------------------------------
# save / load (collective: every rank of the job calls them together)
# ---------------------------------------------------------------------------------------------------


@named_collective(
    lambda root, iteration, *a, **k: (
        f"checkpoint save of iteration {iteration} under {root} (barriers and writes over the world)"
    )
)
def save_checkpoint(
    root: str | Path, iteration: int, layout: HeteroLayout, job, topo, states: dict, schedulers: dict
) -> Path:
    """Save iteration `iteration` under `root` (see the module docstring); returns its directory."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_hetero.layout.yaml_io import dump_layout

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
            model_sd = model_sharded_state_dict(st, layout, job.spec)
            sd.update({f"{mod_name}.model.{k}": v for k, v in model_sd.items()})
            rec: dict[str, Any] = {}
            if st.optimizer is not None:
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
                "optimizer": job.optim.optimizer if any("common_steps" in r for r in recs) else None,
                "common_steps": steps[0] if steps else {},
                "scheduler": sched,
                "scheduler_config": job.schedule.scheduler_config(job.optim.lr, job.train_iters),
            }
        layout_text = dump_layout(layout)
        (d / LAYOUT_FILE).write_text(layout_text)
        state = {
            "format": FORMAT,
            "version": VERSION,
            "iteration": iteration,
            "consumed_samples": iteration * job.global_batch_size,
            "data": data_position(job, iteration),
            "global_batch_size": job.global_batch_size,
            "world_size": world,
            "layout": layout_text,
            "layout_dict": layout.to_dict(),
            "model": spec_record(job.spec),
            "modules": models,
        }
        state_sha = write_train_state(d, state)  # adds the manifest and its own checksum
        _reached("state written")
        publish(root, iteration, d, state_sha, reached=_reached)
    dist.barrier()
    return iteration_dir(root, iteration)


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


def load_checkpoint(root: str | Path, layout: HeteroLayout, job, topo, states: dict, schedulers: dict) -> int:
    """Load the latest checkpoint under `root` into this rank's modules, optimizers, schedulers (and
    RNG, if saved under this very layout); returns its iteration. ValueError naming the directory."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, merge
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

    from megatron_hetero.checkpoint import safe_unpickle
    from megatron_hetero.checkpoint.scheduler_state import restore_scheduler

    # the launcher's choice again (same files, same answer; the hashes are cached or quick)
    d, state, _ = select_checkpoint(root, getattr(job, "load_fallback", False))
    it = state["iteration"]
    logical = logical_models(layout)
    for name in sorted(logical):
        saved = state["modules"][name]
        # Optimizer state moves with the parameters only if the same parameters train (a changed
        # `frozen`, e.g. LLaVA stage 1 -> 2, starts this model's optimizer afresh).
        same_frozen = set(saved.get("frozen", {}).values()) == {layout.module(m).frozen for m in logical[name]}
        sd: dict = {}
        rests: dict[str, dict] = {}
        for mod_name in logical[name]:
            st = states.get(mod_name)
            if st is None:
                continue
            model_sd = model_sharded_state_dict(st, layout, job.spec)
            sd[f"{mod_name}.model"] = model_sd
            if st.optimizer is not None and saved.get("optimizer") and same_frozen:
                opt_sd, rest = optimizer_sharded_state_dict(st, model_sd, is_loading=True)
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
            if mod_name in rests:
                rest = rests[mod_name]
                dict_list_map_inplace(lambda v: v.unwrap() if isinstance(v, LocalNonpersistentObject) else v, rest)
                merge(rest, loaded[f"{mod_name}.optimizer"])
                _put_common_steps(rest, saved.get("common_steps", {}))
                st.optimizer.load_state_dict(rest)
            if mod_name in schedulers and saved.get("scheduler"):
                restore_scheduler(schedulers[mod_name], saved["scheduler"])
    same_layout = state.get("layout_dict") == layout.to_dict() and state.get("world_size") == dist.get_world_size()
    if same_layout and (d / RNG_DIR).is_dir():
        rank, world = dist.get_rank(), dist.get_world_size()
        rng_sd = _rng_sharded_state_dict(rank, world)
        loaded = _guard(f"checkpoint {d / RNG_DIR} cannot be loaded", safe_unpickle.load, rng_sd, d / RNG_DIR)
        _set_rng(loaded)
    dist.barrier()
    return it


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

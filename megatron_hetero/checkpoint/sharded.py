"""The sharded state dicts a checkpoint saves and loads (torch from here on): a module's parameters under
their global keys, its optimizer state, Adam's common step counter and the per-rank RNG states.
"""

from __future__ import annotations

from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.checkpoint.keys import logical_of, global_key, _layer_offset


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
    """(ShardedTensors of the optimizer state, the rest: param groups and the common step counter).

    A distributed optimizer's state goes in Megatron's `fully_reshardable` format: on save each
    module's DP x CP shards are all-gathered over that group and cut into one tensor per parameter
    and state (`optimizer.state.exp_avg.<global key>`, the same keys as the non-distributed
    optimizer's, plus `optimizer.state.param.<global key>`: the fp32 main weights), so it reshards
    under any layout; on load each rank reads the whole tensors of its parameters and keeps its shard.
    SGD's state is its momentum buffers (`optimizer.state.momentum_buffer.<global key>`), Adam's its two
    moments (`exp_avg`, `exp_avg_sq`)."""
    metadata: dict = {"chained_optim_avoid_prefix": True}
    if is_loading:
        from megatron_hetero.compat.fixes import materialize_sgd_state

        materialize_sgd_state(state.optimizer)  # SGD's momentum buffers (fix.sgd_load_state)
    if state.distributed_optimizer:
        metadata["distrib_optim_sharding_type"] = "fully_reshardable"
        if is_loading:
            from megatron_hetero.compat.fixes import materialize_distributed_optimizer_state

            materialize_distributed_optimizer_state(state.optimizer)
    osd = state.optimizer.sharded_state_dict(model_sd, is_loading, metadata=metadata)
    return _split_sharded(osd)


def optimizer_is_stateless(state, optimizer_name: str) -> bool:
    """An optimizer that never stepped on this module: Adam builds its per-parameter state (moments,
    step) and SGD its momentum buffers at the first step, which under --fp16 may not have come yet
    (every step so far skipped for non-finite gradients). Such an optimizer has nothing to save
    (Megatron's distributed optimizer cannot even describe it: its `state_dict` asserts one common
    step), and a resume starts it afresh, as the uninterrupted run still has it. The same on every rank
    of the module (skips are agreed over the world)."""
    if optimizer_name not in ("adam", "sgd") or state.optimizer is None:
        return False
    inner = getattr(state.optimizer, "chained_optimizers", [state.optimizer])
    return all(len(o.optimizer.state) == 0 for o in inner if getattr(o, "optimizer", None) is not None)


MAIN_PARAM_PREFIX = "optimizer.state.param."


def pop_main_params(opt_sd: dict) -> list[tuple[tuple, str]]:
    """Take the distributed optimizer's fp32 main weights (`optimizer.state.param.<key>`) out of a load
    request, for a checkpoint saved without the distributed optimizer (which holds none: in fp32 they
    are the model's weights). Returns (path in `opt_sd` of the dict that held it, the model's global
    key) of each, for :func:`put_main_params`."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    out: list[tuple[tuple, str]] = []

    def walk(d: dict, path: tuple) -> None:
        for k in list(d):
            v = d[k]
            if isinstance(v, dict):
                walk(v, path + (k,))
            elif isinstance(v, ShardedBase) and v.key.startswith(MAIN_PARAM_PREFIX):
                del d[k]
                out.append((path + (k,), v.key[len(MAIN_PARAM_PREFIX) :]))

    walk(opt_sd, ())
    return out


MIXED_MAIN_PARAM_PREFIX = "optimizer.state.fp32_param."


def rename_main_params(opt_sd: dict, src: str, dst: str) -> int:
    """Ask a load for the fp32 main weights under another optimizer's keys: Megatron's mixed-precision
    (--bf16/--fp16) non-distributed optimizer keeps them as `optimizer.state.fp32_param.<key>`
    (:data:`MIXED_MAIN_PARAM_PREFIX`), the distributed one's `fully_reshardable` state as
    `optimizer.state.param.<key>` (:data:`MAIN_PARAM_PREFIX`); the tensors are the same (one fp32
    tensor per parameter, sharded like the model's). Rewrites the key of every request under `src`
    to `dst` in place; returns how many."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    n = 0

    def walk(d) -> None:
        nonlocal n
        for v in d.values() if isinstance(d, dict) else d:
            if isinstance(v, (dict, list)):
                walk(v)
            elif isinstance(v, ShardedBase) and v.key.startswith(src):
                v.key = dst + v.key[len(src) :]
                n += 1

    walk(opt_sd)
    return n


def put_main_params(loaded_opt: dict, popped: list[tuple[tuple, str]], model: dict) -> None:
    """Put back what :func:`pop_main_params` took: each main weight is a copy of the loaded model
    tensor of its global key (`model`: global key -> tensor)."""
    for path, key in popped:
        d = loaded_opt
        for k in path[:-1]:
            d = d.setdefault(k, {})
        d[path[-1]] = model[key].detach().clone()


def _common_steps(rest: dict) -> dict[str, float]:
    """{'' or chained index: Adam's step counter} found in the optimizer's non-sharded part."""
    import torch

    out = {}
    inners = rest.items() if rest and all(isinstance(k, int) for k in rest) else [("", rest)]
    for tag, inner in inners:
        step = _torch_optimizer_state(inner).get("state", {}).get("common_step")
        if step is None:  # a distributed optimizer keeps it in its param groups (one value)
            steps = {g["step"] for g in _distributed_param_groups(inner) if g.get("step") is not None}
            assert len(steps) <= 1, f"param groups disagree on Adam's step: {sorted(steps)}"
            step = steps.pop() if steps else None
        if step is not None:
            out[str(tag)] = float(step.item() if isinstance(step, torch.Tensor) else step)
    return out


def _torch_optimizer_state(inner: dict) -> dict:
    """The torch optimizer's state dict inside one Megatron optimizer's non-sharded state: the fp32
    optimizer's state is that dict itself; the mixed-precision wrapper's (--bf16, --fp16) is under
    `optimizer`, beside its fp32 main weights (`fp32_from_fp16_params`) and loss scaler (`grad_scaler`).
    A distributed optimizer's has no per-parameter state here (:func:`_distributed_param_groups`)."""
    if "param_state_sharding_type" not in inner and isinstance(inner.get("optimizer"), dict):
        return inner["optimizer"]
    return inner


def _distributed_param_groups(inner: dict) -> list:
    """The param groups of a distributed optimizer's non-sharded state (`{'optimizer': {'param_groups':
    [...]}, 'param_state_sharding_type': ...}`); empty for the other optimizers'."""
    if "param_state_sharding_type" not in inner:
        return []
    return inner.get("optimizer", {}).get("param_groups", [])


def _put_common_steps(rest: dict, steps: dict[str, float]) -> None:
    import torch

    for tag, step in steps.items():
        inner = rest if tag == "" else rest[int(tag)]
        groups = _distributed_param_groups(inner)
        if groups:
            for g in groups:
                g["step"] = step
        else:
            _torch_optimizer_state(inner).setdefault("state", {})["common_step"] = torch.tensor(
                step, dtype=torch.float32
            )


def rng_states() -> dict:
    """This rank's RNG states, as checkpoints keep them: {'torch': CPU generator, 'accelerator': the
    current device's (Megatron's helper: the CPU's on CPU ranks), 'tracker.<name>': Megatron's
    model-parallel RNG tracker's}."""
    import torch
    from megatron.core.tensor_parallel import random as mrandom

    states = {"torch": torch.get_rng_state(), "accelerator": mrandom._get_cuda_rng_state()}
    for name, st in mrandom.get_cuda_rng_tracker().get_states().items():
        states[f"tracker.{name}"] = st
    return states


def set_rng_states(states: dict) -> None:
    """Restore what `rng_states` returned."""
    import torch
    from megatron.core.tensor_parallel import random as mrandom

    torch.set_rng_state(states["torch"])
    mrandom._set_cuda_rng_state(states["accelerator"])
    tracker = {k[len("tracker.") :]: v for k, v in states.items() if k.startswith("tracker.")}
    if tracker:
        mrandom.get_cuda_rng_tracker().set_states(tracker)


def _rng_sharded_state_dict(rank: int, world: int) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return {
        k: ShardedTensor.from_rank_offsets(
            f"rng.{k}", v.detach().cpu().clone().unsqueeze(0), (0, rank, world), replica_id=0
        )
        for k, v in rng_states().items()
    }


def _set_rng(loaded: dict) -> None:
    set_rng_states({k: v[0] for k, v in loaded.items()})

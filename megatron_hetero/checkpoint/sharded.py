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

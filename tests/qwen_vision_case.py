"""The Qwen2.5-VL vision tower case shared by its world-1 (tests/e2e) and TP (tests/ranks) tests: a tiny
random transformers tower, its patches of three images of different sizes and its output, and the
rank function that builds our tower on a layout, loads its TP shard and runs it."""

from __future__ import annotations

import torch

GRID = [[1, 4, 6], [1, 6, 4], [2, 4, 4]]
CONFIG = dict(
    depth=4,
    hidden_size=32,
    num_heads=4,
    intermediate_size=48,
    out_hidden_size=40,
    patch_size=2,
    temporal_patch_size=2,
    spatial_merge_size=2,
    window_size=8,
    fullatt_block_indexes=[1, 3],
    hidden_act="silu",
)


def probe(shape) -> torch.Tensor:
    """The fixed weights of the scalar whose gradients are compared: loss = sum(out * probe)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(7))


def reference_grads(cfg: dict, hf: dict, patches: torch.Tensor) -> dict:
    """transformers' parameter gradients of sum(tower(patches) * probe), by Hugging Face name."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    c = Qwen2_5_VLVisionConfig(**{k: v for k, v in cfg.items() if k in CONFIG})
    c._attn_implementation = "eager"
    model = Qwen2_5_VisionTransformerPretrainedModel(c)
    model.load_state_dict(hf)
    out = model(patches, grid_thw=torch.tensor(GRID))
    (out * probe(out.shape)).sum().backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


def reference() -> tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(HF config dict, HF state dict, patches, transformers' output)."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    torch.manual_seed(0)
    cfg = Qwen2_5_VLVisionConfig(**CONFIG)
    cfg._attn_implementation = "eager"
    model = Qwen2_5_VisionTransformerPretrainedModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # norms and biases away from their 1 / 0 init
            p.add_(0.1 * torch.randn_like(p))
    grid = torch.tensor(GRID)
    n = int(grid.prod(dim=1).sum())
    patches = torch.randn(n, 3 * 2 * 2 * 2)
    with torch.no_grad():
        ref = model(patches, grid_thw=grid)
    return cfg.to_dict(), {k: v.clone() for k, v in model.state_dict().items()}, patches, ref


def tower_rank(cfg: dict, hf: dict, patches: torch.Tensor, layout_doc: dict) -> dict:
    """Build the tower on this rank's layout, load its TP shard of `hf`, run it; return outputs and shard."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hetero.compat import ensure_global_memory_buffer
    from megatron_hetero.convert.hf_qwen_vision import hf_to_tower
    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.models.qwen_vision import QwenVisionSpec, QwenVisionTower
    from megatron_hetero.runtime.topology import Topology

    ensure_global_memory_buffer()
    model_parallel_cuda_manual_seed(1, tp_rank=0, ep_rank=0, etp_rank=0)
    layout = layout_from_dict(layout_doc, world_size=dist.get_world_size())
    topo = Topology.build(layout)
    pgs = topo.pg_collection("vision")
    spec = QwenVisionSpec.from_hf(cfg)
    tower = QwenVisionTower(spec, layout.module("vision"), pgs).eval()
    shard = hf_to_tower(hf, spec.depth, spec.num_heads, tp_rank=pgs.tp.rank(), tp=pgs.tp.size())
    missing, unexpected = tower.load_state_dict(tower.stage_state(shard), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    with torch.no_grad():
        out = _stages(tower, pgs, patches)
    if pgs.pp.size() > 1:  # a pipelined tower: its output (last stage), no backward here
        topo.destroy()
        return {"out": out} if tower.last else {}
    errors = []
    for bad_grid in ([[1, 3, 4]], [[1, 4, 4]]):
        try:
            tower(patches, torch.tensor(bad_grid))
        except ValueError as e:
            errors.append(str(e))
    state = {k: v for k, v in tower.state_dict().items() if not k.endswith("_extra_state")}
    tower.train()
    again = tower(patches, torch.tensor(GRID))
    (again * probe(again.shape)).sum().backward()
    grads = {k: p.grad.clone() for k, p in tower.named_parameters()}
    topo.destroy()
    return {"out": out, "shard": state, "errors": errors, "grads": grads}


def _stages(tower, pgs, patches: torch.Tensor) -> torch.Tensor:
    """This rank's stage of the tower: hidden states [N, 1, h] from the previous stage's rank and to the
    next one's by point-to-point (what Megatron's schedules would hand over)."""
    import torch.distributed as dist

    ranks, r = dist.get_process_group_ranks(pgs.pp), pgs.pp.rank()
    grid = torch.tensor(GRID)
    hidden = None
    if r > 0:
        hidden = torch.empty(int(grid.prod(dim=1).sum()), 1, CONFIG["hidden_size"])
        dist.recv(hidden, src=ranks[r - 1])
    out = tower(patches, grid, hidden=hidden)
    if r < len(ranks) - 1:
        dist.send(out.contiguous(), dst=ranks[r + 1])
    return out


LAYOUT = {"placement": "colocated", "modules": {"vision": {}, "language": {}}, "edges": ["vision -> language"]}

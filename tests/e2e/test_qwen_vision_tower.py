"""The Qwen2.5-VL vision tower built from Megatron-core parts computes transformers' forward.

A tiny random `Qwen2_5_VisionTransformerPretrainedModel` (4 blocks, full attention in blocks 1 and 3,
windows of 2 x 2 merged tokens, patch 2, temporal patch 2, 2 x 2 merge) runs on three images of
different sizes in one packed batch (grids 1x4x6, 1x6x4, 2x4x4: a window cut at the image's edge, a
non-square image, two frames). Its weights go through `convert.hf_qwen_vision.hf_to_tower` into
`models.qwen_vision.QwenVisionTower` on one forked rank; the merged tokens must equal transformers'
within 1e-5 relative (max |ours - hf| / max |hf|), and `tower_to_hf` returns the weights bitwise.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
import torch  # noqa: E402

from megatron_hetero.runtime.launcher import run_ranks  # noqa: E402

TOL = 1e-5
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
    missing, unexpected = tower.load_state_dict(shard, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    with torch.no_grad():
        out = tower(patches, torch.tensor(GRID))
    errors = []
    for bad_grid in ([[1, 3, 4]], [[1, 4, 4]]):
        try:
            tower(patches, torch.tensor(bad_grid))
        except ValueError as e:
            errors.append(str(e))
    state = {k: v for k, v in tower.state_dict().items() if not k.endswith("_extra_state")}
    topo.destroy()
    return {"out": out, "shard": state, "errors": errors}


LAYOUT = {"placement": "colocated", "modules": {"vision": {}, "language": {}}, "edges": ["vision -> language"]}


@pytest.mark.timeout(300)
def test_qwen_vision_tower_matches_transformers_on_mixed_sizes():
    from megatron_hetero.convert.hf_qwen_vision import tower_to_hf

    cfg, hf, patches, ref = reference()
    got = run_ranks(1, tower_rank, cfg, hf, patches, LAYOUT, timeout=240)[0]
    assert got["out"].shape == ref.shape == (sum(t * h * w for t, h, w in GRID) // 4, 40)
    rel = float((got["out"] - ref).abs().max() / ref.abs().max())
    print(f"\nQwen2.5-VL tower vs transformers, grids {GRID}: {rel:.2e} relative")
    assert rel <= TOL, rel
    back = tower_to_hf([got["shard"]], CONFIG["depth"], CONFIG["num_heads"])
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)
    assert "multiples of 2" in got["errors"][0] and "patches must be [16, 24]" in got["errors"][1]


def test_qwen_vision_tower_refuses_cp_and_pp_with_the_reason():
    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.models.qwen_vision import QwenVisionSpec, QwenVisionTower

    spec = QwenVisionSpec.from_hf(CONFIG)
    for arith, why in (({"cp": 2}, "cp 1: its windows and images are attention segments"), ({"pp": 2}, "pp 1")):
        doc = {
            "placement": "colocated",
            "modules": {"vision": arith, "language": {"dp": 2}},
            "edges": ["vision -> language"],
        }
        layout = layout_from_dict(doc, world_size=2)
        with pytest.raises(ValueError, match=why):
            QwenVisionTower(spec, layout.module("vision"), pgs=None)  # refused before any group is read

"""Qwen2.5-VL's native-resolution preprocessing (`data.qwen_image_processor`) gives transformers'
`Qwen2VLImageProcessor` pixel_values and image_grid_thw: scikit-learn's two photographs, a grey copy, a 4:1 crop
and digits at 8, 32 and 64 px (as the digits data writes them: `digit_png`), with small min/max
pixels so that both the down- and the up-scaling branch of `smart_resize` run; the token counts
differ per image. Those patches through the converted tower (`qwen_vision_case`'s model rebuilt
with patch 14) equal transformers' tower within 1e-5. Bad configs are refused by name."""

from __future__ import annotations

import io
import json

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
import torch  # noqa: E402

from megatron_hetero.runtime.launcher import run_ranks  # noqa: E402

CONFIG = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "min_pixels": 28 * 28 * 4,
    "max_pixels": 28 * 28 * 12,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


def _images() -> list:
    from PIL import Image
    from sklearn.datasets import load_digits

    from megatron_hetero.data.digits import digit_png
    from sample_photos import photos

    pics = photos()
    digits = load_digits().images
    made = [Image.open(io.BytesIO(digit_png(digits[i], size))) for i, size in ((0, 8), (1, 32), (2, 64))]
    wide = pics["flower"].crop((0, 0, 420, 105))
    return [pics["china"], pics["flower"], pics["china"].convert("L"), wide, *made]


def _tower_rank(cfg: dict, hf: dict, patches: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hetero.compat import ensure_global_memory_buffer
    from megatron_hetero.convert.hf_qwen_vision import hf_to_tower
    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.models.qwen_vision import QwenVisionSpec, QwenVisionTower
    from megatron_hetero.runtime.topology import Topology

    ensure_global_memory_buffer()
    model_parallel_cuda_manual_seed(1, tp_rank=0, ep_rank=0, etp_rank=0)
    doc = {"modules": {"vision": {}, "language": {}}, "edges": ["vision -> language"]}
    layout = layout_from_dict(doc, world_size=dist.get_world_size())
    topo = Topology.build(layout)
    spec = QwenVisionSpec.from_hf(cfg)
    tower = QwenVisionTower(spec, layout.module("vision"), topo.pg_collection("vision")).eval()
    tower.load_state_dict(hf_to_tower(hf, spec.depth, spec.num_heads), strict=False)
    with torch.no_grad():
        out = tower(patches, grid)
    topo.destroy()
    return out


@pytest.mark.timeout(300)
def test_native_resolution_pixels_and_tower_match_transformers(tmp_path):
    from transformers import Qwen2VLImageProcessor
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    from megatron_hetero.data.qwen_image_processor import QwenImageProcessor
    from qwen_vision_case import CONFIG as TOWER

    (tmp_path / "preprocessor_config.json").write_text(json.dumps(CONFIG))
    ours = QwenImageProcessor.load(tmp_path)
    images = _images()
    patches, grid = ours.batch(images)
    ref = Qwen2VLImageProcessor(**{k: v for k, v in CONFIG.items() if k != "image_processor_type"})(
        images, return_tensors="pt"
    )
    assert torch.equal(grid, ref["image_grid_thw"]), (grid.tolist(), ref["image_grid_thw"].tolist())
    diff = float((patches - ref["pixel_values"]).abs().max())
    assert patches.shape == ref["pixel_values"].shape and diff <= 1e-6, diff
    tokens = (grid.prod(dim=1) // 4).tolist()
    shapes = {tuple(g) for g in grid.tolist()}
    assert len(shapes) >= 3 and len(set(tokens)) >= 2 and min(tokens) >= 4 and max(tokens) <= 12, (shapes, tokens)

    torch.manual_seed(0)
    cfg = Qwen2_5_VLVisionConfig(**dict(TOWER, patch_size=14, window_size=56))
    cfg._attn_implementation = "eager"
    model = Qwen2_5_VisionTransformerPretrainedModel(cfg).eval()
    with torch.no_grad():
        want = model(ref["pixel_values"], grid_thw=ref["image_grid_thw"])
    hf = {k: v.clone() for k, v in model.state_dict().items()}
    got = run_ranks(1, _tower_rank, cfg.to_dict(), hf, patches, grid, timeout=240)[0]
    rel = float((got - want).abs().max() / want.abs().max())
    print(f"\nnative resolution: grids {grid.tolist()}, pixels max diff {diff:.1e}, tower {rel:.2e} relative")
    assert rel <= 1e-5, rel


def test_qwen_image_processor_refuses_other_configs():
    from megatron_hetero.data.qwen_image_processor import QwenImageProcessor

    with pytest.raises(ValueError, match="image_processor_type 'CLIPImageProcessor' is not one of"):
        QwenImageProcessor.from_dict({"image_processor_type": "CLIPImageProcessor"})
    with pytest.raises(ValueError, match="do_normalize false is not supported"):
        QwenImageProcessor.from_dict({**CONFIG, "do_normalize": False})

"""A converted CLIP tower fed through its own preprocessing computes Hugging Face's forward on photographs.

A tiny random `CLIPVisionModel` (32 px images, 8 px patches: 16 tokens + the class token) is saved
with a `preprocessor_config.json` (CLIPImageProcessor: shortest edge 32, center crop 32, CLIP's
mean/std), converted with `megatron-hetero convert hf-to-checkpoint` (with a tiny Llama: the
converter writes a whole LLaVA model), and loaded on one forked rank. scikit-learn's two
photographs, a grey copy of one (converted to RGB) and one decoded the way energon decodes
(float CHW in [0, 1]) go through `data.image_processor` (our pixels equal
`CLIPImageProcessor`'s: checked) and into the encoder both ways the data can hand them over: as
patch features (`image_processor.to_patches`, the layout of the data path) and as pixels
(`ClipEncoderModule.pixel_features`), bitwise the same. Against `CLIPVisionModel(pixel_values=
CLIPImageProcessor(photos)).last_hidden_state`: within 1e-5 relative (max |ours - hf| / max |hf|;
measured in docs/images.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
import torch  # noqa: E402

from megatron_hetero.cli import main  # noqa: E402
from megatron_hetero.data import image_processor as ip  # noqa: E402
from megatron_hetero.runtime.launcher import run_ranks  # noqa: E402

TOL = 1e-5
IMG, PATCH, S = 32, 8, 32
PREPROCESSOR = {
    "image_processor_type": "CLIPImageProcessor",
    "do_convert_rgb": True,
    "do_resize": True,
    "size": {"shortest_edge": IMG},
    "resample": 3,
    "do_center_crop": True,
    "crop_size": {"height": IMG, "width": IMG},
    "do_rescale": True,
    "rescale_factor": 0.00392156862745098,
    "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


def _tiny_hf(root: Path) -> tuple[Path, Path]:
    from transformers import CLIPVisionConfig, CLIPVisionModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    clip, llama = root / "clip", root / "llama"
    CLIPVisionModel(
        CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=IMG,
            patch_size=PATCH,
            hidden_act="quick_gelu",
        )
    ).save_pretrained(clip)
    (clip / ip.CONFIG_NAME).write_text(json.dumps(PREPROCESSOR, indent=2))
    LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=64,
            max_position_embeddings=64,
        )
    ).save_pretrained(llama)
    return clip, llama


def _images():
    """(what our processor is given, what transformers' is given) for each of 4 images."""
    from sample_photos import energon_decoded, photos

    pics = photos()
    grey = pics["china"].convert("L")
    return [
        (pics["china"], pics["china"]),
        (pics["flower"], pics["flower"]),
        (grey, grey),
        energon_decoded(pics["flower"]),  # float CHW in [0, 1], as energon decodes; the file's PIL image
    ]


def _rank(clip: str, llama: str, out: str, pixels: torch.Tensor) -> dict:
    """One rank: convert, load the checkpoint, run the tower on patch features and on pixels."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hetero.checkpoint.files import read_train_state
    from megatron_hetero.checkpoint.save_load import load_weights
    from megatron_hetero.compat import ensure_global_memory_buffer
    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.models.llava import LlavaSpec
    from megatron_hetero.runtime.topology import Topology
    from megatron_hetero.training.setup import build_module

    argv = ["convert", "hf-to-checkpoint", "--vision", clip, "--language", llama, "--seq-length", str(S)]
    rc = main(argv + ["--out", out])
    assert rc == 0, rc
    ensure_global_memory_buffer()
    model_parallel_cuda_manual_seed(1, tp_rank=0, ep_rank=0, etp_rank=0)
    spec = LlavaSpec.from_record(read_train_state(out)[1]["model"])
    doc = {"placement": "colocated", "modules": {"vision": {}, "language": {}}, "edges": ["vision -> language"]}
    layout = layout_from_dict(doc, world_size=dist.get_world_size())
    topo = Topology.build(layout)
    states = {}
    for m in layout.modules:
        pgs = topo.pg_collection(m.name)
        states[m.name] = SimpleNamespace(
            name=m.name, module=build_module(m.name, layout, spec, pgs).eval(), pgs=pgs, optimizer=None
        )
    load_weights(out, layout, spec, topo, states)
    vision = states["vision"].module
    with torch.no_grad():
        res = {
            "from_patches": vision.features(ip.to_patches(pixels, PATCH)),
            "from_pixels": vision.pixel_features(pixels),
        }
        with pytest.raises(ValueError, match=r"pixels must be \[b, 3, 32, 32\]"):
            vision.pixel_features(pixels[:, :, :16])
    topo.destroy()
    return res


@pytest.mark.timeout(300)
def test_converted_tower_on_preprocessed_photographs_matches_hf(tmp_path):
    from transformers import CLIPImageProcessor, CLIPVisionModel

    clip, llama = _tiny_hf(tmp_path)
    images = _images()
    ours = ip.load_image_processor(clip)
    pixels = ours.batch([a for a, _ in images])
    ref_pixels = CLIPImageProcessor.from_pretrained(str(clip))([b for _, b in images], return_tensors="pt")[
        "pixel_values"
    ]
    pixel_diff = float((pixels - ref_pixels).abs().max())
    assert pixels.shape == (4, 3, IMG, IMG) and pixel_diff <= 1e-6, pixel_diff
    with torch.no_grad():
        ref = CLIPVisionModel.from_pretrained(str(clip)).eval()(pixel_values=ref_pixels).last_hidden_state
    got = run_ranks(1, _rank, str(clip), str(llama), str(tmp_path / "ckpt"), pixels, timeout=240)[0]
    assert torch.equal(got["from_patches"], got["from_pixels"])
    assert got["from_patches"].shape == ref.shape == (4, 1 + (IMG // PATCH) ** 2, 32)
    rel = float((got["from_patches"] - ref).abs().max() / ref.abs().max())
    print(
        f"\nconverted CLIP on 4 preprocessed photographs: pixels max |ours - hf| {pixel_diff:.1e}, "
        f"last_hidden_state {rel:.2e} relative"
    )
    assert rel <= TOL, rel

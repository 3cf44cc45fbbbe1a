"""`data.image_processor` gives the pixel_values transformers' own processors give, on real photographs.

scikit-learn's two bundled photographs (china.jpg, flower.jpg, 640x427 RGB) go through our
processor and through transformers' `CLIPImageProcessor` / `SiglipImageProcessor`, both reading
the SAME preprocessor_config.json from disk; max |ours - transformers| must be <= 1e-6 (measured:
0.0 in every case, docs/images.md). Configs: a LLaVA-1.5-style CLIP (shortest edge 224, crop 224),
the old integer form (`size: 32`, `crop_size: 32`, CLIPFeatureExtractor), a crop larger than the
resize (zero padding), a fixed non-square bilinear CLIP resize, SigLIP 224x224 and a non-square
SigLIP. Inputs: each photograph as it is (landscape), rotated (portrait), shrunk to 30x20
(upscaling), at an odd 101x77 (odd crop offsets), grey (PIL mode L, converted to RGB), as a uint8
numpy array, as RGBA, and decoded the way energon decodes (webdataset's `torchrgb`: float CHW in
[0, 1]). The comparison can fail: the digits recipe (`energon_data.patchify`'s bilinear resize and
[-1, 1] scaling) is measured > 1e-2 away from SigLIP's on the same photograph.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

PIL = pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")
from PIL import Image  # noqa: E402

from megatron_hetero.data import image_processor as ip  # noqa: E402
import sample_photos  # noqa: E402  (tests/sample_photos.py)
from sample_photos import energon_decoded  # noqa: E402

TOL = 1e-6
CONFIGS = {
    "clip-224": {
        "image_processor_type": "CLIPImageProcessor",
        "processor_class": "LlavaProcessor",
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"shortest_edge": 224},
        "resample": 3,
        "do_center_crop": True,
        "crop_size": {"height": 224, "width": 224},
        "do_rescale": True,
        "rescale_factor": 0.00392156862745098,
        "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    },
    "clip-32-int": {  # the old form of openai/clip-vit-*: integer sizes, feature_extractor_type
        "feature_extractor_type": "CLIPFeatureExtractor",
        "size": 32,
        "crop_size": 32,
        "resample": 3,
        "do_center_crop": True,
        "do_normalize": True,
        "do_resize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    },
    "clip-pad": {  # crop larger than the resized image: zero padding
        "image_processor_type": "CLIPImageProcessor",
        "size": {"shortest_edge": 24},
        "crop_size": {"height": 32, "width": 32},
    },
    "clip-fixed-bilinear": {
        "image_processor_type": "CLIPImageProcessor",
        "size": {"height": 40, "width": 56},
        "resample": 2,
        "do_center_crop": False,
    },
    "siglip-224": {
        "image_processor_type": "SiglipImageProcessor",
        "processor_class": "SiglipProcessor",
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "resample": 3,
        "rescale_factor": 0.00392156862745098,
        "size": {"height": 224, "width": 224},
    },
    "siglip-32x48": {
        "image_processor_type": "SiglipImageProcessor",
        "do_convert_rgb": True,
        "size": {"height": 32, "width": 48},
    },
}
FIGURES: list[tuple[str, str, str, float]] = []


def _inputs(photo: Image.Image) -> dict[str, tuple[object, Image.Image]]:
    """name -> (what our processor is given, what transformers is given)."""
    small = photo.resize((30, 20), Image.Resampling.BOX)
    odd = photo.resize((101, 77), Image.Resampling.BOX)
    tensor, decoded = energon_decoded(odd)
    rgba = np.concatenate([np.asarray(odd), np.full((77, 101, 1), 200, np.uint8)], axis=2)
    return {
        "landscape 640x427": (photo, photo),
        "portrait 427x640": (photo.transpose(Image.Transpose.ROTATE_90),) * 2,
        "upscale 30x20": (small, small),
        "odd 101x77": (odd, odd),
        "grey L 640x427": (photo.convert("L"),) * 2,
        "numpy uint8 HWC": (np.asarray(odd), odd),
        "numpy RGBA": (rgba, Image.fromarray(rgba)),
        "energon torchrgb": (tensor, decoded),
    }


@pytest.fixture(scope="module")
def photos() -> dict[str, Image.Image]:
    return sample_photos.photos()


def _reference(folder: Path, kind: str):
    from transformers import CLIPImageProcessor, SiglipImageProcessor

    cls = CLIPImageProcessor if kind == ip.CLIP else SiglipImageProcessor
    return cls.from_pretrained(str(folder))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_pixels_match_transformers_on_photographs(name, photos, tmp_path):
    (tmp_path / ip.CONFIG_NAME).write_text(json.dumps(CONFIGS[name]))
    ours = ip.load_image_processor(tmp_path)
    ref = _reference(tmp_path, ours.kind)
    for photo_name, photo in photos.items():
        for input_name, (mine, theirs) in _inputs(photo).items():
            got = ours(mine)
            want = ref(theirs, return_tensors="pt")["pixel_values"][0]
            assert got.dtype == torch.float32 and got.shape == want.shape, (name, input_name, got.shape, want.shape)
            diff = float((got - want.float()).abs().max())
            FIGURES.append((name, photo_name, input_name, diff))
            assert diff <= TOL, (name, photo_name, input_name, diff)
    print(
        f"\n{name}: max |ours - transformers| {max(d for n, *_, d in FIGURES if n == name):.1e} over 2 photos x 8 inputs"
    )


def test_the_comparison_can_fail(photos):
    """The digits recipe (torch bilinear antialiased resize, [-1, 1]) on the same photograph is far
    from SigLIP's own pixels: the 1e-6 bound above is a real test of the arithmetic."""
    from transformers import SiglipImageProcessor

    photo = photos["china"]
    want = SiglipImageProcessor(size={"height": 224, "width": 224})(photo, return_tensors="pt")["pixel_values"][0]
    x = torch.from_numpy(np.asarray(photo).copy()).permute(2, 0, 1).float() / 255
    x = torch.nn.functional.interpolate(x[None], size=(224, 224), mode="bilinear", antialias=True)[0]
    naive = (x - 0.5) / 0.5
    diff = float((naive - want).abs().max())
    print(f"\nthe digits recipe vs SigLIP's pixels on china.jpg: max abs difference {diff:.3f}")
    assert diff > 1e-2


def test_batch_and_patches_round_trip(photos, tmp_path):
    """`batch` stacks; `to_patches` is the exact inverse of the encoder's reassembly (a reshape)."""
    proc = ip.processor_from_dict(CONFIGS["clip-32-int"])
    px = proc.batch(list(photos.values()))
    assert px.shape == (2, 3, 32, 32) and proc.output_size == (32, 32)
    feats = ip.to_patches(px, 8)
    assert feats.shape == (2, 16, 3 * 64)
    b, g, p = 2, 4, 8  # ClipEncoderModule.image
    back = feats.reshape(b, g, g, 3, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, 3, g * p, g * p)
    assert torch.equal(back, px)
    assert torch.equal(ip.caption_features(photos["flower"], proc, 8), feats[1])
    # the same layout as the data path's own patches (energon_data.patchify), and a config that fits
    from dataclasses import replace

    from megatron_hetero.config.data import CaptionDataConfig
    from megatron_hetero.data.energon_data import patchify

    cfg = replace(CaptionDataConfig(path="unused", patch_size=8), **ip.caption_format(proc, 8))
    x = torch.rand(3, 32, 32)
    assert torch.equal(patchify(x, cfg), ip.to_patches((x - 0.5) / 0.5, 8))
    assert (cfg.image_tokens, cfg.feature_dim) == (16, 192)
    ip.check_fits(proc, (32, 32))
    assert ip.caption_format(proc, 8) == {"image_size": (32, 32), "channels": 3}
    with pytest.raises(ValueError, match="do not cut into 5x5 patches"):
        ip.caption_format(proc, 5)
    with pytest.raises(ValueError, match=r"gives 32x32 images; the encoder takes 16x16"):
        ip.check_fits(proc, (16, 16))
    with pytest.raises(ValueError, match="depends on the input"):
        ip.check_fits(ip.processor_from_dict({**CONFIGS["clip-224"], "do_center_crop": False}), (224, 224))
    with pytest.raises(ValueError, match="does not cut into 5x5 patches"):
        ip.to_patches(px, 5)
    with pytest.raises(ValueError, match="come out in 2 sizes"):
        ip.processor_from_dict({**CONFIGS["clip-224"], "do_center_crop": False}).batch(
            [photos["china"], photos["china"].transpose(Image.Transpose.ROTATE_90)]
        )


CLIP = CONFIGS["clip-224"]
SIGLIP = CONFIGS["siglip-224"]
REFUSED = [
    ({**CLIP, "do_pad": True}, r"do_pad=True is not supported: padding"),
    ({**CLIP, "image_grid_pinpoints": [[336, 672]]}, r"image_grid_pinpoints=.*anyres grids"),
    ({**CLIP, "image_processor_type": "LlavaNextImageProcessor"}, r"'LlavaNextImageProcessor' is not supported"),
    ({"size": 224}, r"neither image_processor_type nor feature_extractor_type"),
    ({**CLIP, "size": {"shortest_edge": 224, "longest_edge": 448}}, r"longest_edge is not supported"),
    ({**CLIP, "resample": 7}, r"resample=7 is not one of PIL's filters"),
    ({**CLIP, "resample": None}, r"resample=None is not one of PIL's filters"),
    ({**CLIP, "image_mean": [0.5, 0.5]}, r"image_mean=\[0.5, 0.5\] must be 3 finite numbers"),
    ({**CLIP, "image_std": [1, 0, 1]}, r"image_std=.* has a zero"),
    ({**CLIP, "crop_pct": 0.875}, r"crop_pct=0.875 is not supported"),
    ({**CLIP, "do_resize": "yes"}, r"do_resize='yes' must be true or false"),
    ({**CLIP, "some_new_option": 3}, r"option some_new_option=3 is not one this CLIP processor reads"),
    ({**SIGLIP, "do_center_crop": True}, r"do_center_crop=True is not supported: SiglipImageProcessor does not crop"),
    ({**SIGLIP, "size": 224}, r"size=224 is not supported here"),
    ({**SIGLIP, "size": {"shortest_edge": 224}}, r"size=\{'shortest_edge': 224\} is not supported here"),
]


@pytest.mark.parametrize("cfg,message", REFUSED, ids=[m.split(" ")[0][:30] for _, m in REFUSED])
def test_unsupported_options_are_refused_by_name(cfg, message):
    with pytest.raises(ValueError, match=message):
        ip.processor_from_dict(cfg)


def test_off_options_are_ignored_and_null_switches_are_off():
    p = ip.processor_from_dict({**CLIP, "do_pad": False, "image_grid_pinpoints": None, "unknown_switch": False})
    assert p.crop == (224, 224) and p.shortest_edge == 224
    q = ip.processor_from_dict({**SIGLIP, "do_convert_rgb": None, "do_normalize": None})
    assert not q.convert_rgb and q.mean is None


def test_bad_images_are_refused(photos):
    proc = ip.processor_from_dict(CONFIGS["siglip-32x48"])
    grey = photos["china"].convert("L")
    with pytest.raises(ValueError, match="PIL mode L, and do_convert_rgb is off"):
        ip.processor_from_dict({**SIGLIP, "do_convert_rgb": False})(grey)
    with pytest.raises(ValueError, match=r"8-bit levels / 255"):
        proc(torch.full((3, 8, 8), 0.3337))
    with pytest.raises(ValueError, match=r"values in \[0, 1\]"):
        proc(torch.full((3, 8, 8), 2.0))
    with pytest.raises(ValueError, match=r"values in \[0, 1\]"):
        proc(torch.full((3, 8, 8), float("nan")))
    with pytest.raises(ValueError, match="must be uint8"):
        proc(np.zeros((8, 8, 3), np.float32))
    with pytest.raises(ValueError, match="HxW, HxWx1, HxWx3 or HxWx4"):
        proc(np.zeros((8, 8, 2), np.uint8))
    with pytest.raises(ValueError, match="not list"):
        proc([1, 2, 3])
    assert torch.equal(proc(torch.from_numpy(np.asarray(grey).copy())[None]), proc(grey))  # uint8 CHW = PIL L


def test_config_files_are_read_and_bad_ones_named(tmp_path):
    with pytest.raises(ValueError, match="no preprocessor_config.json"):
        ip.load_image_processor(tmp_path)
    (tmp_path / ip.CONFIG_NAME).write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        ip.load_image_processor(tmp_path)
    (tmp_path / ip.CONFIG_NAME).write_text(json.dumps(SIGLIP))
    p = ip.load_image_processor(tmp_path / ip.CONFIG_NAME)
    assert (p.kind, p.size, p.mean, p.crop) == ("siglip", (224, 224), (0.5, 0.5, 0.5), None)
    assert p.source.endswith(ip.CONFIG_NAME)


def test_the_package_does_not_import_transformers():
    import ast

    tree = ast.parse(Path(ip.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert names and not [n for n in names if n.split(".")[0] == "transformers"], names

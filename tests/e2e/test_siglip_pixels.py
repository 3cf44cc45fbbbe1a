"""A converted SigLIP tower fed through its own preprocessing computes Hugging Face's forward on
photographs, and `train --load` of it refuses model flags that build another model, naming the fields.

A tiny random `SiglipVisionModel` (gelu tanh, pooling head; 18 px images in 4 px patches: the
convolution never reads the last 2 rows and columns, as so400m-patch14-384's never reads 6) is saved
with a `preprocessor_config.json` (SiglipImageProcessor: 18 x 18 bicubic, mean = std = 0.5),
converted with a tiny Llama 3.1-style LM (llama3 rope scaling factor 8) and loaded on one forked
rank. scikit-learn's two photographs and a grey copy of one go through `data.image_processor`
(our pixels equal `SiglipImageProcessor`'s: checked) into `SiglipEncoderModule.pixel_features`
(the 18 x 18 pixels, cut to the 16 x 16 the convolution reads) and, bitwise the same, into
`features` as patches of that square. Against `SiglipVisionModel(pixel_values=
SiglipImageProcessor(photos)).last_hidden_state`: within 1e-5 relative (max |ours - hf| / max |hf|).
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
IMG, PATCH, S, V = 18, 4, 32, 64
GRID = IMG // PATCH
PREPROCESSOR = {
    "image_processor_type": "SiglipImageProcessor",
    "do_convert_rgb": True,
    "do_resize": True,
    "size": {"height": IMG, "width": IMG},
    "resample": 3,
    "do_rescale": True,
    "rescale_factor": 0.00392156862745098,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _tiny_hf(root: Path) -> tuple[Path, Path]:
    from transformers import LlamaConfig, LlamaForCausalLM, SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(0)
    siglip, llama = root / "siglip", root / "llama31"
    SiglipVisionModel(
        SiglipVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=IMG,
            patch_size=PATCH,
        )
    ).save_pretrained(siglip)
    (siglip / ip.CONFIG_NAME).write_text(json.dumps(PREPROCESSOR, indent=2))
    LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=V,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            rope_scaling=dict(LLAMA3),
            tie_word_embeddings=False,
        )
    ).save_pretrained(llama)
    return siglip, llama


def _images() -> list:
    from sample_photos import photos

    pics = photos()
    return [pics["china"], pics["flower"], pics["china"].convert("L")]


def _rank(siglip: str, llama: str, out: str, pixels: torch.Tensor) -> dict:
    """One rank: convert, load the checkpoint, run the tower on pixels and on patch features."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hetero.checkpoint.files import read_train_state
    from megatron_hetero.checkpoint.save_load import load_weights
    from megatron_hetero.compat import ensure_global_memory_buffer
    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.models.llava import LlavaSpec
    from megatron_hetero.runtime.topology import Topology
    from megatron_hetero.training.setup import build_module

    argv = ["convert", "hf-to-checkpoint", "--vision", siglip, "--language", llama, "--seq-length", str(S)]
    assert main(argv + ["--out", out]) == 0
    ensure_global_memory_buffer()
    model_parallel_cuda_manual_seed(1, tp_rank=0, ep_rank=0, etp_rank=0)
    spec = LlavaSpec.from_record(read_train_state(out)[1]["model"])
    doc = {"placement": "colocated", "modules": {"vision": {}, "language": {}}, "edges": ["vision -> language"]}
    layout = layout_from_dict(doc, world_size=dist.get_world_size())
    topo = Topology.build(layout)
    pgs = topo.pg_collection("vision")
    vision = build_module("vision", layout, spec, pgs).eval()
    states = {"vision": SimpleNamespace(name="vision", module=vision, pgs=pgs, optimizer=None)}
    load_weights(out, layout, spec, topo, states)
    side = GRID * PATCH
    with torch.no_grad():
        res = {
            "from_pixels": vision.pixel_features(pixels),
            "from_patches": vision.features(ip.to_patches(pixels[:, :, :side, :side], PATCH)),
            "square": vision.pixel_features(pixels[:, :, :side, :side].contiguous()),
        }
    for bad in (pixels[:, :, :15, :15], torch.zeros(1, 3, side + PATCH, side + PATCH), pixels[:, :, :, :16]):
        with pytest.raises(ValueError, match=r"pixels must be \[b, 3, S, S\] with 16 <= S <= 19"):
            vision.pixel_features(bad)
    topo.destroy()
    return res


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> SimpleNamespace:
    """The HF folders, our pixels of the photographs, transformers' outputs, and one rank's results."""
    from transformers import SiglipImageProcessor, SiglipVisionModel

    root = tmp_path_factory.mktemp("siglip_pixels")
    siglip, llama = _tiny_hf(root)
    images = _images()
    pixels = ip.load_image_processor(siglip).batch(images)
    ref_pixels = SiglipImageProcessor.from_pretrained(str(siglip))(images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        ref = SiglipVisionModel.from_pretrained(str(siglip)).eval()(pixel_values=ref_pixels).last_hidden_state
    ckpt = root / "ckpt"
    got = run_ranks(1, _rank, str(siglip), str(llama), str(ckpt), pixels, timeout=240)[0]
    return SimpleNamespace(pixels=pixels, ref_pixels=ref_pixels, ref=ref, got=got, ckpt=ckpt)


@pytest.mark.timeout(300)
def test_converted_siglip_on_preprocessed_photographs_matches_hf(converted):
    pixels, ref, got = converted.pixels, converted.ref, converted.got
    pixel_diff = float((pixels - converted.ref_pixels).abs().max())
    assert pixels.shape == (3, 3, IMG, IMG) and pixel_diff <= 1e-6, pixel_diff
    assert torch.equal(got["from_pixels"], got["from_patches"])
    assert torch.equal(got["from_pixels"], got["square"])  # the unread rows and columns change nothing
    assert got["from_pixels"].shape == ref.shape == (3, GRID * GRID, 32)
    rel = float((got["from_pixels"] - ref).abs().max() / ref.abs().max())
    print(
        f"\nconverted SigLIP on 3 preprocessed photographs: pixels max |ours - hf| {pixel_diff:.1e}, "
        f"last_hidden_state {rel:.2e} relative"
    )
    assert rel <= TOL, rel


def _train_args(ckpt: Path, *flags: str):
    from megatron_hetero.cli import build_parser

    argv = ["train", "--load", str(ckpt), "--hetero-module", "vision:dp=1", "--hetero-module", "language:tp=1"]
    return build_parser().parse_args(argv + ["--hetero-edge", "vision->language", *flags])


# the converted model by Megatron-LM's flags (the encoder without its pooling head and with its MLP
# width left to 4 * hidden: the encoders still differ)
LLAMA31_FLAGS = (
    "--num-layers 1 --hidden-size 32 --num-attention-heads 4 --ffn-hidden-size 64 --vocab-size 64 "
    f"--seq-length {S} --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --position-embedding-type rope "
    "--rotary-base 500000 --group-query-attention --num-query-groups 2 --disable-bias-linear "
    f"--vision-model-type siglip --patch-dim {PATCH} --encoder-tokens {GRID * GRID} --encoder-hidden-size 32 "
    "--encoder-num-layers 2 --encoder-num-attention-heads 4"
).split()


def test_load_with_flags_that_drop_the_rope_scaling_names_it(converted):
    """Flags beside --load of converted weights must agree with the recorded model; a field they do not
    set is the record's: without --use-rope-scaling the recorded rope scaling stays (not a difference),
    and what differs is named, field and flag: the encoder built by --vision-model-type siglip has no
    pooling head, the converted one has."""
    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.cli.train_door import job_from_args

    doc = {"modules": {"vision": {}, "language": {}}, "edges": ["vision -> language"]}
    layout = layout_from_dict(doc, world_size=1)
    for extra in ((), ("--use-rope-scaling",)):
        with pytest.raises(
            ValueError,
            match=r"encoders\.vision\.pooling_head \(--vision-model-type\): True in the checkpoint, False given",
        ) as err:
            job_from_args(_train_args(converted.ckpt, *LLAMA31_FLAGS, *extra), layout)
        assert "rope_scaling" not in str(err.value), err.value

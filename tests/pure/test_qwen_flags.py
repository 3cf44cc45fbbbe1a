"""`--vision-model-type qwen2.5-vl` with `--position-embedding-type mrope --mrope-section T H W` on
`train`: the Qwen2.5-VL tower's fields (features of a merged token's 2 x 2 patches, windows of 8
patches, full attention every eighth block), a record that reads back equal, and each inconsistent
combination a ValueError naming what is wrong (cp on the tower, pipeline stages with native-resolution
images or blocks that do not split evenly); pipeline stages on fixed-size images pass. Pure: no torch."""

from __future__ import annotations

import pytest

from megatron_hetero import cli
from megatron_hetero.checkpoint.records import spec_record
from megatron_hetero.layout import layout_from_dict
from megatron_hetero.models.architecture import check_architecture
from megatron_hetero.config.model import LlavaSpec, spec_from_flags
from megatron_hetero.cli.train_door import arch_flags, model_flags
from megatron_hetero.config.arch import apply_arch_flags

QWEN = ["--vision-model-type", "qwen2.5-vl", "--patch-dim", "2", "--encoder-tokens", "4"]
MROPE = ["--position-embedding-type", "mrope", "--mrope-section", "2", "3", "3"]
LAYOUT = {"placement": "colocated", "modules": {"vision": {}, "language": {}}, "edges": ["vision -> language"]}


def _spec(*flags: str) -> LlavaSpec:
    args = cli.build_parser().parse_args(["train", *flags])
    return apply_arch_flags(arch_flags(args), spec_from_flags(model_flags(args)), model_flags(args))


def _check(spec: LlavaSpec, modules: dict | None = None, world: int = 1) -> None:
    doc = dict(LAYOUT, modules=modules or LAYOUT["modules"])
    check_architecture(layout_from_dict(doc, world_size=world), spec, ["language"])


def test_qwen_flags_set_the_tower_and_its_record_reads_back() -> None:
    spec = _spec(*QWEN, *MROPE, "--encoder-num-layers", "16")
    enc = spec.encoders["vision"]
    assert (enc.kind, enc.patch_size, enc.feature_dim, enc.window_size) == ("qwen2.5-vl", 2, 96, 16)
    assert (enc.fullatt_block_indexes, enc.activation, spec.mrope_section) == ((7, 15), "silu", (2, 3, 3))
    _check(spec)
    assert LlavaSpec.from_record(spec_record(spec)) == spec
    assert _spec(*QWEN, *MROPE).encoders["vision"].fullatt_block_indexes == (1,)  # the last of 2 blocks
    plain = spec_record(_spec())
    assert "mrope_section" not in plain and "window_size" not in plain["encoders"]["vision"]


def test_qwen_tower_takes_pipeline_stages_on_fixed_size_images() -> None:
    _check(_spec(*QWEN, *MROPE), {"vision": {"pp": 2}, "language": {"dp": 2}}, world=2)
    _check(
        _spec(*QWEN, *MROPE, "--encoder-num-layers", "4"),
        {"vision": {"tp": 2, "pp": 2}, "language": {"dp": 4}},
        world=4,
    )


@pytest.mark.parametrize(
    "flags, modules, words",
    [
        (QWEN, None, "M-RoPE"),
        (["--vision-model-type", "qwen2.5-vl", *MROPE], None, "--patch-dim"),
        ([*QWEN, "--encoder-feature-dim", "12", *MROPE], None, "96"),
        ([*QWEN, "--position-embedding-type", "mrope", "--mrope-section", "2", "2", "2"], None, "head dimension"),
        (MROPE, None, "one Qwen2.5-VL encoder"),
        ([*QWEN, *MROPE], {"vision": {"cp": 2}, "language": {"dp": 2}}, "runs with cp 1: its windows and images"),
        (
            [*QWEN, *MROPE, "--encoder-max-tiles", "2"],
            {"vision": {"pp": 2}, "language": {"dp": 2}},
            "native-resolution images .* runs with pp 1: .* no one static shape",
        ),
        (
            [*QWEN, *MROPE, "--encoder-num-layers", "3"],
            {"vision": {"pp": 2}, "language": {"dp": 2}},
            r"3 blocks do not split evenly over pp\(2\)",
        ),
        ([*QWEN, "--encoder-tokens", "5", *MROPE], None, "rows"),
    ],
)
def test_inconsistent_qwen_flags_are_refused(flags, modules, words) -> None:
    with pytest.raises(ValueError, match=words):
        spec = _spec(*flags)
        world = 2 if modules else 1
        doc = dict(LAYOUT, modules=modules or LAYOUT["modules"])
        check_architecture(layout_from_dict(doc, world_size=world), spec, ["language"])

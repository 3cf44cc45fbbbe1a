"""The planner prices a Qwen2.5-VL tower on pipeline stages (`planner/memory_qwen.py`,
`planner.model.qwen_encoder_spec`): its blocks divided evenly by pp as the generic encoder's, the
patch embedding on the first stage and the merger on the last (the stages' parameters add up to the
one-stage tower's), each stage's activations its own blocks' (with the masks of the attention kinds
they use), and the tensor between stages the image's patches (tokens x merge**2, what
`LlavaStageRunner.stage_tensor` sends). Pure: no torch."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_hetero.layout.spec import ModuleLayout
from megatron_hetero.planner.memory_qwen import (
    block_params,
    merger_params,
    patch_width,
    qwen_activation_bytes,
    qwen_stage_params,
)
from megatron_hetero.planner.memory_terms import ActivationFeatures, norm_activation_bytes
from megatron_hetero.planner.model import qwen_encoder_spec
from qwen_train_case import TOWER

QWEN = dataclasses.replace(TOWER, num_layers=4, fullatt_block_indexes=(1, 3))
H = 64


@pytest.mark.parametrize("tp", [1, 2])
def test_stage_parameters_split_the_blocks_and_add_up(tp: int) -> None:
    one = qwen_stage_params(QWEN, H, ModuleLayout("vision", tp=tp), 0)
    m = ModuleLayout("vision", tp=tp, pp=2)
    first, last = qwen_stage_params(QWEN, H, m, 0), qwen_stage_params(QWEN, H, m, 1)
    assert first + last == one
    assert first == 2 * block_params(QWEN, tp) + patch_width(QWEN) * QWEN.hidden_size
    assert last == 2 * block_params(QWEN, tp) + merger_params(QWEN, H, tp)
    with pytest.raises(ValueError, match=r"4 blocks do not split over pp\(3\)"):
        qwen_stage_params(QWEN, H, ModuleLayout("vision", pp=3), 0)


def test_stage_activations_are_the_stages_own_blocks() -> None:
    f, b = ActivationFeatures(dtype_bytes=4), 4
    n, h = 2 * QWEN.tokens * QWEN.merge_size**2, QWEN.hidden_size  # patches of two images
    inputs = n * patch_width(QWEN) * b  # the first stage's patches
    # the last stage's ln_q, the merger's inputs, the window order and its inverse
    merger = norm_activation_bytes(n, 1, h, 1, f, "RMSNorm") + (n * h + 2 * n * h) * b + 2 * (n // 4) * 8
    one = qwen_activation_bytes(QWEN, H, ModuleLayout("vision"), 0, 2, f)
    layer = (one - 2 * n * n - inputs - merger) // 4  # four blocks, the two masks kept once
    m = ModuleLayout("vision", pp=2)
    # each stage holds a window block and a full block: both masks (n*n bytes each) on each stage
    assert qwen_activation_bytes(QWEN, H, m, 0, 2, f) == 2 * layer + 2 * n * n + inputs
    assert qwen_activation_bytes(QWEN, H, m, 1, 2, f) == 2 * layer + 2 * n * n + merger
    # a stage of window blocks only keeps the window mask only
    windows = dataclasses.replace(QWEN, fullatt_block_indexes=(3,))
    assert qwen_activation_bytes(windows, H, m, 0, 2, f) == 2 * layer + n * n + inputs


def test_cost_model_sends_the_images_patches_between_stages() -> None:
    spec = qwen_encoder_spec("vision", QWEN, H)
    assert (spec.num_layers, spec.seq, spec.out_tokens) == (4, QWEN.tokens * QWEN.merge_size**2, QWEN.tokens)

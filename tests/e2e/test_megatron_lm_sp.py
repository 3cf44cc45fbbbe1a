"""`pretrain_gpt.py --sequence-parallel` with a layout: Megatron's sequence parallelism in every
language module (segment) with tp > 1, against the unpatched script (TP1·DP2, where Megatron ignores
the flag): one GPT cut into two segments TP2 @0-1 -> TP2 @2-3, so each segment's hidden states are
`[s/2, b, h]` on each TP rank, the first segment all-gathers them over its TP group before the edge
and the second keeps its own chunk. The losses, the validation losses and the logged grad norm
(the whole model's, after the TP all-reduce of the layer-norm gradients) equal the reference's.
`pretrain_vlm.py --sequence-parallel` stays refused (Megatron's LLaVAModel asserts Transformer
Engine attention for it)."""

from __future__ import annotations

import pytest

from test_megatron_lm import GPT, ITERS, TREE_ENV, _unpatched, assert_grad_norms, assert_losses, torchrun, trees

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not TREE_ENV, reason="set MEGATRON_LM to a Megatron-LM tree at core_v0.19.0 to run these"),
]
assert trees  # the fixture: {'pristine': a copy of the tree, 'patched': a copy with the patches applied}

SEGMENTS_TP2_TP2 = [
    "--hetero-placement",
    "disjoint",
    "--hetero-module",
    "language_a:tp=2,layers=0-1",
    "--hetero-module",
    "language_b:tp=2,layers=2-3",
    "--hetero-edge",
    "language_a->language_b",
]


@pytest.mark.timeout(600)
def test_gpt_segments_with_sequence_parallel_match_unpatched(trees):
    ref = _unpatched(trees, "pretrain_gpt.py", GPT)
    run = torchrun(
        trees["patched"] / "pretrain_gpt.py", GPT + ITERS + SEGMENTS_TP2_TP2 + ["--sequence-parallel"], nproc=4
    )
    for seg in ("language_a", "language_b"):
        assert f"module {seg}: sequence parallelism over tp(2)" in run.out, run.tail()
    assert_losses(run, ref.losses, 1e-5, "GPT: segments TP2 @0-1 -> TP2 @2-3, --sequence-parallel", ref.valid)
    assert_grad_norms(run, ref)


def test_vlm_sequence_parallel_is_refused():
    """Before any process group (the script exits 2 with this message: `driver.pretrain_with_layout`)."""
    from types import SimpleNamespace

    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.megatron_lm.vlm import check_vlm

    doc = {"placement": "colocated", "modules": {"vision": {"dp": 2}, "language": {"tp": 2}}, "edges": []}
    doc["edges"] = ["vision -> language"]
    with pytest.raises(ValueError, match="--sequence-parallel is not supported with pretrain_vlm.py"):
        check_vlm(SimpleNamespace(sequence_parallel=True), layout_from_dict(doc, world_size=2))

"""MoE in `pretrain_gpt.py` with a layout (docs/megatron-lm.md): Megatron's MoE layers (local spec,
`SequentialMLP` experts, top-2 router with the load-balancing loss, alltoall dispatcher) with each
module's own expert parallelism from the layout, against the unpatched script (one model, one
optimizer, EP 1) from the same weights: expert k of the reference goes to EP rank k // (E / ep) of
the module as its local expert k % (E / ep) (`weights.copy_into`).

Needs a Megatron-LM tree (`MEGATRON_LM`); runs as `tests/e2e/test_megatron_lm.py` does (CPU/gloo,
forked ranks, 3 iterations, fp32, dropout 0, Megatron's default --clip-grad 1.0)."""

from __future__ import annotations

from test_megatron_lm import (  # noqa: F401  (trees: the fixture, used by name)
    GPT,
    ITERS,
    RTOL,
    assert_grad_norms,
    assert_losses,
    pytestmark,
    torchrun,
    trees,
    _default_clip,
    _unpatched,
    _with,
)

#: 4 experts, top-2, the load-balancing loss on (its gradient scale is what EP and DP must keep); no
#: linear biases, as MoE models have them (Megatron 0.19's SequentialMLP with biases fails at TP 1: an
#: in-place add on the view _ReduceFromModelParallelRegion returns)
MOE = (
    "--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 0.01 --moe-token-dispatcher-type alltoall "
    "--disable-bias-linear"
).split()


#: the gated MLP in every expert (--swiglu): each expert-TP rank must get its gate and up rows of every
#: expert's linear_fc1 (weights.py; with a plain chunk of [gate; up] the TP2 case's iteration 2 misses by
#: 4.6e-5 and its first validation by 3.1e-4); with it the reference's grad norms are just under 1.0
#: (0.971, 0.992, 0.997), so the runs clip at 0.9, engaged at every iteration
GATED = ["--swiglu", "--clip-grad", "0.9"]


def test_gpt_moe_with_expert_parallel_layouts_matches_unpatched(trees):  # noqa: F811
    """The unpatched TP1·DP2 MoE GPT (EP 1) vs (a) one module DP2 with its experts over EP2 (each rank
    holds 2 of the 4 experts of every layer), (b) disjoint segments: layers 0-1 DP2·EP2 on ranks
    0-1, layers 2-3 DP2 (all 4 experts on each rank) on ranks 2-3, and (c) one module TP2·DP2·EP2 with
    expert TP2 (`expt_tp=2`, Megatron's default expert TP at TP 2) on 4 ranks with --sequence-parallel
    (Megatron's MoE with TP dispatches each TP rank's sequence chunk and all-gathers the routed tokens
    over expert TP; the dense weights split over TP and each expert's fc1/fc2 over expert TP from the
    TP1·EP1 reference): training and validation losses and the logged grad norm, all with --swiglu."""
    args = _default_clip(_with(GPT, micro_batch_size="2", global_batch_size="8")) + MOE + GATED
    ref = _unpatched(trees, "pretrain_gpt.py", args)
    one = torchrun(trees["patched"] / "pretrain_gpt.py", args + ITERS + ["--hetero-module", "language:dp=2,ep=2"])
    assert_losses(one, ref.losses, RTOL, "GPT MoE: language DP2·EP2", ref.valid)
    assert_grad_norms(one, ref, clip=0.9)
    segments = [
        "--hetero-placement",
        "disjoint",
        "--hetero-module",
        "language_a:dp=2,ep=2,layers=0-1",
        "--hetero-module",
        "language_b:dp=2,layers=2-3",
        "--hetero-edge",
        "language_a->language_b",
    ]
    seg = torchrun(trees["patched"] / "pretrain_gpt.py", args + ITERS + segments, nproc=4)
    assert_losses(seg, ref.losses, RTOL, "GPT MoE: segments DP2·EP2 @0-1 -> DP2 @2-3", ref.valid)
    assert_grad_norms(seg, ref, clip=0.9)
    tp2 = ["--sequence-parallel", "--hetero-module", "language:tp=2,dp=2,ep=2,expt_tp=2"]
    run = torchrun(trees["patched"] / "pretrain_gpt.py", args + ITERS + tp2, nproc=4)
    assert "module language: experts over expt_tp(2) x ep(2) x expt_dp(1), 2 per EP rank" in run.out, run.tail()
    assert "module language: sequence parallelism over tp(2)" in run.out, run.tail()
    assert_losses(run, ref.losses, RTOL, "GPT MoE: language TP2·DP2·EP2·ETP2, --sequence-parallel", ref.valid)
    assert_grad_norms(run, ref, clip=0.9)

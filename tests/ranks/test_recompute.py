"""Activation recompute in `megatron-hetero train` (Megatron's `recompute_granularity`,
`recompute_method`, `recompute_num_layers` in each module's TransformerConfig): the job's flags for
every module, or a module's own `recompute:` in the layout. Recompute changes memory, never the
results: the same losses and grad norms bit for bit (dropout is 0, the recomputed forward runs the
same ops), and fewer activations saved for backward."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron_hetero.layout import layout_from_dict
from megatron_hetero.models.llava import LlavaSpec
from megatron_hetero.runtime.launcher import run_ranks
from megatron_hetero.runtime.module_state import OptimConfig
from megatron_hetero.training.setup import JobConfig

from parity import losses, run_job

SPEC = LlavaSpec(swiglu=True, num_layers=2)
JOB = JobConfig(
    spec=SPEC, global_batch_size=4, micro_batch_size=1, train_iters=3, optim=OptimConfig(optimizer="adam", lr=1e-3)
)
FULL = {"granularity": "full", "method": "uniform", "num_layers": 1}


def _doc(vision: dict, language: dict) -> dict:
    return {
        "placement": "colocated",
        "modules": {"vision": vision, "language": language},
        "edges": ["vision -> language"],
    }


def _norms(per_rank: list[dict]) -> list[float]:
    return [r["grad_norm"] for r in per_rank[0]["records"]]


def test_recompute_keeps_losses_and_grad_norms_bitwise():
    """vision DP2 + language TP2 colocated on 2 ranks: without recompute, with the job's
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1, and with the
    layout's per-module `recompute:` on the language model only."""
    plain = run_job(_doc({"dp": 2}, {"tp": 2}), 2, JOB)
    flags = dataclasses.replace(JOB, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    whole = run_job(_doc({"dp": 2}, {"tp": 2}), 2, flags)
    per_module = run_job(_doc({"dp": 2}, {"tp": 2, "recompute": FULL}), 2, JOB)
    assert len(losses(plain)) == 3
    for run in (whole, per_module):
        assert losses(run) == losses(plain) and _norms(run) == _norms(plain), (losses(run), losses(plain))
    print(f"losses {losses(plain)}, grad norms {_norms(plain)}: the same with recompute")


def _saved_bytes(recompute: bool) -> tuple[int, int]:
    """(bytes of the activations autograd saves for backward in one micro-batch's forward of the
    language model's decoder, how many distinct tensors), this rank; then the backward runs (with
    recompute: the layers' forward again)."""
    from megatron_hetero.runtime.topology import Topology
    from megatron_hetero.training.setup import build_module
    from megatron_hetero.training.trainer import prepare_rank

    from megatron_hetero.layout.spec import Recompute

    prepare_rank(JOB)
    layout = layout_from_dict(_doc({}, {}), world_size=dist.get_world_size())
    topo = Topology.build(layout)
    try:
        r = Recompute(**FULL) if recompute else None
        mod = build_module("language", layout, SPEC, topo.pg_collection("language"), r).train()
        s = SPEC.seq_length
        x = torch.randn(s, 1, SPEC.hidden_size, generator=torch.Generator().manual_seed(0), requires_grad=True)
        mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
        weights = {p.untyped_storage().data_ptr() for p in mod.parameters()}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in weights:  # activations only (autograd saves the weights too)
                seen.setdefault(ptr, t.untyped_storage().nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = mod.gpt.decoder(hidden_states=x, attention_mask=mask)
        y.sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()
        return sum(seen.values()), len(seen)
    finally:
        topo.destroy()


def test_recompute_saves_fewer_activations():
    """One micro-batch (32 tokens, hidden 64, 2 swiglu layers) of the language decoder on one rank:
    the bytes of the distinct activation tensors autograd keeps for backward (not the weights), without
    and with full recompute (uniform, 1 layer per unit: each layer's input and the mask remain)."""
    (plain, n_plain), (recomputed, n_rec) = run_ranks(1, _saved_bytes, False)[0], run_ranks(1, _saved_bytes, True)[0]
    print(
        f"activations saved for backward: {plain} bytes in {n_plain} tensors without recompute, {recomputed} in {n_rec} with"
    )
    assert recomputed < plain / 10, (plain, recomputed)

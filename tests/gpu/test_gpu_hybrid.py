"""The GPU check of a HybridModel language model with Mamba layers (`--hybrid-layer-pattern` with `M`,
`models/hybrid_lm.py`): refused on CPU, built from Megatron's own (Transformer Engine) hybrid spec
with `--transformer-impl transformer_engine`. Skipped without a CUDA GPU, Transformer Engine or
mamba-ssm (the reason says which); where all three are present it must pass. Not yet run on a GPU.

World 1 on one GPU (NCCL), fp32 weights, 3 SGD steps of `M*-M-` (Mamba, attention, MLP, Mamba, MLP):
finite, falling losses; and `*-*-` under the TE spec gives the local spec's losses within 2% (the
same layers, TE's kernels), the anchor that the TE path is built as the local one.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
MISSING = [m for m in ("transformer_engine", "mamba_ssm", "causal_conv1d") if importlib.util.find_spec(m) is None]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU (NCCL); none is present"),
    pytest.mark.skipif(bool(MISSING), reason=f"Mamba layers need {MISSING} (not installed)"),
]


def _losses(pattern: str, impl: str) -> list[float]:
    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.models.llava import LlavaSpec
    from megatron_hetero.runtime.launcher import run_ranks
    from megatron_hetero.runtime.module_state import OptimConfig
    from megatron_hetero.training.setup import JobConfig, JobDraft, validate_job
    from megatron_hetero.training.trainer import train_rank

    spec = LlavaSpec(
        num_layers=len(pattern),
        hidden_size=64,
        num_attention_heads=4,
        hybrid_layer_pattern=pattern,
        transformer_impl=impl,
    )
    job = JobConfig(spec=spec, train_iters=3, optim=OptimConfig(optimizer="sgd", lr=0.5))
    doc = {"placement": "colocated", "modules": {"vision": {}, "language": {}}, "edges": ["vision -> language"]}
    layout = layout_from_dict(doc, world_size=1)
    per_rank = run_ranks(1, train_rank, validate_job(JobDraft(layout, job)), backend="nccl", timeout=500)
    return [r["loss"] for r in per_rank[0]["records"]]


@pytest.mark.timeout(600)
def test_mamba_pattern_trains_on_one_gpu():
    got = _losses("M*-M-", "transformer_engine")
    assert len(got) == 3 and all(torch.isfinite(torch.tensor(got))) and got[-1] < got[0], got


@pytest.mark.timeout(600)
def test_te_hybrid_spec_matches_the_local_one():
    te, local = _losses("*-*-", "transformer_engine"), _losses("*-*-", "local")
    assert max(abs(a - b) / abs(b) for a, b in zip(te, local)) <= 2e-2, (te, local)

"""Encoder offload on CUDA (`runtime.offload`): the device bytes it frees, measured with the caching
allocator's count (`compat.device.memory_allocated`), alone and in the colocated schedule's language
phase (world-1 NCCL). Skipped without a CUDA GPU; `scripts/gpu_check.sh offload` runs this file.

Every CUDA call runs in a forked rank (`run_ranks`), so this process never initialises CUDA and the
other GPU tests can still fork. The same helpers run on CPU/gloo (where the allocator count is 0),
which is how they were checked without a GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_hetero.layout import layout_from_dict
from megatron_hetero.config.model import EncoderSpec, LlavaSpec
from megatron_hetero.runtime.launcher import run_ranks
from megatron_hetero.runtime.module_state import OptimConfig
from megatron_hetero.training.setup import JobConfig, JobDraft, validate_job
from megatron_hetero.training.trainer import train_rank

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
BACKEND = "nccl"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU (NCCL); none is present"),
]


def offloader_frees(hidden: int = 2048) -> dict:
    """On a rank: a Linear's parameters, gradients and Adam state offloaded and restored; the bytes
    Offloader reports, the allocator's count before/after, and whether the values came back."""
    from megatron_hetero.compat.device import get_device, memory_allocated
    from megatron_hetero.runtime.offload import Offloader

    device = get_device()
    lin = torch.nn.Linear(hidden, hidden, bias=False, device=device)
    opt = torch.optim.Adam(lin.parameters(), lr=1e-3)
    lin(torch.randn(8, hidden, device=device)).sum().backward()
    opt.step()
    tensors = [lin.weight, lin.weight.grad, *opt.state[lin.weight].values()]
    tensors = [t for t in tensors if t.numel() > 1]  # Adam's step counter is a scalar
    copies = [t.detach().cpu().clone() for t in tensors]
    off = Offloader(lambda: tensors)
    before = memory_allocated(device)
    freed = off.offload()
    after = memory_allocated(device)
    off.restore()
    back = all(torch.equal(t.detach().cpu(), c) for t, c in zip(tensors, copies))
    return {"freed": freed, "before": before, "after": after, "restored": back, "expected": 4 * hidden * hidden * 4}


def language_phase_memory(log: str) -> None:
    """Wrap Offloader.offload/restore in this (forked) rank: each offload appends the allocator's
    count before and after, and the bytes freed, to the JSON-lines file `log`."""
    from megatron_hetero.compat.device import memory_allocated
    from megatron_hetero.runtime import offload as mod

    plain = mod.Offloader.offload

    def offload(self) -> int:
        before = memory_allocated()
        freed = plain(self)
        with open(log, "a") as f:
            f.write(json.dumps({"before": before, "after": memory_allocated(), "freed": freed}) + "\n")
        return freed

    mod.Offloader.offload = offload  # type: ignore[method-assign]


def colocated_job(offload: bool) -> JobConfig:
    """A world-1 colocated job whose encoder state is worth measuring (about 50 MB with Adam)."""
    spec = LlavaSpec(encoders={"vision": EncoderSpec(num_layers=2, hidden_size=512, num_attention_heads=8)})
    return JobConfig(spec=spec, train_iters=3, optim=OptimConfig(optimizer="adam", lr=1e-3), offload_encoder=offload)


def _train(job: JobConfig, backend: str, log: str = "") -> list[float]:
    doc = {"placement": "colocated", "modules": {"vision": {}, "language": {}}, "edges": ["vision -> language"]}
    layout = layout_from_dict(doc, world_size=1)

    def rank(validated):
        if log:
            language_phase_memory(log)
        return train_rank(validated)

    per_rank = run_ranks(1, rank, validate_job(JobDraft(layout, job)), backend=backend, timeout=300)
    return [r["loss"] for r in per_rank[0]["records"]]


@pytest.mark.timeout(300)
def test_offloader_frees_device_bytes_and_restores_them():
    got = run_ranks(1, offloader_frees, backend=BACKEND, timeout=200)[0]
    assert got["restored"], got
    assert got["freed"] >= got["expected"], got
    assert got["before"] - got["after"] >= got["freed"], got  # the allocator's count fell by the bytes freed


@pytest.mark.timeout(600)
def test_colocated_offload_frees_device_bytes_in_language_phase(tmp_path: Path):
    log = tmp_path / "offload.jsonl"
    off = _train(colocated_job(True), BACKEND, str(log))
    on = _train(colocated_job(False), BACKEND)
    assert off == on  # bitwise: only storage moved
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(rows) == 3, rows  # one offload per step
    for r in rows[1:]:  # from step 2 on Adam state exists too
        assert r["freed"] > 0 and r["before"] - r["after"] >= r["freed"], rows

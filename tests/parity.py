"""Helpers for loss/parameter parity tests: run a job on forked ranks, gather full parameters from
TP shards and pipeline stages, compare against a reference run."""

from __future__ import annotations

import re

import torch

from megatron_hetero.layout import layout_from_dict  # noqa: E402
from megatron_hetero.runtime.launcher import run_ranks  # noqa: E402
from megatron_hetero.training.setup import JobConfig, JobDraft, validate_job  # noqa: E402
from megatron_hetero.training.trainer import train_rank  # noqa: E402

_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")
_GATED_FC1 = re.compile(r"layers\.\d+\.mlp\.linear_fc1\.")
HOMOGENEOUS_W1 = {"placement": "colocated", "modules": {}, "edges": []}


def world1_doc(job: JobConfig, frozen: tuple[str, ...] = ()) -> dict:
    """Every module TP1 on one rank: the simplest homogeneous run of the same model."""
    mods = {n: ({"frozen": True} if n in frozen else {}) for n in job.spec.encoders}
    mods["language"] = {"frozen": True} if "language" in frozen else {}
    return {"placement": "colocated", "modules": mods, "edges": [f"{n} -> language" for n in job.spec.encoders]}


def run_job(doc: dict, world: int, job: JobConfig, timeout: float = 180) -> list[dict]:
    layout = layout_from_dict(doc, world_size=world)
    return run_ranks(world, train_rank, validate_job(JobDraft(layout, job)), collect_params=True, timeout=timeout)


def losses(per_rank: list[dict]) -> list[float]:
    return [r["loss"] for r in per_rank[0]["records"]]


def _layers_per_stage(per_rank: list[dict], module: str) -> int:
    """Layers held by pipeline stage 0 of `module` (uniform split)."""
    for r in per_rank:
        if module in r.get("params", {}) and r["coords"][module]["pp"] == 0:
            idx = {int(m.group(2)) for n in r["params"][module] for m in [_LAYER.search(n)] if m}
            return len(idx)
    return 0


def full_params(
    per_rank: list[dict], segment_offsets: dict[str, int] | None = None, gated: bool = False
) -> dict[str, dict[str, torch.Tensor]]:
    """Full parameters by (module, global name): TP shards concatenated along the dimension where the
    shard is smaller than the full tensor, pipeline-stage layer indices made global. The language
    module's parameters are keyed under 'language' whatever the segment names (offsets by segment).
    `gated`: the layers' MLPs are gated (SwiGLU): each TP shard of a layer's fused fc1 is its [gate;
    up] halves, put together as [all gates; all ups] (Megatron's strided split)."""
    segment_offsets = segment_offsets or {}
    shards: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for r in per_rank:
        for module, params in r.get("params", {}).items():
            c = r["coords"][module]
            if c["dp"] != 0 or c["cp"] != 0:
                continue
            per_stage = _layers_per_stage(per_rank, module)
            offset = segment_offsets.get(module, 0) + c["pp"] * per_stage
            key_module = "language" if module in segment_offsets else module
            for name, t in params.items():
                gname = _LAYER.sub(lambda m: f"{m.group(1)}layers.{int(m.group(2)) + offset}.", name, count=1)
                shards.setdefault((key_module, gname), {})[c["tp"]] = t
    out: dict[str, dict[str, torch.Tensor]] = {}
    for (module, name), by_tp in shards.items():
        parts = [by_tp[k] for k in sorted(by_tp)]
        dim = _split_dim(name)
        if len(parts) == 1 or dim is None:
            assert all(_same(parts[0], p) for p in parts[1:]), f"{module}.{name}: TP replicas differ"
            full = parts[0]  # replicated over TP (norms, positions, row-parallel biases, ...)
        elif gated and _GATED_FC1.search(name):
            halves = [p.chunk(2, dim=0) for p in parts]
            full = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        else:
            full = torch.cat(parts, dim=dim)
        out.setdefault(module, {})[name] = full
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """TP replicas of a replicated parameter (identical up to reduction-order noise); TP shards of a
    split parameter are independent random draws and differ completely."""
    return a.shape == b.shape and bool((a - b).abs().max() <= 1e-6 * a.abs().max().clamp_min(1e-30))


_COLUMN = (
    "linear_qkv.weight",
    "linear_qkv.bias",
    "linear_fc1.weight",
    "linear_fc1.bias",
    "word_embeddings.weight",
    "output_layer.weight",
)
_ROW = ("linear_proj.weight", "linear_fc2.weight")


def _split_dim(name: str):
    """Megatron's TP split of a parameter: column-parallel layers (QKV, fc1, vocab embedding and
    output layer) along dim 0, row-parallel (proj, fc2) weights along dim 1, None if replicated."""
    if name.endswith(_COLUMN):
        return 0
    if name.endswith(_ROW):
        return 1
    return None


def max_param_rel_diff(a: dict, b: dict) -> tuple[float, str]:
    """max over tensors of max|a-b| / max|b|; both must hold the same names and shapes."""
    worst = (0.0, "")
    for module in b:
        assert set(a[module]) == set(b[module]), (module, set(a[module]) ^ set(b[module]))
        for name, ref in b[module].items():
            got = a[module][name]
            assert got.shape == ref.shape, (module, name, got.shape, ref.shape)
            rel = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
            worst = max(worst, (rel, f"{module}.{name}"))
    return worst


def max_loss_rel_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))

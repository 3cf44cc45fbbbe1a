"""A module's pipeline stages for many candidates at once, as numpy arrays (one row per candidate): `Stages`
(classes of equal stages) and `module_stages`, each stage's per-run costs, once-per-step tails, state and
activation bytes. Pure (numpy only); the formulas are in `planner/cost.py`'s docstring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from megatron_hetero.planner.hardware import Profile
from megatron_hetero.planner.workload import ModelSpec, Workload
from megatron_hetero.planner.cost_terms import (
    layer_parts,
    p2p_time,
    state_bytes,
    act_bytes,
    dp_time,
    io_time,
    data_time,
)


#: resident-state snapshots per module per step (the runtimes report memory per phase / per step)
SNAPSHOTS = {"colocated": 3, "disjoint": 1, "homogeneous": 0}


# ---------------------------------------------------------------------------------------------
# The evaluator: pipeline stages of many candidates at once, as numpy arrays
# ---------------------------------------------------------------------------------------------
_PARTS = ("compute", "tp", "cp", "pp", "boundary")


_FIELDS = _PARTS + ("ranks", "runs", "dp", "opt", "state", "act")


@dataclass
class Stages:
    """The pipeline stages of N rows (candidates, or one side of them), grouped into K classes of
    equal stages: arrays (N, K). A module's evenly split stages fall into four classes (its first
    stage, the other stages with ceil(L/pp) layers, those with floor(L/pp), its last stage).

    count: stages in the class (0: absent); first: index of its first stage in the pipeline (the
    1F1B in-flight micro-batches of stage i of n are min(n - i, B)); compute/tp/cp/pp/boundary: one
    run (a micro-batch, or a colocated encoder's whole share); ranks: ranks running one stage;
    runs: per step; dp/opt: once per step (gradient all-reduce, optimizer step); state: bytes of
    weights, grads and optimizer state on a rank; act: activation bytes of one run."""

    count: np.ndarray
    first: np.ndarray
    compute: np.ndarray
    tp: np.ndarray
    cp: np.ndarray
    pp: np.ndarray
    boundary: np.ndarray
    ranks: np.ndarray
    runs: np.ndarray
    dp: np.ndarray
    opt: np.ndarray
    state: np.ndarray
    act: np.ndarray

    @property
    def cost(self) -> np.ndarray:
        return self.compute + self.tp + self.cp + self.pp + self.boundary

    @staticmethod
    def cat(*parts: "Stages") -> "Stages":
        return Stages(
            **{k: np.concatenate([getattr(p, k) for p in parts], axis=1) for k in ("count", "first") + _FIELDS}
        )


def _col(x, n: int) -> np.ndarray:
    return np.broadcast_to(np.asarray(x), (n,))[:, None]


def module_stages(
    prof: Profile,
    wl: Workload,
    spec: ModelSpec,
    tp,
    cp,
    pp,
    dp,
    layers,
    samples,
    *,
    runs,
    p2p,
    inter,
    placement: str,
    offset=0,
    embed_first=False,
    embed_last=False,
    io_last=False,
    data: str = "none",
    head: Optional[dict] = None,
    ep=1,
) -> Stages:
    """The four stage classes of a module (or LLM segment) of `layers` layers evenly split over `pp`
    stages (pp = 0: absent), each stage running `samples` samples per replica and run.

    embed_first / embed_last: the first / last stage holds an embedding's parameters; io_last: the
    last stage does the module's work outside its layers (`io_time`); data: which stages build the
    run's samples, "all" (language model), "first" (an encoder: the samples of its images) or
    "none"; p2p: whether stages exchange with a neighbour stage (over the inter-node link where
    `inter`); head: extra per-run costs / parameters / activations on the first stage (the encoder
    inside a homogeneous stage 0: keys compute, tp, cp, params, act). Arguments broadcast over rows.
    ep: the module's expert parallelism (a model with experts: expert parameters are split over ep
    instead of tp, and their gradients reduce over expert-DP = tp*cp*dp/ep)."""
    shape = np.broadcast(
        *(
            np.asarray(x)
            for x in (tp, cp, pp, dp, layers, samples, runs, p2p, inter, offset, embed_first, embed_last, io_last, ep)
        )
    ).shape
    n = int(np.prod(shape)) if shape else 1
    tp, cp, pp, dp, layers, samples, runs, ep = (_col(x, n) for x in (tp, cp, pp, dp, layers, samples, runs, ep))
    p2p, inter, offset = _col(p2p, n), _col(inter, n), _col(offset, n)
    embed_first, embed_last, io_last = _col(embed_first, n), _col(embed_last, n), _col(io_last, n)
    p = np.maximum(pp, 1)
    r = layers % p
    fl = layers // p
    ce = fl + (r > 0)
    multi = pp > 1
    count = np.hstack(
        [
            (pp >= 1).astype(int),
            np.maximum(r - 1, 0),
            np.where(multi, np.maximum(p - 1 - np.maximum(r, 1), 0), 0),
            multi.astype(int),
        ]
    )
    first = offset + np.hstack([np.zeros_like(p), np.ones_like(p), np.maximum(r, 1), p - 1])
    lam = np.hstack([ce, ce, fl, fl]).astype(float)
    is_first = np.array([True, False, False, False])[None, :]
    is_last = np.hstack([pp == 1, np.zeros((n, 2), bool), np.ones((n, 1), bool)])
    c, t, q = layer_parts(prof, wl, spec, samples, tp, cp, ep)
    compute = lam * c
    if data != "none":
        per = samples / wl.images_per_sample if data == "first" else samples
        compute = compute + data_time(prof, wl, per) * (is_first if data == "first" else 1.0)
    compute = compute + np.where(io_last & is_last, io_time(prof, wl, spec, samples, tp, cp), 0.0)
    tpc, cpc = lam * t, lam * q
    ppc = np.broadcast_to(np.where(p2p, p2p_time(prof, wl, spec, samples, cp, inter), 0.0), lam.shape)
    emb = float(spec.embedding_params)
    experts = float(spec.expert_layer_params)  # 0 for a dense model
    params = lam * (spec.layer_params - experts) + emb * (
        (embed_first & is_first).astype(float) + (embed_last & is_last)
    )
    act = act_bytes(wl, spec, samples, tp, cp, lam)
    if head is not None:
        compute = compute + is_first * np.asarray(head["compute"])[..., None]
        tpc = tpc + is_first * np.asarray(head["tp"])[..., None]
        cpc = cpc + is_first * np.asarray(head["cp"])[..., None]
        params = params + is_first * np.asarray(head["params"])[..., None]
        act = act + is_first * np.asarray(head["act"])[..., None]
    params = params / tp
    if spec is wl.encoder:  # its patch embedding and positions, its final norm and projector
        first_io, last_io = wl.encoder_io_params(tp)
        params = params + first_io * is_first + last_io * is_last
    dpt, state = dp_time(prof, wl, params, tp, cp, dp), state_bytes(wl, params, dp * cp)
    if experts:  # this rank's experts: 1/ep of each layer's, reduced and sharded over expert-DP
        eparams = lam * experts / ep
        edp = tp * cp * dp // ep
        dpt = dpt + dp_time(prof, wl, eparams, ep, 1, edp)
        state = state + state_bytes(wl, eparams, edp)
        params = params + eparams
    opt = prof.overhead_time("optimizer", params) + SNAPSHOTS[placement] * prof.overhead_time("snapshot", params)
    shape = lam.shape
    return Stages(
        count=count,
        first=first,
        compute=compute,
        tp=np.broadcast_to(tpc, shape),
        cp=np.broadcast_to(cpc, shape),
        pp=ppc,
        boundary=np.zeros(shape),
        ranks=np.broadcast_to((tp * cp * dp).astype(float), shape),
        runs=np.broadcast_to(runs, shape),
        dp=dpt,
        opt=np.broadcast_to(opt, shape),
        state=state,
        act=act,
    )

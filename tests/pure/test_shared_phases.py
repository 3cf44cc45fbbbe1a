"""The step on ranks that share execution units (CPU ranks forked on one machine), when a part of it
runs alone: the colocated encoder passes, stage after stage, with every rank waiting at the boundary.

Worked by hand on 4 ranks sharing 2 cores (`cores` 2 measured with all 4 busy, `cpu_cores` 2): a
rank alone runs twice as fast as with all four busy. The encoder's 4 stages take 10 ms each at that
sharing, one after the other (40 ms of critical path, 10 ms of the mean rank's busy time); the
language model's phase keeps every rank busy 30 ms. Alone, each stage has a core to itself: 5 ms,
20 ms for the four; then 30 ms for the language model: 50 ms. A model that averages the runnable
ranks over the whole step lets the lone stages borrow the idle core and says 40 ms; measured on the
inherited-TP workload that model priced encoder PP4·DP1 19-39% below the step it ran."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_hetero.planner import hardware as HW
from megatron_hetero.planner.cost_terms import loss_reduce
from megatron_hetero.planner.step import finish

PARTS = ("compute", "tp", "cp", "pp", "boundary")


def _shared(cores: float = 2.0) -> HW.Profile:
    return HW.Profile(
        layers={"default": HW.LayerModel(0.0, 1e-12)},
        links={"intra": HW.AlphaBeta(1e-4, 1e-9), "inter": HW.AlphaBeta(1e-4, 1e-9)},
        devices_per_node=8,
        memory_bytes=1e9,
        host_bandwidth=5e9,
        source="synthetic",
        cores=cores,
        concurrency=4,
        cpu_cores=2.0,
    )


def _busy(compute: float) -> dict:
    out = {k: np.array([0.0]) for k in PARTS}
    out["compute"] = np.array([compute])
    out["dp"], out["opt"] = np.array([0.0]), np.array([0.0])
    return out


def _step(prof: HW.Profile, with_phase: bool) -> dict:
    enc_crit, enc_busy = np.array([0.040]), _busy(4 * 0.010)  # 4 stages of 10 ms, one rank each
    llm_crit, llm_busy = 0.030, _busy(4 * 0.030)  # every rank 30 ms
    busy = {k: enc_busy[k] + llm_busy[k] for k in enc_busy}
    parts = {k: np.array([0.0]) for k in PARTS}
    zero = np.array([0.0])
    return finish(
        prof,
        4,
        1,
        enc_crit + llm_crit,
        parts,
        zero,
        zero,
        busy,
        zero,
        zero,
        zero,
        (enc_crit, enc_busy) if with_phase else None,
    )


def test_a_part_that_runs_alone_is_priced_at_the_ranks_it_keeps_busy():
    prof = _shared()
    loss = float(loss_reduce(prof, 4))
    out = _step(prof, with_phase=True)
    assert float(out["total"][0]) == pytest.approx(0.020 + 0.030 + loss, rel=1e-12)
    # the mean rank's busy time at each phase's sharing: 10 ms of encoder at a core each (x2), 30 ms
    assert float(out["compute"][0]) == pytest.approx(0.020 + 0.030, rel=1e-12)
    parts = sum(
        float(np.asarray(out[k]).reshape(-1)[0])
        for k in ("compute", "tp_comm", "cp_comm", "pp_comm", "dp_comm", "boundary", "offload", "optimizer", "bubble")
    )
    assert parts == pytest.approx(float(out["total"][0]), rel=1e-12)
    # averaged over the whole step instead, the lone stages borrow the idle core: 40 ms
    assert float(_step(prof, with_phase=False)["total"][0]) == pytest.approx(0.040 + loss, rel=1e-12)


def test_units_not_shared_keep_the_critical_path():
    prof = _shared(cores=0.0)  # not shared: the formulas' critical path, phase or not
    prof = HW.Profile(**{**prof.__dict__, "concurrency": 0, "cpu_cores": 0.0})
    loss = float(loss_reduce(prof, 4))
    for with_phase in (True, False):
        assert float(_step(prof, with_phase)["total"][0]) == pytest.approx(0.070 + loss, rel=1e-12)

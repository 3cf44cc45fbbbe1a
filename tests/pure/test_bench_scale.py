"""`bench scale`'s arithmetic: its layouts are valid at every world it runs, their batches pass the
rank plans' checks, the growth exponent is the log-log slope, and the probe times this tree's
per-rank planning (the real functions, at a world of 256)."""

from __future__ import annotations

import math

import pytest

from megatron_hetero.bench import scale, scale_probe
from megatron_hetero.layout import layout_from_dict
from megatron_hetero.plan.rank_plan import check_rank_plans, rank_plan


@pytest.mark.parametrize("world", [64, 1024, 65536])
@pytest.mark.parametrize("kind", scale_probe.KINDS)
def test_layouts_and_batches_are_valid(world: int, kind: str) -> None:
    layout = layout_from_dict(scale_probe.layout_doc(world, kind))
    assert layout.world_size == world and layout.placement == kind
    g, mbs = scale_probe.batch_of(world, kind)
    check_rank_plans(layout, g, mbs)  # raises on bad batch arithmetic
    assert rank_plan(layout, world - 1, g, mbs).rank == world - 1


def test_bad_world_and_kind_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 64"):
        scale_probe.layout_doc(100, "colocated")
    with pytest.raises(ValueError, match="layout kind"):
        scale_probe.layout_doc(1024, "mixed")


def test_growth_is_the_log_log_slope_up_to_16384() -> None:
    worlds = [1024, 4096, 16384, 65536]
    assert scale.growth(worlds, [1.0, 4.0, 16.0, 1e9]) == pytest.approx(1.0)  # 65,536 is left out
    assert scale.growth(worlds, [1.0, 1.0, 16.0, None]) == pytest.approx(2.0)
    assert scale.growth(worlds, [1.0, ">300", None, None]) is None
    assert scale.growth([4096, 16384], [2.0, 2.0]) == pytest.approx(0.0)
    assert math.isclose(scale.growth([1024, 4096], [0.5, 1.0]), 0.5)


def test_probe_times_this_trees_per_rank_planning() -> None:
    out = scale_probe.probe(256, "disjoint", timeout_s=60, plan_cli=False)
    assert out["per_rank"] == "one rank" and out["world"] == 256
    for k in ("validate_s", "rank_plan_s", "boundary_s"):
        assert isinstance(out[k], float) and out[k] >= 0
    assert out["plugin_s"] == pytest.approx(out["validate_s"] + out["rank_plan_s"] + out["boundary_s"])
    assert "plan_cli_s" not in out
    assert scale_probe.timed(lambda: None, 5) >= 0

"""`bench.trace_overhead`'s step order and summary: both modes run alternately, and an odd number of steps
(one mode a step ahead) is summarised over the steps both ran instead of failing."""

from __future__ import annotations

import pytest

from megatron_hetero.bench.trace_overhead import step_modes, summarize


def test_step_modes_alternate_with_swapped_pairs():
    assert step_modes(8) == ["off", "on", "on", "off", "off", "on", "on", "off"]
    assert step_modes(3).count("on") == 2  # an odd count leaves one mode ahead


def _rank(wall_off, wall_on, spans):
    return {
        "wall": {"off": wall_off, "on": wall_on},
        "cpu": {"off": [w / 2 for w in wall_off], "on": [w / 2 for w in wall_on]},
        "spans": spans,
        "span_cost_s": 1e-6,
    }


def test_summary_pairs_the_steps_both_modes_ran():
    # 3 steps: off ran 1, on ran 2 (the first of each is the warm-up); rank 1 is the slowest
    per_rank = [_rank([9.0, 1.0], [9.0, 1.1, 50.0], [10]), _rank([9.0, 2.0], [9.0, 2.2, 50.0], [12])]
    out = summarize(per_rank)
    assert out["steps_per_mode"] == 1
    assert out["wall_median_ms"] == pytest.approx({"off": 2000.0, "on": 2200.0})  # the third step left out
    assert out["wall_overhead"] == pytest.approx(0.1)
    assert out["cpu_median_ms"] == pytest.approx({"off": 1500.0, "on": 1650.0})  # summed over the ranks
    assert out["spans_per_rank_step"] == 12
    assert out["span_bound"] == pytest.approx(12 * 1e-6 / 2.0)


def test_summary_refuses_too_few_steps():
    with pytest.raises(ValueError, match="two steps of each mode"):
        summarize([_rank([9.0], [9.0, 1.0], [10])])  # 3 steps: one "off" step, dropped as the warm-up

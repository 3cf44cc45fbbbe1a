"""`megatron-hetero bench soak`'s arithmetic (sample steps, the per-rank verdict), without running ranks;
the 60-step soak itself is tests/ranks/test_soak.py."""

from __future__ import annotations

import pytest

from megatron_hetero.bench import soak


def test_sample_steps():
    assert soak.sample_steps(300, 50) == [1, 50, 100, 150, 200, 250, 300]
    assert soak.sample_steps(60, 20) == [1, 20, 28, 36, 44, 52, 60]
    with pytest.raises(ValueError, match="warm-up step 60"):
        soak.sample_steps(60, 60)


def test_verdict_fails_on_growth_or_a_changed_count():
    base = {"rss_bytes": 100 * 2**20, "process_groups": 9, "threads": 40, "python_threads": 2, "open_fds": 90}
    ok = soak.rank_summary(0, {20: base, 40: base, 60: {**base, "rss_bytes": int(101.9 * 2**20)}}, 20, 60)
    assert ok["passed"] and ok["rss_growth"] == pytest.approx(0.019)
    grown = soak.rank_summary(0, {20: base, 60: {**base, "rss_bytes": 102 * 2**20}}, 20, 60)
    assert not grown["passed"] and grown["counts_constant"]
    # a descriptor opened in between and closed again by the end still fails (every sample counts)
    blip = soak.rank_summary(0, {1: {**base, "threads": 3}, 20: base, 40: {**base, "open_fds": 91}, 60: base}, 20, 60)
    assert not blip["passed"] and not blip["counts_constant"] and blip["rss_growth"] == 0
    thread = soak.rank_summary(0, {20: base, 40: {**base, "threads": 39}, 60: base}, 20, 60)
    assert not thread["passed"] and not thread["counts_constant"]
    # a descriptor closed (fewer than at the warm-up step) is not a leak; the count is still reported as changed
    closed = soak.rank_summary(0, {20: base, 40: base, 60: {**base, "open_fds": 89}}, 20, 60)
    assert closed["passed"] and not closed["counts_constant"]

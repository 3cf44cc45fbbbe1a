"""The layout runs' Megatron log line (`megatron_lm/log.py`) against Megatron-LM's `training_log`
accounting: skipped iterations (--fp16 overflow) leave their loss out of the average, are counted
(and their non-finite losses as nan iterations), the first line does not reset the counters, and the
loss scale is the one passed in. The numbers below are those Megatron-LM's own log printed for the
same sequence (the unpatched pretrain_vlm.py at TP2 with --fp16 --initial-loss-scale 1048576
--hysteresis 1: iteration 1 skipped)."""

from __future__ import annotations

import argparse
import re

import pytest

from megatron_hetero.megatron_lm import log as log_mod


@pytest.fixture
def lines(monkeypatch):
    out: list[str] = []
    monkeypatch.setattr(log_mod, "print_last", out.append)
    return out


def _field(line: str, name: str):
    m = re.search(r"\| " + re.escape(name) + r": ([^|]+) \|", line)
    return m.group(1).strip() if m else None


def test_skipped_iterations_are_counted_and_left_out_of_the_loss(lines):
    log = log_mod.IntervalLog(argparse.Namespace(log_interval=1, train_iters=4, global_batch_size=4))
    log.add(1, 4.9, 10.0, 0.0, None, skipped=True, loss_scale=524288.0)
    log.add(2, 4.854633, 10.0, 5e-4, 1.573, skipped=False, loss_scale=524288.0)
    log.add(3, 4.854202, 10.0, 1e-3, 1.562, skipped=False, loss_scale=524288.0)
    log.add(4, float("inf"), 10.0, 1e-3, None, skipped=True, loss_scale=262144.0)
    first, second, third, fourth = lines
    assert _field(first, "lm loss") is None  # no update yet: Megatron prints no loss field
    assert _field(first, "loss scale") == "524288.0" and _field(first, "grad norm") is None
    assert _field(first, "number of skipped iterations") == "1"
    # the first line did not reset: the second counts iteration 1's skip, averages iteration 2 alone
    assert _field(second, "lm loss") == "4.854633E+00" and _field(second, "number of skipped iterations") == "1"
    assert _field(second, "grad norm") == "1.573" and _field(second, "learning rate") == "5.000000E-04"
    assert _field(third, "lm loss") == "4.854202E+00" and _field(third, "number of skipped iterations") == "0"
    # an interval whose only iteration was skipped prints a zero loss, as Megatron's reset tensor does
    assert _field(fourth, "lm loss") == "0.000000E+00" and _field(fourth, "loss scale") == "262144.0"
    assert _field(fourth, "number of skipped iterations") == "1" and _field(fourth, "number of nan iterations") == "1"


def test_an_interval_averages_the_updated_iterations_only(lines):
    log = log_mod.IntervalLog(argparse.Namespace(log_interval=3, train_iters=4, global_batch_size=4))
    for it, loss, skipped in ((1, 3.0, False), (2, 100.0, True), (3, 5.0, False), (4, 7.0, False)):
        log.add(it, loss, 30.0, 1e-3, None if skipped else 1.0, skipped=skipped)
    first, third = lines  # iteration 1 (the first line, no reset) and iteration 3
    assert _field(first, "lm loss") == "3.000000E+00" and _field(first, "loss scale") == "1.0"
    assert _field(third, "lm loss") == "4.000000E+00"  # (3 + 5) / 2 updated iterations, not / 3
    assert _field(third, "number of skipped iterations") == "1" and _field(third, "number of nan iterations") == "0"
    assert "elapsed time per iteration (ms): 30.0 |" in third

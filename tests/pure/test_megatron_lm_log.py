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


class _State:
    """A ModuleState's --overlap-param-gather side, recording the order of calls in `events`."""

    def __init__(self, name: str, events: list) -> None:
        import contextlib

        import torch

        self.name, self.events, self.module = name, events, torch.nn.Linear(1, 1)

        @contextlib.contextmanager
        def params_gathered():
            events.append(f"{name}: gathered, hooks off")
            yield
            events.append(f"{name}: hooks on")

        self.params_gathered = params_gathered

    def gather_params(self) -> None:
        self.events.append(f"{self.name}: gathered")


class _Schedule:
    def __init__(self, events: list) -> None:
        self.events = events

    def step(self, b: int, train: bool = True):
        self.events.append(f"eval step {b}" if not train else f"step {b}")
        return argparse.Namespace(loss=4.0)


class _Runner:
    def has_split(self, split: str) -> bool:
        return True

    def set_split(self, split: str) -> None:
        pass

    def loss_tokens(self, b: int) -> int:
        return 1


def test_evaluation_runs_on_gathered_parameters_with_the_forward_pre_hooks_off(lines):
    """--overlap-param-gather: every module's last-step parameters are all-gathered before the first
    evaluation forward and its hooks come back after the last one (Megatron-LM's
    disable_forward_pre_hook / enable_forward_pre_hook around `evaluate_and_print_results`)."""
    events: list[str] = []
    states = {n: _State(n, events) for n in ("vision", "language")}
    args = argparse.Namespace(eval_iters=2, eval_interval=2)
    evaluator = log_mod.Evaluator(_Schedule(events), _Runner(), states, args, start_iteration=0)
    evaluator.after_iteration(1)
    assert events == []  # not due: nothing gathered (the next forward's pre-hooks do it)
    evaluator.after_iteration(2)
    assert events == [
        "vision: gathered, hooks off",
        "language: gathered, hooks off",
        "eval step 0",
        "eval step 1",
        "language: hooks on",
        "vision: hooks on",
    ]


def test_a_checkpoint_is_written_from_gathered_parameters():
    from megatron_hetero.megatron_lm.front_end import ScriptFrontEnd

    events: list[str] = []
    states = {n: _State(n, events) for n in ("vision", "language")}
    args = argparse.Namespace(eval_iters=0, eval_interval=None, log_interval=1, train_iters=2, global_batch_size=4)
    front = ScriptFrontEnd(args, states, None, save=lambda it: events.append(f"save {it}"))
    front.save(2)
    assert events == ["vision: gathered", "language: gathered", "save 2"]

"""The one training loop (`training/loop.py`) both front ends run, on a scripted schedule and a
recording front end, in a world-1 gloo group of this process: the order of every call, when
checkpoints are written (every --save-interval, at the end, never twice for one iteration, not again
for the iteration a resume starts from), schedulers that do not advance on a skipped step, and the
stop on the exit signal (the checkpoint of the iteration it stopped after, no final evaluation)."""

from __future__ import annotations

import dataclasses
import socket

import pytest
import torch.distributed as dist

from megatron_hetero.runtime.step import StepResult
from megatron_hetero.training.loop import LoopSpec, run_loop
from megatron_hetero.training.signals import ExitSignal


@pytest.fixture(scope="module")
def world1():
    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class Schedule:
    """Step k returns loss k + 1; the steps in `skip` report non-finite gradients (skipped)."""

    def __init__(self, skip=(), signal_after=None, stop=None) -> None:
        self.skip, self.signal_after, self.stop, self.steps = set(skip), signal_after, stop, []

    def step(self, it: int) -> StepResult:
        self.steps.append(it)
        if self.signal_after is not None and it + 1 == self.signal_after:
            self.stop.received = True  # what the SIGTERM handler sets
        return StepResult(loss=float(it + 1), memory={}, skipped=it in self.skip)


class Scheduler:
    def __init__(self) -> None:
        self.increments = []

    def step(self, increment: int) -> None:
        self.increments.append(increment)


@dataclasses.dataclass
class Front:
    calls: list = dataclasses.field(default_factory=list)

    def record(self, iteration, res, seconds):
        self.calls.append(("record", iteration))
        assert seconds >= 0.0
        return {"iteration": iteration, "loss": res.loss, "skipped": res.skipped}

    def log(self, rec):
        self.calls.append(("log", rec["iteration"]))

    def evaluate(self, iteration, rec):
        self.calls.append(("evaluate", iteration))

    def save(self, iteration):
        self.calls.append(("save", iteration))

    def finish(self, iteration):
        self.calls.append(("finish", iteration))

    def saves(self):
        return [i for what, i in self.calls if what == "save"]


def spec(**kw) -> LoopSpec:
    base = dict(start=0, train_iters=5, scheduler_increment=8, save="/ckpt", save_interval=2, rank=0)
    base.update(kw)
    return LoopSpec(**base)


def test_order_of_calls_and_interval_saves(world1):
    front, sched = Front(), Scheduler()
    out = run_loop(Schedule(), {"a": sched}, spec(), front, ExitSignal(False))
    assert out.stopped is None and [r["loss"] for r in out.records] == [1.0, 2.0, 3.0, 4.0, 5.0]
    expected = []
    for i in range(1, 6):
        expected += [("record", i), ("log", i), ("evaluate", i)]
        if i % 2 == 0:
            expected.append(("save", i))
    expected += [("save", 5), ("finish", 5)]
    assert front.calls == expected
    assert sched.increments == [8] * 5


def test_no_save_dir_saves_nothing_and_last_interval_save_is_not_repeated(world1):
    front = Front()
    run_loop(Schedule(), {}, spec(save=None), front, ExitSignal(False))
    assert front.saves() == []
    front = Front()
    run_loop(Schedule(), {}, spec(train_iters=4), front, ExitSignal(False))
    assert front.saves() == [2, 4]  # iteration 4 is an interval save: not saved a second time at the end
    front = Front()
    run_loop(Schedule(), {}, spec(save_interval=None), front, ExitSignal(False))
    assert front.saves() == [5]


def test_resume_starts_at_the_checkpoint_and_does_not_save_it_again(world1):
    front, schedule = Front(), Schedule()
    run_loop(schedule, {}, spec(start=4, train_iters=4), front, ExitSignal(False))
    assert schedule.steps == [] and front.calls == [("finish", 4)]
    front, schedule = Front(), Schedule()
    run_loop(schedule, {}, spec(start=2, train_iters=5, save_interval=3), front, ExitSignal(False))
    assert schedule.steps == [2, 3, 4] and front.saves() == [3, 5]


def test_skipped_steps_do_not_advance_the_schedulers(world1):
    a, b = Scheduler(), Scheduler()
    out = run_loop(Schedule(skip={1, 3}), {"a": a, "b": b}, spec(save=None), Front(), ExitSignal(False))
    assert [r["skipped"] for r in out.records] == [False, True, False, True, False]
    assert a.increments == b.increments == [8, 8, 8]


def test_exit_signal_saves_the_iteration_and_stops(world1, capsys):
    for signal_after, saves in ((3, [2, 3]), (2, [2])):  # after 2 the interval save is that checkpoint
        front, stop = Front(), ExitSignal(True)
        schedule = Schedule(signal_after=signal_after, stop=stop)
        lines = []
        out = run_loop(schedule, {}, spec(), front, stop, write=lines.append)
        assert out.stopped == signal_after and len(out.records) == signal_after
        assert front.saves() == saves and ("finish", 5) not in front.calls
        assert len(lines) == 1 and f"stopped after iteration {signal_after}" in lines[0] and "/ckpt" in lines[0]
    # the signal after the last iteration: the run just ends
    front, stop = Front(), ExitSignal(True)
    out = run_loop(Schedule(signal_after=5, stop=stop), {}, spec(), front, stop, write=lambda s: None)
    assert out.stopped is None and front.calls[-1] == ("finish", 5)

"""Both schedule interpreters implement the one `Schedule` protocol with the protocol's signatures,
so callers step and close either without asking which one they hold."""

from __future__ import annotations

import inspect

import pytest

from megatron_hetero.runtime.colocated import ColocatedSchedule
from megatron_hetero.runtime.disjoint import DisjointSchedule
from megatron_hetero.runtime.schedules import Schedule


@pytest.mark.parametrize("cls", [ColocatedSchedule, DisjointSchedule], ids=lambda c: c.__name__)
def test_interpreter_methods_have_the_protocols_signatures(cls):
    for name in ("step", "close"):
        assert inspect.signature(getattr(cls, name)) == inspect.signature(getattr(Schedule, name)), name


def test_protocol_names_what_callers_use():
    members = set(Schedule.__annotations__) | {n for n in vars(Schedule) if not n.startswith("_")}
    assert members == {"plan", "config", "runner", "boundaries", "step", "close"}


def test_an_object_without_close_is_not_a_schedule():
    class StepOnly:
        plan = config = runner = None
        boundaries: dict = {}

        def step(self, step: int, train: bool = True):
            return None

    assert not isinstance(StepOnly(), Schedule)
    StepOnly.close = lambda self: None  # type: ignore[attr-defined]
    assert isinstance(StepOnly(), Schedule)

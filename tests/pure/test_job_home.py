"""The job has one home: every section a `Job` holds, down to the model's encoders, is a dataclass of the
pure floor `config/` (or the layout's own, `layout/`), typed on its field, never `Any`."""

from __future__ import annotations

import dataclasses
import typing

from megatron_hetero.config.job import Job, JobDraft


def sections(root: type) -> dict[type, str]:
    """Every dataclass reachable from `root`'s field types (through Optional, dict, tuple), by module."""
    seen: dict[type, str] = {}

    def walk(tp: typing.Any, where: str) -> None:
        assert tp is not typing.Any, f"{where} is typed Any: a section must say its type"
        for arg in typing.get_args(tp):
            walk(arg, where)
        if dataclasses.is_dataclass(tp) and isinstance(tp, type) and tp not in seen:
            seen[tp] = tp.__module__
            for name, hint in typing.get_type_hints(tp).items():
                if name != "checked":  # the rank plans' checked arithmetic (a tuple of plan objects)
                    walk(hint, f"{tp.__name__}.{name}")

    walk(root, root.__name__)
    return seen


def test_every_section_of_a_job_lives_in_config():
    found = sections(Job)
    outside = {
        t.__name__: m
        for t, m in found.items()
        if not m.startswith(("megatron_hetero.config.", "megatron_hetero.layout."))
    }
    assert not outside, f"sections outside config/: {outside}"
    names = {t.__name__ for t in found}
    # the sections the issue names: model, optimizer, schedule, data, autotune, and the job itself
    assert {
        "JobConfig",
        "LlavaSpec",
        "EncoderSpec",
        "OptimConfig",
        "LRSchedule",
        "CaptionDataConfig",
        "AutotuneConfig",
    } <= names
    assert sections(JobDraft).keys() >= {t for t in found if t is not Job}


def test_the_check_sees_a_section_typed_any():
    @dataclasses.dataclass(frozen=True)
    class Loose:
        data: typing.Any = None

    try:
        sections(Loose)
    except AssertionError as e:
        assert "Loose.data is typed Any" in str(e)
    else:
        raise AssertionError("a section typed Any went unnoticed")

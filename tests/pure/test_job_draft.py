"""A job travels whole: no function of the package takes a layout and a `JobConfig` side by side.

Before validation the two are a `config.job.JobDraft` (what a door makes of its flags, an
autotune candidate before its check); after, the validated `config.job.Job`. A function that
needs only one of them takes only that one. This test reads every file of the package (no import)
and names any signature with a `layout` argument next to a `job` or `config` one, or annotated with
both `HeteroLayout` and `JobConfig`.
"""

from __future__ import annotations

import ast
import dataclasses
import textwrap
from pathlib import Path

import pytest

from megatron_hetero.layout.yaml_io import layout_from_dict
from megatron_hetero.config.job import JobConfig, JobDraft

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_hetero"


def paired_signatures(source: str, name: str) -> list[str]:
    """`name:line function(args)` of every function in `source` whose arguments pair a layout with a
    job's config (by name, or by annotation)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
        names = {a.arg for a in args}
        notes = " ".join(ast.unparse(a.annotation) for a in args if a.annotation is not None)
        by_name = "layout" in names and bool({"job", "config"} & names)
        by_type = "HeteroLayout" in notes and "JobConfig" in notes
        if by_name or by_type:
            out.append(f"{name}:{node.lineno} {node.name}({', '.join(a.arg for a in args)})")
    return out


def test_the_check_finds_a_pair_by_name_and_by_annotation():
    source = textwrap.dedent(
        """
        def by_name(layout, job): ...
        def by_config(x, layout, config=None): ...
        def by_type(a: HeteroLayout, b: "Optional[JobConfig]"): ...
        def fine(draft: JobDraft, layout_name: str, run: Job): ...
        """
    )
    got = [s.split(" ", 1)[1] for s in paired_signatures(source, "f.py")]
    assert got == ["by_name(layout, job)", "by_config(x, layout, config)", "by_type(a, b)"]


def test_no_signature_of_the_package_takes_a_layout_and_a_job_config():
    found = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        for hit in paired_signatures(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    ]
    assert found == [], "pass a config.job.JobDraft (before validation) or the Job:\n" + "\n".join(found)


def test_a_draft_is_a_frozen_pair_compared_by_value():
    layout = layout_from_dict({"modules": {"vision": {}, "language": {}}, "edges": ["vision -> language"]})
    draft = JobDraft(layout, JobConfig(train_iters=3))
    assert (draft.layout, draft.config.train_iters) == (layout, 3)
    assert draft == JobDraft(layout, JobConfig(train_iters=3)) != JobDraft(layout, JobConfig(train_iters=4))
    with pytest.raises(dataclasses.FrozenInstanceError):
        draft.config = JobConfig()  # type: ignore[misc]

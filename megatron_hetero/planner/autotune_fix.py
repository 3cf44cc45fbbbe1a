"""`--autotune-fix`: the candidates that honour the degrees a run pins (`honours`, `space_with_fixes`; the
pins themselves: `config.autotune.parse_fix`). Pure; part of `planner.autotune`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_hetero.config.autotune import Fixes
from megatron_hetero.planner.search_space import SearchSpace
from megatron_hetero.planner.workload import Candidate, Segment


def _segments(c: Candidate, encoder_name: str, llm_name: str, extra_names: tuple = ()) -> dict[str, list[Segment]]:
    """The candidate's segments by the module names a fix may use: the encoders (`extra_names`: the
    candidate's extra encoders'), the language model (all its segments) and, for a chain, each
    segment as `Candidate.to_layout` names it (`language_a`)."""
    out: dict[str, list[Segment]] = {encoder_name: [c.encoder], llm_name: list(c.llm)}
    out.update({n: [e] for n, e in zip(extra_names, c.extra_encoders)})
    if len(c.llm) > 1:
        for i, s in enumerate(c.llm):
            out[f"{llm_name}_{chr(ord('a') + i)}"] = [s]
    return out


def _check_names(fixes: Fixes, encoder_name: str, llm_name: str, extra_names: tuple = ()) -> None:
    for name in fixes:
        base = name[: -len("_a")] if len(name) > 2 and name[-2] == "_" and name[-1].isalpha() else name
        if name not in (encoder_name, *extra_names, llm_name) and base != llm_name:
            known = ", ".join(repr(n) for n in (encoder_name, *extra_names))
            raise ValueError(f"--autotune-fix: unknown module {name!r}; the modules are {known} and {llm_name!r}")


def honours(
    c: Candidate, fixes: Fixes, encoder_name: str = "vision", llm_name: str = "language", extra_names: tuple = ()
) -> bool:
    """Whether candidate `c` has every fixed degree: a fix on the language model holds for each of
    its segments; one on `language_a` only for the chain's first segment (a candidate without
    that segment does not honour it). ValueError for a module name that is neither."""
    _check_names(fixes, encoder_name, llm_name, extra_names)
    segs = _segments(c, encoder_name, llm_name, extra_names)
    for name, want in fixes.items():
        if name not in segs:
            return False
        for s in segs[name]:
            if any(getattr(s, k) != v for k, v in want.items()):
                return False
    return True


def space_with_fixes(
    space: SearchSpace, fixes: Fixes, encoder_name: str = "vision", llm_name: str = "language", extra_names: tuple = ()
) -> SearchSpace:
    """`space` with the degrees the search enumerates (tp, cp, pp per module) pinned to the fixed
    values, so the search itself honours them; dp and ep (derived by the search) and per-segment
    fixes are left to `honours`. ValueError for a fix the space cannot hold (an encoder CP > 1 in
    a runtime space: the runtime's encoders do not take CP). With `extra_names` (several encoders,
    whose degrees the space gives alike) the encoders' fixes are left to `honours` too."""
    _check_names(fixes, encoder_name, llm_name, extra_names)
    changes: dict[str, Any] = {}  # SearchSpace fields -> the one value tried
    for name, want in fixes.items():
        prefix = "encoder_" if name == encoder_name else "" if name == llm_name else None
        if prefix is None or (prefix and extra_names):
            continue
        for k in ("tp", "cp", "pp"):
            if k in want:
                changes[prefix + k] = (want[k],)
    if space.runtime and changes.get("encoder_cp", (1,)) != (1,):
        raise ValueError(
            f"--autotune-fix {encoder_name}.cp={changes['encoder_cp'][0]}: the runtime runs encoders with cp 1"
        )
    return dataclasses.replace(space, **changes)

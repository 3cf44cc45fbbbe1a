"""Layout documents: the YAML file contract and the equivalent `--hetero-module` flag strings.

YAML keys: `placement: colocated|disjoint`, `boundary_mode: direct|hierarchical` (default direct;
hierarchical needs disjoint placement), `modules: {NAME: {tp, cp, pp, dp, ep, expt_tp,
ranks: "A-B", frozen: bool, layers: "A-B", role: language,
recompute: {granularity: full|selective, method: uniform|block, num_layers: N}}}`,
`edges: ["vision -> language", ...]`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import yaml

from megatron_hetero.layout.degrees import DEGREE_KEYS
from megatron_hetero.layout.spec import Edge, HeteroLayout, ModuleLayout, RankRange, Recompute
from megatron_hetero.layout.validate import resolve_layout

MODULE_KEYS = set(DEGREE_KEYS) | {"ranks", "frozen", "layers", "role", "recompute"}
RECOMPUTE_KEYS = ("granularity", "method", "num_layers")
TOP_KEYS = {"placement", "boundary_mode", "modules", "edges"}


def _as_int(value: Any, where: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{where} must be a positive integer, got {value!r}")
    if isinstance(value, int):
        return value
    try:
        return int(str(value).strip())
    except ValueError:
        raise ValueError(f"{where} must be a positive integer, got {value!r}") from None


def _as_bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "yes", "1", "on"):
        return True
    if text in ("false", "no", "0", "off"):
        return False
    raise ValueError(f"{where} must be true or false, got {value!r}")


def module_from_dict(name: str, spec: Any) -> ModuleLayout:
    """Build one `ModuleLayout` from its mapping; unknown keys are an error."""
    if spec is None:
        spec = {}
    if not isinstance(spec, dict):
        raise ValueError(f"module {name}: expected a mapping of {sorted(MODULE_KEYS)}, got {spec!r}")
    unknown = sorted(set(map(str, spec)) - MODULE_KEYS)
    if unknown:
        raise ValueError(f"module {name}: unknown keys {unknown}; allowed keys are {sorted(MODULE_KEYS)}")
    kwargs: dict[str, Any] = {k: _as_int(spec[k], f"module {name}: {k}") for k in DEGREE_KEYS if k in spec}
    if "ranks" in spec and spec["ranks"] is not None:
        kwargs["ranks"] = RankRange.parse(spec["ranks"], f"module {name}")
    if "layers" in spec and spec["layers"] is not None:
        kwargs["layers"] = RankRange.parse(spec["layers"], f"module {name}: layers")
    if "role" in spec and spec["role"] is not None:
        kwargs["role"] = str(spec["role"]).strip()
    if "frozen" in spec:
        kwargs["frozen"] = _as_bool(spec["frozen"], f"module {name}: frozen")
    if spec.get("recompute") is not None:
        kwargs["recompute"] = recompute_from_dict(spec["recompute"], f"module {name}: recompute")
    return ModuleLayout(name=str(name), **kwargs)


def recompute_from_dict(spec: Any, where: str) -> Recompute:
    """A module's `recompute: {granularity, method, num_layers}` mapping (values checked by validation)."""
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: expected a mapping of {list(RECOMPUTE_KEYS)}, got {spec!r}")
    unknown = sorted(set(map(str, spec)) - set(RECOMPUTE_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; allowed keys are {list(RECOMPUTE_KEYS)}")
    if spec.get("granularity") is None:
        raise ValueError(f"{where}: granularity (full or selective) is required")
    num = spec.get("num_layers")
    return Recompute(
        granularity=str(spec["granularity"]).strip(),
        method=None if spec.get("method") is None else str(spec["method"]).strip(),
        num_layers=None if num is None else _as_int(num, f"{where}: num_layers"),
    )


def layout_from_dict(doc: Any, world_size: Optional[int] = None) -> HeteroLayout:
    """Parse and validate a layout document (the YAML contract); returns a resolved layout."""
    if not isinstance(doc, dict):
        raise ValueError(f"a layout document must be a mapping with keys {sorted(TOP_KEYS)}, got {type(doc).__name__}")
    unknown = sorted(set(map(str, doc)) - TOP_KEYS)
    if unknown:
        raise ValueError(f"unknown top-level keys {unknown}; allowed keys are {sorted(TOP_KEYS)}")
    placement = doc.get("placement", "colocated")
    modules = doc.get("modules")
    if not isinstance(modules, dict) or not modules:
        raise ValueError("'modules' must be a non-empty mapping NAME -> {tp, cp, pp, dp, ...}")
    edges = doc.get("edges") or []
    if not isinstance(edges, list):
        raise ValueError(f"'edges' must be a list of 'src -> dst' strings, got {edges!r}")
    layout = HeteroLayout(
        placement=str(placement),
        modules=tuple(module_from_dict(str(n), s) for n, s in modules.items()),
        edges=tuple(Edge.parse(e) for e in edges),
        boundary_mode=str(doc.get("boundary_mode") or "direct").strip(),
    )
    return resolve_layout(layout, world_size)


def load_layout(path: str | Path, world_size: Optional[int] = None) -> HeteroLayout:
    """Read a layout YAML file; errors name the file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read layout file {str(p)!r}: {exc.strerror}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"layout file {str(p)!r} is not valid YAML: {exc}") from None
    try:
        return layout_from_dict(doc, world_size)
    except ValueError as exc:
        raise ValueError(f"layout file {str(p)!r}: {exc}") from None


def dump_layout(layout: HeteroLayout) -> str:
    """The YAML text of a layout (round-trips through `layout_from_dict`)."""
    return yaml.safe_dump(layout.to_dict(), sort_keys=False)


def parse_module_flag(text: str) -> tuple[str, dict[str, Any]]:
    """Parse one `--hetero-module NAME:tp=1,dp=8[,ranks=0-3][,frozen]` value into (name, mapping)."""
    name, sep, rest = str(text).partition(":")
    name = name.strip()
    if not sep or not name:
        raise ValueError(f"--hetero-module {text!r} is not of the form NAME:tp=..,dp=..[,ranks=A-B][,frozen]")
    spec: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq:
            if key == "frozen":
                spec["frozen"] = True
                continue
            raise ValueError(f"--hetero-module {text!r}: {item!r} is not KEY=VALUE")
        if key in spec:
            raise ValueError(f"--hetero-module {text!r}: {key} given twice")
        spec[key] = value.strip()
    return name, spec

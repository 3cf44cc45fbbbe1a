"""Layout parsing (YAML documents, `--hetero-*` flags) and validation.

Pure tests: no torch, no process groups. Every user error must be a ValueError whose message spells
out what is wrong (docs/architecture.md, rules); the property tests feed garbage and accept only ValueError.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from megatron_hetero.layout import (
    Edge,
    HeteroLayout,
    ModuleLayout,
    RankRange,
    add_hetero_args,
    dump_layout,
    layout_from_args,
    layout_from_dict,
    load_layout,
    order_modules,
    resolve_layout,
    topological_order,
)
from megatron_hetero.layout.yaml_io import MODULE_KEYS, parse_module_flag

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples" / "layouts").glob("*.yaml"))


def _raises(doc, message: str, world_size=None) -> None:
    """layout_from_dict(doc) raises ValueError whose text is exactly `message`."""
    with pytest.raises(ValueError) as info:
        layout_from_dict(doc, world_size)
    assert str(info.value) == message


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pretrain_vlm.py")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)  # a Megatron flag
    out = add_hetero_args(parser)
    assert out is parser
    return parser


# --------------------------------------------------------------------------------------------
# YAML documents
# --------------------------------------------------------------------------------------------


def test_yaml_colocated_fan_in_example() -> None:
    layout = load_layout(REPO / "examples/layouts/colocated_fan_in.yaml")
    assert layout.placement == "colocated"
    assert layout.names == ["vision", "language"]
    assert layout.module("vision") == ModuleLayout("vision", tp=1, cp=1, pp=1, dp=8, ranks=RankRange(0, 7))
    assert layout.module("language") == ModuleLayout("language", tp=2, cp=1, pp=2, dp=2, ranks=RankRange(0, 7))
    assert layout.edges == (Edge("vision", "language"),)
    assert layout.world_size == 8


def test_yaml_disjoint_defaults_contiguous_islands_in_declaration_order(tmp_path: Path) -> None:
    path = tmp_path / "l.yaml"
    path.write_text(
        textwrap.dedent("""\
        placement: disjoint
        modules:
          vision: {tp: 2}
          audio:  {dp: 3, frozen: true}
          language: {tp: 2, cp: 2, pp: 2, dp: 1, layers: "0-11"}
        edges: ["vision->language", "audio -> language"]
    """)
    )
    layout = load_layout(path)
    assert [(m.name, m.ranks) for m in layout.modules] == [
        ("vision", RankRange(0, 1)),
        ("audio", RankRange(2, 4)),
        ("language", RankRange(5, 12)),
    ]
    assert layout.module("audio").frozen is True
    assert layout.module("vision").frozen is False
    assert layout.module("language").layers == RankRange(0, 11)
    assert layout.world_size == 13
    assert layout.producers("language") == ["vision", "audio"]
    assert layout.consumers("vision") == ["language"]
    assert topological_order(layout) == ["vision", "audio", "language"]


def test_yaml_llm_segments_example() -> None:
    layout = load_layout(REPO / "examples/layouts/llm_segments.yaml")
    a, b = layout.modules
    assert (a.name, a.tp, a.dp, a.ranks, a.layers) == ("language_a", 4, 1, RankRange(0, 3), RankRange(0, 5))
    assert (b.name, b.tp, b.dp, b.ranks, b.layers) == ("language_b", 1, 4, RankRange(4, 7), RankRange(6, 11))


def test_yaml_values_as_strings_and_defaults() -> None:
    layout = layout_from_dict({"modules": {"m": {"tp": "2", "dp": " 2 ", "frozen": "yes", "ranks": "0 - 3"}}})
    m = layout.modules[0]
    assert layout.placement == "colocated"  # the default placement
    assert (m.tp, m.cp, m.pp, m.dp, m.ep, m.expt_tp, m.frozen, m.ranks) == (2, 1, 1, 2, 1, 1, True, RankRange(0, 3))
    # A module with no mapping at all is tp=cp=pp=dp=1.
    layout = layout_from_dict({"placement": "disjoint", "modules": {"a": None, "b": {}}, "edges": None})
    assert [(m.name, m.size, m.ranks) for m in layout.modules] == [("a", 1, RankRange(0, 0)), ("b", 1, RankRange(1, 1))]
    assert layout.edges == ()


def test_yaml_colocated_with_world_size() -> None:
    doc = {"placement": "colocated", "modules": {"v": {"dp": 4}, "l": {"tp": 2, "dp": 2}}}
    layout = layout_from_dict(doc, world_size=4)
    assert all(m.ranks == RankRange(0, 3) for m in layout.modules)


def test_yaml_moe_module() -> None:
    layout = layout_from_dict({"modules": {"language": {"tp": 2, "dp": 4, "pp": 2, "ep": 4, "expt_tp": 2}}})
    m = layout.modules[0]
    assert (m.ep, m.expt_tp, m.size, m.stage_size) == (4, 2, 16, 8)
    assert m.short() == "TP2·CP1·PP2·DP4·EP4·ETP2"
    assert m.arithmetic() == "tp(2)*cp(1)*pp(2)*dp(4)=16"


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_loads_and_round_trips(path: Path) -> None:
    layout = load_layout(path)
    again = layout_from_dict(yaml.safe_load(dump_layout(layout)))
    assert again == layout
    # The dumped text names every module and the placement.
    text = dump_layout(layout)
    assert f"placement: {layout.placement}" in text
    for name in layout.names:
        assert f"{name}:" in text


def test_round_trip_keeps_every_field() -> None:
    layout = resolve_layout(
        HeteroLayout(
            placement="disjoint",
            modules=(
                ModuleLayout("vision", tp=2, dp=2, ranks=RankRange(8, 11), frozen=True),
                ModuleLayout(
                    "language", tp=2, cp=2, dp=2, ep=4, expt_tp=2, ranks=RankRange(0, 7), layers=RankRange(3, 9)
                ),
            ),
            edges=(Edge("vision", "language"),),
        )
    )
    doc = yaml.safe_load(dump_layout(layout))
    assert doc == {
        "placement": "disjoint",
        "modules": {
            "vision": {"tp": 2, "cp": 1, "pp": 1, "dp": 2, "ranks": "8-11", "frozen": True},
            "language": {"tp": 2, "cp": 2, "pp": 1, "dp": 2, "ep": 4, "expt_tp": 2, "ranks": "0-7", "layers": "3-9"},
        },
        "edges": ["vision -> language"],
    }
    assert layout_from_dict(doc) == layout


def test_load_layout_errors_name_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ValueError) as info:
        load_layout(missing)
    assert str(info.value) == f"cannot read layout file {str(missing)!r}: No such file or directory"
    bad = tmp_path / "bad.yaml"
    bad.write_text("modules: {vision: [1, 2\n")
    with pytest.raises(ValueError, match=r"layout file .*bad\.yaml' is not valid YAML"):
        load_layout(bad)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("modules:\n  vision: {tp: 2, dp: 3}\n  language: {dp: 4}\n")
    with pytest.raises(ValueError) as info:
        load_layout(wrong)
    assert str(info.value) == (
        f"layout file {str(wrong)!r}: module language: tp(1)*cp(1)*pp(1)*dp(4)=4 != ranks 0-5 (6)"
    )


# --------------------------------------------------------------------------------------------
# Validation errors: exact messages
# --------------------------------------------------------------------------------------------


def test_error_size_does_not_multiply_out() -> None:
    _raises(
        {"placement": "colocated", "modules": {"vision": {"tp": 1, "dp": 8}, "language": {"tp": 2, "pp": 2, "dp": 3}}},
        "module language: tp(2)*cp(1)*pp(2)*dp(3)=12 != ranks 0-7 (8)",
    )


def test_error_size_does_not_match_explicit_ranks() -> None:
    _raises(
        {"placement": "disjoint", "modules": {"vision": {"dp": 4, "ranks": "0-2"}}},
        "module vision: tp(1)*cp(1)*pp(1)*dp(4)=4 != ranks 0-2 (3)",
    )
    _raises(
        {"placement": "colocated", "modules": {"language": {"tp": 2, "cp": 2, "ranks": "0-7"}}},
        "module language: tp(2)*cp(2)*pp(1)*dp(1)=4 != ranks 0-7 (8)",
    )


def test_error_colocated_world_size_mismatch() -> None:
    _raises(
        {"modules": {"vision": {"dp": 8}}}, "module vision: tp(1)*cp(1)*pp(1)*dp(8)=8 != ranks 0-3 (4)", world_size=4
    )
    _raises(
        {"modules": {"vision": {"dp": 8, "ranks": "0-7"}}},
        "colocated ranks 0-7 need world size 8, but world size is 4",
        world_size=4,
    )


def test_error_disjoint_overlap() -> None:
    _raises(
        {
            "placement": "disjoint",
            "modules": {"vision": {"dp": 4, "ranks": "0-3"}, "language": {"dp": 4, "ranks": "2-5"}},
        },
        "disjoint modules overlap: module language ranks 2-5 and module vision ranks 0-3",
    )
    # An implicit island (vision 0-1) and an explicit one that overlaps it.
    _raises(
        {"placement": "disjoint", "modules": {"vision": {"dp": 2}, "language": {"dp": 2, "ranks": "1-2"}}},
        "disjoint modules overlap: module language ranks 1-2 and module vision ranks 0-1",
    )
    _raises(
        {
            "placement": "disjoint",
            "modules": {"vision": {"dp": 2, "ranks": "0-1"}, "language": {"dp": 4, "ranks": "1-4"}},
        },
        "disjoint modules overlap: module language ranks 1-4 and module vision ranks 0-1",
    )


def test_error_colocated_different_ranges() -> None:
    _raises(
        {
            "placement": "colocated",
            "modules": {"vision": {"dp": 4, "ranks": "0-3"}, "language": {"dp": 4, "ranks": "4-7"}},
        },
        "colocated modules must share one rank range: module vision has ranks 0-3 but module language has ranks 4-7",
    )


def test_error_unknown_edge_endpoints() -> None:
    mods = {"vision": {"dp": 2}, "language": {"tp": 2}}
    _raises(
        {"modules": mods, "edges": ["vision -> llm"]},
        "edge vision->llm: unknown module 'llm'; modules are ['vision', 'language']",
    )
    _raises(
        {"modules": mods, "edges": ["audio->language"]},
        "edge audio->language: unknown module 'audio'; modules are ['vision', 'language']",
    )


def test_error_edge_syntax_self_and_duplicate() -> None:
    mods = {"vision": {"dp": 2}, "language": {"tp": 2}}
    _raises(
        {"modules": mods, "edges": ["vision - language"]},
        "edge 'vision - language' is not of the form 'src -> dst' (e.g. 'vision -> language')",
    )
    _raises(
        {"modules": mods, "edges": ["a -> b -> c"]},
        "edge 'a -> b -> c' is not of the form 'src -> dst' (e.g. 'vision -> language')",
    )
    _raises(
        {"modules": mods, "edges": ["vision ->"]},
        "edge 'vision ->' is not of the form 'src -> dst' (e.g. 'vision -> language')",
    )
    _raises({"modules": mods, "edges": ["vision->vision"]}, "edge vision->vision: a module cannot feed itself")
    _raises(
        {"modules": mods, "edges": ["vision->language", "vision -> language"]},
        "edge vision->language is declared twice",
    )


def test_error_cycle_is_named() -> None:
    mods = {"a": {"dp": 2}, "b": {"dp": 2}, "c": {"dp": 2}, "d": {"dp": 2}}
    _raises(
        {"modules": mods, "edges": ["d->a", "a->b", "b->c", "c->a"]},
        "edges form a cycle: a -> b -> c -> a; the module graph must be acyclic",
    )
    _raises(
        {"modules": mods, "edges": ["c->d", "d->c"]},
        "edges form a cycle: c -> d -> c; the module graph must be acyclic",
    )


def test_topological_order_reports_cycle_as_value_error() -> None:
    # topological_order on an unvalidated layout: a ValueError naming the modules on the cycle.
    layout = HeteroLayout(
        "colocated", (ModuleLayout("a"), ModuleLayout("b"), ModuleLayout("c")), (Edge("a", "b"), Edge("b", "a"))
    )
    with pytest.raises(ValueError) as info:
        topological_order(layout)
    assert str(info.value) == "edges form a cycle: a -> b -> a; the module graph must be acyclic"
    # The cycle is named from the module declared first, whichever node graphlib's walk starts at.
    layout = HeteroLayout(
        "colocated",
        tuple(ModuleLayout(n) for n in "xcab"),
        (Edge("b", "c"), Edge("a", "b"), Edge("c", "a"), Edge("x", "a")),
    )
    with pytest.raises(ValueError) as info:
        topological_order(layout)
    assert str(info.value) == "edges form a cycle: c -> a -> b -> c; the module graph must be acyclic"
    # An edge to an undeclared module is a ValueError, not a KeyError.
    layout = HeteroLayout("colocated", (ModuleLayout("a"),), (Edge("a", "z"),))
    with pytest.raises(ValueError, match="edge a->z: unknown module 'z'"):
        topological_order(layout)


def test_topological_order_declaration_order_breaks_ties() -> None:
    # Among the modules whose producers are placed, the one declared first comes next.
    mods = tuple(ModuleLayout(n) for n in ("language", "projector", "vision", "audio"))
    layout = HeteroLayout(
        "colocated", mods, (Edge("vision", "projector"), Edge("projector", "language"), Edge("audio", "language"))
    )
    assert topological_order(layout) == ["vision", "projector", "audio", "language"]
    assert order_modules(["b", "a", "c"], [Edge("b", "a")]) == ["b", "a", "c"]
    assert order_modules(["c", "b", "a"], []) == ["c", "b", "a"]
    # No edges at all, or one module: declaration order.
    assert topological_order(HeteroLayout("colocated", (ModuleLayout("m"),))) == ["m"]


def test_topological_order_is_the_one_graph_function() -> None:
    # validate.py and the package export the function of layout/graph.py (one implementation).
    import megatron_hetero.layout as layout_pkg
    from megatron_hetero.layout import graph, validate

    assert layout_pkg.topological_order is graph.topological_order
    assert validate.topological_order is graph.topological_order
    assert not hasattr(validate, "find_cycle")
    # spec.py is pure data: the constructors are the module-level functions, not staticmethods
    # that would import the parsers back (the old spec <-> args/yaml_io cycle).
    assert not hasattr(HeteroLayout, "from_args") and not hasattr(HeteroLayout, "from_yaml")


def test_error_expert_parallel_does_not_fit() -> None:
    _raises(
        {"modules": {"language": {"tp": 2, "dp": 2, "ep": 8}}},
        "module language: expert-tp(1)*ep(8)=8 does not divide tp(2)*cp(1)*dp(2)=4 "
        "(Megatron's MoE parallel folding needs it to)",
    )
    _raises(
        {"modules": {"language": {"tp": 2, "cp": 2, "dp": 2, "ep": 3}}},
        "module language: expert-tp(1)*ep(3)=3 does not divide tp(2)*cp(2)*dp(2)=8 "
        "(Megatron's MoE parallel folding needs it to)",
    )
    _raises(
        {"modules": {"language": {"tp": 2, "dp": 2, "pp": 4, "ep": 2, "expt_tp": 4}}},
        "module language: expert-tp(4)*ep(2)=8 does not divide tp(2)*cp(1)*dp(2)=4 "
        "(Megatron's MoE parallel folding needs it to)",
    )
    # pp does not count: ep may be larger than tp*dp of the whole job only within a stage.
    layout = layout_from_dict({"modules": {"language": {"tp": 1, "dp": 4, "pp": 2, "ep": 2, "expt_tp": 2}}})
    assert layout.modules[0].ep == 2


def test_error_non_integer_fan_factor() -> None:
    _raises(
        {
            "placement": "disjoint",
            "modules": {"vision": {"dp": 4}, "language": {"dp": 3}},
            "edges": ["vision -> language"],
        },
        "edge vision->language: src dp(4) and dst dp(3): fan-in factor 4/3 is not an integer",
    )
    _raises(
        {
            "placement": "disjoint",
            "modules": {"vision": {"dp": 2}, "language": {"dp": 3}},
            "edges": ["vision -> language"],
        },
        "edge vision->language: src dp(2) and dst dp(3): fan-out factor 3/2 is not an integer",
    )
    _raises(
        {
            "placement": "colocated",
            "modules": {"vision": {"dp": 6}, "language": {"tp": 3, "dp": 2}, "audio": {"tp": 2, "dp": 3}},
            "edges": ["vision -> language", "audio -> language"],
        },
        "edge audio->language: src dp(3) and dst dp(2): fan-in factor 3/2 is not an integer",
    )


def test_error_unassigned_ranks_disjoint() -> None:
    _raises(
        {
            "placement": "disjoint",
            "modules": {"vision": {"dp": 2, "ranks": "0-1"}, "language": {"dp": 2, "ranks": "4-5"}},
        },
        "ranks 2-3 of world size 6 are not assigned to any module: vision 0-1, language 4-5",
    )
    _raises(
        {"placement": "disjoint", "modules": {"vision": {"dp": 2}, "language": {"tp": 2, "dp": 2}}},
        "ranks 6-7 of world size 8 are not assigned to any module: vision 0-1, language 2-5",
        world_size=8,
    )
    _raises(
        {
            "placement": "disjoint",
            "modules": {"a": {"ranks": "1"}, "b": {"ranks": "3"}, "c": {"dp": 2, "ranks": "5-6"}},
        },
        "ranks 0,2,4,7-9 of world size 10 are not assigned to any module: a 1-1, b 3-3, c 5-6",
        world_size=10,
    )
    _raises(
        {"placement": "disjoint", "modules": {"vision": {"dp": 4}, "language": {"tp": 2, "dp": 2}}},
        "disjoint modules need ranks 0-7 (8) but world size is 6: vision 0-3 (tp(1)*cp(1)*pp(1)*dp(4)=4), "
        "language 4-7 (tp(2)*cp(1)*pp(1)*dp(2)=4)",
        world_size=6,
    )


def test_error_unassigned_ranks_colocated_explicit_range_not_at_zero() -> None:
    """BUG: a colocated range that leaves ranks idle must be rejected like a disjoint one.

    docs/architecture.md: colocated modules 'all share [0, W)'. `_resolve_colocated` accepts explicit ranks
    '2-5' and the resolved layout reports world size 6 with ranks 0-1 serving no module (the plan
    printout shows them as '-'); the disjoint path rejects the same gap.
    """
    doc = {
        "placement": "colocated",
        "modules": {"vision": {"dp": 4, "ranks": "2-5"}, "language": {"tp": 4, "ranks": "2-5"}},
    }
    with pytest.raises(ValueError) as info:
        layout_from_dict(doc)
    assert "not assigned" in str(info.value) and "0-1" in str(info.value)


def test_error_unassigned_ranks_colocated_range_smaller_than_world() -> None:
    """BUG: colocated ranks 0-3 with world size 8 leave ranks 4-7 idle but are accepted."""
    doc = {"placement": "colocated", "modules": {"vision": {"dp": 4, "ranks": "0-3"}, "language": {"tp": 4}}}
    with pytest.raises(ValueError) as info:
        layout_from_dict(doc, world_size=8)
    assert "not assigned" in str(info.value) and "4-7" in str(info.value)


def test_error_unknown_keys() -> None:
    _raises(
        {"modules": {"vision": {"tp": 1, "dpp": 2}}},
        "module vision: unknown keys ['dpp']; allowed keys are "
        "['cp', 'dp', 'ep', 'expt_tp', 'frozen', 'layers', 'pp', 'ranks', 'recompute', 'role', 'tp']",
    )
    _raises(
        {"modules": {"vision": {"tp": 1}}, "edge": ["a->b"]},
        "unknown top-level keys ['edge']; allowed keys are ['boundary_mode', 'edges', 'modules', 'placement']",
    )
    _raises(
        {"modules": {"vision": {"tensor_parallel": 2, "tp": 2}}, "size": 3, "zz": 1},
        "unknown top-level keys ['size', 'zz']; allowed keys are ['boundary_mode', 'edges', 'modules', 'placement']",
    )


@pytest.mark.parametrize("key", ["tp", "cp", "pp", "dp", "ep", "expt_tp"])
@pytest.mark.parametrize("value", [0, -1, -8])
def test_error_non_positive_degrees(key: str, value: int) -> None:
    _raises({"modules": {"vision": {key: value}}}, f"module vision: {key} must be a positive integer, got {value}")


@pytest.mark.parametrize("value", [True, False])
@pytest.mark.parametrize("key", ["tp", "dp", "ep"])
def test_error_bools_where_ints_are_expected(key: str, value: bool) -> None:
    _raises({"modules": {"vision": {key: value}}}, f"module vision: {key} must be a positive integer, got {value!r}")


def test_error_bools_in_direct_construction_and_world_size() -> None:
    layout = HeteroLayout("colocated", (ModuleLayout("vision", tp=True),))
    with pytest.raises(ValueError) as info:
        resolve_layout(layout)
    assert str(info.value) == "module vision: tp must be a positive integer, got True"
    with pytest.raises(ValueError) as info:
        resolve_layout(HeteroLayout("colocated", (ModuleLayout("vision", dp=2.0),)))
    assert str(info.value) == "module vision: dp must be a positive integer, got 2.0"
    with pytest.raises(ValueError) as info:
        resolve_layout(HeteroLayout("colocated", (ModuleLayout("vision", frozen=1),)))
    assert str(info.value) == "module vision: frozen must be true or false, got 1"
    for ws in (True, 0, -4, 2.0, "8"):
        with pytest.raises(ValueError) as info:
            layout_from_dict({"modules": {"vision": {"dp": 1}}}, world_size=ws)
        assert str(info.value) == f"world size must be a positive integer, got {ws!r}"


@pytest.mark.parametrize("value", ["two", "2.5", 2.5, "", [2], {"a": 1}, None])
def test_error_non_integer_degrees(value) -> None:
    _raises({"modules": {"vision": {"tp": value}}}, f"module vision: tp must be a positive integer, got {value!r}")


def test_error_frozen_and_ranks_values() -> None:
    _raises({"modules": {"vision": {"frozen": "maybe"}}}, "module vision: frozen must be true or false, got 'maybe'")
    _raises({"modules": {"vision": {"frozen": 3}}}, "module vision: frozen must be true or false, got 3")
    _raises({"modules": {"vision": {"ranks": "3-1"}}}, "module vision: ranks '3-1' must satisfy 0 <= A <= B")
    _raises(
        {"modules": {"vision": {"ranks": "a-b"}}}, "module vision: ranks 'a-b' is not of the form 'A-B' (e.g. '0-3')"
    )
    _raises(
        {"modules": {"vision": {"ranks": "0-1-2"}}},
        "module vision: ranks '0-1-2' is not of the form 'A-B' (e.g. '0-3')",
    )
    _raises({"modules": {"vision": {"ranks": "-1"}}}, "module vision: ranks '-1' is not of the form 'A-B' (e.g. '0-3')")
    _raises(
        {"modules": {"vision": {"layers": "x"}}},
        "module vision: layers: ranks 'x' is not of the form 'A-B' (e.g. '0-3')",
    )


def test_error_document_shape() -> None:
    _raises(
        [1, 2],
        "a layout document must be a mapping with keys ['boundary_mode', 'edges', 'modules', 'placement'], got list",
    )
    _raises(
        None,
        "a layout document must be a mapping with keys ['boundary_mode', 'edges', 'modules', 'placement'], got NoneType",
    )
    _raises({"placement": "colocated"}, "'modules' must be a non-empty mapping NAME -> {tp, cp, pp, dp, ...}")
    _raises({"modules": {}}, "'modules' must be a non-empty mapping NAME -> {tp, cp, pp, dp, ...}")
    _raises({"modules": ["vision"]}, "'modules' must be a non-empty mapping NAME -> {tp, cp, pp, dp, ...}")
    _raises(
        {"modules": {"vision": {}}, "edges": "vision->language"},
        "'edges' must be a list of 'src -> dst' strings, got 'vision->language'",
    )
    _raises(
        {"modules": {"vision": [1]}},
        "module vision: expected a mapping of ['cp', 'dp', 'ep', 'expt_tp', 'frozen', 'layers', 'pp', "
        "'ranks', 'recompute', 'role', 'tp'], got [1]",
    )
    _raises(
        {"placement": "mixed", "modules": {"vision": {}}},
        "placement must be one of ['colocated', 'disjoint'], got 'mixed'",
    )
    _raises({"modules": {"a b": {}}}, "module name 'a b' must be a non-empty name of letters, digits, '_' or '-'")
    _raises({"modules": {"": {}}}, "module name '' must be a non-empty name of letters, digits, '_' or '-'")
    _raises({"modules": {1: {}, "1": {}}}, "module names must be unique; declared twice: ['1']")


def test_module_lookup_error() -> None:
    layout = layout_from_dict({"modules": {"vision": {}}})
    with pytest.raises(ValueError) as info:
        layout.module("language")
    assert str(info.value) == "unknown module 'language'; modules are ['vision']"


def test_rank_range_and_edge_parse() -> None:
    assert RankRange.parse("0-3", "x") == RankRange(0, 3)
    assert RankRange.parse(" 5 ", "x") == RankRange(5, 5)
    assert RankRange.parse(7, "x") == RankRange(7, 7)
    r = RankRange(2, 5)
    assert (r.size, list(r.ranks()), str(r)) == (4, [2, 3, 4, 5], "2-5")
    assert r.overlaps(RankRange(5, 9)) and not r.overlaps(RankRange(6, 9)) and r.overlaps(RankRange(0, 2))
    assert Edge.parse(" vision->language ") == Edge("vision", "language")
    assert str(Edge.parse("a -> b")) == "a->b"


# --------------------------------------------------------------------------------------------
# Flags (Megatron extra_args_provider)
# --------------------------------------------------------------------------------------------


def test_flags_defaults() -> None:
    args = _parser().parse_args([])
    assert args.hetero_layout is None and args.hetero_module is None and args.hetero_edge is None
    assert args.hetero_placement is None
    assert args.hetero_comm_timeout == 600.0 and args.hetero_offload_encoder is False
    assert args.tensor_model_parallel_size == 1
    with pytest.raises(ValueError) as info:
        layout_from_args(args)
    assert str(info.value) == (
        "no layout: give --hetero-layout FILE or one --hetero-module NAME:tp=..,dp=.. per module"
    )


def test_flags_colocated_modules_and_edge() -> None:
    args = _parser().parse_args(
        [
            "--tensor-model-parallel-size",
            "2",
            "--hetero-module",
            "vision:tp=1,dp=8",
            "--hetero-module",
            "language:tp=2,pp=2,dp=2",
            "--hetero-edge",
            "vision->language",
            "--hetero-comm-timeout",
            "30",
            "--hetero-offload-encoder",
        ]
    )
    assert args.hetero_comm_timeout == 30.0 and args.hetero_offload_encoder is True
    layout = layout_from_args(args)
    assert layout == load_layout(REPO / "examples/layouts/colocated_fan_in.yaml")


def test_flags_disjoint_ranks_frozen_and_world_size() -> None:
    args = _parser().parse_args(
        [
            "--hetero-placement",
            "disjoint",
            "--hetero-module",
            "language: tp=2 , dp=2 , ranks=2-5, ep=2, expt_tp=2",
            "--hetero-module",
            "vision:tp=2,ranks=0-1,frozen",
            "--hetero-module",
            "audio:dp=2,frozen=false,layers=0-3",
            "--hetero-edge",
            "vision -> language",
            "--hetero-edge",
            "audio->language",
        ]
    )
    layout = layout_from_args(args)
    assert layout.placement == "disjoint"
    assert [(m.name, m.ranks, m.frozen) for m in layout.modules] == [
        ("language", RankRange(2, 5), False),
        ("vision", RankRange(0, 1), True),
        ("audio", RankRange(6, 7), False),
    ]
    assert (layout.module("language").ep, layout.module("language").expt_tp) == (2, 2)
    assert layout.module("audio").layers == RankRange(0, 3)
    assert layout.edges == (Edge("vision", "language"), Edge("audio", "language"))
    # Megatron's args carry world_size: it is used when no explicit one is given.
    args.world_size = 10
    with pytest.raises(ValueError) as info:
        layout_from_args(args)
    assert str(info.value) == (
        "ranks 8-9 of world size 10 are not assigned to any module: language 2-5, vision 0-1, audio 6-7"
    )
    assert layout_from_args(args, world_size=8) == layout


def test_flags_layout_file(tmp_path: Path) -> None:
    path = REPO / "examples/layouts/disjoint_fan_in.yaml"
    args = _parser().parse_args(["--hetero-layout", str(path)])
    assert layout_from_args(args) == load_layout(path)
    args = _parser().parse_args(["--hetero-layout", str(path), "--hetero-placement", "disjoint"])
    assert layout_from_args(args) == load_layout(path)
    args = _parser().parse_args(["--hetero-layout", str(path), "--hetero-placement", "colocated"])
    with pytest.raises(ValueError) as info:
        layout_from_args(args)
    assert str(info.value) == f"--hetero-placement colocated contradicts placement disjoint in {path}"
    args = _parser().parse_args(["--hetero-layout", str(path), "--hetero-module", "vision:dp=4"])
    with pytest.raises(ValueError) as info:
        layout_from_args(args)
    assert str(info.value) == "give either --hetero-layout FILE or --hetero-module/--hetero-edge flags, not both"
    args = _parser().parse_args(["--hetero-layout", str(path), "--hetero-edge", "a->b"])
    with pytest.raises(ValueError, match="not both"):
        layout_from_args(args)
    args = _parser().parse_args(["--hetero-layout", str(tmp_path / "missing.yaml")])
    with pytest.raises(ValueError, match="cannot read layout file"):
        layout_from_args(args)


def test_flag_errors() -> None:
    def err(modules, edges=(), placement=None) -> str:
        ns = argparse.Namespace(
            hetero_layout=None, hetero_module=list(modules), hetero_edge=list(edges), hetero_placement=placement
        )
        with pytest.raises(ValueError) as info:
            layout_from_args(ns)
        return str(info.value)

    assert err(["vision"]) == "--hetero-module 'vision' is not of the form NAME:tp=..,dp=..[,ranks=A-B][,frozen]"
    assert err([":tp=2"]) == "--hetero-module ':tp=2' is not of the form NAME:tp=..,dp=..[,ranks=A-B][,frozen]"
    assert err(["vision:tp"]) == "--hetero-module 'vision:tp': 'tp' is not KEY=VALUE"
    assert err(["vision:tp=1,tp=2"]) == "--hetero-module 'vision:tp=1,tp=2': tp given twice"
    assert err(["vision:dp=2", "vision:dp=2"]) == "--hetero-module vision is given twice"
    assert err(["vision:tp=true"]) == "module vision: tp must be a positive integer, got 'true'"
    assert err(["vision:tp=0"]) == "module vision: tp must be a positive integer, got 0"
    assert err(["vision:tp="]) == "module vision: tp must be a positive integer, got ''"
    assert err(["vision:size=2"]) == (
        "module vision: unknown keys ['size']; allowed keys are "
        "['cp', 'dp', 'ep', 'expt_tp', 'frozen', 'layers', 'pp', 'ranks', 'recompute', 'role', 'tp']"
    )
    assert (
        err(["vision:dp=8", "language:tp=2,pp=2,dp=3"])
        == "module language: tp(2)*cp(1)*pp(2)*dp(3)=12 != ranks 0-7 (8)"
    )
    assert err(["vision:dp=2"], ["vision->llm"]) == "edge vision->llm: unknown module 'llm'; modules are ['vision']"
    assert err(["a:dp=2", "b:dp=2"], ["a->b", "b->a"]) == (
        "edges form a cycle: a -> b -> a; the module graph must be acyclic"
    )
    assert err(["vision:dp=2"], ["vision"]) == (
        "edge 'vision' is not of the form 'src -> dst' (e.g. 'vision -> language')"
    )
    assert err(["vision:dp=2,ranks=0-1", "language:dp=2,ranks=4-5"], placement="disjoint") == (
        "ranks 2-3 of world size 6 are not assigned to any module: vision 0-1, language 4-5"
    )


def test_parse_module_flag() -> None:
    assert parse_module_flag("vision:tp=1,dp=8") == ("vision", {"tp": "1", "dp": "8"})
    assert parse_module_flag(" vision : tp=2,,frozen, ranks=0-3 ") == (
        "vision",
        {"tp": "2", "frozen": True, "ranks": "0-3"},
    )
    assert parse_module_flag("v:") == ("v", {})


def test_argparse_rejects_unknown_placement(capsys) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["--hetero-placement", "mixed"])
    assert "invalid choice" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# Property tests
# --------------------------------------------------------------------------------------------

NAMES = ["vision", "audio", "language", "proj"]
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 16),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(
        [
            "1",
            "2",
            "4",
            "0",
            "-1",
            "0-3",
            "4-7",
            "0-7",
            " 2 ",
            "true",
            "no",
            "a->b",
            "vision -> language",
            "colocated",
            "disjoint",
            "1_0",
            "2.0",
            "0-1-2",
            "3-1",
        ]
    ),
)
_garbage = st.recursive(
    _scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(
            st.one_of(
                st.sampled_from(sorted(MODULE_KEYS) + NAMES + ["placement", "modules", "edges"]),
                st.text(max_size=5),
                st.integers(-2, 5),
            ),
            children,
            max_size=4,
        ),
    ),
    max_leaves=12,
)
_small_degree = st.one_of(st.integers(1, 4), st.integers(1, 4).map(str), st.sampled_from([0, -1, True, "x", None, 2.5]))
_module_spec = st.one_of(
    st.dictionaries(
        st.sampled_from(sorted(MODULE_KEYS)),
        st.one_of(_small_degree, st.sampled_from(["0-3", "4-7", "0-1", "2-3", "0", "1-0", "true"]), st.booleans()),
        max_size=5,
    ),
    st.dictionaries(st.sampled_from(["tp", "dp", "pp", "cp"]), st.integers(1, 4), max_size=4),
    _garbage,
)
_edge = st.one_of(
    st.tuples(st.sampled_from(NAMES), st.sampled_from(NAMES)).map(lambda ab: f"{ab[0]} -> {ab[1]}"), _garbage
)
_docs = st.one_of(
    st.fixed_dictionaries(
        {"modules": st.one_of(st.dictionaries(st.sampled_from(NAMES), _module_spec, min_size=1, max_size=4), _garbage)},
        optional={
            "placement": st.one_of(st.sampled_from(["colocated", "disjoint"]), _garbage),
            "edges": st.one_of(st.lists(_edge, max_size=4), _garbage),
        },
    ),
    _garbage,
)
_world = st.one_of(st.none(), st.integers(-1, 20), st.sampled_from([True, 2.0, "8"]))


def _no_huge_numbers(obj) -> bool:
    """Keep every generated number <= 16 so no layout needs more than a few thousand ranks
    (huge degrees are covered by a separate test)."""
    if isinstance(obj, bool):
        return True
    if isinstance(obj, int):
        return abs(obj) <= 16
    if isinstance(obj, str):
        return all(int(run) <= 16 for run in re.findall(r"\d+", obj.replace("_", "")))
    if isinstance(obj, dict):
        return all(_no_huge_numbers(k) and _no_huge_numbers(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return all(_no_huge_numbers(v) for v in obj)
    return True


def _accept_only_value_error(fn, *args) -> None:
    try:
        fn(*args)
    except ValueError as exc:
        assert str(exc), "a ValueError must carry a message"
        event("rejected")
    else:
        event("accepted")


@settings(max_examples=200, deadline=None)
@given(doc=_docs, world_size=_world)
def test_property_documents_raise_only_value_error(doc, world_size) -> None:
    assume(_no_huge_numbers(doc))
    try:
        layout = layout_from_dict(doc, world_size)
    except ValueError as exc:
        assert str(exc)
        event("rejected")
        return
    event("accepted")
    # Success: a resolved layout whose every module has a rank range of the right size, which
    # round-trips through its YAML text.
    for m in layout.modules:
        assert m.ranks is not None and m.ranks.size == m.size
    assert layout_from_dict(yaml.safe_load(dump_layout(layout))) == layout


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=_docs, text=st.one_of(st.none(), st.text(max_size=40)))
def test_property_yaml_files_raise_only_value_error(tmp_path: Path, doc, text) -> None:
    assume(_no_huge_numbers(doc) and _no_huge_numbers(text or ""))
    path = tmp_path / "layout.yaml"
    path.write_text(yaml.safe_dump(doc) if text is None else text)
    _accept_only_value_error(load_layout, path)


_flag_text = st.one_of(
    st.text(alphabet="visonlagu:=,-0123 tpdcefrozkx", max_size=30),
    st.builds(  # well-formed specs: often valid
        lambda name, degrees, frozen: f"{name}:" + ",".join(f"{k}={v}" for k, v in degrees.items()) + frozen,
        st.sampled_from(NAMES),
        st.dictionaries(st.sampled_from(["tp", "cp", "pp", "dp"]), st.sampled_from([1, 2, 4]), max_size=3),
        st.sampled_from(["", ",frozen"]),
    ),
    st.builds(
        lambda name, items: f"{name}:" + ",".join(items),
        st.sampled_from(NAMES + ["", "a b", "x"]),
        st.lists(
            st.one_of(
                st.builds(
                    lambda k, v: f"{k}={v}",
                    st.sampled_from(sorted(MODULE_KEYS) + ["size"]),
                    st.sampled_from(["1", "2", "4", "0", "-1", "0-3", "4-7", "true", "", "x", "2.0"]),
                ),
                st.sampled_from(["frozen", "tp", "=", ""]),
            ),
            max_size=5,
        ),
    ),
)


@settings(max_examples=200, deadline=None)
@given(
    modules=st.lists(_flag_text, max_size=4),
    edges=st.lists(st.one_of(_edge.filter(lambda e: isinstance(e, str)), st.text(max_size=12)), max_size=3),
    placement=st.sampled_from([None, "colocated", "disjoint"]),
    world_size=st.one_of(st.none(), st.integers(1, 16)),
)
def test_property_flags_raise_only_value_error(modules, edges, placement, world_size) -> None:
    assume(_no_huge_numbers(modules) and _no_huge_numbers(edges))
    argv = []
    for m in modules:
        argv.append(f"--hetero-module={m}")
    for e in edges:
        argv.append(f"--hetero-edge={e}")
    if placement:
        argv += ["--hetero-placement", placement]
    args = _parser().parse_args(argv)
    args.world_size = world_size
    _accept_only_value_error(layout_from_args, args)


# Random valid layouts for the round trip.
@st.composite
def valid_layouts(draw):
    placement = draw(st.sampled_from(["colocated", "disjoint"]))
    n = draw(st.integers(1, 3))
    names = draw(st.permutations(NAMES))[:n]
    size = draw(st.sampled_from([1, 2, 4, 8]))
    modules = {}
    for name in names:
        tp = draw(st.sampled_from([d for d in (1, 2, 4) if size % d == 0]))
        cp = draw(st.sampled_from([d for d in (1, 2) if (size // tp) % d == 0]))
        pp = draw(st.sampled_from([d for d in (1, 2) if (size // tp // cp) % d == 0]))
        dp = size // (tp * cp * pp)
        spec = {"tp": tp, "cp": cp, "pp": pp, "dp": dp}
        dense = tp * cp * dp
        ep = draw(st.sampled_from([d for d in (1, 2, 4) if dense % d == 0]))
        if ep > 1:
            spec["ep"] = ep
        if draw(st.booleans()):
            spec["frozen"] = True
        if draw(st.booleans()):
            spec["layers"] = f"0-{draw(st.integers(0, 9))}"
        modules[name] = spec
        if placement == "disjoint":
            size = draw(st.sampled_from([1, 2, 4, 8]))
    edges = [f"{a} -> {b}" for i, a in enumerate(names) for b in names[i + 1 :] if draw(st.booleans())]
    return {"placement": placement, "modules": modules, "edges": edges}


@settings(max_examples=150, deadline=None)
@given(doc=valid_layouts())
def test_property_round_trip(doc) -> None:
    layout = layout_from_dict(doc)
    text = dump_layout(layout)
    assert layout_from_dict(yaml.safe_load(text)) == layout
    assert layout_from_dict(layout.to_dict(), world_size=layout.world_size) == layout
    assert list(layout.names) == list(doc["modules"])
    order = topological_order(layout)
    for e in layout.edges:
        assert order.index(e.src) < order.index(e.dst)
    if layout.placement == "colocated":
        assert {m.ranks for m in layout.modules} == {RankRange(0, layout.world_size - 1)}
    else:
        covered = sorted(r for m in layout.modules for r in m.ranks.ranks())
        assert covered == list(range(layout.world_size))


# --------------------------------------------------------------------------------------------
# Pinned robustness bugs (see the docstrings)
# --------------------------------------------------------------------------------------------


def test_long_acyclic_chain_is_valid() -> None:
    """BUG (fixed): a recursive cycle search raised RecursionError (not a layout error at all) from
    `layout_from_dict` on a valid chain of 1500 modules; graphlib is iterative."""
    n = 1500
    doc = {
        "placement": "disjoint",
        "modules": {f"m{i}": {} for i in range(n)},
        "edges": [f"m{i} -> m{i + 1}" for i in range(n - 1)],
    }
    layout = layout_from_dict(doc)
    assert layout.world_size == n


def test_huge_disjoint_degree_does_not_exhaust_memory() -> None:
    """BUG: `_resolve_disjoint` lists every rank of every island (`sorted(r for m in out for r in
    m.ranks.ranks())`), so a typo such as tp=1099511627776 exhausts memory (MemoryError under a
    memory limit, an effectively endless loop without one) instead of resolving arithmetically
    (as the colocated path does at once) or raising ValueError.

    Run in a subprocess with a 512 MiB address-space limit so the machine is never at risk.
    """
    code = textwrap.dedent("""
        import resource, sys
        from megatron_hetero.layout import layout_from_dict
        resource.setrlimit(resource.RLIMIT_AS, (512 * 2**20, 512 * 2**20))
        doc = {"placement": "disjoint", "modules": {"vision": {"tp": 2**40}, "language": {"dp": 2}}}
        try:
            layout = layout_from_dict(doc)
            print("OK", layout.world_size)
        except ValueError as exc:
            print("VALUEERROR", exc)
        except BaseException as exc:
            print("OTHER", type(exc).__name__)
    """)
    with pytest.raises(ValueError, match=r"beyond the largest world a layout may have, 1048576 = 2\*\*20 ranks"):
        layout_from_dict({"placement": "colocated", "modules": {"vision": {"tp": 2**40}}})  # refused at once
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith(("OK", "VALUEERROR")), (out.stdout, out.stderr[-2000:])


def test_role_key_round_trips_and_is_validated() -> None:
    doc = {
        "placement": "disjoint",
        "modules": {"img": {}, "llm": {"pp": 2, "role": "language"}, "head": {}},
        "edges": ["img -> llm", "llm -> head"],
    }
    layout = layout_from_dict(doc)
    assert layout.module("llm").role == "language" and layout.module("img").role is None
    assert layout_from_dict(yaml.safe_load(dump_layout(layout))) == layout
    _raises(
        {"modules": {"vision": {"role": "encoder"}}}, "module vision: role must be one of ['language'], got 'encoder'"
    )


# -- a module's own activation recompute ------------------------------------------------------------
def test_recompute_key_parses_and_round_trips():
    from megatron_hetero.layout.spec import Recompute
    from megatron_hetero.layout.yaml_io import dump_layout, layout_from_dict

    import yaml

    doc = {
        "modules": {
            "vision": {"dp": 2},
            "language": {"tp": 2, "recompute": {"granularity": "full", "method": "uniform", "num_layers": 1}},
        },
        "edges": ["vision -> language"],
    }
    layout = layout_from_dict(doc, 2)
    assert layout.module("language").recompute == Recompute("full", "uniform", 1)
    assert layout.module("vision").recompute is None
    assert Recompute("full", "uniform", 1).config_kwargs() == {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    }
    assert layout_from_dict(yaml.safe_load(dump_layout(layout)), 2) == layout
    sel = layout_from_dict({"modules": {"language": {"recompute": {"granularity": "selective"}}}}, 1)
    assert sel.module("language").recompute == Recompute("selective")


@pytest.mark.parametrize(
    "recompute, message",
    [
        ("full", "module language: recompute: expected a mapping"),
        ({"granularity": "full", "layers": 1}, "unknown keys ['layers']"),
        ({"method": "uniform"}, "granularity (full or selective) is required"),
        ({"granularity": "partial"}, "granularity 'partial' must be one of ['full', 'selective']"),
        ({"granularity": "full", "num_layers": 1}, "granularity full needs method uniform or block, got None"),
        ({"granularity": "full", "method": "uniform"}, "granularity full needs num_layers >= 1, got None"),
        ({"granularity": "full", "method": "uniform", "num_layers": "two"}, "num_layers must be a positive integer"),
        ({"granularity": "selective", "method": "block"}, "granularity selective takes no method or num_layers"),
    ],
)
def test_bad_recompute_is_a_value_error(recompute, message):
    from megatron_hetero.layout.yaml_io import layout_from_dict

    with pytest.raises(ValueError) as info:
        layout_from_dict({"modules": {"language": {"recompute": recompute}}}, 1)
    assert message in str(info.value)


def test_job_recompute_flags():
    from megatron_hetero.layout.spec import Recompute
    from megatron_hetero.config.job import JobConfig, job_recompute

    assert job_recompute(JobConfig()) is None
    job = JobConfig(recompute_granularity="full", recompute_method="block", recompute_num_layers=2)
    assert job_recompute(job) == Recompute("full", "block", 2)
    with pytest.raises(ValueError, match="need --recompute-granularity full"):
        job_recompute(JobConfig(recompute_num_layers=1))


def test_world_beyond_the_bound_is_refused() -> None:
    """A world above 2**20 ranks is refused at resolution, by arithmetic: one module too large, disjoint
    islands that add up beyond it, or a --world-size beyond it; 2**20 itself resolves."""
    from megatron_hetero.layout.degrees import MAX_WORLD_SIZE

    assert MAX_WORLD_SIZE == 2**20
    bound = r"beyond the largest world a layout may have, 1048576 = 2\*\*20 ranks"
    with pytest.raises(
        ValueError,
        match=r"module vision: tp\(1\)\*cp\(1\)\*pp\(1\)\*dp\(1000000000000\)=1000000000000 ranks is " + bound,
    ):
        layout_from_dict({"placement": "colocated", "modules": {"vision": {"dp": 10**12}}})
    halves = {"placement": "disjoint", "modules": {"vision": {"dp": 2**20}, "language": {"tp": 8}}}
    with pytest.raises(
        ValueError, match=r"the modules need 1048584 ranks \(vision 0-1048575, language 1048576-1048583\), " + bound
    ):
        layout_from_dict(halves)
    with pytest.raises(ValueError, match=r"world size 1048577 is " + bound):
        layout_from_dict({"placement": "colocated", "modules": {"vision": {}}}, world_size=2**20 + 1)
    assert layout_from_dict({"placement": "colocated", "modules": {"vision": {"dp": 2**20}}}).world_size == 2**20


def test_boundary_mode_yaml_flag_and_validation(tmp_path: Path) -> None:
    """`boundary_mode` defaults to direct, round-trips, is replaced by --hetero-boundary-mode, and
    hierarchical on a colocated layout is refused with the reason."""
    fan_in = REPO / "examples/layouts/disjoint_fan_in.yaml"
    hier = REPO / "examples/layouts/disjoint_hierarchical.yaml"
    assert load_layout(fan_in).boundary_mode == "direct"
    layout = load_layout(hier)
    assert layout.boundary_mode == "hierarchical"
    assert layout.to_dict()["boundary_mode"] == "hierarchical" and "boundary_mode" not in load_layout(fan_in).to_dict()
    assert layout_from_dict(layout.to_dict()) == layout
    assert layout.modules == load_layout(fan_in).modules
    args = _parser().parse_args(["--hetero-layout", str(fan_in), "--hetero-boundary-mode", "hierarchical"])
    assert layout_from_args(args) == layout
    args = _parser().parse_args(["--hetero-layout", str(hier), "--hetero-boundary-mode", "direct"])
    assert layout_from_args(args).boundary_mode == "direct"
    flags = [
        "--hetero-placement",
        "disjoint",
        "--hetero-module",
        "vision:dp=4",
        "--hetero-module",
        "language:tp=2,dp=2",
    ]
    args = _parser().parse_args([*flags, "--hetero-edge", "vision->language", "--hetero-boundary-mode", "hierarchical"])
    assert layout_from_args(args) == layout
    with pytest.raises(ValueError, match=r"boundary_mode must be one of \['direct', 'hierarchical'\], got 'leader'"):
        layout_from_dict({"placement": "disjoint", "boundary_mode": "leader", "modules": {"a": {}}})
    colocated = {"placement": "colocated", "boundary_mode": "hierarchical", "modules": {"a": {}, "b": {}}}
    with pytest.raises(ValueError, match="boundary_mode hierarchical needs placement disjoint, got colocated"):
        layout_from_dict({**colocated, "edges": ["a -> b"]})
    args = _parser().parse_args(
        [
            "--hetero-layout",
            str(REPO / "examples/layouts/colocated_fan_in.yaml"),
            "--hetero-boundary-mode",
            "hierarchical",
        ]
    )
    with pytest.raises(ValueError, match="--hetero-boundary-mode hierarchical with .*needs placement disjoint"):
        layout_from_args(args)


def test_heads_divide_by_the_modules_tp() -> None:
    """`check_heads`: the one rule train, the Megatron-LM scripts and the Whisper encoder keep about heads
    and tensor parallelism (each head lives whole on one tp rank)."""
    from megatron_hetero.layout.validate import check_heads

    m = layout_from_dict({"placement": "colocated", "modules": {"language": {"tp": 4, "dp": 2}}}).module("language")
    for heads in (4, 8, 32):
        check_heads(m, heads)
    for heads in (2, 6, 9):
        with pytest.raises(ValueError) as info:
            check_heads(m, heads)
        assert str(info.value) == f"module language: {heads} attention heads are not divisible by tp(4)"
    with pytest.raises(ValueError) as info:
        check_heads(m, 6, "--num-attention-heads")
    assert str(info.value) == "module language: 6 attention heads (--num-attention-heads) are not divisible by tp(4)"

"""`search --segments N` (planner/segments.py): the heteropipe DP's layer partition x TP/DP of one
language model, checked against brute force over every configuration (tests/search_reference.py), and
the layout it prints. Training that layout: tests/e2e/test_search_out_trains.py."""

from __future__ import annotations

import json

import pytest

import search_reference as R
from megatron_hetero import cli
from megatron_hetero.cli import search as cli_search
from megatron_hetero.planner.hardware import Profile
from megatron_hetero.planner.hardware_presets import DEFAULT_HARDWARE, load_hardware
from megatron_hetero.planner.heteropipe import enumerate_pipelines
from megatron_hetero.planner.segments import plan_segments, segments_layout, segments_problems

FLAGS = ["--world-size", "4", "--hardware", DEFAULT_HARDWARE, "--num-layers", "6", "--global-batch-size", "16"]


def _problems():
    args = cli.build_parser().parse_args(["search", *FLAGS])
    wl = cli_search.workload_from_args(args)
    return segments_problems(wl, Profile.from_hardware(load_hardware(DEFAULT_HARDWARE)), 4, 2)


def test_segments_dp_equals_brute_force() -> None:
    """Every problem (one per largest DP) has the brute force's optimum, and the chosen plan is the least."""
    problems = _problems()
    assert [p.max_dp for p in problems] == [1, 2, 4] and [p.num_microbatches for p in problems] == [16, 8, 4]
    refs, confs = [], 0
    for p in problems:
        confs += len(list(enumerate_pipelines(p.num_layers, p.world_size, p.num_segments, p.strategies)))
        ref = R.heteropipe_brute_force(
            p.num_layers, p.world_size, p.num_segments, p.strategies, p.stage_cost, p.num_microbatches
        )
        refs.append((ref.objective, p.max_dp))
    assert confs > 20  # the brute force really compares layer cuts x strategies
    problem, plan = plan_segments(problems)
    best_ref, best_dp = min(refs)
    assert plan.objective == pytest.approx(best_ref, rel=1e-12) and problem.max_dp == best_dp
    layout = segments_layout(plan)
    assert layout.world_size == 4 and layout.placement == "disjoint"
    assert [str(e) for e in layout.edges] == ["language_0 -> language_1".replace(" ", "")]
    assert [(m.layers.start, m.layers.end) for m in layout.modules] == [(s.start, s.end - 1) for s in plan.stages]
    assert layout.modules[0].layers.start == 0 and layout.modules[-1].layers.end == 5


def test_search_segments_cli(capsys, tmp_path) -> None:
    out = tmp_path / "seg.yaml"
    rc = cli.main(["search", *FLAGS, "--segments", "2", "--json", "--out", str(out)])
    text, err = capsys.readouterr()
    assert rc == 0, err
    doc = json.loads(text)
    _, plan = plan_segments(_problems())
    assert doc["objective_s"] == pytest.approx(plan.objective)
    assert [(s["layers"], s["tp"], s["dp"]) for s in doc["segments"]] == [
        ([s.start, s.end - 1], s.strategy.tp, s.strategy.dp) for s in plan.stages
    ]
    assert doc["best_layout"] == segments_layout(plan).to_dict()
    assert "# megatron-hetero train --hetero-layout seg.yaml --num-layers 6 --global-batch-size 16" in out.read_text()
    rc = cli.main(["search", *FLAGS, "--segments", "7"])
    _, err = capsys.readouterr()
    assert rc == 2 and "--segments 7: the language model has only 6 layers" in err
    rc = cli.main(["search", *FLAGS, "--segments", "2", "--all-layouts"])
    _, err = capsys.readouterr()
    assert rc == 2 and "--segments plans one language model's segments; drop --all-layouts" in err

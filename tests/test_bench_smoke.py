"""The boundary benchmark runs end to end (tiny shape, one iteration) and its byte ratios hold:
direct mode moves exactly the minimum, the leader path more. Times are not asserted."""
from __future__ import annotations

import json

import pytest

from megatron_hetero.bench import boundary as bench


@pytest.mark.timeout(300)
def test_bench_boundary_smoke(tmp_path):
    doc = bench.run(tmp_path, batch=8, seq=16, hidden=8, iters=1)
    assert json.loads((tmp_path / "boundary.json").read_text()) == doc
    assert len(doc["cases"]) == len(bench.CASES)
    for row in doc["cases"]:
        assert row["time_s"] > 0 and row["plain_send_s"] > 0
        if row["mode"] == "direct":
            assert row["bytes_moved"] == row["min_bytes"], row
        else:
            assert row["bytes_moved"] > row["min_bytes"], row
    assert "| case | mode |" in bench.table(doc)


@pytest.mark.timeout(300)
def test_bench_schedule_smoke():
    """One disjoint case, two steps: the measured and predicted bubbles are fractions, and the
    prediction is the checker's simulation of the same tables with the measured stage costs."""
    from megatron_hetero.bench import schedule as sched_bench
    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.plan.schedule import build_tables
    from megatron_hetero.plan.schedule_check import check_tables

    name, doc, encoders, layers, gbs, mbs = sched_bench.CASES[0]
    row = sched_bench._measure(name, doc, encoders, layers, gbs, mbs, steps=2)
    assert 0.0 < row["measured_bubble"] < 1.0 and 0.0 < row["predicted_bubble"] < 1.0
    costs = {m: (c["forward"], c["backward"]) for m, c in row["stage_costs_s"].items()}
    layout = layout_from_dict(doc)
    expect = check_tables(build_tables(layout, row["micro_batches"], stage_costs=costs), layout=layout)
    assert row["predicted_bubble"] == pytest.approx(expect.bubble_fraction)
    assert row["stages"] == 4 and row["micro_batches"] == 8


def test_bench_command_checks_its_input_before_running(capsys):
    """`megatron-hetero bench` rejects bad input with exit 2 before any benchmark starts."""
    from megatron_hetero import cli
    from megatron_hetero.bench.suite import BENCHMARKS, DEFAULT_ITERS, run_benchmark

    assert set(DEFAULT_ITERS) == set(BENCHMARKS)
    assert cli.main(["bench", "boundary", "--iters", "0"]) == 2
    assert capsys.readouterr().err == "megatron-hetero bench: invalid input: --iters must be >= 1, got 0\n"
    with pytest.raises(ValueError, match="unknown benchmark 'nope'"):
        run_benchmark("nope", ".")
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "nope"])
    assert info.value.code == 2

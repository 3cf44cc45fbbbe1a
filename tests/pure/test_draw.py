"""Pictures of layouts, planned schedules and traces: valid PNGs whose drawn ranks are the layout's
(or the trace's) ranks, checked on what the drawing functions read back from the figure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = ROOT / "examples" / "layouts"


def _layout(name: str):
    from megatron_hetero.layout.yaml_io import load_layout

    return load_layout(str(LAYOUTS / name), None)


def _png_shape(path: Path, size: list[int]) -> None:
    from matplotlib.image import imread

    img = imread(str(path))
    assert img.shape[:2] == (size[1], size[0]) and img.shape[2] in (3, 4), (img.shape, size)
    assert img[..., :3].std() > 0.01  # not a blank canvas


@pytest.mark.parametrize("name", sorted(p.name for p in LAYOUTS.glob("*.yaml")))
def test_layout_picture_draws_every_rank(name, tmp_path):
    from megatron_hetero.report.draw import draw_layout
    from megatron_hetero.report.plan import default_shape

    layout = _layout(name)
    out = tmp_path / "layout.png"
    s = draw_layout(layout, out, default_shape(layout))
    assert s["ranks"] == list(range(layout.world_size))
    used = {r for m in layout.modules for r in m.ranks.ranks()}
    assert s["cells"] == sum(m.size for m in layout.modules) + (layout.world_size - len(used))
    assert s["modules"] == [m.name for m in layout.modules]
    assert [e["edge"] for e in s["edges"]] == [str(e) for e in layout.edges]
    _png_shape(out, s["size"])


def test_layout_picture_transforms():
    from megatron_hetero.report.draw import draw_layout

    s = draw_layout(_layout("colocated_fan_in.yaml"), Path("/dev/null"))
    assert s["edges"] == [{"edge": "vision->language", "transform": "fan-in", "factor": 4}]
    assert s["cells"] == 16  # one row of 8 cells per module over the same ranks


@pytest.mark.parametrize(
    "name",
    [
        "colocated_fan_in.yaml",
        "colocated_two_encoders.yaml",
        "disjoint_encoder_pp.yaml",
        "llm_segments.yaml",
        "disjoint_two_encoders.yaml",
    ],
)
def test_schedule_picture_draws_every_rank(name, tmp_path):
    from megatron_hetero.report.draw import draw_schedule

    layout = _layout(name)
    out = tmp_path / "schedule.png"
    kwargs = {"global_batch": 8} if layout.placement == "colocated" else {"micro_batches": 4}
    s = draw_schedule(layout, out, **kwargs)
    assert s["ranks"] == list(range(layout.world_size))
    assert s["bars"] > 0
    _png_shape(out, s["size"])


def test_planned_timeline_covers_every_micro_batch():
    from megatron_hetero.report.draw import planned_timeline
    from megatron_hetero.plan.placement import coord_of

    layout = _layout("disjoint_encoder_pp.yaml")
    rows = planned_timeline(layout, micro_batches=4)
    assert sorted(rows) == list(range(8))
    for r, row in rows.items():
        compute = sorted(lab for _, _, k, lab in row if k.endswith("forward") or k.endswith("backward"))
        assert compute == sorted([f"F{i}" for i in range(4)] + [f"B{i}" for i in range(4)]), (r, compute)
        role = "encoder" if r < 4 else "llm"
        assert {k for _, _, k, _ in row} <= {f"{role}-forward", f"{role}-backward", "wait"}
        t = 0.0
        for t0, t1, _, _ in row:  # gaps are waits: the row is contiguous from 0
            assert abs(t0 - t) < 1e-9 and t1 >= t0
            t = t1

    layout = _layout("colocated_fan_in.yaml")  # language TP2·PP2·DP2: 4 micro-batches of 1 per DP rank
    rows = planned_timeline(layout, global_batch=8, micro_batch_size=1)
    for r, row in rows.items():
        kinds = [k for _, _, k, _ in row]
        assert kinds.count("llm-forward") == kinds.count("llm-backward") == 4
        assert kinds.count("encoder-forward") == 1 and kinds.count("boundary") == 2
        assert kinds[-2:] == ["optimizer", "loss-reduce"]
        lm = layout.module("language")
        # after the boundary forward, stage 1 first waits for stage 0's forward of micro-batch 0
        after = kinds[kinds.index("boundary") + 1]
        assert after == ("llm-forward" if coord_of(lm, r).pp == 0 else "wait"), (r, kinds)
    assert len({row[-1][1] for row in rows.values()}) == 1  # everyone ends with the closing collectives


def test_timeline_draws_the_trace_ranks(tmp_path):
    from megatron_hetero.report.draw import draw_timeline
    from megatron_hetero.runtime.trace import chrome_trace

    payloads = [
        {
            "rank": r,
            "host": "h",
            "spans": [("llm-forward", f"F{i}", 1000 * i, 1000 * i + 700, {"mb": i}) for i in range(3)]
            + [("wait", "w", 5000, 6000, {})],
        }
        for r in range(3)
    ]
    payloads.append({"rank": 3, "host": "h", "spans": []})  # a rank with nothing traced still gets its row
    doc = chrome_trace(payloads)
    out = tmp_path / "t.png"
    s = draw_timeline(doc, out)
    assert s["ranks"] == doc["otherData"]["ranks"] == [0, 1, 2, 3]
    assert s["bars"] == 12 and s["kinds"] == ["llm-forward", "wait"]
    _png_shape(out, s["size"])


def test_cli_draw_flags_and_timeline(tmp_path, capsys):
    from megatron_hetero.cli import main
    from megatron_hetero.runtime.trace import chrome_trace

    png = tmp_path / "plan.png"
    assert main(["plan", str(LAYOUTS / "disjoint_fan_in.yaml"), "--draw", str(png)]) == 0
    assert "cells over 8 ranks" in capsys.readouterr().out
    assert main(["plan", str(LAYOUTS / "disjoint_fan_in.yaml"), "--json", "--draw", str(png)]) == 0
    json.loads(capsys.readouterr().out)  # --json stays a clean document (the drawing line goes to stderr)
    assert (
        main(
            [
                "schedule",
                str(LAYOUTS / "disjoint_fan_in.yaml"),
                "--micro-batches",
                "2",
                "--draw",
                str(tmp_path / "s.png"),
            ]
        )
        == 0
    )
    assert "planned timeline of 8 ranks" in capsys.readouterr().out
    assert main(["schedule", str(LAYOUTS / "colocated_fan_out.yaml"), "--draw", str(tmp_path / "c.png")]) == 0
    capsys.readouterr()
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(chrome_trace([{"rank": 0, "host": "h", "spans": [("optimizer", "o", 0, 10, {})]}])))
    assert main(["timeline", str(trace), "--out", str(tmp_path / "tl.png")]) == 0
    assert "timeline of 1 ranks" in capsys.readouterr().out
    assert (tmp_path / "tl.png").stat().st_size > 0
    (tmp_path / "bad.json").write_text("{}")
    assert main(["timeline", str(tmp_path / "bad.json")]) == 2
    assert main(["timeline", str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err

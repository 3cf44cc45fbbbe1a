"""`megatron-hetero plan` at scale: the summary of a large world, one rank's plan (--rank), and the
refusal of a world beyond 2**20 ranks. Values are checked against the whole-edge plan (small worlds)
or hand arithmetic (the 65,536-rank layout); no timing asserts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_hetero import cli
from megatron_hetero.layout import load_layout
from megatron_hetero.plan.boundary import plan_boundary
from megatron_hetero.report.plan import default_shape
from megatron_hetero.report.plan_summary import summary_text

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "layouts"

BIG = """\
placement: colocated
modules:
  vision: {dp: 65536}
  language: {tp: 8, pp: 4, dp: 2048}
edges: ["vision -> language"]
"""


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.timeout(60)  # a hang fails here, not a slow machine: the refusal is arithmetic
def test_absurd_world_is_refused_with_exit_2(tmp_path: Path, capsys) -> None:
    """`dp: 1000000000000` used to make `plan` run without end; now it is refused at resolution."""
    path = tmp_path / "absurd.yaml"
    path.write_text("placement: colocated\nmodules:\n  vision: {dp: 1000000000000}\n")
    rc, out, err = _run(capsys, "plan", str(path))
    assert rc == 2, err
    assert out == ""
    assert (
        "module vision: tp(1)*cp(1)*pp(1)*dp(1000000000000)=1000000000000 ranks is beyond the largest world a "
        "layout may have, 1048576 = 2**20 ranks" in err
    )


def test_summary_of_a_65536_rank_world(capsys, tmp_path: Path) -> None:
    """Vision DP=65536 -> language TP8·PP4·DP2048, colocated: batch 65536 (lcm of the DP sizes),
    seq 8, hidden 64, fp32. Forward: each of the 16,384 language stage-0 ranks needs 32 samples and
    holds one of them only when its rank is a vision rank of its own samples (language dp d, tp t is
    rank 8d+t; vision rank r holds sample r; its samples are 32d..32d+31, so it holds one when
    32d <= 8d+t < 32d+32, i.e. d == 0)."""
    path = tmp_path / "big.yaml"
    path.write_text(BIG)
    rc, out, err = _run(capsys, "plan", str(path), "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["summary"] is True and doc["world_size"] == 65536 and "ranks" not in doc
    assert doc["modules"]["language"]["stage_size"] == 16384
    (e,) = doc["edges"]
    sample = 8 * 64 * 4  # bytes of one sample: seq 8 x hidden 64 x fp32
    held = 8  # language dp 0: ranks 0-7 each hold one of their own 32 samples
    assert (e["transform"], e["factor"], e["src_ranks"], e["dst_ranks"]) == ("fan-in", 32, "0-65535", "0-16383")
    assert e["bytes_forward"] == (16384 * 32 - held) * sample
    # backward: every vision rank needs its sample's gradient; ranks 0-7 hold their own
    assert e["bytes_backward"] == (65536 - held) * sample
    assert e["messages_forward"] == 16384 * 32 - held and e["messages_backward"] == 65536 - held
    assert e["modes"] == {"direct": {"bytes": e["bytes_forward"], "hops": e["max_peers_forward"]}}
    ranks = [r["rank"] for r in doc["sample_ranks"]]
    assert ranks == [0, 16384, 32768, 49152, 65535]
    last = doc["sample_ranks"][-1]
    assert last["modules"]["language"] == {
        "tp": 7, "cp": 0, "dp": 2047, "pp": 3, "ep": 0, "expt_tp": 0, "prev_rank": 65535 - 16384, "next_rank": None
    }  # fmt: skip
    fwd = last["edges"]["vision->language"]["forward"]
    assert (fwd["sends"], fwd["recvs"], fwd["bytes_sent"]) == (8, 0, 8 * sample)
    text = summary_text(doc)  # what `plan` prints without --json (one run of the planning is enough here)
    assert text.startswith("world size 65536, placement colocated, boundary mode direct (summary")
    assert "edge vision->language: fan-in x32  [batch 65536, seq 8, hidden 64] x 4 B" in text
    assert len(text.splitlines()) < 40  # no line per rank


@pytest.mark.parametrize("name", ["colocated_fan_in", "disjoint_fan_out", "colocated_generator"])
def test_rank_plan_is_that_rank_of_the_whole_plan(capsys, name: str) -> None:
    path = EXAMPLES / f"{name}.yaml"
    layout = load_layout(path)
    shape = default_shape(layout)
    whole = {str(e): plan_boundary(layout, e, shape) for e in layout.edges}
    for rank in range(layout.world_size):
        rc, out, err = _run(capsys, "plan", str(path), "--rank", str(rank), "--json")
        assert rc == 0, err
        doc = json.loads(out)
        assert doc["rank"] == rank
        for edge, p in whole.items():
            on = rank in p.src_ranks or rank in p.dst_ranks
            assert (edge in doc["edges"]) == on
            if not on:
                continue
            got = doc["edges"][edge]
            for d in ("forward", "backward"):
                for key, want in (
                    ("sends", p.sends(rank, d)),
                    ("recvs", p.recvs(rank, d)),
                    ("local_copies", p.local_copies(rank, d)),
                ):
                    assert [(t["src"], t["dst"], t["b0"], t["b1"], t["s0"], t["s1"]) for t in got[d][key]] == [
                        (t.src, t.dst, t.block.b0, t.block.b1, t.block.s0, t.block.s1) for t in want
                    ]


def test_rank_text_schedule_and_bad_rank(capsys) -> None:
    path = str(EXAMPLES / "colocated_fan_in.yaml")
    rc, out, _ = _run(capsys, "plan", path, "--rank", "2", "--global-batch-size", "8", "--micro-batch-size", "2")
    assert rc == 0
    assert out.startswith("rank 2 of world size 8, placement colocated, boundary mode direct")
    assert "  language: tp0 cp0 dp1 pp0, pipeline peers prev -, next 6" in out
    # vision TP1·DP8 holds sample r on rank r; language dp1 (ranks 2, 3) needs samples 4-7 (seq 8)
    assert (
        "forward : receives b[4:5] s[0:8] from 4, b[5:6] s[0:8] from 5, b[6:7] s[0:8] from 6, b[7:8] s[0:8] from 7"
        in out
    )
    assert "  schedule:" in out and "1F1B language/0 of pp 2: 2 micro-batches of 2" in out
    rc, _, err = _run(capsys, "plan", path, "--rank", "8")
    assert rc == 2 and "--rank 8 is outside the layout's world size 8" in err


def test_small_world_keeps_its_full_report_and_summary_on_request(capsys) -> None:
    path = str(EXAMPLES / "colocated_fan_in.yaml")
    rc, full, _ = _run(capsys, "plan", path)
    rc2, forced, _ = _run(capsys, "plan", path, "--full")
    assert rc == rc2 == 0 and full == forced and "summary" not in full
    rc, text, _ = _run(capsys, "plan", path, "--summary")
    assert (
        rc == 0
        and text.startswith("world size 8, placement colocated, boundary mode direct (summary")
        and "  rank 7: " in text
    )
    rc, out, _ = _run(capsys, "plan", path, "--summary", "--json")
    assert rc == 0
    doc = json.loads(out)
    (e,) = doc["edges"]
    p = plan_boundary(load_layout(path), "vision -> language", default_shape(load_layout(path)))
    assert (e["bytes_forward"], e["bytes_backward"]) == (p.planned_bytes("forward"), p.planned_bytes("backward"))
    assert e["messages_forward"] == len({(t.src, t.dst) for t in p.forward if not t.local})
    assert e["modes"]["direct"] == {"bytes": p.costs["direct"].bytes, "hops": p.costs["direct"].hops}

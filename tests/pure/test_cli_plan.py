"""`megatron-hetero plan`: every example layout, the --json document, and the exit-code-2 path."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from megatron_hetero import cli

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples" / "layouts").glob("*.yaml"))

BROKEN = textwrap.dedent("""\
    placement: colocated
    modules:
      vision:   {tp: 1, dp: 8}
      language: {tp: 2, pp: 2, dp: 3}
""")
BROKEN_MESSAGE = "module language: tp(2)*cp(1)*pp(2)*dp(3)=12 != ranks 0-7 (8)"


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_examples_exist() -> None:
    assert len(EXAMPLES) >= 8


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_plan_every_example(capsys, path: Path) -> None:
    rc, out, err = _run(capsys, "plan", str(path))
    assert rc == 0, err
    assert err == ""
    assert out.startswith("world size ")
    rc, out, err = _run(capsys, "plan", str(path), "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert set(doc) >= {"world_size", "placement", "modules", "ranks", "edges"}
    assert [e["rank"] for e in doc["ranks"]] == list(range(doc["world_size"]))
    for edge in doc["edges"]:
        assert edge["planned_bytes_forward"] == edge["min_bytes_forward"]
        assert edge["planned_bytes_backward"] == edge["min_bytes_backward"]
    # Also through --hetero-layout.
    rc, out2, err = _run(capsys, "plan", "--hetero-layout", str(path), "--json")
    assert rc == 0 and json.loads(out2) == doc


def test_plan_text_colocated_fan_in(capsys) -> None:
    rc, out, _ = _run(capsys, "plan", str(REPO / "examples/layouts/colocated_fan_in.yaml"))
    assert rc == 0
    lines = out.splitlines()
    assert lines[0] == "world size 8, placement colocated, boundary mode direct"
    assert lines[2].split() == ["rank", "vision", "TP1·CP1·PP1·DP8", "@0-7", "language", "TP2·CP1·PP2·DP2", "@0-7"]
    rows = {int(line.split()[0]): line.split()[1:] for line in lines[3:11]}
    assert rows[3] == ["tp0", "cp0", "dp3", "pp0", "tp1", "cp0", "dp1", "pp0"]
    assert rows[6] == ["tp0", "cp0", "dp6", "pp0", "tp0", "cp0", "dp1", "pp1"]
    assert "edge vision->language: fan-in x4  [batch 8, seq 8, hidden 64] x 4 B" in lines
    # 14 samples x 8 positions x 64 hidden x 4 B = 28 KiB forward; 6 samples = 12 KiB backward.
    assert "  forward : moves 28.0 KiB (minimum 28.0 KiB)" in lines
    assert "  backward: moves 12.0 KiB (minimum 12.0 KiB)" in lines
    assert (
        "  rank 2: receives b[4:5] s[0:8] from 4, b[5:6] s[0:8] from 5, b[6:7] s[0:8] from 6, b[7:8] s[0:8] from 7"
    ) in lines
    assert (
        "  rank 0: selects b[0:1] s[0:8]; receives b[1:2] s[0:8] from 1, b[2:3] s[0:8] from 2, b[3:4] s[0:8] from 3"
        in lines
    )


def test_plan_json_colocated_fan_in(capsys) -> None:
    rc, out, _ = _run(capsys, "plan", str(REPO / "examples/layouts/colocated_fan_in.yaml"), "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["world_size"] == 8
    assert doc["placement"] == "colocated"
    assert doc["modules"] == {
        "vision": {"tp": 1, "cp": 1, "pp": 1, "dp": 8, "ep": 1, "expt_tp": 1, "ranks": "0-7", "frozen": False},
        "language": {"tp": 2, "cp": 1, "pp": 2, "dp": 2, "ep": 1, "expt_tp": 1, "ranks": "0-7", "frozen": False},
    }
    language = [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1)]  # (tp, dp, pp)
    assert len(doc["ranks"]) == 8
    for r, entry in enumerate(doc["ranks"]):
        assert entry["rank"] == r
        assert set(entry["modules"]) == {"vision", "language"}
        v, lang = entry["modules"]["vision"], entry["modules"]["language"]
        assert {k: v[k] for k in ("tp", "cp", "dp", "pp", "ep")} == {"tp": 0, "cp": 0, "dp": r, "pp": 0, "ep": 0}
        tp, dp, pp = language[r]
        assert {k: lang[k] for k in ("tp", "cp", "dp", "pp", "ep")} == {"tp": tp, "cp": 0, "dp": dp, "pp": pp, "ep": 0}
    (edge,) = doc["edges"]
    assert (edge["src"], edge["dst"], edge["transform"], edge["factor"]) == ("vision", "language", "fan-in", 4)
    assert edge["shape"] == {"batch": 8, "seq": 8, "hidden": 64, "dtype_bytes": 4}
    assert edge["src_ranks"] == list(range(8)) and edge["dst_ranks"] == [0, 1, 2, 3]
    assert edge["src_leaders"] == list(range(8)) and edge["dst_leader"] == 0
    assert edge["min_bytes_forward"] == edge["planned_bytes_forward"] == 14 * 8 * 64 * 4
    assert edge["min_bytes_backward"] == edge["planned_bytes_backward"] == 6 * 8 * 64 * 4
    assert edge["recommended_mode"] == "direct" and set(edge["modes"]) == {"direct"}
    assert edge["local_groups"] == [list(range(8))]
    assert {"src": 5, "dst": 2, "b0": 5, "b1": 6, "s0": 0, "s1": 8} in edge["forward"]
    assert {"src": 3, "dst": 5, "b0": 5, "b1": 6, "s0": 0, "s1": 8} in edge["backward"]
    assert len(edge["forward"]) == 16 and len(edge["backward"]) == 8


def test_plan_json_from_flags_with_shape(capsys) -> None:
    rc, out, err = _run(
        capsys,
        "plan",
        "--json",
        "--hetero-placement",
        "disjoint",
        "--hetero-module",
        "vision:tp=2,frozen",
        "--hetero-module",
        "language:cp=2,dp=2,ep=2",
        "--hetero-edge",
        "vision->language",
        "--global-batch-size",
        "2",
        "--seq-length",
        "8",
        "--hidden-size",
        "1",
        "--dtype-bytes",
        "2",
    )
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["world_size"] == 6 and doc["placement"] == "disjoint"
    assert doc["modules"]["vision"]["frozen"] is True and doc["modules"]["language"]["ranks"] == "2-5"
    assert doc["ranks"][0]["modules"] == {"vision": {"tp": 0, "cp": 0, "dp": 0, "pp": 0, "ep": 0, "expt_tp": 0}}
    assert doc["ranks"][1]["modules"]["vision"]["tp"] == 1
    # language CP2·DP2 with ep2: rank 3 is cp1 dp0 ep1, rank 4 cp0 dp1 ep0.
    # (an MoE module's entries carry the expert-DP coordinate too)
    assert doc["ranks"][3]["modules"] == {
        "language": {"tp": 0, "cp": 1, "dp": 0, "pp": 0, "ep": 1, "expt_tp": 0, "expt_dp": 0}
    }
    assert doc["ranks"][4]["modules"] == {
        "language": {"tp": 0, "cp": 0, "dp": 1, "pp": 0, "ep": 0, "expt_tp": 0, "expt_dp": 1}
    }
    (edge,) = doc["edges"]
    assert (edge["src"], edge["dst"], edge["transform"], edge["factor"]) == ("vision", "language", "fan-out", 2)
    assert [t for t in edge["forward"] if t["dst"] == 3] == [
        {"src": 1, "dst": 3, "b0": 0, "b1": 1, "s0": 2, "s1": 4},
        {"src": 1, "dst": 3, "b0": 0, "b1": 1, "s0": 4, "s1": 6},
    ]
    assert edge["planned_bytes_forward"] == 16 * 2
    assert set(edge["modes"]) == {"direct", "hierarchical"}


def test_plan_world_size_flag(capsys) -> None:
    path = str(REPO / "examples/layouts/colocated_fan_out.yaml")
    rc, out, _ = _run(capsys, "plan", path, "--world-size", "4")
    assert rc == 0 and out.startswith("world size 4, placement colocated, boundary mode direct")
    rc, _, err = _run(capsys, "plan", path, "--world-size", "8")
    assert rc == 2
    assert "module vision: tp(2)*cp(1)*pp(1)*dp(2)=4 != ranks 0-7 (8)" in err


def test_plan_broken_layout_exits_2(capsys, tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(BROKEN)
    rc, out, err = _run(capsys, "plan", str(path))
    assert rc == 2
    assert out == ""
    assert err == f"megatron-hetero plan: invalid input: layout file {str(path)!r}: {BROKEN_MESSAGE}\n"
    rc, out, err = _run(capsys, "plan", str(path), "--json")
    assert (rc, out) == (2, "") and BROKEN_MESSAGE in err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--hetero-module", "vision:dp=8", "--hetero-module", "language:tp=2,pp=2,dp=3"], BROKEN_MESSAGE),
        (["--hetero-module", "vision:dp=2"], None),  # valid: exit 0
        ([], "no layout: give --hetero-layout FILE or one --hetero-module NAME:tp=..,dp=.. per module"),
        (
            ["--hetero-module", "vision:dp=2", "--hetero-edge", "vision->llm"],
            "edge vision->llm: unknown module 'llm'; modules are ['vision']",
        ),
        (
            ["examples/layouts/colocated_fan_in.yaml", "--global-batch-size", "4"],
            "edge vision->language: batch 4 is not divisible by source vision dp(8) (remainder 4)",
        ),
        (
            ["examples/layouts/colocated_equal_dp_cp.yaml", "--seq-length", "6"],
            "edge vision->language: sequence 6 is not divisible by 2*cp = 2*2 = 4 of destination language",
        ),
        (
            ["examples/layouts/colocated_fan_in.yaml", "--hidden-size", "0"],
            "edge vision->language: hidden must be a positive integer, got 0",
        ),
        (
            ["examples/layouts/colocated_fan_in.yaml", "--hetero-layout", "examples/layouts/homogeneous.yaml"],
            "give the layout file once: positional LAYOUT or --hetero-layout, not both",
        ),
        (
            ["examples/layouts/colocated_fan_in.yaml", "--hetero-placement", "disjoint"],
            "--hetero-placement disjoint contradicts placement colocated in examples/layouts/colocated_fan_in.yaml",
        ),
        (["examples/layouts/does_not_exist.yaml"], "cannot read layout file 'examples/layouts/does_not_exist.yaml'"),
    ],
)
def test_plan_invalid_input_messages(capsys, monkeypatch, argv, message) -> None:
    monkeypatch.chdir(REPO)
    rc, out, err = _run(capsys, "plan", *argv)
    if message is None:
        assert rc == 0 and err == ""
        return
    assert rc == 2, out
    assert out == ""
    assert err.startswith("megatron-hetero plan: invalid input: ")
    assert message in err
    assert err.count("\n") == 1  # one paragraph, no traceback


def test_argparse_errors_exit_2(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["plan", "--hetero-placement", "mixed", "--hetero-module", "a:dp=1"])
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2


def test_unexpected_failure_exits_1(capsys, monkeypatch) -> None:
    from megatron_hetero.cli import plan as cli_plan

    def boom(*_a, **_k):
        raise RuntimeError("boom")

    monkeypatch.setattr(cli_plan, "layout_text", boom)
    rc, out, err = _run(capsys, "plan", str(REPO / "examples/layouts/homogeneous.yaml"))
    assert rc == 1
    assert "RuntimeError: boom" in err


def test_plan_moe_expert_coordinates(capsys) -> None:
    """Every rank entry of an MoE module carries its expert coordinates (ep, expt_dp); text shows
    them as ep/edp and names the folding."""
    path = str(REPO / "examples" / "layouts" / "colocated_moe.yaml")
    rc, out, err = _run(capsys, "plan", path, "--json", "--num-experts", "8")
    assert rc == 0, err
    doc = json.loads(out)
    lang = doc["modules"]["language"]
    assert (lang["ep"], lang["expt_dp"], lang["num_experts"], lang["experts_per_rank"]) == (4, 2, 8, 2)
    assert "expt_dp" not in doc["modules"]["vision"]
    seen = set()
    for e in doc["ranks"]:
        c = e["modules"]["language"]
        assert {"ep", "expt_dp", "expt_tp"} <= set(c)
        assert c["ep"] == e["rank"] % 4 and c["expt_dp"] == e["rank"] // 4  # Megatron's folding: ep fastest
        seen.add((c["ep"], c["expt_dp"]))
        assert "expt_dp" not in e["modules"]["vision"]
    assert len(seen) == 8
    rc, out, err = _run(capsys, "plan", path, "--num-experts", "8")
    assert rc == 0, err
    assert (
        "experts folded as expt_tp(1) x ep(4) x expt_dp(2) over each stage's 8 ranks; 8 experts, 2 per EP rank" in out
    )
    assert "tp0 cp0 dp5 pp0 ep1 edp1" in out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--num-experts", "6"], "module language: ep(4) does not divide --num-experts 6 (6 % 4 = 2)"),
        (
            [
                "--hetero-module",
                "language:dp=8,ep=4",
                "--hetero-module",
                "vision:dp=8,ep=2",
                "--hetero-edge",
                "vision->language",
                "--num-experts",
                "4",
            ],
            "module vision: ep(2) expt_tp(1) > 1 but the module has no experts",
        ),
    ],
)
def test_plan_moe_invalid_exits_2(capsys, argv, message) -> None:
    if argv[0] == "--num-experts":
        argv = [str(REPO / "examples" / "layouts" / "colocated_moe.yaml")] + argv
    rc, out, err = _run(capsys, "plan", *argv)
    assert rc == 2 and message in err, err


RECOMPUTE = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split()
MEMORY_FLAGS = (
    "--hetero-placement disjoint --hetero-module vision:dp=2,ranks=0-1 --hetero-module language:tp=2,pp=2,ranks=2-5 "
    "--hetero-edge vision->language --memory --num-layers 4 --global-batch-size 8 --micro-batch-size 2"
).split()


@pytest.mark.parametrize(
    "features",
    [[], ["--bf16", "--use-distributed-optimizer", "--sequence-parallel"] + RECOMPUTE],
    ids=["fp32", "bf16-distopt-sp-recompute"],
)
def test_plan_memory_json_is_the_memory_model(capsys, features) -> None:
    """`plan --memory --json` gives every rank the memory model's prediction for train with the same
    flags (`planner.memory.predicted_rank_bytes`, which tests/ranks/test_memory_model.py holds against
    what train measures); the features change it the way they should (bf16 halves parameter bytes,
    the distributed optimizer shards Adam's state, SP and recompute shrink the activations: the next
    test)."""
    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.models.llava import LlavaSpec
    from megatron_hetero.planner.memory import StateFeatures, predicted_rank_bytes
    from megatron_hetero.layout.spec import Recompute

    rc, out, _ = _run(capsys, "plan", *MEMORY_FLAGS, *features, "--json")
    assert rc == 0
    ranks = json.loads(out)["ranks"]
    layout = layout_from_dict(
        {
            "placement": "disjoint",
            "modules": {"vision": {"dp": 2, "ranks": "0-1"}, "language": {"tp": 2, "pp": 2, "ranks": "2-5"}},
            "edges": ["vision -> language"],
        }
    )
    on = bool(features)
    spec = LlavaSpec(num_layers=4, bf16=on)
    state = StateFeatures(precision="bf16" if on else "fp32", distributed_optimizer=on)
    recompute = Recompute("full", "uniform", 1) if on else None
    for r, entry in enumerate(ranks):
        want = predicted_rank_bytes(layout, spec, r, state, 8, 2, on, recompute)
        assert (entry["predicted_state_bytes"], entry["predicted_activation_bytes"]) == (
            want["state"],
            want["activation"],
        )
        assert entry["predicted_state_bytes"] > 0 and entry["predicted_activation_bytes"] > 0


def test_plan_memory_features_move_the_prediction(capsys) -> None:
    def totals(*extra: str) -> list[tuple[int, int]]:
        rc, out, _ = _run(capsys, "plan", *MEMORY_FLAGS, *extra, "--json")
        assert rc == 0
        return [(e["predicted_state_bytes"], e["predicted_activation_bytes"]) for e in json.loads(out)["ranks"]]

    plain = totals()
    for (s0, a0), (s1, a1) in zip(plain, totals("--use-distributed-optimizer")):
        assert a1 == a0 and s1 <= s0  # vision DP2: Adam's 8 bytes per parameter over 2 ranks
    assert totals("--use-distributed-optimizer")[0][0] < plain[0][0]
    for (_, a0), (_, a1) in zip(plain, totals(*RECOMPUTE)):
        assert a1 < a0
    # bf16: half the parameter bytes, and 4 more optimizer bytes per parameter (the fp32 main weights)
    rc, out, _ = _run(capsys, "plan", *MEMORY_FLAGS, "--json")
    rc16, out16, _ = _run(capsys, "plan", *MEMORY_FLAGS, "--bf16", "--json")
    for e32, e16 in zip(json.loads(out)["ranks"], json.loads(out16)["ranks"]):
        for name, parts in e32["state"].items():
            assert 2 * e16["state"][name]["params"] == parts["params"]
            assert e16["state"][name]["optimizer"] == parts["optimizer"] * 12 // 8


def test_plan_memory_bad_recompute_exits_2(capsys) -> None:
    rc, _, err = _run(capsys, "plan", *MEMORY_FLAGS, "--recompute-method", "uniform")
    assert rc == 2 and "--recompute-granularity" in err


def test_plan_memory_peak_with_encoder_offload(capsys) -> None:
    """Colocated with --hetero-offload-encoder: the encoders' state leaves the device for the language
    phase, so the peak at one moment is below state + activation peak, by at most the encoders' state
    (`planner.memory.rank_peak_bytes`); without offload the two are equal."""
    flags = (
        "--hetero-module vision:dp=2 --hetero-module language:tp=2 --hetero-edge vision->language --memory "
        "--num-layers 4 --global-batch-size 8 --micro-batch-size 1 --encoder-num-layers 4 --json"
    ).split()
    rc, out, _ = _run(capsys, "plan", *flags)
    rc_off, out_off, _ = _run(capsys, "plan", *flags, "--hetero-offload-encoder")
    assert rc == rc_off == 0
    for plain, off in zip(json.loads(out)["ranks"], json.loads(out_off)["ranks"]):
        both = plain["predicted_state_bytes"] + plain["predicted_activation_bytes"]
        assert plain["predicted_peak_bytes"] == both
        enc = sum(plain["state"]["vision"].values())
        assert both - enc <= off["predicted_peak_bytes"] < both


def test_plan_shows_the_boundary_mode(capsys) -> None:
    path = REPO / "examples/layouts/disjoint_hierarchical.yaml"
    rc, out, _ = _run(capsys, "plan", str(path))
    assert rc == 0 and out.splitlines()[0] == "world size 8, placement disjoint, boundary mode hierarchical"
    rc, out, _ = _run(capsys, "plan", str(path), "--json")
    assert rc == 0 and json.loads(out)["boundary_mode"] == "hierarchical"
    rc, out, err = _run(
        capsys, "plan", str(REPO / "examples/layouts/colocated_fan_in.yaml"), "--hetero-boundary-mode", "hierarchical"
    )
    assert rc == 2 and "needs placement disjoint" in err and out == ""

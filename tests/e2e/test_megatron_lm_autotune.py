"""`pretrain_vlm.py --hetero-* --hetero-autotune` (docs/autotune.md, "Megatron-LM's scripts"): the patched
script moves colocated -> disjoint and back in the same processes through Megatron's own checkpoints,
and each move changes speed, not training: the losses after it equal those of a run of the patched
script that loads that checkpoint (Megatron's `--load`) under the layout moved to; back on the first
layout, every rank has the process groups, threads and file descriptors it had there before.

Needs a Megatron-LM tree (`MEGATRON_LM`, as `test_megatron_lm.py`, whose helpers and tree fixture this
file reuses); CPU/gloo, 2 forked ranks, the tiny LLaVA of `test_megatron_lm.py`, fp32. The decision is
forced (`autotune_probe.py`: switch to the disjoint layout, then measured slower, so the run goes back),
so the test checks the mechanics, not this CPU's timings; the real calibration and search of the
script's model run in `test_script_autotune_stays_and_says_why`.
"""

from __future__ import annotations

import json
import re

from test_megatron_lm import EDGE, REPO, VLM, _with, torchrun, trees  # noqa: F401
from test_megatron_lm import pytestmark as _megatron_lm_marks
from test_megatron_lm_checkpoints import at_iteration

pytestmark = list(_megatron_lm_marks)  # slow; skipped with the reason without MEGATRON_LM

ITERS, K = 9, 3  # windows: 1-3 colocated (then the switch), 4-6 disjoint (then back), 7-9 colocated
COLOC = ["--hetero-module", "vision:dp=2", "--hetero-module", "language:dp=2"] + EDGE
DISJOINT = [
    "--hetero-placement",
    "disjoint",
    "--hetero-module",
    "vision:dp=1",
    "--hetero-module",
    "language:dp=1",
] + EDGE
TARGET = {"placement": "disjoint", "modules": {"vision": {}, "language": {}}, "edges": ["vision -> language"]}
#: evaluation after training only (Megatron's --eval-interval past the run)
BASE = _with(VLM, eval_interval="100") + ["--save-interval", "100"]
PROBE_LINE = re.compile(r"autotune probe rank (\d+): (\{.*\})")
LOSS_TEXT = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.Ee+-]+) \|")


def printed_losses(out: str) -> dict[int, str]:
    """Each iteration's "lm loss" exactly as Megatron's log line prints it."""
    return {int(m.group(1)): m.group(2) for m in LOSS_TEXT.finditer(out)}


def assert_resumed_like(tuned: dict[int, str], resumed: dict[int, str], iterations: list[int]) -> float:
    """The autotuned run's losses at `iterations` (the lines of one run: the switches reset no average)
    against a run that resumed at `iterations[0] - 1`: its first line and those after its second are
    the same text; its second line averages its first two iterations (Megatron's first line does not
    reset the accumulators), undone here and within 1e-6 relative. Returns that difference."""
    first, second, *rest = iterations
    assert tuned[first] == resumed[first] and all(tuned[i] == resumed[i] for i in rest), (tuned, resumed)
    own = 2 * float(resumed[second]) - float(resumed[first])
    diff = abs(own - float(tuned[second])) / abs(float(tuned[second]))
    assert diff <= 1e-6, (tuned, resumed, own)
    return diff


def test_script_switch_and_back_equal_resuming_megatron_checkpoints(trees, tmp_path):  # noqa: F811
    save = tmp_path / "run"
    force = {"MEGATRON_FORK_PROBE": str(REPO / "tests" / "e2e" / "autotune_probe.py")}
    force["AUTOTUNE_FORCE"] = json.dumps({"target": TARGET, "measured_s": 1e-6})  # the switch measures slower
    tuned = torchrun(
        trees["patched"] / "pretrain_vlm.py",
        BASE
        + COLOC
        + ["--train-iters", str(ITERS), "--save", str(save)]
        + ["--hetero-autotune", "--autotune-steps", str(K), "--autotune-rounds", "1", "--autotune-skip-layers"],
        extra_env=force,
    )
    assert tuned.rc == 0, tuned.tail()
    probes = {int(m.group(1)): json.loads(m.group(2)) for m in PROBE_LINE.finditer(tuned.out)}
    assert sorted(probes) == [0, 1] and probes[0]["rounds"] == 1, tuned.tail()
    for rank, p in probes.items():  # back on the first layout: no process group, thread or descriptor left over
        first, _, back = p["sessions"]
        assert back == first, (rank, p["sessions"])
    for text in (
        "training with colocated layout vision tp1·pp1·dp2@0-1, language tp1·pp1·dp2@0-1, from iteration 0",
        "training with disjoint layout vision tp1·pp1·dp1@0-0, language tp1·pp1·dp1@1-1, from iteration 3",
        "training with colocated layout vision tp1·pp1·dp2@0-1, language tp1·pp1·dp2@0-1, from iteration 6",
        "autotune: switch: forced by the test",
    ):
        assert text in tuned.out, (text, tuned.tail())
    doc = json.loads((save / "autotune.json").read_text())
    (d,) = doc["decisions"]
    assert d["iteration"] == K and d["kept"] is False and d["to_layout"].startswith("disjoint"), d
    assert d["measured_after_s"] > 0
    assert "placement: colocated" in (save / "autotune-layout.yaml").read_text()
    got = printed_losses(tuned.out)
    assert sorted(got) == list(range(1, ITERS + 1)), tuned.tail()

    # the switch: the disjoint layout from Megatron's iteration-K checkpoint, resumed by a run of its own
    there = torchrun(
        trees["patched"] / "pretrain_vlm.py",
        BASE + DISJOINT + ["--train-iters", str(ITERS), "--load", str(at_iteration(save, K, tmp_path / "atK"))],
    )
    assert there.rc == 0, there.tail()
    # the way back: the colocated layout from the iteration-2K checkpoint the run went back through
    back = torchrun(
        trees["patched"] / "pretrain_vlm.py",
        BASE + COLOC + ["--train-iters", str(ITERS), "--load", str(at_iteration(save, 2 * K, tmp_path / "at2K"))],
    )
    assert back.rc == 0, back.tail()
    resumed_there, resumed_back = printed_losses(there.out), printed_losses(back.out)
    worst = max(
        assert_resumed_like(got, resumed_there, [K + 1, K + 2, 2 * K]),  # the disjoint window
        assert_resumed_like(got, resumed_back, [2 * K + 1, 2 * K + 2, ITERS]),  # back on colocated
    )
    print(f"autotuned {got}; resumed on disjoint {resumed_there}; on colocated {resumed_back}; {worst:.1e} off")
    print(f"after each session was built: {probes}")


def test_script_autotune_stays_and_says_why(trees, tmp_path):  # noqa: F811
    """The real round on the script's model: the window traced, one layer of each module timed at the
    other TP degrees, the cost model fitted and searched under the script's constraints; with a gain of
    100x asked for the run stays (the layout is the best predicted, or the best gains less) and says
    why, and the measuring changes no number of the training."""
    save = tmp_path / "run"
    iters = ["--train-iters", "6"]
    run = torchrun(
        trees["patched"] / "pretrain_vlm.py",
        BASE
        + COLOC
        + iters
        + ["--save", str(save), "--hetero-autotune", "--autotune-steps", "3", "--autotune-min-gain", "100"],
    )
    assert run.rc == 0, run.tail()
    (line,) = [s for s in run.out.splitlines() if s.startswith("autotune: stay")]
    assert "predicted" in line and "measured" in line, line  # why: the best layout's prediction vs the window
    doc = json.loads((save / "autotune.json").read_text())
    (d,) = doc["decisions"]
    assert d["from_layout"] == d["to_layout"] and d["kept"] is True and d["measured_after_s"] is None, d
    (cal,) = doc["calibration"]
    assert cal["steps_measured"] == 2 and cal["measured_step_s"] > 0, cal
    assert set(cal["factors"]) == {"encoder", "llm", "comm", "optimizer", "residual"}, cal
    plain = torchrun(trees["patched"] / "pretrain_vlm.py", BASE + COLOC + iters)
    assert plain.rc == 0, plain.tail()
    assert printed_losses(run.out) == printed_losses(plain.out), (run.out[-2000:], plain.out[-2000:])
    print(line)

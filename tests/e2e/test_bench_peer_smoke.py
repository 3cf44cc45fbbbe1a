"""`bench peer --quick` end to end (one round, 3 iterations per script run, one pretrain_vlm.py case
and one pretrain_mimo.py layout): the document's structure, ours and the unpatched pretrain_vlm.py
train the same thing (equal losses), and pretrain_mimo.py either runs or its stop is recorded with the
error it raised. Needs `MEGATRON_LM` (a Megatron-LM tree at core_v0.19.0); no timing asserts."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from megatron_hetero.bench import peer

TREE = os.environ.get("MEGATRON_LM")


def test_bench_peer_checks_its_input_before_running(tmp_path, monkeypatch):
    monkeypatch.delenv("MEGATRON_LM", raising=False)
    with pytest.raises(ValueError, match=r"needs \$MEGATRON_LM set to a Megatron-LM tree"):
        peer.run(tmp_path, iters=3)
    with pytest.raises(ValueError, match="needs more than 2 iterations per run"):
        peer.run(tmp_path, iters=2, tree=str(tmp_path))  # checked before the tree's scripts are looked at
    assert not list(tmp_path.iterdir())


def test_error_of_picks_the_last_exception_line():
    out = "[rank0]: Traceback\n[rank0]: RuntimeError: first\n[rank1]: StopIteration:  when instantiating X\nChildFailedError:"
    assert peer._error_of(out) == "StopIteration:  when instantiating X"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not TREE, reason="set MEGATRON_LM to a Megatron-LM tree at core_v0.19.0 to run this")
def test_bench_peer_quick(tmp_path):
    doc = peer.run(tmp_path, iters=3, rounds=1, quick=True)
    assert json.loads((tmp_path / "peer.json").read_text()) == json.loads(json.dumps(doc))
    assert [c["name"] for c in doc["cases"]] == [c.name for c in peer.cases(quick=True)]
    vlm, mimo = doc["cases"]
    assert vlm["peer"] == "pretrain_vlm.py" and vlm["losses_equal"] is True, (vlm["ours_losses"], vlm["peer_losses"])
    assert vlm["ours_ms"] > 0 and vlm["peer_ms"] > 0 and vlm["ratio"] == pytest.approx(vlm["peer_ms"] / vlm["ours_ms"])
    assert len(vlm["ours_losses"]) == 3
    assert mimo["peer"] == "pretrain_mimo.py" and mimo["ours_ms"] > 0
    if mimo["peer_ms"] is None:  # it stopped before training: the error it raised is recorded
        assert mimo["peer_error"] and mimo["ratio"] is None and mimo["losses_equal"] is None
    if importlib.util.find_spec("matplotlib") is not None:
        assert Path(tmp_path / "peer.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_launcher_finds_the_tree_of_a_script_inside_it(tmp_path):
    """examples/mimo/pretrain_mimo.py imports `examples.mimo...` from the tree's root: the launcher puts
    the nearest folder above the script that holds megatron/training on the path, not the script's own."""
    from megatron_hetero.megatron_lm.run import tree_of

    (tmp_path / "megatron" / "training").mkdir(parents=True)
    (tmp_path / "examples" / "mimo").mkdir(parents=True)
    assert tree_of(str(tmp_path / "examples" / "mimo" / "pretrain_mimo.py")) == str(tmp_path)
    assert tree_of(str(tmp_path / "pretrain_vlm.py")) == str(tmp_path)
    lone = tmp_path.parent / "lone"
    lone.mkdir(exist_ok=True)
    assert tree_of(str(lone / "script.py")) == str(lone)

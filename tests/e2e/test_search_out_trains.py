"""`search --out` writes a layout that `train` trains directly (both in one process; the training runs
on forked ranks): without model flags (a hardware preset as the cost source) and with them (the layout's
header carries the train command). The rest of `search` and the cli/ package: tests/pure/test_cli_search.py."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from megatron_hetero import cli
from megatron_hetero.planner.hardware_presets import DEFAULT_HARDWARE


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# ------------------------------------------------------------------------------------------
# search --out trains directly
# ------------------------------------------------------------------------------------------
def _train_line(path: Path) -> list[str]:
    """The `megatron-hetero train ...` command search writes into the layout's header."""
    line = next(x for x in path.read_text().splitlines() if x.startswith("# megatron-hetero train "))
    argv = shlex.split(line[2:])[1:]
    layout_at = argv.index("--hetero-layout") + 1
    argv[layout_at] = str(path.parent / argv[layout_at])
    return argv


@pytest.mark.timeout(300)
@pytest.mark.parametrize("extra", [[], ["--placements", "disjoint"]], ids=["best", "disjoint"])
def test_search_out_without_model_flags_trains(tmp_path, capsys, extra) -> None:
    """`search` with no model flags (a hardware preset as the cost source) writes L.yaml; `train
    --hetero-layout L.yaml --train-iters 1` with no model flags exits 0, and so does the train
    command written into L.yaml's header."""
    out = tmp_path / "L.yaml"
    rc, text, err = _run(
        capsys, "search", "--hardware", DEFAULT_HARDWARE, "--world-size", "4", "--out", str(out), *extra
    )
    assert rc == 0, err
    assert "global batch 8, micro-batch 1" in text and f"(written to {out})" in text
    doc = yaml.safe_load(out.read_text())
    assert doc["placement"] == ("disjoint" if extra else doc["placement"])
    log = tmp_path / "log.jsonl"
    rc, text, err = _run(capsys, "train", "--hetero-layout", str(out), "--train-iters", "1", "--log-jsonl", str(log))
    assert rc == 0, err[-3000:]
    assert "iteration    1/1 | lm loss" in text
    assert len(log.read_text().splitlines()) == 1
    if extra:
        rc, text, err = _run(capsys, *_train_line(out), "--train-iters", "1")
        assert rc == 0, err[-3000:]


@pytest.mark.timeout(300)
def test_search_out_with_model_flags_header_trains(tmp_path, capsys) -> None:
    """With model flags (and a measured-style profile), the header's train command carries them."""
    from megatron_hetero.planner import hardware as C

    lm = C.LayerModel(2e-3, 3e-11)
    prof = C.Profile(
        layers={"llm": lm, "encoder": C.LayerModel(1.5e-3, 3e-11), "default": lm},
        links={"intra": C.AlphaBeta(1e-3, 1e-9), "inter": C.AlphaBeta(1e-3, 1e-9)},
        devices_per_node=8,
        memory_bytes=1e9,
        host_bandwidth=5e9,
        source="synthetic",
    )
    prof_path = tmp_path / "profile.json"
    prof.save(prof_path)
    out = tmp_path / "best.yaml"
    model = ["--num-layers", "4", "--hidden-size", "32", "--encoder-tokens", "4", "--global-batch-size", "8"]
    rc, text, err = _run(capsys, "search", "--profile", str(prof_path), "--world-size", "4", *model, "--out", str(out))
    assert rc == 0, err
    argv = _train_line(out)
    assert argv[:1] == ["train"] and " ".join(model[:6]) in " ".join(argv)
    rc, text, err = _run(capsys, *argv, "--train-iters", "1")
    assert rc == 0, err[-3000:]
    assert "iteration    1/1 | lm loss" in text


@pytest.mark.timeout(300)
def test_search_segments_out_trains(tmp_path, capsys) -> None:
    """`search --segments 2 --out L.yaml` (the heteropipe DP) writes a layout of two language segments
    whose header's train command trains it."""
    out = tmp_path / "L.yaml"
    rc, text, err = _run(
        capsys, "search", "--hardware", DEFAULT_HARDWARE, "--world-size", "4", "--num-layers", "4",
        "--segments", "2", "--out", str(out),
    )  # fmt: skip
    assert rc == 0, err
    assert "heteropipe DP: layers 0-" in text and f"(written to {out})" in text
    doc = yaml.safe_load(out.read_text())
    assert list(doc["modules"]) == ["language_0", "language_1"] and doc["edges"] == ["language_0 -> language_1"]
    rc, text, err = _run(capsys, *_train_line(out), "--train-iters", "1")
    assert rc == 0, err[-3000:]
    assert "iteration    1/1 | lm loss" in text

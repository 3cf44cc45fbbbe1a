"""A checkpoint written before the megatron-core 0.19 upgrade (0.16.1's torch_dist format, with
`common.pt`; tests/fixtures/mcore_0_16_1_checkpoint) resumes on 0.19 with the losses the old code
printed, under its own layout and another one; a crafted `common.pt` in it is refused and does not
run. fp32, tiny model, world 2."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
import torch

from parity import max_loss_rel_diff

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "mcore_0_16_1_checkpoint"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
TP2_TO_DP2 = EXPECTED["layout"].replace("language: {tp: 2}", "language: {dp: 2}")


class Payload:
    """Unpickling this runs code: it writes `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('payload ran')",))


def _unpack(tmp_path: Path) -> Path:
    with tarfile.open(FIXTURE / "run.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    return tmp_path / "run"


def _train(tmp_path: Path, layout_text: str, *argv: str) -> int:
    from megatron_hetero.cli import main

    layout = tmp_path / "layout.yaml"
    layout.write_text(layout_text)
    return main(["train", "--hetero-layout", str(layout), *EXPECTED["flags"], "--train-iters", "4", *argv])


def _losses(path: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in path.read_text().splitlines()]


@pytest.mark.timeout(300)
def test_old_format_checkpoint_resumes_with_the_old_losses(tmp_path, capsys, megatron_compat):
    from megatron_hetero.cli import main

    root = _unpack(tmp_path)
    assert (root / "iter_0000002" / "language" / "common.pt").is_file()  # the 0.16.1 format
    assert json.loads((root / "iter_0000002" / "language" / "metadata.json").read_text())["common_backend"] == "torch"
    log = tmp_path / "resumed.jsonl"
    assert _train(tmp_path, EXPECTED["layout"], "--load", str(root), "--save", str(root), "--log-jsonl", str(log)) == 0
    assert _losses(log) == EXPECTED["losses_resumed_from_2"]  # bitwise: the old code's resume
    assert EXPECTED["losses_resumed_from_2"] == EXPECTED["losses_uninterrupted"][2:]
    # iteration 4 is in 0.19's format next to the old iteration 2; both inspect
    assert not (root / "iter_0000004" / "language" / "common.pt").exists()
    capsys.readouterr()
    assert main(["checkpoint", "inspect", str(root), "--iteration", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    shape = doc["modules"]["language"]["tensors"]["language.gpt.embedding.word_embeddings.weight"]["shape"]
    assert doc["iteration"] == 2 and shape == [32, 16]
    assert main(["checkpoint", "inspect", str(root)]) == 0
    assert "iteration 4, consumed samples 16" in capsys.readouterr().out


@pytest.mark.timeout(300)
def test_old_format_checkpoint_resumes_under_another_layout(tmp_path, megatron_compat):
    root = _unpack(tmp_path)
    log = tmp_path / "resumed.jsonl"
    assert _train(tmp_path, TP2_TO_DP2, "--load", str(root), "--log-jsonl", str(log)) == 0
    diff = max_loss_rel_diff(_losses(log), EXPECTED["losses_resumed_from_2"])
    print(f"0.16.1 checkpoint, language TP2 -> DP2 on 0.19: max relative loss difference {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.timeout(300)
def test_crafted_common_pt_in_an_old_checkpoint_is_refused_and_does_not_run(tmp_path, capsys, megatron_compat):
    """The manifest forged to match, so the weights-only read of common.pt is what stops it."""
    from megatron_hetero.checkpoint import files as cf
    from megatron_hetero.cli import main

    root = _unpack(tmp_path)
    marker = tmp_path / "PAYLOAD_RAN"
    target = root / "iter_0000002" / "vision" / "common.pt"
    torch.save({"state": Payload(marker)}, target)
    torch.load(target, weights_only=False)
    assert marker.read_text() == "payload ran"  # the crafted file is live
    marker.unlink()
    d = cf.iteration_dir(root, 2)
    cf.write_marker(root, 2, cf.write_train_state(d, json.loads((d / cf.STATE_FILE).read_text())))
    capsys.readouterr()
    assert _train(tmp_path, EXPECTED["layout"], "--load", str(root)) == 2
    err = capsys.readouterr().err
    assert f"checkpoint file {target} is refused: it names exec" in err, err
    assert main(["checkpoint", "inspect", str(root)]) == 2
    assert str(target) in capsys.readouterr().err
    assert not marker.exists()

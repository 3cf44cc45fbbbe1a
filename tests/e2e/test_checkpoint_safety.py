"""Checkpoint hardening (docs/checkpoints.md, Safety): crafted pickles in a checkpoint are refused and do not
run (with the manifest forged to match, so the restricted unpickler is what stops them, and without);
one flipped byte in any file is an error naming it; another hidden size names the tensor and both
shapes; a save killed at several points leaves the previous checkpoint as the one that loads, and
`--load` on a directory whose newest save is incomplete exits 2 unless `--load-fallback`. The layout
YAML is safe-loaded. fp32, tiny model, world 2."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import shutil
import signal
from pathlib import Path

import pytest
import yaml

from parity import losses, run_job
from megatron_hetero.training.setup import JobConfig

COLOC_TP2 = {
    "placement": "colocated",
    "modules": {"vision": {"dp": 2}, "language": {"tp": 2}},
    "edges": ["vision -> language"],
}
JOB = JobConfig(train_iters=3)


class Payload:
    """Unpickling this runs code: it writes `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('payload ran')",))


@pytest.fixture(scope="module")
def base(tmp_path_factory, megatron_compat):
    """A checkpoint directory with iterations 1 and 2 (marker: 2)."""
    root = tmp_path_factory.mktemp("safety") / "run"
    run_job(COLOC_TP2, 2, dataclasses.replace(JOB, train_iters=2, save=str(root), save_interval=1))
    return root


def _copy(base: Path, tmp_path: Path) -> Path:
    root = tmp_path / "ck"
    shutil.copytree(base, root)
    return root


def _reseal(root: Path, iteration: int = 2) -> None:
    """What a forger does after changing files: a new manifest, state checksum and marker."""
    from megatron_hetero.checkpoint import files as cf

    d = cf.iteration_dir(root, iteration)
    state = json.loads((d / cf.STATE_FILE).read_text())
    sha = cf.write_train_state(d, state)
    cf.write_marker(root, iteration, sha)


def _layout_file(tmp_path: Path) -> str:
    p = tmp_path / "l.yaml"
    p.write_text(yaml.safe_dump(COLOC_TP2))
    return str(p)


def _craft(root: Path, kind: str, marker: Path) -> Path:
    """Put a payload into one file of iteration 2; returns the file. Checks the payload is live: a
    plain unpickle of what was written runs it."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from megatron_hetero.checkpoint.safe_unpickle import common_state_key, read_dcp_metadata

    d = root / "iter_0000002"
    if kind == "common.pt":  # 0.16.1's common-state file, which Megatron 0.19 still reads first
        target = d / "language" / "common.pt"
        torch.save({"state": Payload(marker)}, target)
        torch.load(target, weights_only=False)
        assert marker.read_text() == "payload ran"  # the crafted file is live
        marker.unlink()
        return target
    md = read_dcp_metadata(d / "vision")
    if kind == "common state":  # 0.19's common-state bytes, appended to their .distcp and pointed at
        blob = io.BytesIO()
        torch.save([{"state": Payload(marker)}], blob)
        index = next(i for i in md.storage_data if i.fqn == common_state_key())
        target = d / "vision" / md.storage_data[index].relative_path
        offset = target.stat().st_size
        with target.open("ab") as f:
            f.write(blob.getvalue())
        md.storage_data[index] = _StorageInfo(target.name, offset, len(blob.getvalue()))
        torch.load(io.BytesIO(blob.getvalue()), weights_only=False)
    elif kind == ".metadata":  # the real metadata, a payload nested inside
        md.storage_meta.modules = [Payload(marker)]
    else:  # "object entry": one tensor turned into a pickled object read by torch.load(weights_only=False)
        key = next(k for k in md.state_dict_metadata if k != common_state_key())
        md.state_dict_metadata[key] = BytesStorageMetadata()
        blob = io.BytesIO()
        torch.save(Payload(marker), blob)
        (d / "vision" / "__9_0.distcp").write_bytes(blob.getvalue())
        torch.load(io.BytesIO(blob.getvalue()), weights_only=False)
    (d / "vision" / ".metadata").write_bytes(pickle.dumps(md))
    if kind == ".metadata":
        pickle.loads((d / "vision" / ".metadata").read_bytes())
    assert marker.read_text() == "payload ran"  # the crafted file is live
    marker.unlink()
    return target if kind == "common state" else d / "vision" / ".metadata"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("forged", [True, False], ids=["manifest forged", "manifest stale"])
@pytest.mark.parametrize("kind", [".metadata", "common state", "common.pt", "object entry"])
def test_crafted_pickle_is_refused_and_does_not_run(base, tmp_path, capsys, kind, forged):
    from megatron_hetero.cli import main

    root = _copy(base, tmp_path)
    marker = tmp_path / "PAYLOAD_RAN"
    target = _craft(root, kind, marker)
    if forged:
        _reseal(root)
    layout = _layout_file(tmp_path)
    assert main(["train", "--hetero-layout", layout, "--train-iters", "3", "--load", str(root)]) == 2
    err = capsys.readouterr().err
    if forged:  # past the manifest: the restricted unpickler refuses it
        assert f"checkpoint file {target} is refused" in err, err
        want = {
            ".metadata": "it names builtins.exec",
            "common state": "is refused: its common state (bytes ",
            "common.pt": "it names exec",
            "object entry": "is a BytesStorageMetadata, not a tensor",
        }[kind]
        assert want in err and (kind != "common state" or "it names exec" in err), err
    # the common state's payload changed its .distcp and the .metadata pointing at it: a stale manifest names either
    changed = [target, target.parent / ".metadata"] if kind == "common state" else [target]
    if not forged:
        assert any(f"checkpoint file {p} is corrupt" in err for p in changed) or "not in the manifest" in err, err
    assert main(["checkpoint", "inspect", str(root)]) == 2
    err = capsys.readouterr().err
    assert any(str(p) in err for p in (changed if not forged else [target])), err
    if forged:  # a crafted file that matches its manifest is not damage to fall back from: refused
        assert (
            main(["train", "--hetero-layout", layout, "--train-iters", "3", "--load", str(root), "--load-fallback"])
            == 2
        )
    assert not marker.exists()


@pytest.mark.timeout(300)
def test_ranks_read_through_the_restricted_unpickler(base, tmp_path, monkeypatch):
    """Past the launcher's checks (skipped here), the ranks' own reads refuse a crafted `.metadata`;
    a sharded-object file added (and forged into the manifest) is never read."""
    from megatron_hetero.runtime.launcher import RankFailure
    from megatron_hetero.checkpoint import loadable

    root = _copy(base, tmp_path)
    marker = tmp_path / "PAYLOAD_RAN"
    d = root / "iter_0000002"
    torch_save_payload = io.BytesIO()
    import torch

    torch.save(Payload(marker), torch_save_payload)
    (d / "vision" / "vision.model.some._extra_state.pt").write_bytes(torch_save_payload.getvalue())
    from megatron_hetero.checkpoint.safe_unpickle import read_dcp_metadata

    md = read_dcp_metadata(d / "rng")
    md.storage_meta.modules = [Payload(marker)]
    (d / "rng" / ".metadata").write_bytes(pickle.dumps(md))
    _reseal(root)
    monkeypatch.setattr(loadable, "read_torch_files", lambda d, state: None)
    with pytest.raises(RankFailure) as info:
        run_job(COLOC_TP2, 2, dataclasses.replace(JOB, load=str(root)))
    assert f"checkpoint file {d / 'rng' / '.metadata'} is refused: it names builtins.exec" in str(info.value)
    assert not marker.exists()


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.timeout(300)
def test_one_flipped_byte_in_any_file_names_it(base, tmp_path):
    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.checkpoint.loadable import check_loadable
    from megatron_hetero.config.job import JobDraft

    layout = layout_from_dict(COLOC_TP2, world_size=2)
    files = sorted(p.relative_to(base) for p in base.rglob("*") if p.is_file() and "iter_0000001" not in p.parts)
    kinds = {p.name if not p.name.endswith(".distcp") else ".distcp" for p in files}
    assert kinds == {
        ".distcp",
        ".metadata",
        "metadata.json",
        "layout.yaml",
        "train_state.json",
        "latest_checkpointed_iteration.txt",
    }
    for rel in files:
        root = tmp_path / f"flip{files.index(rel)}"
        shutil.copytree(base, root)
        _flip(root / rel)
        with pytest.raises(ValueError) as info:
            check_loadable(root, JobDraft(layout, JOB))
        assert str(root / rel) in str(info.value), (rel, str(info.value))
        shutil.rmtree(root)
    print(f"{len(files)} files, each with one flipped byte: an error naming it")


def test_no_pickled_object_is_read_and_the_common_state_must_be_empty(base, tmp_path):
    """Past the metadata checks: the load strategy refuses to be asked for a sharded object, the
    reader refuses any bytes read (torch would decode it with weights_only=False), and a common state
    that decodes safely but holds values is refused (ours is always empty)."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    from megatron_hetero.checkpoint import safe_unpickle as su

    d = base / "iter_0000002" / "vision"
    with pytest.raises(ValueError, match=r"asked for pickled objects \['vision.x'\]; this build loads none"):
        su.strategy().load({"x": ShardedObject("vision.x", None, (1,), (0,))}, d)
    reader = su._reader_class()(str(d))
    md = reader.read_metadata()
    reader.set_up_storage_reader(md, True)
    key = su.common_state_key()
    index = next(i for i in md.storage_data if i.fqn == key)
    size = torch.Size([0])
    item = ReadItem(LoadItemType.BYTE_IO, MetadataIndex(key), size, index, size, size)
    with pytest.raises(ValueError, match=r"asked for pickled objects \['common_state/shard_0_1'\]"):
        reader.read_data(LoadPlan([item]), None)
    assert su.read_common_state(d) == {}
    folder = tmp_path / "vision"
    shutil.copytree(d, folder)
    blob = io.BytesIO()
    torch.save([{"args": {"async_save": True}}], blob)
    with (folder / md.storage_data[index].relative_path).open("ab") as f:
        offset = f.tell()
        f.write(blob.getvalue())
    md.storage_data[index] = _StorageInfo(md.storage_data[index].relative_path, offset, len(blob.getvalue()))
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(ValueError, match=r"is refused: its common state is not empty \(\{'args'"):
        su.read_common_state(folder)


def test_damaged_marked_checkpoint_falls_back_only_when_asked(base, tmp_path):
    from megatron_hetero.checkpoint.files import select_checkpoint

    root = _copy(base, tmp_path)
    bad = root / "iter_0000002" / "language" / "__0_0.distcp"
    _flip(bad)
    with pytest.raises(
        ValueError,
        match=r"__0_0\.distcp is corrupt.*pass --load-fallback to resume from .*"
        r"\(iter_0000001\)",
    ):
        select_checkpoint(root)
    d, state, note = select_checkpoint(root, fallback=True)
    assert d == root / "iter_0000001" and state["iteration"] == 1
    assert f"{bad} is corrupt" in note and "--load-fallback: resuming from iteration 1" in note


@pytest.mark.timeout(300)
def test_other_hidden_size_names_the_tensor_and_both_shapes(base, tmp_path):
    """The train state claims this job's sizes (forged), the tensors are of hidden size 64: the ranks
    name the tensor and both shapes before reading any tensor data."""
    from megatron_hetero.models.llava import LlavaSpec
    from megatron_hetero.runtime.launcher import RankFailure

    root = _copy(base, tmp_path)
    path = root / "iter_0000002" / "train_state.json"
    state = json.loads(path.read_text())
    state["model"]["hidden_size"] = 32
    path.write_text(json.dumps(state))
    _reseal(root)
    with pytest.raises(RankFailure) as info:
        run_job(COLOC_TP2, 2, dataclasses.replace(JOB, load=str(root), spec=LlavaSpec(hidden_size=32)))
    import re

    m = re.search(r"tensor (language\.\S+) is (\d+)x64 in the checkpoint, (\d+)x32 in this model", str(info.value))
    assert m and m.group(2) == m.group(3), str(info.value)[-2000:]
    print(m.group(0))


KILL_POINTS = ["saved language", "files written", "state written", "renamed"]


@pytest.mark.timeout(600)
def test_killed_save_leaves_the_previous_checkpoint(base, tmp_path, monkeypatch, capsys):
    """Resume from 2 and save 3, SIGKILLed at several points of the save (each rank that reaches the
    point dies there; rank 0 alone reaches the last two): the marker stays on 2. Before the rename,
    `--load` exits 2 saying the newest save is incomplete and `--load-fallback` resumes from 2 (and the
    next save of 3 completes); after it, the complete iter_3 is newer than the marker, which decides.
    Both resumes give the same loss (the same iteration-2 state)."""
    from megatron_hetero.cli import main
    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.runtime.launcher import RankFailure
    from megatron_hetero.checkpoint import save_load as ckpt
    from megatron_hetero.checkpoint import files as cf
    from megatron_hetero.checkpoint.loadable import check_loadable
    from megatron_hetero.config.job import JobDraft

    layout = layout_from_dict(COLOC_TP2, world_size=2)
    roots = {}
    for point in KILL_POINTS:
        root = tmp_path / point.replace(" ", "_")
        shutil.copytree(base, root)

        def die(p, point=point):
            if p == point:
                os.kill(os.getpid(), signal.SIGKILL)

        monkeypatch.setattr(ckpt, "_reached", die)  # inherited by the forked ranks
        with pytest.raises(RankFailure, match="died without reporting"):
            run_job(COLOC_TP2, 2, dataclasses.replace(JOB, load=str(root), save=str(root)))
        monkeypatch.undo()
        assert cf.read_tracker(root) == 2, point
        roots[point] = root
        if point != "renamed":
            assert (root / "iter_0000003.saving").is_dir() and not (root / "iter_0000003").exists()
            with pytest.raises(
                ValueError,
                match=r"the newest save, .*iter_0000003\.saving, is incomplete.*"
                r"pass --load-fallback",
            ):
                check_loadable(root, JobDraft(layout, JOB))
            assert check_loadable(root, JobDraft(layout, dataclasses.replace(JOB, load_fallback=True))) == 2
        else:
            assert (root / "iter_0000003" / cf.STATE_FILE).is_file()
            assert check_loadable(root, JobDraft(layout, JOB)) == 2
    capsys.readouterr()
    lay = _layout_file(tmp_path)
    incomplete = roots["files written"]
    assert main(["train", "--hetero-layout", lay, "--train-iters", "3", "--load", str(incomplete)]) == 2
    err = capsys.readouterr().err
    assert "iter_0000003.saving, is incomplete" in err and "--load-fallback" in err
    out = tmp_path / "fallback.jsonl"
    assert (
        main(
            [
                "train",
                "--hetero-layout",
                lay,
                "--train-iters",
                "3",
                "--load",
                str(incomplete),
                "--load-fallback",
                "--save",
                str(incomplete),
                "--log-jsonl",
                str(out),
            ]
        )
        == 0
    )
    assert "--load-fallback: resuming from iteration 2" in capsys.readouterr().err
    fell_back = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["iteration"] for r in fell_back] == [3]
    assert cf.read_tracker(incomplete) == 3 and not list(incomplete.glob("*.saving"))
    cf.verify_manifest(*cf.read_train_state(incomplete))
    renamed = losses(run_job(COLOC_TP2, 2, dataclasses.replace(JOB, load=str(roots["renamed"]))))
    assert renamed == [fell_back[0]["loss"]]


def test_layout_yaml_is_safe_loaded_and_unknown_keys_named(tmp_path):
    from megatron_hetero.layout.yaml_io import load_layout

    marker = tmp_path / "YAML_RAN"
    bad = tmp_path / "evil.yaml"
    bad.write_text(f"placement: !!python/object/apply:os.system ['touch {marker}']\nmodules: {{}}\nedges: []\n")
    with pytest.raises(ValueError, match="is not valid YAML"):
        load_layout(bad)
    assert not marker.exists()
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text(yaml.safe_dump({**COLOC_TP2, "modules": {"vision": {"dpp": 2}, "language": {}}}))
    with pytest.raises(ValueError, match=r"module vision: unknown keys \['dpp'\]"):
        load_layout(unknown)

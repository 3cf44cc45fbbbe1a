"""A dataset runs no code unless the user passes --trust-dataset-code.

Each crafted copy of the digits dataset names code one way (a Python file in `.nv-meta`, a
`__function__`, a `__module__` outside megatron.energon, `.pyd` and `.pth` members that webdataset
would unpickle / torch.load); every one of them writes a marker file when its code runs. Without the
flag `train --data-path` exits 2 naming the file, the key and the flag, and the marker never appears;
with it the same dataset trains (the marker appears: the code ran because the user said so). The
digits dataset as built trains without the flag. A member that slips past the inspection (an index
that does not list it) is refused when it is decoded: webdataset's secure mode is on.
"""

from __future__ import annotations

import io
import json
import pickle
import shutil
import tarfile
from pathlib import Path

import pytest

from megatron_hetero.data.dataset_trust import (
    CODE_EXTENSIONS,
    TRUST_FLAG,
    UntrustedDataset,
    check_dataset,
    inspect_dataset,
    npy_cache_findings,
)
from megatron_hetero.data.digits import (
    digits_sample_args,
    digits_split_parts,
    energon_prepare,
    write_digits_dataset,
)

TRAIN = [
    "train",
    "--hetero-placement",
    "colocated",
    "--hetero-module",
    "vision:dp=1",
    "--hetero-module",
    "language:tp=1",
    "--hetero-edge",
    "vision->language",
    "--seq-length",
    "16",
    "--global-batch-size",
    "2",
    "--train-iters",
    "1",
]
CAPTION_FROM = "the {} caption"


class _RunsCode:
    """Unpickles as `CAPTION` after writing `marker` (what a malicious pickled member does)."""

    def __init__(self, marker: Path, caption: str) -> None:
        self.marker, self.caption = str(marker), caption

    def __reduce__(self):
        return eval, (f"__import__('pathlib').Path({self.marker!r}).write_text('ran') and {self.caption!r}",)


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("digits") / "ds"
    write_digits_dataset(out)
    return out


def _copy(digits: Path, tmp_path: Path) -> tuple[Path, Path]:
    ds = tmp_path / "ds"
    shutil.copytree(digits, ds)
    return ds, tmp_path / "marker"


def _python_file(ds: Path, marker: Path) -> str:
    meta = ds / ".nv-meta"
    (meta / "sample_loader.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "def sample_loader(raw):\n    return dict(image=raw['png'], caption=raw['txt'])\n"
        "def part_filter(part):\n    return part in ('png', 'txt')\n"
    )
    (meta / "dataset.yaml").write_text(
        "sample_type:\n  __module__: megatron.energon\n  __class__: CaptioningSample\n"
        "sample_loader: sample_loader.py:sample_loader\npart_filter: sample_loader.py:part_filter\n"
    )
    return "sample_loader"


def _function(ds: Path, marker: Path) -> str:
    (ds / ".nv-meta" / "dataset.yaml").write_text(
        "sample_type:\n  __module__: megatron.energon\n  __function__: CaptioningSample\n"
        "field_map:\n  image: png\n  caption: txt\n"
    )
    return "__function__"


def _foreign_module(ds: Path, marker: Path) -> str:
    (ds / "evil_samples.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from megatron.energon import CaptioningSample\n"
    )
    (ds / ".nv-meta" / "dataset.yaml").write_text(
        "sample_type:\n  __module__: evil_samples\n  __class__: CaptioningSample\n"
        "field_map:\n  image: png\n  caption: txt\n"
    )
    return "__module__"


def _members(ext: str):
    def craft(ds: Path, marker: Path) -> str:
        """Every caption member `.txt` becomes `.EXT`, a pickle (torch.save for .pth) that writes the
        marker when loaded; energon's index is rebuilt with the caption read from `.EXT`."""
        import torch

        for tar in sorted(ds.rglob("*.tar")):
            with tarfile.open(tar) as tf:
                members = [(m, tf.extractfile(m).read()) for m in tf if m.isfile()]
            with tarfile.open(tar, "w") as tf:
                for m, data in members:
                    if m.name.endswith(".txt"):
                        payload = _RunsCode(marker, data.decode())
                        if ext == "pth":
                            buf = io.BytesIO()
                            torch.save(payload, buf)
                            data = buf.getvalue()
                        else:
                            data = pickle.dumps(payload)
                        m = tarfile.TarInfo(m.name[:-3] + ext)
                        m.size = len(data)
                    tf.addfile(m, io.BytesIO(data))
        energon_prepare(ds, digits_split_parts(), digits_sample_args(caption_ext=ext))
        return f"member *.{ext}"

    return craft


CASES = {
    "python_file": _python_file,
    "function": _function,
    "foreign_module": _foreign_module,
    "pyd_member": _members("pyd"),
    "pth_member": _members("pth"),
}
#: the cases energon (with trust) really runs; `__function__` on a sample type is not one it can use
RUNS_WITH_TRUST = ("python_file", "foreign_module", "pyd_member", "pth_member")


@pytest.mark.parametrize("case", sorted(CASES))
def test_inspection_names_file_and_key(case, digits, tmp_path):
    ds, marker = _copy(digits, tmp_path)
    key = CASES[case](ds, marker)
    found = inspect_dataset(ds)
    assert [f.key for f in found if f.key.endswith(key)], found
    with pytest.raises(UntrustedDataset) as err:
        check_dataset(ds, trust=False)
    msg = str(err.value)
    assert key in msg and TRUST_FLAG in msg and str(ds) in msg
    want_file = "index.sqlite" if key.startswith("member") else "dataset.yaml"
    assert want_file in msg
    assert check_dataset(ds, trust=True) == found  # trusted: the same findings, no error
    assert not marker.exists()  # reading the dataset as data ran nothing


def test_digits_and_metadataset(digits, tmp_path):
    assert inspect_dataset(digits) == []
    ds, marker = _copy(digits, tmp_path)
    _python_file(ds, marker)
    meta = tmp_path / "blend.yaml"  # a metadataset referencing the crafted dataset and the clean one
    meta.write_text(
        "__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n    blend:\n"
        f"      - weight: 1\n        path: ds\n      - weight: 1\n        path: {digits}\n"
    )
    found = inspect_dataset(meta)
    assert {f.key for f in found} == {"sample_loader", "part_filter"}
    assert all(f.file == str((ds / ".nv-meta" / "dataset.yaml").resolve()) for f in found)
    meta.write_text("__module__: os\n__class__: system\n")
    assert [f.key for f in inspect_dataset(meta)] == ["__module__"]
    meta.write_text("!!python/object/apply:os.system ['true']\n")
    with pytest.raises(UntrustedDataset, match="not plain YAML"):
        inspect_dataset(meta)


def test_code_extensions_are_webdatasets_unsafe_decoders():
    """The member extensions refused are exactly those webdataset's secure mode refuses to decode."""
    import webdataset.autodecode as ad
    import webdataset.utils

    unsafe = set()
    old = webdataset.utils.enforce_security
    webdataset.utils.enforce_security = True
    try:
        for ext, fn in ad.decoders.items():
            try:
                fn(b"\x80\x04N.")  # pickle of None
            except ValueError as exc:
                if "security" in str(exc):
                    unsafe.add(ext)
            except Exception:  # noqa: BLE001 - other formats fail on these bytes, which is not refusal
                pass
    finally:
        webdataset.utils.enforce_security = old
    assert unsafe == set(CODE_EXTENSIONS)


def test_npy_cache_that_unpickles_is_found(tmp_path):
    import numpy as np

    np.save(tmp_path / "plain.npy", np.arange(4))
    assert npy_cache_findings([tmp_path]) == []
    (tmp_path / "doc-document_index.npy").write_bytes(pickle.dumps(_RunsCode(tmp_path / "m", "x")))
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    assert sorted(f.value for f in npy_cache_findings([tmp_path])) == ["doc-document_index.npy", "obj.npy"]
    assert not (tmp_path / "m").exists()


@pytest.mark.timeout(600)
def test_train_refuses_untrusted_and_runs_trusted(digits, tmp_path, capfd, monkeypatch):
    """Each case: exit 2 naming the file, the key and the flag, no marker; the cases energon runs
    train with --trust-dataset-code (and the marker shows their code ran); the digits train as they
    are without the flag."""
    from megatron_hetero.cli import main

    for case in sorted(CASES):
        ds, marker = _copy(digits, tmp_path / case)
        key = CASES[case](ds, marker)
        monkeypatch.syspath_prepend(str(ds))  # where `evil_samples` can be imported from
        rc = main([*TRAIN, "--data-path", str(ds)])
        err = capfd.readouterr().err
        assert rc == 2, (case, err[-2000:])
        assert key in err and TRUST_FLAG in err and str(ds) in err, err
        last = err.strip().splitlines()[-1]  # the line a user reads: the cause and what to do
        assert last.startswith(f"--data-path {ds} refused: it names code (") and TRUST_FLAG in last, last
        assert not marker.exists(), case
        if case in RUNS_WITH_TRUST:
            rc = main([*TRAIN, "--data-path", str(ds), TRUST_FLAG])
            out, err = capfd.readouterr()
            assert rc == 0, (case, err[-3000:])
            assert marker.read_text() == "ran", case
            assert f"{TRUST_FLAG}: running the code dataset {ds} names" in out and key in out, out[-2000:]
    assert main([*TRAIN, "--data-path", str(digits)]) == 0
    out = capfd.readouterr().out
    assert " iteration    1/1 | lm loss" in out and TRUST_FLAG not in out


def test_secure_decoding_refuses_a_member_the_inspection_missed(digits, tmp_path, monkeypatch):
    """With the inspection switched off (standing for a member it did not see), opening the crafted
    `.pyd` dataset still runs nothing: webdataset's secure mode refuses to unpickle the member."""
    from megatron_hetero.data import energon_data

    ds, marker = _copy(digits, tmp_path)
    _members("pyd")(ds, marker)
    monkeypatch.setattr(energon_data, "check_dataset", lambda path, trust: [])
    n, it = energon_data.open_split(str(ds), "train")
    with pytest.raises(Exception) as err:  # webdataset's DecodingError, raised from the ValueError below
        energon_data._next(it)
    chain, exc = [], err.value
    while exc is not None:
        chain.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    assert any("Unpickling is not allowed for security reasons" in c for c in chain), chain
    assert not marker.exists()


def test_data_check_command(digits, tmp_path, capsys):
    from megatron_hetero.cli import main

    assert main(["data", "check", str(digits)]) == 0
    assert "names no code" in capsys.readouterr().out
    ds, marker = _copy(digits, tmp_path)
    _python_file(ds, marker)
    assert main(["data", "check", str(ds)]) == 2
    assert "sample_loader" in capsys.readouterr().err
    assert main(["data", "check", str(ds), TRUST_FLAG]) == 0
    assert "sample_loader.py:sample_loader" in capsys.readouterr().out
    assert main(["data", "check", str(ds), "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert {f["key"] for f in doc["findings"]} == {"sample_loader", "part_filter"}

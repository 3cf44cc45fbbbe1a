"""Which parts of a dataset would run code, found by reading its files as data (no torch, no energon).

A dataset downloaded from a hub is input, not code, until the user says otherwise. Three ways a
dataset can run code when Megatron's data stack opens it:

  * energon's `.nv-meta/*.yaml` names a Python file: `sample_loader: FILE.py:FUNC` and
    `part_filter: FILE.py:FUNC` are loaded with `compile`/`eval` by energon's `ModuleLoader` on every
    rank that opens the dataset;
  * energon's typed YAML (`__module__` + `__class__` / `__function__`) imports any module and calls
    what it names: `__module__` outside `megatron.energon`, and `__function__` anywhere, name code;
  * sample members whose extension webdataset's default decoders unpickle (`.pkl`, `.pickle`, `.pyd`:
    `pickle.loads`) or `torch.load` (`.pth`, `weights_only=False` by default).

Megatron-LM's GPT data path has a fourth: `numpy.load(..., allow_pickle=True)` on the index cache
(`*.npy` under `<prefix>/cache/` and `--data-cache-path`) falls back to `pickle.load` for a file that is
not in numpy's format; `npy_cache_findings` reads those headers as data.

`inspect_dataset(path)` reads an energon dataset folder (every YAML in `.nv-meta/`, the member names
in `.nv-meta/index.sqlite`, or the tar headers where there is no index) or a metadataset YAML (and,
recursively, every dataset it references by `path:`) with `yaml.safe_load` and returns the findings.
`check_dataset(path, trust=...)` raises `UntrustedDataset` (a ValueError: exit 2) naming each file,
key and value, and the flag that allows it (`--trust-dataset-code`); with `trust=True` it returns the
findings, which the run prints once on rank 0. `secure_decoding(trust)` sets webdataset's own secure
mode, so a member that slips past the inspection (an index that lies about its members) is refused
when it is decoded.
"""

from __future__ import annotations

import sqlite3
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Union

import yaml

TRUST_FLAG = "--trust-dataset-code"
#: member extensions webdataset's default decoders hand to pickle.loads or torch.load
CODE_EXTENSIONS = {"pkl": "pickle.loads", "pickle": "pickle.loads", "pyd": "pickle.loads", "pth": "torch.load"}
#: YAML keys whose string value energon loads as `FILE.py:FUNC` and runs
LOADER_KEYS = ("sample_loader", "part_filter")
ENERGON_MODULE = "megatron.energon"
META_DIR = ".nv-meta"


@dataclass(frozen=True)
class Finding:
    """One place in a dataset that would run code: `file` (the YAML, index or shard), `key` (the YAML
    key path or `member *.EXT`), `value` (what it names) and `why` (what would run it)."""

    file: str
    key: str
    value: str
    why: str

    def line(self) -> str:
        return f"{self.file}: {self.key}: {self.value} ({self.why})"


class UntrustedDataset(ValueError):
    """A dataset that would run code, opened without `--trust-dataset-code`."""


def _yaml_findings(doc: Any, file: str, where: str = "") -> Iterator[Finding]:
    """Findings in one parsed YAML document (walked recursively)."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            key = f"{where}.{k}" if where else str(k)
            if k in LOADER_KEYS and isinstance(v, str):
                yield Finding(file, key, v, "a Python file energon loads and runs")
            elif k == "__function__":
                yield Finding(file, key, str(v), "a function energon's typed YAML calls")
            elif k == "__module__" and not (v == ENERGON_MODULE or str(v).startswith(ENERGON_MODULE + ".")):
                yield Finding(file, key, str(v), f"a module outside {ENERGON_MODULE} energon's typed YAML imports")
            else:
                yield from _yaml_findings(v, file, key)
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _yaml_findings(v, file, f"{where}[{i}]")


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:  # python tags (!!python/object) and broken files alike
        raise UntrustedDataset(f"{path}: not plain YAML data ({type(exc).__name__}: {exc})") from None


def _referenced_paths(doc: Any, base: Path) -> Iterator[Path]:
    """Every `path:` string of a metadataset, resolved against the metadataset's folder."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            if k == "path" and isinstance(v, str):
                p = Path(v)
                yield p if p.is_absolute() else base / p
            else:
                yield from _referenced_paths(v, base)
    elif isinstance(doc, list):
        for v in doc:
            yield from _referenced_paths(v, base)


def _member_extensions(folder: Path) -> tuple[str, set[str]]:
    """(where they were read, the set of sample part names) of a dataset folder: energon's index when
    present (fast), else every tar's headers (no member content is read)."""
    index = folder / META_DIR / "index.sqlite"
    if index.is_file():
        con = sqlite3.connect(f"file:{index}?mode=ro", uri=True)
        try:
            return str(index), {r[0] for r in con.execute("SELECT DISTINCT part_name FROM sample_parts")}
        except sqlite3.Error as exc:
            raise UntrustedDataset(f"{index}: unreadable energon index ({exc})") from None
        finally:
            con.close()
    parts: set[str] = set()
    for tar in sorted(folder.rglob("*.tar")):
        with tarfile.open(tar) as tf:
            parts.update(m.name.split("/")[-1].split(".", 1)[-1] for m in tf if m.isfile())
    return str(folder / "*.tar"), parts


def _member_findings(folder: Path) -> Iterator[Finding]:
    where, parts = _member_extensions(folder)
    for ext in sorted({p.rsplit(".", 1)[-1].lower() for p in parts} & CODE_EXTENSIONS.keys()):
        yield Finding(
            where,
            f"member *.{ext}",
            f"sample members named .{ext}",
            f"webdataset decodes them with {CODE_EXTENSIONS[ext]}",
        )


def _inspect(path: Path, seen: set[Path]) -> Iterator[Finding]:
    path = path.resolve()
    if path in seen:
        return
    seen.add(path)
    if path.is_file():  # a metadataset (or a dataset YAML given directly)
        doc = _read_yaml(path)
        yield from _yaml_findings(doc, str(path))
        for ref in _referenced_paths(doc, path.parent):
            yield from _inspect(ref, seen)
        return
    meta = path / META_DIR
    if not meta.is_dir():
        return  # not an energon dataset: energon itself refuses to open it
    for y in sorted([*meta.glob("*.yaml"), *meta.glob("*.yml")]):
        yield from _yaml_findings(_read_yaml(y), str(y))
    yield from _member_findings(path)


def inspect_dataset(path: Union[str, Path]) -> list[Finding]:
    """Every place in the energon dataset (folder) or metadataset (YAML file) at `path`, and in the
    datasets a metadataset references, that would run code (see the module docstring)."""
    return list(_inspect(Path(path), set()))


def refusal(flag: str, path: Union[str, Path], findings: Iterable[Finding]) -> str:
    """The refusal: what in the dataset names code, one line each, then one line with the cause and
    what to do (the line a user reads last)."""
    found = list(findings)
    lines = "\n".join(f"  {f.line()}" for f in found)
    return (
        f"{flag} {path}: the dataset would run code on every rank that opens it:\n{lines}\n"
        f"{flag} {path} refused: it names code ({len(found)} place{'s' if len(found) != 1 else ''} above); "
        f"pass {TRUST_FLAG} to run it as energon intends (only for a dataset whose code you have read)"
    )


def check_dataset(path: Union[str, Path], *, trust: bool, flag: str = "--data-path") -> list[Finding]:
    """The findings of `inspect_dataset(path)`; `UntrustedDataset` (exit 2) naming each one and
    `--trust-dataset-code` when there are any and `trust` is False."""
    found = inspect_dataset(path)
    if found and not trust:
        raise UntrustedDataset(refusal(flag, path, found))
    return found


def trusted_message(path: Union[str, Path], findings: Iterable[str]) -> str:
    """What a run with `--trust-dataset-code` prints once, on rank 0 (`findings`: `Finding.line()`s)."""
    found = list(findings)
    if not found:
        return f"{TRUST_FLAG}: {path} names no code"
    return f"{TRUST_FLAG}: running the code dataset {path} names:\n" + "\n".join(f"  {f}" for f in found)


def secure_decoding(trust: bool) -> None:
    """webdataset's own guard (`webdataset.utils.enforce_security`, read when a member is decoded):
    on unless `trust`, so pickle and torch.load decoding raise even for a member the inspection did
    not see."""
    import webdataset.utils

    webdataset.utils.enforce_security = not trust


# -- Megatron-LM's GPT index cache -------------------------------------------------------------------
def _npy_is_plain(path: Path) -> bool:
    """True when `path` is a numpy .npy file whose dtype holds no Python objects (read as data: the
    magic string and the header literal; never unpickled)."""
    import numpy.lib.format as fmt

    try:
        with path.open("rb") as fh:
            version = fmt.read_magic(fh)
            read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
            _, _, dtype = read(fh)
    except (ValueError, OSError):
        return False
    return not dtype.hasobject


def npy_cache_findings(folders: Iterable[Union[str, Path]]) -> list[Finding]:
    """`.npy` files under `folders` that Megatron's `numpy.load(allow_pickle=True)` would unpickle
    (not numpy's format, or an object dtype)."""
    out = []
    for folder in folders:
        for f in sorted(Path(folder).rglob("*.npy")) if Path(folder).is_dir() else ():
            if not _npy_is_plain(f):
                out.append(
                    Finding(
                        str(f),
                        "index cache",
                        f.name,
                        "not a plain numpy array: numpy.load(allow_pickle=True) unpickles it",
                    )
                )
    return out

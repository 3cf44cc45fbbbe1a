"""The files of a checkpoint directory, without torch: names, the marker, the train state, the
manifest, atomic writes, and which checkpoint `--load` takes (`select_checkpoint`).

    DIR/latest_checkpointed_iteration.txt   the marker: line 1 the iteration of the last COMPLETE
                                            checkpoint (Megatron's file name; a hand-edited marker
                                            with only that line is accepted: rolling back), line 2
                                            `sha256 <hex>` of that checkpoint's train_state.json
    DIR/iter_0000010/                       a complete checkpoint (train_state.json is inside)
    DIR/iter_0000012.saving/                a save in progress, or one that was killed: a save
                                            writes here, then renames it to iter_0000012, then
                                            replaces the marker (temp file + os.replace)

train_state.json is plain JSON (no pickle) holding `files`, the manifest (bytes and sha256 of every
other file of the checkpoint), and `state_sha256`, the sha256 of its own content without that field
(canonical JSON), so one flipped byte in any file of a checkpoint is an error naming the file.
Every problem is a ValueError naming the file (the CLI exits 2).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Optional

TRACKER = "latest_checkpointed_iteration.txt"
STATE_FILE = "train_state.json"
LAYOUT_FILE = "layout.yaml"
RNG_DIR = "rng"
FORMAT = "megatron-hetero-checkpoint"
VERSION = 2  # 2: state_sha256 and the marker's sha256 line; 1 (no self checksum) is still read
STAGE_SUFFIX = ".saving"
REPLACED_SUFFIX = ".replaced"

_ITER = re.compile(r"iter_(\d{7,})")


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def stage_dir(root: str | Path, iteration: int) -> Path:
    """Where a save of `iteration` writes before it is complete."""
    return Path(root) / f"iter_{iteration:07d}{STAGE_SUFFIX}"


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# (path, inode, bytes, mtime_ns, ctime_ns) -> sha256: the launcher and forked ranks verify the same files
_HASHED: dict[tuple, str] = {}


def sha256_file(path: Path) -> str:
    st = path.stat()
    key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in _HASHED:
        h = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        _HASHED[key] = h.hexdigest()
    return _HASHED[key]


def state_digest(state: dict) -> str:
    """sha256 of the train state's content without `state_sha256` (canonical JSON)."""
    body = {k: v for k, v in state.items() if k != "state_sha256"}
    return _sha256_bytes(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


# ---------------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------------


def read_marker(root: str | Path) -> tuple[int, Optional[str]]:
    """(iteration, sha256 of its train_state.json or None for a one-line marker); ValueError naming
    the file."""
    path = Path(root) / TRACKER
    if not Path(root).is_dir():
        raise ValueError(f"--load {root}: no such directory")
    if not path.is_file():
        raise ValueError(f"--load {root}: no checkpoint ({path} does not exist)")
    try:
        lines = path.read_text().splitlines()
    except UnicodeDecodeError:
        lines = ["\ufffd"]
    first = lines[0].strip() if lines else ""
    if not first.isdigit() or not first.isascii():
        raise ValueError(f"checkpoint marker {path} is corrupt: expected an iteration number, got {first[:40]!r}")
    rest = [x.strip() for x in lines[1:] if x.strip()]
    if not rest:
        return int(first), None
    m = re.fullmatch(r"sha256 ([0-9a-f]{64})", rest[0])
    if len(rest) > 1 or m is None:
        raise ValueError(f"checkpoint marker {path} is corrupt: line 2 is not 'sha256 <64 hex digits>'")
    return int(first), m.group(1)


def read_tracker(root: str | Path) -> int:
    """The iteration of the last complete checkpoint under `root`; ValueError naming the file."""
    return read_marker(root)[0]


def read_train_state(root: str | Path, iteration: Optional[int] = None) -> tuple[Path, dict]:
    """(iteration directory, its train_state.json) of the latest (or the given) checkpoint; checks
    the format, the state's own checksum and, for the marker's checkpoint, the marker's sha256."""
    want_sha = None
    if iteration is None:
        iteration, want_sha = read_marker(root)
    d = iteration_dir(root, iteration)
    path = d / STATE_FILE
    if not path.is_file():
        raise ValueError(f"checkpoint {d}: {path} does not exist")
    data = path.read_bytes()
    if want_sha is not None and _sha256_bytes(data) != want_sha:
        raise ValueError(
            f"checkpoint file {path} is corrupt: its sha256 differs from the one the marker "
            f"{Path(root) / TRACKER} recorded (one of the two files is altered)"
        )
    try:
        state = json.loads(data.decode())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"checkpoint file {path} is corrupt: {exc}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"checkpoint file {path} is not a {FORMAT} train state")
    if state.get("version") not in (1, VERSION):
        raise ValueError(
            f"checkpoint file {path}: format version {state.get('version')!r}, this build reads 1-{VERSION}"
        )
    if state.get("version") >= 2 and state.get("state_sha256") != state_digest(state):
        raise ValueError(f"checkpoint file {path} is corrupt: its content differs from its state_sha256")
    if state.get("iteration") != iteration:
        raise ValueError(f"checkpoint file {path} says iteration {state.get('iteration')!r}, its directory {iteration}")
    return d, state


def manifest(d: Path) -> dict[str, dict]:
    """relative path -> {bytes, sha256} of every file under `d` except the train state itself."""
    out = {}
    for p in sorted(d.rglob("*")):
        if p.is_file() and p.name != STATE_FILE:
            out[str(p.relative_to(d))] = {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
    return out


def verify_manifest(d: Path, state: dict) -> None:
    """ValueError naming the first file that is missing, truncated, altered, or not in the manifest."""
    files = state.get("files")
    if not isinstance(files, dict) or not files:
        raise ValueError(f"checkpoint file {d / STATE_FILE} has no file manifest")
    for rel, want in files.items():
        p = d / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise ValueError(f"checkpoint file {d / STATE_FILE}: manifest entry {rel!r} is outside the checkpoint")
        if not p.is_file():
            raise ValueError(f"checkpoint file {p} is missing")
        size = p.stat().st_size
        if size != want["bytes"]:
            raise ValueError(f"checkpoint file {p} is corrupt: {size} bytes, {want['bytes']} when saved (truncated?)")
        if sha256_file(p) != want["sha256"]:
            raise ValueError(f"checkpoint file {p} is corrupt: its sha256 differs from the one recorded when saved")
    for p in sorted(d.rglob("*")):
        if p.is_file() and p.name != STATE_FILE and str(p.relative_to(d)) not in files:
            raise ValueError(f"checkpoint file {p} is not in the manifest of {d / STATE_FILE} (added after the save)")


# ---------------------------------------------------------------------------------------------------
# which checkpoint --load takes
# ---------------------------------------------------------------------------------------------------


def saves(root: Path) -> tuple[list[int], list[tuple[int, Path]]]:
    """(iterations with a train_state.json, newest first; [(iteration, folder)] of saves that did not
    complete: staging folders and iteration folders without a train state)."""
    complete, incomplete = [], []
    for p in root.iterdir() if root.is_dir() else []:
        if not p.is_dir():
            continue
        if p.name.endswith(STAGE_SUFFIX) and _ITER.fullmatch(p.name[: -len(STAGE_SUFFIX)]):
            incomplete.append((int(_ITER.fullmatch(p.name[: -len(STAGE_SUFFIX)]).group(1)), p))
        elif _ITER.fullmatch(p.name):
            n = int(_ITER.fullmatch(p.name).group(1))
            (complete.append(n) if (p / STATE_FILE).is_file() else incomplete.append((n, p)))
    return sorted(complete, reverse=True), sorted(incomplete)


def select_checkpoint(root: str | Path, fallback: bool = False) -> tuple[Path, dict, Optional[str]]:
    """(directory, train state, note) of the checkpoint `--load root` resumes from, its files
    verified against the manifest. The marker's checkpoint, unless a newer save is incomplete or the
    marker's checkpoint is damaged: then ValueError saying so, or with `fallback` the newest older
    complete checkpoint that verifies, and `note` says which and why. `note` also tells of a complete
    checkpoint newer than the marker (a save killed between its rename and the marker, or a marker
    rolled back by hand): the marker decides."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"--load {root}: no such directory")
    complete, incomplete = saves(root)
    try:
        marked: Optional[int] = read_marker(root)[0]
        problem = None
    except ValueError as exc:
        marked, problem = None, str(exc)
    newer_bad = [p for n, p in incomplete if marked is None or n > marked]
    if newer_bad:
        problem = (
            f"the newest save, {newer_bad[-1]}, is incomplete (the job was killed while saving it, or its "
            f"train state is missing)"
        )
    if problem is None:
        try:
            d, state = read_train_state(root)
            verify_manifest(d, state)
        except ValueError as exc:
            problem = str(exc)
            complete = [n for n in complete if n != marked]  # the marker's own checkpoint is the damaged one
        else:
            newer = [n for n in complete if n > marked]
            note = (
                (
                    f"--load {root}: {iteration_dir(root, newer[0]).name} is a complete checkpoint newer than the "
                    f"marker's iteration {marked}; resuming from {marked} (the marker decides)"
                )
                if newer
                else None
            )
            return d, state, note
    older = [n for n in complete if marked is None or n <= marked]
    if not fallback:
        hint = (
            f"; pass --load-fallback to resume from the newest complete checkpoint before it "
            f"({iteration_dir(root, older[0]).name})"
            if older
            else "; no complete checkpoint to fall back to"
        )
        raise ValueError(f"--load {root}: {problem}{hint}")
    errors = []
    for n in older:
        try:
            d, state = read_train_state(root, n)
            if n == marked:
                d, state = read_train_state(root)  # the marker's sha256 too
            verify_manifest(d, state)
        except ValueError as exc:
            errors.append(str(exc))
            continue
        return (
            d,
            state,
            (
                f"--load {root}: {problem}; --load-fallback: resuming from iteration {n} "
                f"({d.name}), the newest complete checkpoint before it"
            ),
        )
    raise ValueError(
        f"--load {root}: {problem}; --load-fallback found no complete checkpoint to fall back to"
        + (" (" + "; ".join(errors) + ")" if errors else "")
    )


# ---------------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------------


def fsync_dir(d: Path) -> None:
    fd = os.open(str(d), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(d: Path) -> None:
    """Flush every file and folder under `d` to disk (a rename publishes only what is on disk)."""
    for p in sorted(d.rglob("*")):
        if p.is_file():
            with p.open("rb") as f:
                os.fsync(f.fileno())
    for p in sorted([d, *[q for q in d.rglob("*") if q.is_dir()]], reverse=True):
        fsync_dir(p)


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_train_state(d: Path, state: dict) -> str:
    """Seal `state` (manifest of `d`, its own checksum), write it atomically; returns the sha256 of
    the bytes written (the marker records it)."""
    state = dict(state, version=VERSION, files=manifest(d))
    state["state_sha256"] = state_digest(state)
    text = json.dumps(state, indent=1, sort_keys=True)
    atomic_write(d / STATE_FILE, text)
    return _sha256_bytes(text.encode())


def write_marker(root: Path, iteration: int, state_sha: str) -> None:
    atomic_write(root / TRACKER, f"{iteration}\nsha256 {state_sha}\n")


def publish(root: Path, iteration: int, stage: Path, state_sha: str, reached=lambda point: None) -> Path:
    """Make the complete `stage` the checkpoint of `iteration`: rename it to iter_N (an older iter_N
    is renamed aside first and removed at the end), then replace the marker; remove staging folders
    of saves that were killed. `reached(point)` is called after each step (fault injection). The one
    window: re-saving the very iteration the marker names (only a job loading from elsewhere does)
    and killed between the two renames leaves the marker on a folder that is aside as
    iter_N.replaced; `--load-fallback` then takes the newest complete one before it."""
    final = iteration_dir(root, iteration)
    fsync_tree(stage)
    old = None
    if final.exists():
        old = final.with_name(final.name + REPLACED_SUFFIX)
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
    os.rename(stage, final)
    fsync_dir(root)
    reached("renamed")
    write_marker(root, iteration, state_sha)
    reached("marker-written")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    for p in root.iterdir():
        if p.is_dir() and p.name.endswith(STAGE_SUFFIX):
            shutil.rmtree(p, ignore_errors=True)
    return final

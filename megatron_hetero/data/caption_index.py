"""Random access to a prepared energon captioning dataset, by position in a split, read as data.

`energon prepare` leaves an index in the dataset's `.nv-meta/`: `.info.json` (every shard and its
sample count, in the order prepare numbered them), `split.yaml` (each split's shards, brace patterns,
and `exclude`), `dataset.yaml` (the sample type and `field_map`) and `index.sqlite`, whose
`samples` table holds each sample's key, shard number (`tar_file_id`: the shard's position in
`.info.json`), index in the shard and byte range, and `sample_parts` each member's content offset
and size. That is all random access needs: split position p -> (shard, index in shard) by the
cumulative shard counts, -> the member's bytes by one indexed sqlite lookup and one `os.pread`.
Nothing is replayed and nothing is unpickled.

`CaptionIndex(path, split)` opens a split (O(shards): the shard counts, cross-checked against the
sqlite index); `key(p)`, `caption(p)` (the caption member only, decoded as UTF-8: no image bytes are
read) and `image(p)` (float RGB [3, H, W] in [0, 1], as energon's default decoder gives it: PIL,
`convert("RGB")`, /255) read position p of the split's stored order (its shards in `split.yaml`
order, each shard's samples in tar order: the order energon's val loader reads). Every member read
checks the tar header in front of it (a regular file of the indexed size), so a stale index is an
error, not a wrong sample.

Which datasets: `indexable(path)` is None for a folder whose `dataset.yaml` is energon's
`CaptioningSample` with a `field_map` (image <- an image member, caption <- a text member) and no
`sample_loader`, `subflavors` or `part_filter`; otherwise a sentence saying why not (then the caller
reads through energon's own loader). Decoding is data-only: image members through PIL, caption
members as text; a field map naming any other member (a pickle, `.pth`) is refused with a
ValueError, whatever `--trust-dataset-code` says (energon reads such a dataset when trusted).

Threads: one sqlite connection and one file descriptor per shard per thread (`threading.local`),
so worker threads (`caption_batches.CaptionBatches`' prefetch) read concurrently without locks.
"""

from __future__ import annotations

import io
import json
import os
import sqlite3
import tarfile
import threading
from bisect import bisect_right
from pathlib import Path
from typing import Optional, Union

import torch
import yaml

META_DIR = ".nv-meta"
#: member extensions decoded as images (PIL) and as caption text (UTF-8)
IMAGE_EXTENSIONS = frozenset({"png", "jpg", "jpeg", "webp", "bmp", "gif", "tif", "tiff", "ppm", "pgm", "pbm"})
TEXT_EXTENSIONS = frozenset({"txt", "text", "caption"})


def _expand(pattern: str) -> list[str]:
    """Brace patterns of `split.yaml` ('shard-{000000..000003}.tar', 'a{x,y}.tar'), expanded."""
    start = pattern.find("{")
    if start < 0:
        return [pattern]
    end = pattern.index("}", start)
    body, head, tail = pattern[start + 1 : end], pattern[:start], pattern[end + 1 :]
    if ".." in body:
        lo, hi = body.split("..", 1)
        width = len(lo) if lo.startswith("0") else 0
        items = [f"{i:0{width}d}" for i in range(int(lo), int(hi) + 1)]
    else:
        items = body.split(",")
    return [s for item in items for s in _expand(head + item + tail)]


def _read_yaml(path: Path) -> dict:
    doc = yaml.safe_load(path.read_text())
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: not a YAML mapping")
    return doc


def indexable(path: Union[str, Path]) -> Optional[str]:
    """None when `CaptionIndex` can read the dataset at `path`, else why not (see the docstring)."""
    meta = Path(path) / META_DIR
    for name in ("index.sqlite", ".info.json", "split.yaml", "dataset.yaml"):
        if not (meta / name).is_file():
            return f"no {META_DIR}/{name} (not a folder energon prepare indexed)"
    doc = _read_yaml(meta / "dataset.yaml")
    st = doc.get("sample_type")
    if not (
        isinstance(st, dict)
        and st.get("__module__") == "megatron.energon"
        and st.get("__class__") == "CaptioningSample"
    ):
        return f"dataset.yaml's sample_type is {st!r}, not megatron.energon's CaptioningSample"
    for key in ("sample_loader", "part_filter", "subflavors"):
        if doc.get(key):
            return f"dataset.yaml has {key}"
    fm = doc.get("field_map")
    if not (isinstance(fm, dict) and isinstance(fm.get("image"), str) and isinstance(fm.get("caption"), str)):
        return "dataset.yaml has no field_map with image and caption members"
    return None


class SplitIndex:
    """One split of any `energon prepare`d WebDataset folder, by position in its stored order: the
    shards of `split.yaml` (cross-checked against `.info.json` and `index.sqlite`), `key(p)`,
    `parts(p)` (the member names) and `member(p, part)` (one member's bytes). What the members mean
    is the subclass's business (`CaptionIndex`; `chat_batches.ChatIndex` for conversations)."""

    def __init__(self, path: Union[str, Path], split: str) -> None:
        self.path = Path(path)
        meta = self.path / META_DIR
        counts = json.loads((meta / ".info.json").read_text()).get("shard_counts")
        if not isinstance(counts, dict):
            raise ValueError(f"{meta / '.info.json'}: no shard_counts")
        tar_ids = {name: i for i, name in enumerate(counts)}  # prepare numbers shards in this order
        splits = _read_yaml(meta / "split.yaml")
        parts = (splits.get("split_parts") or {}).get(split)
        if parts is None:
            raise ValueError(f"--data-path {path}: no split '{split}' in {meta / 'split.yaml'}")
        exclude = set(splits.get("exclude") or [])
        self.shards: list[str] = []
        for pattern in parts:
            for name in _expand(str(pattern)):
                if name in exclude:
                    continue
                if name not in tar_ids:
                    raise ValueError(f"{meta / 'split.yaml'}: shard {name} of split '{split}' is not in .info.json")
                self.shards.append(name)
        if any("/" in str(e) and not str(e).endswith(".tar") for e in exclude):
            raise ValueError(f"{meta / 'split.yaml'}: excluding single samples is not supported by the index reader")
        self.tar_ids = [tar_ids[s] for s in self.shards]
        self.cumsum = [0]
        for s in self.shards:
            self.cumsum.append(self.cumsum[-1] + int(counts[s]))
        self._local = threading.local()
        self._pid = os.getpid()
        for s, t in zip(self.shards, self.tar_ids):  # the sqlite index agrees with .info.json
            (n,) = self._db().execute("SELECT COUNT(*) FROM samples WHERE tar_file_id = ?", (t,)).fetchone()
            if n != counts[s]:
                raise ValueError(
                    f"{meta}: index.sqlite has {n} samples for {s}, .info.json {counts[s]}: rerun energon prepare"
                )

    def __len__(self) -> int:
        return self.cumsum[-1]

    # -- per-thread handles ----------------------------------------------------------------------
    def _handles(self) -> threading.local:
        if self._pid != os.getpid():  # forked: handles of the parent are not ours
            self._local, self._pid = threading.local(), os.getpid()
        return self._local

    def _db(self) -> sqlite3.Connection:
        h = self._handles()
        if getattr(h, "db", None) is None:
            h.db = sqlite3.connect(f"file:{self.path / META_DIR / 'index.sqlite'}?mode=ro", uri=True)
            h.fds = {}
        return h.db

    def _fd(self, shard: int) -> int:
        self._db()
        fds = self._handles().fds
        if shard not in fds:
            fds[shard] = os.open(self.path / self.shards[shard], os.O_RDONLY)
        return fds[shard]

    def close(self) -> None:
        """Close this thread's handles (others close when their thread ends)."""
        h = self._handles()
        for fd in getattr(h, "fds", {}).values():
            os.close(fd)
        if getattr(h, "db", None) is not None:
            h.db.close()
        h.db, h.fds = None, {}

    # -- reads -----------------------------------------------------------------------------------
    def locate(self, pos: int) -> tuple[int, int]:
        """(shard number in the split, sample index in that shard) of split position `pos`."""
        if not 0 <= pos < len(self):
            raise ValueError(f"sample {pos} is not in the split's [0, {len(self)})")
        shard = bisect_right(self.cumsum, pos) - 1
        return shard, pos - self.cumsum[shard]

    def key(self, pos: int) -> str:
        shard, i = self.locate(pos)
        row = (
            self._db()
            .execute(
                "SELECT sample_key FROM samples WHERE tar_file_id = ? AND sample_index = ?", (self.tar_ids[shard], i)
            )
            .fetchone()
        )
        if row is None:
            raise ValueError(f"{self.shards[shard]}: sample {i} is not in index.sqlite: rerun energon prepare")
        return str(row[0])

    def member(self, pos: int, part: str) -> bytes:
        """The content of member `part` of split position `pos` (checked against its tar header)."""
        shard, i = self.locate(pos)
        row = (
            self._db()
            .execute(
                "SELECT content_byte_offset, content_byte_size FROM sample_parts "
                "WHERE tar_file_id = ? AND sample_index = ? AND part_name = ?",
                (self.tar_ids[shard], i, part),
            )
            .fetchone()
        )
        if row is None:
            raise ValueError(f"{self.shards[shard]}: sample {i} has no '{part}' member")
        offset, size = int(row[0]), int(row[1])
        buf = os.pread(self._fd(shard), size + 512, offset - 512)
        try:
            header = tarfile.TarInfo.frombuf(buf[:512], "utf-8", "surrogateescape")
        except tarfile.TarError:
            header = None
        if header is None or header.size != size or not header.isfile() or len(buf) != size + 512:
            raise ValueError(
                f"{self.path / self.shards[shard]}: no '{part}' member of {size} bytes at offset {offset}: "
                f"the index does not match the shard (rerun energon prepare)"
            )
        return buf[512:]

    def parts(self, pos: int) -> list[str]:
        """The member (part) names of split position `pos`, e.g. ['img0.png', 'json'] (sorted)."""
        shard, i = self.locate(pos)
        rows = (
            self._db()
            .execute(
                "SELECT part_name FROM sample_parts WHERE tar_file_id = ? AND sample_index = ? ORDER BY part_name",
                (self.tar_ids[shard], i),
            )
            .fetchall()
        )
        return [str(r[0]) for r in rows]


def decode_image(data: bytes) -> torch.Tensor:
    """An image member's bytes -> float RGB [3, H, W] in [0, 1] (energon's default image decoding:
    PIL, `convert("RGB")`, /255)."""
    import numpy as np
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        rgb = np.asarray(img.convert("RGB"), dtype=np.float32) / 255.0
    return torch.from_numpy(rgb.transpose(2, 0, 1).copy())


def image_size_of(data: bytes) -> tuple[int, int]:
    """(H, W) of an image member from its header (PIL opens lazily: no pixel is decoded)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        w, h = img.size
    return int(h), int(w)


class CaptionIndex(SplitIndex):
    """One split of a prepared captioning dataset, by position in its stored order (module docstring)."""

    def __init__(self, path: Union[str, Path], split: str) -> None:
        why = indexable(Path(path))
        if why:
            raise ValueError(f"--data-path {path}: cannot read by index: {why}")
        fm = _read_yaml(Path(path) / META_DIR / "dataset.yaml")["field_map"]
        self.image_part, self.caption_part = str(fm["image"]), str(fm["caption"])
        for field, part, allowed in (
            ("image", self.image_part, IMAGE_EXTENSIONS),
            ("caption", self.caption_part, TEXT_EXTENSIONS),
        ):
            if part.rsplit(".", 1)[-1].lower() not in allowed:
                raise ValueError(
                    f"--data-path {path}: field_map {field} <- '{part}': the index reader decodes {field}s "
                    f"only from {sorted(allowed)} members"
                )
        super().__init__(path, split)

    def caption(self, pos: int) -> str:
        return self.member(pos, self.caption_part).decode("utf-8")

    def image(self, pos: int) -> torch.Tensor:
        """Float RGB [3, H, W] in [0, 1] (energon's default image decoding)."""
        return decode_image(self.member(pos, self.image_part))

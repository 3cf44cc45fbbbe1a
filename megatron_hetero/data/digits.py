"""A small REAL image-caption dataset built offline: scikit-learn's bundled handwritten digits.

`write_digits_dataset(out)` writes the 1,797 8x8 grey digits (UCI optical digits, shipped inside
scikit-learn, so nothing is downloaded) as an energon-prepared WebDataset of captioning samples:

    OUT/train/shard-00000{0..3}.tar   1,597 samples  (`NNNN.png` 8x8 grey, `NNNN.txt` "a handwritten seven")
    OUT/heldout/shard-000000.tar        200 samples  (20 of each digit)
    OUT/.nv-meta/                     energon's index, `split.yaml` (train; val and test = the held-out
                                      shard) and `dataset.yaml` (CaptioningSample: image <- png, caption <- txt)

`NNNN` is the sample's index in `sklearn.datasets.load_digits()`. The held-out split is stratified and
deterministic in `seed`: for each digit, a `numpy.random.RandomState(seed)` permutation of its
indices, the first `held_out // 10` of them held out. Pixels 0..16 are scaled to 0..255
(round(v * 255 / 16)). The tar files are byte-identical for the same seed (mtime 0, no owner).

The held-out split is registered twice, as `val` and as `test` (the same 200 samples), so energon's
default `energon lint DIR` (which checks train, val and test) accepts the folder as it is.

`energon prepare` runs as a subprocess of this interpreter with the flags that
run it unattended on a CPU-only host (non-interactive, one worker, no progress bar).
Imports neither torch nor energon in this process.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Optional, Sequence

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
TRAIN_DIR, HELDOUT_DIR = "train", "heldout"
HELDOUT_SPLITS = ("val", "test")  # energon split names that both read the held-out shard


def digit_caption(digit: int) -> str:
    """The caption of a digit image: 'a handwritten seven'."""
    return f"a handwritten {DIGIT_WORDS[digit]}"


def digit_of_caption(text: str) -> Optional[int]:
    """The digit a caption names: the one digit word among its words (case-insensitive), else None
    (no digit word, or words of two different digits)."""
    found = {DIGIT_WORDS.index(w) for w in text.lower().replace(".", " ").replace(",", " ").split() if w in DIGIT_WORDS}
    return found.pop() if len(found) == 1 else None


def heldout_indices(targets: Sequence[int], held_out: int, seed: int) -> list[int]:
    """Sorted indices of the held-out samples: `held_out // 10` of each digit (see module docstring)."""
    import numpy as np

    if held_out % 10 or held_out < 10:
        raise ValueError(f"--held-out {held_out}: must be a positive multiple of 10 (the same count of each digit)")
    per = held_out // 10
    rng = np.random.RandomState(seed)
    targets = np.asarray(targets)
    out: list[int] = []
    for d in range(10):
        idx = np.flatnonzero(targets == d)
        if per > len(idx):
            raise ValueError(f"--held-out {held_out}: digit {d} has only {len(idx)} images, {per} asked")
        out.extend(int(i) for i in rng.permutation(idx)[:per])
    return sorted(out)


def digit_png(pixels, size: int = 8) -> bytes:
    """An 8x8 digit (values 0..16) as a `size` x `size` 8-bit grey PNG (pixel repetition above 8)."""
    from PIL import Image
    import numpy as np

    img = np.round(np.asarray(pixels, dtype=np.float64) * 255.0 / 16.0).astype(np.uint8)
    if size != img.shape[0]:
        f = size // img.shape[0]
        img = np.kron(img, np.ones((f, f), dtype=np.uint8))
    buf = io.BytesIO()
    Image.fromarray(img, "L").save(buf, "PNG")
    return buf.getvalue()


def add_tar_member(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    """One member of a shard, with fixed metadata (mtime 0, mode 644): rebuilt shards are byte-identical."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    tf.addfile(info, io.BytesIO(data))


def _write_shards(folder: Path, indices: Sequence[int], images, targets, shards: int) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for s in range(shards):
        part = indices[s * len(indices) // shards : (s + 1) * len(indices) // shards]
        name = f"shard-{s:06d}.tar"
        with tarfile.open(folder / name, "w", format=tarfile.USTAR_FORMAT) as tf:
            for i in part:
                add_tar_member(tf, f"{i:04d}.png", digit_png(images[i]))
                add_tar_member(tf, f"{i:04d}.txt", digit_caption(int(targets[i])).encode())
        names.append(f"{folder.name}/{name}")
    return names


def energon_prepare(out: Path, split_parts: Sequence[str], sample_args: Sequence[str]) -> None:
    """`energon prepare` of `out` with this interpreter, over any earlier index: the split parts
    (`split:regex` of shard paths) and the sample-type flags; RuntimeError with energon's output if it
    fails."""
    cmd = [
        sys.executable,
        "-c",
        "import sys; from megatron.energon.cli.main import main; sys.exit(main())",
        "prepare",
        str(out),
        "--non-interactive",
        *sample_args,
        "--num-workers",
        "1",
        "--no-progress",
        "--force-overwrite",
    ]
    for p in split_parts:
        cmd += ["--split-parts", p]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"energon prepare {out} failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")


def digits_split_parts() -> list[str]:
    """The digits dataset's `energon prepare --split-parts`: train from its folder, every held-out
    split from the held-out folder."""
    return [f"train:{TRAIN_DIR}/.*"] + [f"{s}:{HELDOUT_DIR}/.*" for s in HELDOUT_SPLITS]


def digits_sample_args(caption_ext: str = "txt") -> list[str]:
    """The digits dataset's sample-type flags for `energon prepare`: a CaptioningSample of the png
    member and the caption member with extension `caption_ext`."""
    return ["--sample-type", "CaptioningSample", "--field-map", json.dumps({"image": "png", "caption": caption_ext})]


def write_digits_dataset(out, held_out: int = 200, seed: int = 0, train_shards: int = 4, force: bool = False) -> dict:
    """Write the digits captioning dataset to `out` and prepare it for energon (see the module
    docstring). Returns a summary: path, samples per split, shards. ValueError if `out` holds files
    and not `force`; RuntimeError with energon's output if `energon prepare` fails."""
    from sklearn.datasets import load_digits

    out = Path(out)
    if train_shards < 1:
        raise ValueError(f"--train-shards {train_shards}: must be >= 1")
    if out.exists() and any(out.iterdir()) and not force:
        raise ValueError(f"--out {out}: the folder is not empty (give --force to overwrite)")
    digits = load_digits()
    images, targets = digits.images, digits.target
    held = heldout_indices(targets, held_out, seed)
    held_set = set(held)
    train = [i for i in range(len(targets)) if i not in held_set]
    if len(train) < train_shards:
        raise ValueError(f"--train-shards {train_shards}: only {len(train)} training samples")
    out.mkdir(parents=True, exist_ok=True)
    for sub in (TRAIN_DIR, HELDOUT_DIR):
        for old in (out / sub).glob("shard-*.tar") if (out / sub).exists() else ():
            old.unlink()
    train_tars = _write_shards(out / TRAIN_DIR, train, images, targets, train_shards)
    held_tars = _write_shards(out / HELDOUT_DIR, held, images, targets, 1)
    energon_prepare(out, digits_split_parts(), digits_sample_args())
    return {
        "path": str(out),
        "train": len(train),
        "heldout": len(held),
        "splits": {"train": len(train), **{s: len(held) for s in HELDOUT_SPLITS}},
        "shards": train_tars + held_tars,
        "image": "8x8 grey PNG",
        "seed": seed,
    }

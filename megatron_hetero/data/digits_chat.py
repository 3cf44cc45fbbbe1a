"""A small REAL visual-instruction (conversation) dataset built offline from scikit-learn's digits.

`write_digits_chat_dataset(out)` writes multi-turn conversations about one or two handwritten digit
images (or none), as an energon-prepared crude WebDataset that `data.chat_data` reads back:

    OUT/train/shard-00000{0..N-1}.tar   `--samples` conversations, images from the training digits
    OUT/val/shard-000000.tar            `--val-samples` conversations, images from the held-out digits only
    OUT/.nv-meta/                       energon's index, split.yaml (train; val and test = the val shard),
                                        dataset.yaml (`megatron.energon` `CrudeWebdataset`: no code named)

A sample is `KEY.json` plus one PNG per image, `KEY.img0.png`, `KEY.img1.png` (8-bit grey):

    {"conversation": [{"role": "user", "content": "<image>\\nWhat digit is this?"},
                      {"role": "assistant", "content": "seven"}, ...],
     "images": ["img0.png"],              # the image parts, in the order of the <image> markers
     "digits": [1234], "labels": [7],     # each image's index in load_digits() and its label
     "sizes": [16], "kind": "one"}

Kinds (chosen with probabilities 0.45 / 0.35 / 0.2): `one` image ("What digit is this?" -> "seven",
then up to two follow-ups: odd or even, plus k, times two), `two` images in one user turn ("What are
the two digits?" -> "seven and four", then the sum "eleven (11)", which is larger, the difference) and
`text` only (arithmetic in words: "What is three plus four?" -> "seven", then "And that times two?").
A third of the conversations start with a system turn. Each image is stored at a size drawn from
`sizes` (default 8 and 16: the 8x8 digit upscaled by pixel repetition), so images of one conversation
can have different token counts. Pixels 0..16 are scaled to 0..255 (round(v * 255 / 16)).

Deterministic in `seed`: the held-out digits are `data.digits.heldout_indices(held_out, seed)` (a
stratified choice) and each split's conversations come from `numpy.random.RandomState` seeded from
(seed, split). Rebuilding gives byte-identical shards (mtime 0, no owner). Imports neither torch nor
energon in this process (`energon prepare` runs as a subprocess, as for `data.digits`).
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from megatron_hetero.data.digits import DIGIT_WORDS, add_tar_member, digit_png, energon_prepare, heldout_indices

TRAIN_DIR, VAL_DIR = "train", "val"
HELDOUT_SPLITS = ("val", "test")
SYSTEM_PROMPT = "You are a helpful assistant that reads handwritten digits."
KINDS = ("one", "two", "text")
_KIND_P = (0.45, 0.35, 0.2)
#: the questions whose answers read the images, by the part of the held-out accuracy they count for
#: (`models.chat_eval.question_hits`): the one digit shown, the two digits shown (named in order)
DIGIT_NAMED, TWO_NAMED = "What digit is this?", "What are the two digits?"
IMAGE_QUESTIONS = {"digit named": DIGIT_NAMED, "two digits named": TWO_NAMED}
_TEENS = ("ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen")
_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")


def number_word(n: int) -> str:
    """0..99 in English words: 7 -> 'seven', 11 -> 'eleven', 42 -> 'forty-two', -3 -> 'minus three'."""
    if n < 0:
        return "minus " + number_word(-n)
    if n < 10:
        return DIGIT_WORDS[n]
    if n < 20:
        return _TEENS[n - 10]
    if n < 100:
        t, u = divmod(n, 10)
        return _TENS[t] + ("" if u == 0 else "-" + DIGIT_WORDS[u])
    raise ValueError(f"number_word: {n} is out of range (0..99)")


def _turns_one(d: int, rng) -> list[tuple[str, str]]:
    turns = [(f"<image>\n{DIGIT_NAMED}", DIGIT_WORDS[d])]
    follow = [
        ("Is it odd or even?", "odd" if d % 2 else "even"),
        ("What is it times two?", number_word(2 * d)),
    ]
    k = int(rng.randint(1, 10))
    follow.append((f"What is it plus {DIGIT_WORDS[k]}?", number_word(d + k)))
    order = rng.permutation(len(follow))[: int(rng.randint(0, 3))]
    return turns + [follow[i] for i in order]


def _turns_two(a: int, b: int, rng) -> list[tuple[str, str]]:
    larger = "the first" if a > b else "the second" if b > a else "they are equal"
    first = (f"<image> <image>\n{TWO_NAMED}", f"{DIGIT_WORDS[a]} and {DIGIT_WORDS[b]}")
    follow = [
        ("What is the sum of the two digits?", f"{number_word(a + b)} ({a + b})"),
        ("Which one is larger?", larger),
        ("What is the first minus the second?", number_word(a - b)),
    ]
    if rng.rand() < 0.3:  # asked straight away, without naming the digits first
        return [("<image><image>\nWhat is the sum of the two digits?", f"{number_word(a + b)} ({a + b})")]
    order = rng.permutation(len(follow))[: int(rng.randint(1, 3))]
    return [first] + [follow[i] for i in order]


def _turns_text(rng) -> list[tuple[str, str]]:
    a, b = int(rng.randint(0, 10)), int(rng.randint(0, 10))
    turns = [(f"What is {DIGIT_WORDS[a]} plus {DIGIT_WORDS[b]}?", number_word(a + b))]
    if rng.rand() < 0.5:
        turns.append(("And that times two?", number_word(2 * (a + b))))
    return turns


def conversation_plan(pool: Sequence[int], targets, count: int, sizes: Sequence[int], rng) -> list[dict]:
    """`count` sample records (the JSON of the module docstring, without the PNG bytes), images drawn
    from the digit indices `pool`."""
    out = []
    for _ in range(count):
        kind = KINDS[int(rng.choice(len(KINDS), p=_KIND_P))]
        n_img = {"one": 1, "two": 2, "text": 0}[kind]
        digits = [int(pool[int(rng.randint(len(pool)))]) for _ in range(n_img)]
        labels = [int(targets[i]) for i in digits]
        size = [int(sizes[int(rng.randint(len(sizes)))]) for _ in range(n_img)]
        if kind == "one":
            turns = _turns_one(labels[0], rng)
        elif kind == "two":
            turns = _turns_two(labels[0], labels[1], rng)
        else:
            turns = _turns_text(rng)
        conv = [{"role": "system", "content": SYSTEM_PROMPT}] if rng.rand() < 1 / 3 else []
        for q, a in turns:
            conv += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        out.append(
            {
                "conversation": conv,
                "images": [f"img{k}.png" for k in range(n_img)],
                "digits": digits,
                "labels": labels,
                "sizes": size,
                "kind": kind,
            }
        )
    return out


def write_shards(
    folder: Path,
    records: list[dict],
    images,
    shards: int,
    offset: int,
    more: Optional[Callable[[tarfile.TarFile, str, dict], None]] = None,
) -> list[str]:
    """Write `records` as `shards` webdataset tars under `folder` (keys from `offset`): each record's
    JSON and its digit images as PNGs; `more(tar, key, record)` adds a dataset's own members (the
    spoken digits' clips). Returns the tars' names relative to the dataset folder."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("shard-*.tar"):
        old.unlink()
    names = []
    for s in range(shards):
        lo, hi = s * len(records) // shards, (s + 1) * len(records) // shards
        name = f"shard-{s:06d}.tar"
        with tarfile.open(folder / name, "w", format=tarfile.USTAR_FORMAT) as tf:
            for j in range(lo, hi):
                rec, key = records[j], f"{offset + j:06d}"
                add_tar_member(tf, f"{key}.json", json.dumps(rec, sort_keys=True).encode())
                for part, d, size in zip(rec["images"], rec["digits"], rec["sizes"]):
                    add_tar_member(tf, f"{key}.{part}", digit_png(images[d], size))
                if more is not None:
                    more(tf, key, rec)
        names.append(f"{folder.name}/{name}")
    return names


def digit_pools(
    out, samples: int, val_samples: int, held_out: int, seed: int, sizes: Sequence[int], train_shards: int, force: bool
) -> tuple[Path, list[int], Any, Any, list[int], list[int]]:
    """The checks every digits conversation dataset makes of its arguments (ValueError), then the
    digits: `(out, sizes, images, targets, held-out indices, training indices)`."""
    from sklearn.datasets import load_digits

    out = Path(out)
    if samples < 1 or val_samples < 1:
        raise ValueError(f"--samples {samples}, --val-samples {val_samples}: both must be >= 1")
    if train_shards < 1 or train_shards > samples:
        raise ValueError(f"--train-shards {train_shards}: must be between 1 and --samples {samples}")
    sizes = [int(s) for s in sizes]
    if not sizes or any(s < 8 or s % 8 for s in sizes):
        raise ValueError(f"--sizes {sizes}: each image size must be a positive multiple of 8 (the digits are 8x8)")
    if out.exists() and any(out.iterdir()) and not force:
        raise ValueError(f"--out {out}: the folder is not empty (give --force to overwrite)")
    digits = load_digits()
    held = heldout_indices(digits.target, held_out, seed)
    held_set = set(held)
    train_pool = [i for i in range(len(digits.target)) if i not in held_set]
    return out, sizes, digits.images, digits.target, held, train_pool


def prepare_conversations(out: Path) -> None:
    """`energon prepare` the train and held-out splits as crude samples (our cookers read them)."""
    parts = [f"train:{TRAIN_DIR}/.*"] + [f"{split}:{VAL_DIR}/.*" for split in HELDOUT_SPLITS]
    energon_prepare(out, parts, ["--sample-type", "CrudeWebdataset"])


def write_digits_chat_dataset(
    out,
    samples: int = 4000,
    val_samples: int = 400,
    held_out: int = 200,
    seed: int = 0,
    sizes: Sequence[int] = (8, 16),
    train_shards: int = 4,
    force: bool = False,
    prepare: bool = True,
) -> dict[str, Any]:
    """Write the digits conversation dataset to `out` and prepare it for energon (module docstring;
    `prepare=False` writes the shards only).
    Returns a summary (path, samples per split, kinds, image sizes, shards). ValueError for bad
    arguments or a non-empty `out` without `force`; RuntimeError with energon's output if
    `energon prepare` fails."""
    import numpy as np

    out, sizes, images, targets, held, train_pool = digit_pools(
        out, samples, val_samples, held_out, seed, sizes, train_shards, force
    )
    train = conversation_plan(train_pool, targets, samples, sizes, np.random.RandomState([seed, 0]))
    val = conversation_plan(held, targets, val_samples, sizes, np.random.RandomState([seed, 1]))
    out.mkdir(parents=True, exist_ok=True)
    train_tars = write_shards(out / TRAIN_DIR, train, images, train_shards, 0)
    val_tars = write_shards(out / VAL_DIR, val, images, 1, samples)
    if prepare:
        prepare_conversations(out)  # crude samples: our cooker reads them (`chat_data`)
    recs = train + val
    return {
        "path": str(out),
        "train": len(train),
        "val": len(val),
        "splits": {"train": len(train), **{s: len(val) for s in HELDOUT_SPLITS}},
        "kinds": {k: sum(r["kind"] == k for r in recs) for k in KINDS},
        "images": sum(len(r["images"]) for r in recs),
        "turns": sum(len(r["conversation"]) for r in recs),
        "sizes": sizes,
        "shards": train_tars + val_tars,
        "seed": seed,
        "held_out_digits": len(held),
    }

"""Spoken digits made offline: conversations mixing a handwritten digit image and a spoken question,
speech-only and text-only samples, as an energon-prepared crude WebDataset (as `data.digits_chat`).

    OUT/train/shard-00000{0..N-1}.tar   `--samples` conversations: training digits, training voices
    OUT/val/shard-000000.tar            `--val-samples`: held-out digit images, held-out voices only
    OUT/.nv-meta/                       energon's index, split.yaml, dataset.yaml (CrudeWebdataset)

A sample is `KEY.json`, one PNG per image (`KEY.img0.png`) and one log-mel array per clip
(`KEY.speech0.npy`: numpy float32 [frames, bins], frames even: `data.speech_synth.log_mel`):

    {"conversation": [{"role": "user", "content": "<image>\\n<speech>\\nWhat digit is shown, and which
                       digit was said?"}, {"role": "assistant", "content": "seven and three"}],
     "images": ["img0.png"], "digits": [1234], "labels": [7], "sizes": [16],
     "speech": ["speech0.npy"], "said": [3], "phrases": ["number three"], "voices": ["en-gb/s130/p35"],
     "kind": "image_speech"}

Kinds (probabilities 0.4 / 0.35 / 0.25): `image_speech` (an image and a spoken digit in one user turn),
`speech` ("<speech>\\nWhich digit was said?", sometimes "Is it odd or even?" after), `text` (the
arithmetic turns of `data.digits_chat`). Each clip is eSpeak NG speaking the digit word or "number
<word>" in one of the split's voices (voice, speed, pitch): train and val voices are disjoint, so val
measures speech from speakers never heard. Clips are synthesised once per (phrase, voice).
Deterministic in `seed` (the same numpy streams as `data.digits_chat`); byte-identical rebuilds
given the same eSpeak NG and transformers versions.
"""

from __future__ import annotations

import io
import json
from itertools import product
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from megatron_hetero.data.digits import DIGIT_WORDS, add_tar_member
from megatron_hetero.data.digits_chat import (
    TRAIN_DIR,
    VAL_DIR,
    _turns_text,
    digit_pools,
    prepare_conversations,
    write_shards,
)
from megatron_hetero.data.speech_synth import Voice, espeak_path, feature_extractor, log_mel, synthesize

SPEECH_MARKER = "<speech>"
SPEECH_INFO = "speech.json"  # OUT/speech.json: {"marker", "mel_bins", "features"}: a speech dataset
KINDS = ("image_speech", "speech", "text")
_KIND_P = (0.4, 0.35, 0.25)
PHRASES = ("{w}", "number {w}")
TRAIN_VOICES = tuple(
    Voice(n, s, p) for n, s, p in product(("en-us", "en-gb", "en-us+f3", "en-gb-scotland"), (130, 175), (35, 65))
)
VAL_VOICES = tuple(Voice(n, s, p) for n, s, p in product(("en-029", "en-gb-x-rp+f2"), (150,), (45, 60)))


def speech_plan(pool: Sequence[int], targets, count: int, sizes: Sequence[int], voices, rng) -> list[dict]:
    """`count` sample records (the JSON of the module docstring), images from the digit indices `pool`."""
    out = []
    for _ in range(count):
        kind = KINDS[int(rng.choice(len(KINDS), p=_KIND_P))]
        rec: dict[str, Any] = {"kind": kind, "images": [], "digits": [], "labels": [], "sizes": []}
        rec.update(speech=[], said=[], phrases=[], voices=[])
        if kind == "image_speech":
            d = int(pool[int(rng.randint(len(pool)))])
            rec.update(images=["img0.png"], digits=[d], labels=[int(targets[d])])
            rec["sizes"] = [int(sizes[int(rng.randint(len(sizes)))])]
        if kind != "text":
            said = int(rng.randint(10))
            phrase = PHRASES[int(rng.randint(len(PHRASES)))].format(w=DIGIT_WORDS[said])
            voice = voices[int(rng.randint(len(voices)))]
            rec.update(speech=["speech0.npy"], said=[said], phrases=[phrase], voices=[voice.label()])
        if kind == "image_speech":
            q = f"<image>\n{SPEECH_MARKER}\nWhat digit is shown, and which digit was said?"
            turns = [(q, f"{DIGIT_WORDS[rec['labels'][0]]} and {DIGIT_WORDS[rec['said'][0]]}")]
        elif kind == "speech":
            turns = [(f"{SPEECH_MARKER}\nWhich digit was said?", DIGIT_WORDS[rec["said"][0]])]
            if rng.rand() < 0.4:
                turns.append(("Is it odd or even?", "odd" if rec["said"][0] % 2 else "even"))
        else:
            turns = _turns_text(rng)
        rec["conversation"] = [
            m for q, a in turns for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})
        ]
        out.append(rec)
    return out


def _npy(array) -> bytes:
    import numpy as np

    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def write_digits_speech_dataset(
    out,
    samples: int = 4000,
    val_samples: int = 400,
    held_out: int = 200,
    seed: int = 0,
    sizes: Sequence[int] = (8, 16),
    mel_bins: int = 80,
    train_shards: int = 4,
    force: bool = False,
    prepare: bool = True,
    speak: Optional[Callable[[str, Voice], Any]] = None,
) -> dict[str, Any]:
    """Write the spoken-digits dataset to `out` (module docstring); returns a summary. ValueError for
    bad arguments or a non-empty `out` without `force`; `speech_synth.SynthesizerMissing` (how to
    install eSpeak NG) before anything is written when the synthesiser is absent. `speak(phrase,
    voice)`: a clip's 16 kHz float32 samples (default: eSpeak NG, `speech_synth.synthesize`; tests
    give a stand-in that needs no synthesiser)."""
    import numpy as np

    if speak is None:
        espeak_path()
        speak = synthesize
    if mel_bins < 1:
        raise ValueError(f"--mel-bins {mel_bins}: must be >= 1")
    out, sizes, images, targets, held, train_pool = digit_pools(
        out, samples, val_samples, held_out, seed, sizes, train_shards, force
    )
    rs = np.random.RandomState
    train = speech_plan(train_pool, targets, samples, sizes, TRAIN_VOICES, rs([seed, 0]))
    val = speech_plan(held, targets, val_samples, sizes, VAL_VOICES, rs([seed, 1]))
    by_label = {v.label(): v for v in TRAIN_VOICES + VAL_VOICES}
    clips: dict[tuple[str, str], bytes] = {}
    fe = feature_extractor(mel_bins)

    def clip(phrase: str, voice: str) -> bytes:
        if (phrase, voice) not in clips:
            clips[phrase, voice] = _npy(log_mel(speak(phrase, by_label[voice]), mel_bins, fe))
        return clips[phrase, voice]

    def add_clips(tf, key: str, rec: dict) -> None:
        for part, phrase, voice in zip(rec["speech"], rec["phrases"], rec["voices"]):
            add_tar_member(tf, f"{key}.{part}", clip(phrase, voice))

    out.mkdir(parents=True, exist_ok=True)
    train_tars = write_shards(out / TRAIN_DIR, train, images, train_shards, 0, add_clips)
    val_tars = write_shards(out / VAL_DIR, val, images, 1, samples, add_clips)
    info = {"marker": SPEECH_MARKER, "mel_bins": mel_bins, "features": "log-mel float32 [frames, bins] (.npy)"}
    (out / SPEECH_INFO).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    if prepare:
        prepare_conversations(out)
    recs = train + val
    frames = [np.load(io.BytesIO(b)).shape[0] for b in clips.values()]
    return {
        "path": str(out),
        "train": len(train),
        "val": len(val),
        "kinds": {k: sum(r["kind"] == k for r in recs) for k in KINDS},
        "clips": len(clips),
        "frames": [min(frames), max(frames)] if frames else [0, 0],
        "mel_bins": mel_bins,
        "voices": {"train": len(TRAIN_VOICES), "val": len(VAL_VOICES)},
        "shards": train_tars + val_tars,
        "seed": seed,
    }


def is_speech_dataset(path) -> bool:
    """Whether `path` holds the spoken-digits dataset (its `speech.json`)."""
    return (Path(path) / SPEECH_INFO).is_file()

"""A small spoken-digits dataset for tests that needs no synthesiser: `data.digits_speech`'s writer
with tones standing in for eSpeak NG's voice (each word its own frequency, the voice's speed its
length and its pitch a shift), through Whisper's real log-mel features. The digit said is in the
clip, so a model can learn it; clips differ in length, so the speech tokens vary per sample."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megatron_hetero.data.digits import DIGIT_WORDS
from megatron_hetero.data.speech_synth import SAMPLE_RATE, Voice

WORDS = ("number", *DIGIT_WORDS)


def tone_speaker(phrase: str, voice: Voice) -> np.ndarray:
    """16 kHz float32 samples of `phrase`: one tone per word (WORDS index -> frequency), 0.05 s apart."""
    out = []
    for w in phrase.split():
        seconds = 0.2 * (1 + len(w) / 6) * 150 / voice.speed
        hz = (250 + 120 * WORDS.index(w)) * (1 + (voice.pitch - 50) / 500)
        t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
        out += [0.5 * np.sin(2 * np.pi * hz * t), np.zeros(int(0.05 * SAMPLE_RATE))]
    return np.concatenate(out).astype(np.float32)


def write_tone_dataset(out: Path, samples: int = 24, val_samples: int = 8, mel_bins: int = 8, seed: int = 0) -> Path:
    """The spoken-digits dataset at `out` with `tone_speaker`'s clips (one train shard)."""
    from megatron_hetero.data.digits_speech import write_digits_speech_dataset

    write_digits_speech_dataset(
        out, samples=samples, val_samples=val_samples, mel_bins=mel_bins, train_shards=1, seed=seed, speak=tone_speaker
    )
    return out

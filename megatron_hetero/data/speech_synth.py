"""Spoken words made offline: eSpeak NG (the `espeak-ng` program, Debian's package) speaks a word
in a voice, speed and pitch; Whisper's feature extractor turns the clip into log-mel frames.

`synthesize(text, voice)` runs `espeak-ng -v VOICE -s SPEED -p PITCH --stdout TEXT`, reads the WAV it
writes (mono 16-bit, 22,050 Hz) and resamples it to 16 kHz (linear interpolation), the rate Whisper's
features assume. `log_mel(wave, bins)` is `transformers.WhisperFeatureExtractor(feature_size=bins)`
on the clip as it is (padding to the longest, not to 30 s), cut to an even frame count (two frames
a speech token, `models.whisper_encoder`): float32 [frames, bins].

Without the program, `SynthesizerMissing` says how to install it. No torch import.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import wave
from dataclasses import dataclass

SAMPLE_RATE = 16000
INSTALL_HINT = (
    "eSpeak NG is not installed (the `espeak-ng` program): install it with `apt-get install espeak-ng` "
    "(Debian/Ubuntu), `dnf install espeak-ng` (Fedora) or `brew install espeak-ng` (macOS)"
)


class SynthesizerMissing(RuntimeError):
    """The speech synthesiser is not on PATH (the message says how to install it)."""


@dataclass(frozen=True)
class Voice:
    """An eSpeak NG voice (`-v`, e.g. `en-us`, `en+f3`), words per minute (`-s`) and pitch 0..99 (`-p`)."""

    name: str
    speed: int = 160
    pitch: int = 50

    def label(self) -> str:
        return f"{self.name}/s{self.speed}/p{self.pitch}"


def espeak_path() -> str:
    """The `espeak-ng` program; `SynthesizerMissing` with the install hint when absent."""
    path = shutil.which("espeak-ng")
    if path is None:
        raise SynthesizerMissing(INSTALL_HINT)
    return path


def synthesizer_available() -> bool:
    return shutil.which("espeak-ng") is not None


def synthesize(text: str, voice: Voice):
    """The spoken `text` as float32 samples in [-1, 1] at 16 kHz (numpy array)."""
    import numpy as np

    cmd = [espeak_path(), "-v", voice.name, "-s", str(voice.speed), "-p", str(voice.pitch), "--stdout", text]
    done = subprocess.run(cmd, capture_output=True, check=False, timeout=60)
    if done.returncode != 0 or not done.stdout:
        raise RuntimeError(f"espeak-ng failed for {text!r} ({voice.label()}): {done.stderr.decode()[-300:]}")
    with wave.open(io.BytesIO(done.stdout)) as w:
        rate, width, channels = w.getframerate(), w.getsampwidth(), w.getnchannels()
        raw = w.readframes(w.getnframes())
    if width != 2:
        raise RuntimeError(f"espeak-ng wrote {8 * width}-bit samples; expected 16-bit")
    samples = np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    if channels > 1:
        samples = samples.reshape(-1, channels).mean(axis=1)
    if rate != SAMPLE_RATE:
        n = max(1, round(len(samples) * SAMPLE_RATE / rate))
        samples = np.interp(np.arange(n) * (rate / SAMPLE_RATE), np.arange(len(samples)), samples)
    return samples.astype(np.float32)


def feature_extractor(bins: int = 80):
    """transformers' `WhisperFeatureExtractor` with `bins` mel bins at 16 kHz (build once, reuse)."""
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=bins, sampling_rate=SAMPLE_RATE)


def log_mel(samples, bins: int = 80, fe=None):
    """Whisper's log-mel features of a 16 kHz clip: float32 [frames, bins], frames even (>= 2);
    `fe`: a `feature_extractor(bins)` to reuse."""
    import numpy as np

    fe = fe if fe is not None else feature_extractor(bins)
    feats = fe(samples, sampling_rate=SAMPLE_RATE, padding="longest", return_tensors="np")["input_features"][0]
    frames = feats.shape[1] - feats.shape[1] % 2
    if frames < 2:
        raise ValueError(f"a clip of {len(samples)} samples gives fewer than 2 log-mel frames")
    return np.ascontiguousarray(feats[:, :frames].T, dtype=np.float32)

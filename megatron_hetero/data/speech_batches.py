"""`SpeechBatches`: the spoken-digits dataset (`megatron-hetero data digits --speech`,
`data.digits_speech`) as TRAINING batches for a LLaVA model with two variable encoders: an image
encoder (tiles, as `data.chat_batches`) and the `audio` encoder (speech chunks).

Speech chunks. A clip is `KEY.speechK.npy`, log-mel float32 [frames, bins] (frames even). Its frames
are read two a speech token (the Whisper encoder's input, `whisper_encoder.mel_to_pairs`) and cut into
chunks of `speech_tokens` tokens (2 * speech_tokens frames); the last chunk is filled up with the
clip's smallest value (the log-mel of its silence). A clip of f frames is ceil(f / (2 *
speech_tokens)) chunks: the number of speech tokens follows the clip's length. Each chunk goes through
the encoder on its own, as an image tile does: features [chunks, speech_tokens, 2 * bins].

Tokenisation (`tokenize_speech_conversation`): the `<image>` and `<speech>` markers of the user turns
become placeholder runs in the order they appear in the text (an image: tiles * T tokens; a clip:
chunks * speech_tokens tokens), through `chat_tokens.tokenize_conversation` with both markers as the
one marker it knows; `kinds` says which run is which. A run that does not end within the sequence is
dropped whole with every run after it (`chat_tokens.train_sample`), its features too.

The batch contract (`batch(samples)`), as `chat_batches` with one more encoder:

  * `tokens`, `labels` LongTensor [rows, S], `loss_mask` float [rows, S];
  * `image_mask` {image encoder: BoolTensor [rows, S], audio: BoolTensor [rows, S]}: each encoder's
    placeholder positions (disjoint);
  * `features` {image encoder: float [n_tiles, T, F], audio: float [n_chunks, speech_tokens, 2*bins]};
  * `tiles` {image encoder: LongTensor [rows] (tiles per row), audio: LongTensor [rows] (chunks)}.

`image_tiles(samples)` gives both counts without decoding an image or a clip (the clip's frame count
comes from its .npy header). Sample order, caching, workers and the held-out split
(`speech_heldout`) are `ChatBatches`' own.
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from megatron_hetero.config.data import CaptionDataConfig
from megatron_hetero.data.caption_reader import IndexSource
from megatron_hetero.data.chat_batches import (
    HELDOUT_SPLIT,
    JSON_PART,
    ChatBatches,
    ChatIndex,
    ChatRecord,
    ChatRowBatch,
    tile_features,
    tiles_of,
)
from megatron_hetero.data.chat_template import ChatTemplate, normalize_messages
from megatron_hetero.data.chat_tokens import (
    IMAGE_MARKER,
    ChatTokens,
    kept_images,
    tokenize_conversation,
    train_sample,
)
from megatron_hetero.data.digits_speech import SPEECH_INFO, SPEECH_MARKER
from megatron_hetero.data.tokenizer import CaptionTokenizer

AUDIO = "audio"  # the speech encoder's module name in layouts
_MARKERS = re.compile(f"{re.escape(IMAGE_MARKER)}|{re.escape(SPEECH_MARKER)}")


def speech_info(path: Union[str, Path]) -> dict:
    """`DIR/speech.json` of a spoken-digits dataset ({"marker", "mel_bins", ...}). ValueError when
    it is missing or malformed."""
    f = Path(path) / SPEECH_INFO
    try:
        info = json.loads(f.read_text())
        bins = int(info["mel_bins"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--data-path {path}: {SPEECH_INFO} is missing or malformed ({exc})") from None
    if bins < 1 or info.get("marker", SPEECH_MARKER) != SPEECH_MARKER:
        raise ValueError(f"--data-path {path}: {SPEECH_INFO}: mel_bins {bins}, marker {info.get('marker')!r}")
    return info


def clip_chunks(frames: int, speech_tokens: int) -> int:
    """Chunks of `speech_tokens` tokens (two frames each) of a clip of `frames` log-mel frames (>= 1)."""
    return max(1, -(-frames // (2 * speech_tokens)))


def clip_features(mel: torch.Tensor, speech_tokens: int) -> torch.Tensor:
    """A clip's log-mel [frames, bins] -> [chunks, speech_tokens, 2 * bins] (module docstring): two
    frames a token side by side, the last chunk filled with the clip's smallest value."""
    frames, bins = mel.shape
    chunks = clip_chunks(frames, speech_tokens)
    full = mel.new_full((chunks * 2 * speech_tokens, bins), float(mel.min()) if mel.numel() else 0.0)
    full[:frames] = mel
    return full.reshape(chunks, speech_tokens, 2 * bins)


def npy_shape(data: bytes) -> tuple[int, ...]:
    """The shape in a .npy member's header, without reading the array (no pickle: refused)."""
    import numpy as np

    f = io.BytesIO(data)
    version = np.lib.format.read_magic(f)
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, dtype = read(f)  # the header only
    if dtype.hasobject:
        raise ValueError("a .npy member of objects (would be unpickled)")
    return tuple(int(s) for s in shape)


def load_mel(data: bytes, bins: int, key: str, part: str) -> torch.Tensor:
    """A clip member -> float32 [frames, bins]. ValueError naming the sample for another shape."""
    import numpy as np

    try:
        arr = np.load(io.BytesIO(data), allow_pickle=False)
    except ValueError as exc:
        raise ValueError(f"sample {key}: clip '{part}' is not a numeric .npy array ({exc})") from None
    if arr.ndim != 2 or arr.shape[1] != bins or arr.shape[0] < 1:
        raise ValueError(f"sample {key}: clip '{part}' is {list(arr.shape)}, expected [frames, {bins}]")
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))


@dataclass(frozen=True)
class SpeechRecord(ChatRecord):
    """A `ChatRecord` with its clips: member names (in `<speech>` marker order) and frame counts."""

    speech: tuple[str, ...] = ()
    frames: tuple[int, ...] = ()


class SpeechIndex(ChatIndex):
    """`ChatIndex` of a spoken-digits split: `record(p)` also names the clips and their frame counts
    (from the .npy headers), `clip(p, name)` reads one [frames, bins]."""

    def __init__(self, path: Union[str, Path], split: str, mel_bins: int) -> None:
        super().__init__(path, split)
        self.mel_bins = mel_bins

    def record(self, pos: int) -> SpeechRecord:
        rec = super().record(pos)
        doc = json.loads(self.member(pos, JSON_PART).decode("utf-8"))  # parsed by super() already
        names = doc.get("speech") or []
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"sample {rec.key}: its JSON's 'speech' is not a list of member names")
        markers = sum(m["content"].count(SPEECH_MARKER) for m in rec.messages)
        if markers != len(names):
            raise ValueError(f"sample {rec.key}: {markers} {SPEECH_MARKER} marker(s) but {len(names)} clip(s)")
        parts = set(self.parts(pos))
        frames = []
        for n in names:
            if n not in parts or not n.endswith(".npy"):
                raise ValueError(f"sample {rec.key}: clip '{n}' named in its JSON is not a .npy member")
            try:
                shape = npy_shape(self.member(pos, n))
            except ValueError as exc:
                raise ValueError(f"sample {rec.key}: clip '{n}': {exc}") from None
            if len(shape) != 2 or shape[1] != self.mel_bins or shape[0] < 1:
                raise ValueError(f"sample {rec.key}: clip '{n}' is {list(shape)}, expected [frames, {self.mel_bins}]")
            frames.append(shape[0])
        return SpeechRecord(rec.key, rec.messages, rec.images, rec.sizes, tuple(names), tuple(frames))

    def clip(self, pos: int, name: str) -> torch.Tensor:
        return load_mel(self.member(pos, name), self.mel_bins, self.key(pos), name)


def tokenize_speech_conversation(
    messages: Sequence[Mapping[str, Any]],
    image_tokens: Sequence[int],
    speech_tokens: Sequence[int],
    tok: CaptionTokenizer,
    template: ChatTemplate,
) -> tuple[ChatTokens, tuple[str, ...]]:
    """(tokenised conversation, the kind of each placeholder run: "image" or "speech", in order):
    image k's run is `image_tokens[k]` long, clip k's `speech_tokens[k]` (module docstring).
    ValueError for marker counts that differ from the counts given."""
    msgs = normalize_messages(messages)
    kinds = tuple("speech" if m == SPEECH_MARKER else "image" for msg in msgs for m in _MARKERS.findall(msg["content"]))
    if kinds.count("speech") != len(speech_tokens):
        raise ValueError(
            f"the conversation has {kinds.count('speech')} {SPEECH_MARKER} marker(s) but {len(speech_tokens)} clip(s)"
        )
    if kinds.count("image") != len(image_tokens):
        raise ValueError(
            f"the conversation has {kinds.count('image')} {IMAGE_MARKER} marker(s) but {len(image_tokens)} image(s)"
        )
    counts, images, clips = [], iter(image_tokens), iter(speech_tokens)
    for k in kinds:
        counts.append(int(next(clips) if k == "speech" else next(images)))
    one = [{**m, "content": m["content"].replace(SPEECH_MARKER, IMAGE_MARKER)} for m in msgs]
    return tokenize_conversation(one, counts, tok, template), kinds


class SpeechRowBatch(ChatRowBatch):
    """`ChatRowBatch` with both encoders' keys (module docstring)."""

    def _build(self, key: str) -> Any:
        o, rows = self._owner, self._samples
        if key == "features":
            return o.row_features(rows)
        if key == "tiles":
            return {n: torch.tensor(v, dtype=torch.long) for n, v in o.image_tiles(rows).items()}
        if key == "image_mask":
            return {n: torch.stack([o.text(i)["masks"][n] for i in rows]) for n in o.encoders}
        return torch.stack([o.text(i)[key] for i in rows])


class SpeechBatches(ChatBatches):
    """The spoken-digits samples of a run by global sample index, for one rank (module docstring).
    `encoder` is the image encoder's module name, `audio` the speech encoder's; `speech_tokens` the
    tokens of a chunk, `mel_bins` the clips' bins (`speech_info`). `image_reads` lists the global
    samples whose features were built (images and clips decoded)."""

    def __init__(
        self,
        cfg: CaptionDataConfig,
        tok: CaptionTokenizer,
        template: ChatTemplate,
        *,
        encoder: str,
        audio: str = AUDIO,
        speech_tokens: int,
        mel_bins: int,
        seq_length: int,
        global_batch: int,
        num_workers: Optional[int] = None,
    ) -> None:
        if speech_tokens < 1:
            raise ValueError(f"speech chunk of {speech_tokens} tokens: must be >= 1")
        if encoder == audio:
            raise ValueError(f"the image encoder and the speech encoder are both '{audio}'")
        super().__init__(
            cfg,
            tok,
            template,
            encoder=encoder,
            seq_length=seq_length,
            global_batch=global_batch,
            num_workers=num_workers,
        )
        self.source.index.close()
        self.source = IndexSource(cfg, index=SpeechIndex(cfg.path, cfg.split, mel_bins))
        self.audio, self.speech_tokens, self.mel_bins = audio, speech_tokens, mel_bins
        self.encoders = (encoder, audio)

    # -- per sample ------------------------------------------------------------------------------
    def conversation(self, i: int) -> tuple[SpeechRecord, ChatTokens, list[int]]:  # type: ignore[override]
        """(record, tokenised conversation, the kept runs' tiles or chunks) of global sample i (no
        image or clip decoded); `kinds(i)` says which kept run is which."""
        return self._conversation(i)[:3]

    def kinds(self, i: int) -> tuple[str, ...]:
        """ "image" / "speech" of each KEPT placeholder run of global sample i, in order."""
        return self._conversation(i)[3]

    def _conversation(self, i: int):
        with self._lock:
            v = self._records.get(i)
        if v is None:
            rec = self.source.index.record(self.source.position(i))
            tiles = [tiles_of(s, self.tile, self.cfg.max_image_tiles) for s in rec.sizes]
            chunks = [clip_chunks(f, self.speech_tokens) for f in rec.frames]
            try:
                ct, kinds = tokenize_speech_conversation(
                    rec.messages,
                    [t * self.tokens_per_tile for t in tiles],
                    [c * self.speech_tokens for c in chunks],
                    self.tok,
                    self.template,
                )
            except ValueError as exc:
                raise ValueError(f"sample {rec.key}: {exc}") from None
            kept = kept_images(ct, self.seq_length)
            counts, ti, ci = [], iter(tiles), iter(chunks)
            for k in kinds[:kept]:
                counts.append(next(ci) if k == "speech" else next(ti))
            v = (rec, ct, counts, kinds[:kept])
            with self._lock:
                self._records[i] = v
        return v

    def _counts(self, i: int) -> dict[str, int]:
        _, _, counts, kinds = self._conversation(i)
        out = {self.encoder: 0, self.audio: 0}
        for n, k in zip(counts, kinds):
            out[self.audio if k == "speech" else self.encoder] += n
        return out

    def sample_tiles(self, i: int) -> int:
        """Image tiles of global sample i that `batch` feeds the image encoder."""
        return self._counts(i)[self.encoder]

    def _decode(self, i: int) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """{image encoder: [tiles, T, F], audio: [chunks, speech_tokens, 2*bins]} of global sample i's
        kept images and clips (decoded here; cached by `features`, its workers call it ahead)."""
        rec, _, counts, kinds = self._conversation(i)
        self.image_reads.append(i)
        pos = self.source.position(i)
        n_images = kinds.count("image")
        images = [tile_features(self.source.index.image(pos, n), self.cfg) for n in rec.images[:n_images]]
        index = self.source.index
        assert isinstance(index, SpeechIndex)
        clips = [clip_features(index.clip(pos, n), self.speech_tokens) for n in rec.speech[: kinds.count("speech")]]
        want = self._counts(i)
        out = {
            self.encoder: torch.cat(images)
            if images
            else torch.zeros((0, self.tokens_per_tile, self.cfg.feature_dim), dtype=torch.float32),
            self.audio: torch.cat(clips)
            if clips
            else torch.zeros((0, self.speech_tokens, 2 * self.mel_bins), dtype=torch.float32),
        }
        for name, t in out.items():
            if t.shape[0] != want[name]:
                raise ValueError(
                    f"sample {rec.key}: {name} gets {t.shape[0]} tiles/chunks, its record says {want[name]}"
                )
        return out

    def text(self, i: int) -> dict:
        """tokens, labels, loss_mask [seq_length] and `masks` {encoder: [seq_length] bool} of global
        sample i (tokenised once)."""
        self._touch(i)
        if i not in self._texts:
            self.text_reads.append(i)
            _, ct, counts, kinds = self._conversation(i)
            s = train_sample(ct, self.seq_length, self.tok.pad_id)
            masks = {n: torch.zeros(self.seq_length, dtype=torch.bool) for n in self.encoders}
            for (start, length), k in zip(ct.image_spans, kinds):
                masks[self.audio if k == "speech" else self.encoder][start : start + length] = True
            assert bool((masks[self.encoder] | masks[self.audio]).eq(s["image_mask"]).all()), "masks and runs disagree"
            want = self._counts(i)
            assert int(masks[self.encoder].sum()) == want[self.encoder] * self.tokens_per_tile
            assert int(masks[self.audio].sum()) == want[self.audio] * self.speech_tokens
            s["masks"] = masks
            self._texts[i] = s
        return self._texts[i]

    # -- per rows / step -------------------------------------------------------------------------
    def batch(self, samples: range) -> SpeechRowBatch:
        self._rows(samples)
        return SpeechRowBatch(self, samples)

    def row_features(self, samples: range) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """{encoder: [n, tokens, features]}: the tiles / chunks of the rows `samples`, in row order."""
        self._rows(samples)
        per = [self.features(i) for i in samples]
        return {n: torch.cat([p[n] for p in per]) for n in self.encoders}

    def image_tiles(self, samples: range) -> dict[str, list[int]]:
        """{image encoder: tiles per row, audio: chunks per row}, nothing decoded (= batch's `tiles`)."""
        self._rows(samples)
        for i in samples:
            self._touch(i)
        counts = [self._counts(i) for i in samples]
        return {n: [c[n] for c in counts] for n in self.encoders}

    def step_batch(self, step: int) -> dict:
        g = self.global_batch
        samples = range(step * g, (step + 1) * g)
        rows = self.batch(samples)
        return {
            **{k: rows[k] for k in SpeechRowBatch._KEYS},
            "keys": self.keys(step),
            "conversations": [self.conversation(i)[0].messages for i in samples],
        }


def speech_heldout(
    cfg: CaptionDataConfig,
    tok: CaptionTokenizer,
    template: ChatTemplate,
    *,
    encoder: str,
    audio: str = AUDIO,
    speech_tokens: int,
    mel_bins: int,
    seq_length: int,
    global_batch: int,
    split: str = HELDOUT_SPLIT,
) -> SpeechBatches:
    """The held-out split read the same way, in stored order: global sample i is held-out sample i
    mod N. ValueError when the split is empty or missing."""
    out = SpeechBatches(
        replace(cfg, split=split, shuffle=False),
        tok,
        template,
        encoder=encoder,
        audio=audio,
        speech_tokens=speech_tokens,
        mel_bins=mel_bins,
        seq_length=seq_length,
        global_batch=global_batch,
        num_workers=0,
    )
    if out.source.samples_per_epoch == 0:
        raise ValueError(f"--data-path {cfg.path}: the held-out split '{split}' is empty")
    return out

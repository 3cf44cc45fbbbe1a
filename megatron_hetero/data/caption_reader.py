"""The samples of a caption split by GLOBAL sample index: random access where the dataset allows, else
energon's own loader (used by `data.caption_batches` and for evaluation, `heldout_batch`).

Datasets the index does not read (`caption_index.indexable`: a metadataset, another sample type, or
a dataset that names code and runs under --trust-dataset-code) are read by `StreamSource`: energon's
loader as rank 0 of 1, epoch e shuffled by energon with seed offset `epoch_seed(seed, e)`, a position
reached by replay within the epoch, every sample's image decoded, no workers. The previous version of
this module read every dataset that way (the order of a run on the digits changed with this reader).

Both readers check the dataset first (`dataset_trust.check_dataset`, `secure_decoding`): the index
reader decodes images only with PIL and captions only as UTF-8 text.
"""

from __future__ import annotations

import random
import threading
from collections import OrderedDict
from dataclasses import replace
from typing import Optional

import torch

from megatron_hetero.config.data import CaptionDataConfig
from megatron_hetero.data.caption_index import CaptionIndex, SplitIndex, indexable
from megatron_hetero.data.dataset_trust import check_dataset, secure_decoding
from megatron_hetero.data.energon_data import (
    _next,
    caption_text,
    encoder_features,
    epoch_seed,
    open_split,
    text_sample,
)
from megatron_hetero.data.tokenizer import CaptionTokenizer


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """Stored split positions in the order epoch `epoch` reads them: `random.Random(epoch_seed(seed,
    epoch)).shuffle` of 0..n-1 (Python's Mersenne Twister and shuffle, stable across versions), or
    the stored order when not `shuffle`."""
    order = list(range(n))
    if shuffle:
        random.Random(epoch_seed(seed, epoch)).shuffle(order)
    return order


class IndexSource:
    """Global sample i -> key, caption, image by random access (`caption_index.CaptionIndex`): global
    sample i is split position `epoch_order(...)[i % N]` of epoch i // N. Positioning is O(1) (the
    epoch's permutation is computed once, ~0.1 s per 100,000 samples); nothing is replayed."""

    order = "permutation"
    replayed = 0  # never: kept for the same interface as StreamSource

    def __init__(self, cfg: CaptionDataConfig, index: Optional[SplitIndex] = None) -> None:
        """`index`: the split's index (default: `CaptionIndex` of cfg.path, cfg.split); the
        conversation data (`chat_batches`) gives its own, with the same order."""
        self.cfg = cfg
        self.index = CaptionIndex(cfg.path, cfg.split) if index is None else index
        self.samples_per_epoch = len(self.index)
        self._orders: "OrderedDict[int, list[int]]" = OrderedDict()
        self._lock = threading.Lock()

    def position(self, i: int) -> int:
        epoch, j = divmod(i, self.samples_per_epoch)
        with self._lock:
            if epoch not in self._orders:
                c = self.cfg
                self._orders[epoch] = epoch_order(self.samples_per_epoch, c.seed, epoch, c.shuffle)
                while len(self._orders) > 2:
                    self._orders.popitem(last=False)
            return self._orders[epoch][j]

    def seek(self, i: int) -> None:
        self.position(i)

    def key(self, i: int) -> str:
        return self.index.key(self.position(i))

    def caption(self, i: int) -> str:
        return self.index.caption(self.position(i))

    def image(self, i: int) -> torch.Tensor:
        return self.index.image(self.position(i))


class StreamSource:
    """Global sample i -> key, caption, image through energon's own sequential loader (rank 0 of 1):
    for datasets the index reader does not read (`caption_index.indexable`: a metadataset, another
    sample type, a dataset that runs code under --trust-dataset-code). Epoch e is energon's shuffle
    with seed offset `epoch_seed(seed, e)`; reaching a position replays the epoch up to it (at most
    one epoch, ~1,800 samples/s for the digits on one core), and the last `window` samples read stay
    cached. Every sample read decodes its image (energon's loader does), wanted or not."""

    order = "energon-shuffle"

    def __init__(self, cfg: CaptionDataConfig, window: int = 64) -> None:
        self.cfg, self.window = cfg, window
        self._epoch, self._next, self._it = -1, 0, None
        self._cache: "OrderedDict[int, tuple[str, torch.Tensor, str]]" = OrderedDict()
        self.samples_per_epoch = self._open(0)
        self.replayed = 0  # samples read only to reach a position (restore, going back)

    def _open(self, epoch: int) -> int:
        c = self.cfg
        n, self._it = open_split(
            c.path,
            c.split,
            seed=c.seed,
            epoch=epoch,
            shuffle=c.shuffle,
            shuffle_buffer_size=c.shuffle_buffer_size,
            max_samples_per_sequence=c.max_samples_per_sequence,
            trust_code=c.trust_code,
        )
        self._epoch, self._next = epoch, 0
        return n

    def _take(self) -> tuple[str, torch.Tensor, str]:
        """The next sample energon gives, kept in the window (a step's rows come in any order)."""
        s = _next(self._it)
        out = (str(s.__key__), s.image, caption_text(s.caption))
        self._cache[self._epoch * self.samples_per_epoch + self._next] = out
        self._next += 1
        while len(self._cache) > self.window:
            self._cache.popitem(last=False)
        return out

    def seek(self, index: int) -> None:
        """Make sample `index` the next one energon reads (replaying the epoch up to it)."""
        epoch, j = divmod(index, self.samples_per_epoch)
        if epoch != self._epoch or j < self._next:
            self._open(epoch)
        while self._next < j:
            self._take()
            self.replayed += 1

    def read(self, index: int) -> tuple[str, torch.Tensor, str]:
        if index in self._cache:
            return self._cache[index]
        epoch, j = divmod(index, self.samples_per_epoch)
        if epoch == self._epoch and self._next <= j:
            while self._next <= j:  # reading ahead within the epoch is not a replay
                out = self._take()
            return out
        self.seek(index)
        return self._take()

    def key(self, i: int) -> str:
        return self.read(i)[0]

    def caption(self, i: int) -> str:
        return self.read(i)[2]

    def image(self, i: int) -> torch.Tensor:
        return self.read(i)[1]


def open_source(cfg: CaptionDataConfig, window: int = 64) -> "IndexSource | StreamSource":
    """The reader of `cfg.split`: `IndexSource` for a dataset that is plain data and indexable (the
    digits, any `energon prepare`d CaptioningSample folder), else `StreamSource`. Either way the
    dataset is checked first (`dataset_trust.check_dataset`: refused when it names code and not
    `trust_code`); a dataset that names code (trusted) is read by energon, which runs it."""
    found = check_dataset(cfg.path, trust=cfg.trust_code)
    secure_decoding(cfg.trust_code)
    if not found and indexable(cfg.path) is None:
        return IndexSource(cfg)
    return StreamSource(cfg, window=window)


def heldout_batch(
    cfg: CaptionDataConfig,
    tok: CaptionTokenizer,
    *,
    encoder: str,
    seq_length: int,
    split: str = "val",
    limit: Optional[int] = None,
) -> dict:
    """Every sample of `split` in stored order (no shuffle), stacked as `CaptionBatches.step_batch`
    (for evaluation, e.g. `caption_eval.greedy_digit_accuracy`). Read by index where the dataset
    allows (`open_source`), else by energon's loader; the stored order is the same."""
    c = replace(cfg, split=split, shuffle=False)
    src = open_source(c)
    n = src.samples_per_epoch if limit is None else min(src.samples_per_epoch, limit)
    rows = [(src.key(i), src.image(i), src.caption(i)) for i in range(n)]
    texts = [
        text_sample(cap, tok, seq_length=seq_length, image_tokens=c.image_tokens, prompt=c.prompt) for *_, cap in rows
    ]
    return {
        "tokens": torch.stack([t["tokens"] for t in texts]),
        "labels": torch.stack([t["labels"] for t in texts]),
        "loss_mask": torch.stack([t["loss_mask"] for t in texts]),
        "features": {encoder: torch.stack([encoder_features(img, c) for _, img, _ in rows])},
        "keys": [k for k, *_ in rows],
        "captions": [cap for *_, cap in rows],
    }

"""`ChatBatches`: a conversation dataset (`megatron-hetero data digits --chat`, `data.chat_data`) as
TRAINING batches for the LLaVA model, with a variable number of image tokens per sample (image tiles).

Image tiles (LLaVA-NeXT "anyres"-like). Every image is cut into square tiles of the encoder's native
side `tile` (`cfg.image_size`, default 8 pixels: the digits are 8x8): an H x W image is a grid of
ceil(H/tile) x ceil(W/tile) tiles (an image whose sides are not multiples of `tile` is resized
to the grid first, bilinear, as `energon_data.patchify` resizes), in row-major order; a 16x16 image
is 2x2 = 4 tiles. Each tile is `T = (tile/patch)^2` encoder tokens of `F = channels*patch^2`
features, cut exactly as the caption path cuts an 8x8 digit (`energon_data.patchify`: grey = the
mean of R, G, B, scaled to [-1, 1], patches row-major). Within a conversation each `<image>` marker
becomes `tiles(image) * T` placeholder ids (`chat_tokens.tokenize_conversation`).

The batch contract (`batch(samples)` for the global sample indices `samples`, within one step):

  * `tokens`, `labels` LongTensor [rows, S], `loss_mask` float [rows, S]: `chat_tokens.train_sample`
    (S = seq_length; the loss covers the assistant turns and their end-of-turn token);
  * `image_mask` {encoder: BoolTensor [rows, S]}: True at the placeholder positions;
  * `features` {encoder: float [n_tiles, T, F]}: the tiles of all rows, row by row, within a row
    image by image, within an image tile by tile (row-major);
  * `tiles` {encoder: LongTensor [rows]}: tiles per row, = image_mask[r].sum() / T. An image whose
    placeholder run does not end within the S `tokens` is dropped whole by `train_sample`, with every
    image after it; its tiles are dropped too (never decoded).

`image_tiles(samples)` gives the same tiles per row WITHOUT decoding any image: from the sample JSON's
"sizes" (the digits write them; else from each image member's header, which PIL reads without
decoding) and the cut at S, which needs only the tokenised text. `loss_tokens(step)` is the sum of
`loss_mask` over the step's global batch [step*G, (step+1)*G): text only, the same on every rank.

Sample order: as `caption_batches.CaptionBatches` (this class is one): global sample i is split
position `caption_reader.epoch_order(N, seed, i // N, shuffle)[i % N]`, a permutation per epoch,
deterministic in (seed, i) and independent of the layout. The split is read by random access
(`ChatIndex`, energon's `.nv-meta/index.sqlite`): a rank decodes exactly the images of the rows it is
asked for `features` of, and with `num_workers` > 0 the same rows of the next step in the background;
lazy `ChatRowBatch` keys, the cache of the current and previous step, `state_dict`/`load_state_dict`
are CaptionBatches' own.

Which datasets: an `energon prepare`d crude WebDataset (`dataset.yaml`: megatron.energon's
`CrudeWebdataset`, no `sample_loader`/`part_filter`/`subflavors`) of the layout `data.chat_data`
reads (`KEY.json` with a "conversation", image members in its "images" order); images are decoded only
with PIL, the JSON only as JSON. A dataset that names code is refused (`dataset_trust`), also under
--trust-dataset-code: energon's loader, which would run it, is not wired to the tiles path.

Native resolution (`native`: a Qwen2.5-VL tower, `data.qwen_image_processor.QwenImageProcessor`):
no tiles; each image goes through the Qwen image processor whole (`smart_resize` to multiples of
patch * merge within its min/max pixels), so its token count is its (rows x cols) of merged tokens
and a "tile" is ONE merged token (T = 1, `cfg.image_size` = `cfg.patch_size` = patch * merge):
`features` [n_tokens, 1, merge**2 * 3*T*p*p] (the images' merged tokens, row by row, image by
image, each row-major), `tiles` the merged tokens per row, and `image_grids(samples)` each row's
kept images' (rows, cols), from the sizes alone (no image decoded): every rank derives the tower's
`grid_thw` and the M-RoPE ids from it; nothing about it crosses the wire.

`chat_heldout(...)`: the held-out split ("val") the same way, in stored order (global sample i is
held-out sample i mod N), for evaluation (`models.chat_runner`).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, Union

import torch

from megatron_hetero.data.caption_batches import CaptionBatches, RowBatch
from megatron_hetero.config.data import CaptionDataConfig
from megatron_hetero.data.caption_index import (
    IMAGE_EXTENSIONS,
    META_DIR,
    SplitIndex,
    _read_yaml,
    decode_image,
    image_size_of,
)
from megatron_hetero.data.caption_reader import IndexSource
from megatron_hetero.data.chat_data import conversation_of
from megatron_hetero.data.chat_template import ChatTemplate
from megatron_hetero.data.chat_tokens import (
    ChatTokens,
    kept_images,
    marker_tokenizer,
    tokenize_conversation,
    train_sample,
)
from megatron_hetero.data.dataset_trust import check_dataset
from megatron_hetero.data.energon_data import image_processor_of, patchify
from megatron_hetero.data.image_processor import caption_features, caption_format
from megatron_hetero.data.qwen_image_processor import QwenImageProcessor
from megatron_hetero.data.tokenizer import CaptionTokenizer

HELDOUT_SPLIT = "val"
DEFAULT_TILE = 8  # the digits' side: one 8x8 digit is one tile
JSON_PART = "json"


def chat_indexable(path: Union[str, Path]) -> Optional[str]:
    """None when `ChatIndex` can read the dataset at `path` (module docstring), else why not."""
    meta = Path(path) / META_DIR
    for name in ("index.sqlite", ".info.json", "split.yaml", "dataset.yaml"):
        if not (meta / name).is_file():
            return f"no {META_DIR}/{name} (not a folder energon prepare indexed)"
    doc = _read_yaml(meta / "dataset.yaml")
    if not (doc.get("__module__") == "megatron.energon" and doc.get("__class__") == "CrudeWebdataset"):
        return f"dataset.yaml is {doc.get('__module__')}.{doc.get('__class__')}, not megatron.energon's CrudeWebdataset"
    for key in ("sample_loader", "part_filter", "subflavors"):
        if doc.get(key):
            return f"dataset.yaml has {key}"
    return None


def is_chat_dataset(path: Union[str, Path]) -> bool:
    """Whether `path` is a crude (conversation) energon dataset rather than a typed one (e.g. the
    caption data's CaptioningSample): its `dataset.yaml` names megatron.energon's CrudeWebdataset."""
    f = Path(path) / META_DIR / "dataset.yaml"
    if not f.is_file():
        return False
    try:
        doc = _read_yaml(f)
    except Exception:  # not YAML: let the caption path report it
        return False
    return doc.get("__module__") == "megatron.energon" and doc.get("__class__") == "CrudeWebdataset"


@dataclass(frozen=True)
class ChatRecord:
    """One conversation sample as read from its JSON: key, normalised messages, image member names
    (in the order of the markers) and each image's (H, W)."""

    key: str
    messages: list
    images: tuple[str, ...]
    sizes: tuple[tuple[int, int], ...]


class ChatIndex(SplitIndex):
    """One split of a crude conversation dataset by position in its stored order: `record(p)` (the
    JSON only, plus image headers when the JSON has no "sizes") and `image(p, name)` (PIL-decoded
    float RGB [3, H, W] in [0, 1])."""

    def __init__(self, path: Union[str, Path], split: str) -> None:
        why = chat_indexable(path)
        if why:
            raise ValueError(f"--data-path {path}: cannot read the conversations by index: {why}")
        super().__init__(path, split)

    def record(self, pos: int) -> ChatRecord:
        """The conversation at split position `pos`. ValueError naming the sample for a bad JSON, a
        marker count that differs from its images, or an image member that is not an image."""
        key = self.key(pos)
        parts = self.parts(pos)
        if JSON_PART not in parts:
            raise ValueError(f"sample {key}: no JSON part (KEY.json with a 'conversation')")
        try:
            doc = json.loads(self.member(pos, JSON_PART).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"sample {key}: its JSON does not parse ({exc})") from None
        raw = {JSON_PART: doc, **{p: p for p in parts if p != JSON_PART}}
        messages, names, meta = conversation_of(raw, key)  # names: the image parts, in marker order
        for n in names:
            if n.rsplit(".", 1)[-1].lower() not in IMAGE_EXTENSIONS:
                raise ValueError(f"sample {key}: image part '{n}' is not an image member ({sorted(IMAGE_EXTENSIONS)})")
        sizes = meta.get("sizes")
        if isinstance(sizes, list) and len(sizes) == len(names) and all(isinstance(s, int) and s > 0 for s in sizes):
            hw = tuple((s, s) for s in sizes)  # the digits' JSON: square images of side s
        else:
            hw = tuple(image_size_of(self.member(pos, n)) for n in names)
        return ChatRecord(key, messages, tuple(names), hw)

    def image(self, pos: int, name: str) -> torch.Tensor:
        return decode_image(self.member(pos, name))


def tile_grid(size: tuple[int, int], tile: int, max_tiles: int = 0) -> tuple[int, int]:
    """(rows, columns) of tiles of an (H, W) image: ceil(H/tile) x ceil(W/tile), then, while there
    are more than `max_tiles` (0: no bound), one fewer along the side with more (the image is resized
    to the grid: `tile_features`)."""
    h, w = size
    gh, gw = -(-h // tile), -(-w // tile)
    while max_tiles and gh * gw > max_tiles:
        if gh >= gw:
            gh -= 1
        else:
            gw -= 1
    return gh, gw


def tiles_of(size: tuple[int, int], tile: int, max_tiles: int = 0) -> int:
    """Tiles of an (H, W) image (`tile_grid`)."""
    gh, gw = tile_grid(size, tile, max_tiles)
    return gh * gw


def tile_features(image: torch.Tensor, cfg: CaptionDataConfig) -> torch.Tensor:
    """A decoded image [C, H, W] -> its tiles' encoder features [tiles, T, F] (module docstring):
    `energon_data.patchify` of the whole image at the tile grid's size, its patches regrouped tile by
    tile (row-major), each tile's patches row-major: the same as patchifying each tile on its own.
    With `cfg.image_processor` (the tower's preprocessing; the tile side is its output size): the image
    is resized to the grid (bilinear, antialiased, as `patchify` resizes), then each tile goes through
    the processor on its own (`image_processor.caption_features`): its resize and crop leave a tile of
    the output size as it is, its rescale, normalisation and RGB make the pixels the tower's."""
    tile, _ = cfg.image_size
    p = cfg.patch_size
    h, w = int(image.shape[-2]), int(image.shape[-1])
    gh, gw = tile_grid((h, w), tile, cfg.max_image_tiles)
    if cfg.image_processor:
        x = image.float().unsqueeze(0) if image.dim() == 3 else image.float().view(1, 1, h, w)
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        if (h, w) != (gh * tile, gw * tile):
            x = torch.nn.functional.interpolate(
                x, size=(gh * tile, gw * tile), mode="bilinear", align_corners=False, antialias=True
            )
        proc = image_processor_of(cfg)
        tiles = [x[0, :, i * tile : (i + 1) * tile, j * tile : (j + 1) * tile] for i in range(gh) for j in range(gw)]
        return torch.stack([caption_features(t.clamp(0, 1), proc, p) for t in tiles])
    x = patchify(image, replace(cfg, image_size=(gh * tile, gw * tile)))  # [(gh*q)*(gw*q), F]
    q = tile // p
    return x.reshape(gh, q, gw, q, x.shape[-1]).permute(0, 2, 1, 3, 4).reshape(gh * gw, q * q, x.shape[-1])


def resolve_native_config(cfg: CaptionDataConfig, proc: QwenImageProcessor) -> CaptionDataConfig:
    """`cfg` for conversation data read at native resolution (module docstring): `kind` "chat", RGB,
    `image_size` and `patch_size` one merged token's side (patch * merge), so `cfg.image_tokens` is 1.
    ValueError for a dataset that names code."""
    check_dataset(cfg.path, trust=cfg.trust_code)
    side = proc.patch_size * proc.merge_size
    out = replace(cfg, image_size=(side, side), patch_size=side, channels=3, kind="chat")
    out.validate()
    return out


def resolve_chat_config(cfg: CaptionDataConfig, tile: int = DEFAULT_TILE, probe: int = 32) -> CaptionDataConfig:
    """`cfg` for conversation data (`kind` "chat"): `image_size` = (tile, tile) (so `cfg.image_tokens` is T and
    `cfg.feature_dim` F) and `channels` (given, else 1 when the images of the split's first `probe`
    samples, stored order, are all grey, else 3; decodes those images). ValueError for an image
    processor (not supported with tiles), a tile side not divisible by the patch size, or a dataset
    this reader cannot read."""
    check_dataset(cfg.path, trust=cfg.trust_code)  # before any member is read: refused when it names code
    if cfg.image_processor:  # the tile is the processor's output (e.g. 336 for CLIP ViT-L/14-336), RGB
        fmt = caption_format(image_processor_of(cfg), cfg.patch_size)
        if tile != DEFAULT_TILE and (tile, tile) != fmt["image_size"]:
            raise ValueError(
                f"--image-processor {cfg.image_processor}: gives {fmt['image_size'][0]}x{fmt['image_size'][1]} "
                f"images; the encoder's tiles are {tile}x{tile}"
            )
        tile, cfg = fmt["image_size"][0], replace(cfg, channels=3)
    if tile < 1:
        raise ValueError(f"tile side {tile}: must be >= 1")
    out = replace(cfg, image_size=(tile, tile), kind="chat")
    out.validate()
    if out.channels is None:
        index = ChatIndex(cfg.path, cfg.split)
        grey = True
        for pos in range(min(len(index), probe)):
            for name in index.record(pos).images:
                im = index.image(pos, name)
                grey = grey and bool((im[0] == im[1]).all() and (im[1] == im[2]).all())
        index.close()
        out = replace(out, channels=1 if grey else 3)
    return out


class ChatRowBatch(RowBatch):
    """The rows `samples` of one step in the batch contract (module docstring), each key built on first
    access (`caption_batches.RowBatch`): an encoder stage reads `features` (images decoded) or `tiles`
    (no image), a language stage the text keys and `image_mask` (conversations tokenised), a middle
    pipeline stage nothing."""

    _KEYS = ("tokens", "labels", "loss_mask", "image_mask", "features", "tiles")

    def _build(self, key: str) -> Any:
        o, rows = self._owner, self._samples
        if key == "features":
            return {o.encoder: o.row_features(rows)}
        if key == "tiles":
            return {o.encoder: torch.tensor(o.image_tiles(rows)[o.encoder], dtype=torch.long)}
        if key == "image_mask":
            return {o.encoder: torch.stack([o.text(i)["image_mask"] for i in rows])}
        return torch.stack([o.text(i)[key] for i in rows])


class ChatBatches(CaptionBatches):
    """The conversation samples of a run by global sample index, for one rank (module docstring):
    `batch(samples)` (lazy `ChatRowBatch`), `image_tiles(samples)`, `loss_tokens(step)`, `keys(step)`,
    `step_batch(step)` (a whole step: tests and tools), and CaptionBatches' `state_dict`/
    `load_state_dict`. `cfg` comes from `resolve_chat_config` (its `image_size` is the tile);
    `template` renders the conversations. `image_reads` lists the global samples whose features were
    built (their kept images decoded; a text-only row decodes none), `text_reads` those whose
    training sample was built (every sample's conversation is tokenised for `loss_tokens`)."""

    def __init__(
        self,
        cfg: CaptionDataConfig,
        tok: CaptionTokenizer,
        template: ChatTemplate,
        *,
        encoder: str,
        seq_length: int,
        global_batch: int,
        num_workers: Optional[int] = None,
        native: Optional[QwenImageProcessor] = None,
    ) -> None:
        if not cfg.resolved() or cfg.image_size[0] != cfg.image_size[1]:
            raise ValueError("ChatBatches needs a config from resolve_chat_config (square tile, channels known)")
        self.native = native
        if native is not None and cfg.image_tokens != 1:
            raise ValueError("native-resolution conversation data needs a config from resolve_native_config")
        if cfg.image_processor and native is None:
            raise ValueError("--image-processor: conversation data cuts images into tiles itself (not supported yet)")
        if check_dataset(cfg.path, trust=cfg.trust_code):  # refused above unless trusted; trusted code is not run
            raise ValueError(
                f"--data-path {cfg.path}: the dataset names code; conversation data is read by index, which runs none"
            )
        self.tile = cfg.image_size[0]
        self.tokens_per_tile = cfg.image_tokens
        if seq_length < self.tokens_per_tile + 1:
            raise ValueError(
                f"--seq-length {seq_length}: too short for any image (one {self.tile}x{self.tile} tile is "
                f"{self.tokens_per_tile} tokens, and a sample needs text around it)"
            )
        if global_batch < 1:
            raise ValueError(f"global batch {global_batch}: must be >= 1")
        source = IndexSource(cfg, index=ChatIndex(cfg.path, cfg.split))
        super().__init__(
            cfg,
            tok,
            encoder=encoder,
            seq_length=seq_length,
            global_batch=global_batch,
            num_workers=num_workers,
            source=source,
        )
        self.template = template
        marker_tokenizer(tok.tokenizer, extra=template.markers)  # made once here, not first by a prefetch thread
        self._records: dict[int, tuple[ChatRecord, ChatTokens, list[int]]] = {}
        self._lock = threading.Lock()  # _records is also filled from the prefetch threads

    # -- per sample ------------------------------------------------------------------------------
    def image_count(self, size: tuple[int, int]) -> int:
        """Tiles (native resolution: merged tokens) of an image of `size` (H, W), no pixel read."""
        if self.native is not None:
            h, w = self.native.merged_grid(size)
            return h * w
        return tiles_of(size, self.tile, self.cfg.max_image_tiles)

    def conversation(self, i: int) -> tuple[ChatRecord, ChatTokens, list[int]]:
        """(record, tokenised conversation, tiles of each KEPT image) of global sample i (no image
        decoded; read and tokenised once per step window)."""
        with self._lock:
            v = self._records.get(i)
        if v is None:
            rec = self.source.index.record(self.source.position(i))
            tiles = [self.image_count(s) for s in rec.sizes]
            try:
                ct = tokenize_conversation(
                    rec.messages, [t * self.tokens_per_tile for t in tiles], self.tok, self.template
                )
            except ValueError as exc:
                raise ValueError(f"sample {rec.key}: {exc}") from None
            v = (rec, ct, tiles[: kept_images(ct, self.seq_length)])
            with self._lock:
                self._records[i] = v
        return v

    def sample_tiles(self, i: int) -> int:
        """Tiles of global sample i that `batch` feeds the encoder (its kept images'), no image decoded."""
        return sum(self.conversation(i)[2])

    def _decode(self, i: int) -> torch.Tensor:
        """[tiles, T, F] of global sample i's kept images (decoded here; CaptionBatches' `features`
        caches it and its workers call it ahead)."""
        rec, _, kept = self.conversation(i)
        self.image_reads.append(i)
        pos = self.source.position(i)
        images = (self.source.index.image(pos, name) for name in rec.images[: len(kept)])
        if self.native is not None:
            parts = [self.native.merged_tokens(im).unsqueeze(1) for im in images]
        else:
            parts = [tile_features(im, self.cfg) for im in images]
        if not parts:
            width = self.cfg.feature_dim if self.native is None else self.native.feature_dim
            return torch.zeros((0, self.tokens_per_tile, width), dtype=torch.float32)
        out = torch.cat(parts)
        if out.shape[0] != sum(kept):
            raise ValueError(f"sample {rec.key}: its images give {out.shape[0]} tiles, its JSON sizes {sum(kept)}")
        return out

    def text(self, i: int) -> dict:
        """tokens, labels, loss_mask, image_mask [seq_length] of global sample i (tokenised once)."""
        self._touch(i)
        if i not in self._texts:
            self.text_reads.append(i)
            _, ct, kept = self.conversation(i)
            s = train_sample(ct, self.seq_length, self.tok.pad_id)
            assert int(s["image_mask"].sum()) == sum(kept) * self.tokens_per_tile, "image_mask and tiles disagree"
            self._texts[i] = s
        return self._texts[i]

    def _touch(self, i: int) -> None:
        step = i // self.global_batch
        if step != self._step:
            lo, hi = (step - 1) * self.global_batch, (step + 2) * self.global_batch
            with self._lock:
                for k in [k for k in self._records if not lo <= k < hi]:
                    del self._records[k]
        super()._touch(i)

    # -- per rows / step -------------------------------------------------------------------------
    def batch(self, samples: range) -> ChatRowBatch:
        """Global samples `samples` (within one step) in the batch contract; keys built when read."""
        self._rows(samples)
        return ChatRowBatch(self, samples)

    def row_features(self, samples: range) -> torch.Tensor:
        """[n_tiles, T, F]: the tiles of the rows `samples`, in row order (decoded once each)."""
        self._rows(samples)
        return torch.cat([self.features(i) for i in samples])

    def image_tiles(self, samples: range) -> dict[str, list[int]]:
        """{encoder: tiles per row} of the rows `samples`, without decoding any image (= batch's `tiles`)."""
        self._rows(samples)
        for i in samples:
            self._touch(i)
        return {self.encoder: [self.sample_tiles(i) for i in samples]}

    def image_grids(self, samples: range) -> dict[str, list[list[tuple[int, int]]]]:
        """{encoder: per row its kept images' (rows, cols) of merged tokens} (native resolution only;
        module docstring), from the sizes: no image decoded."""
        if self.native is None:
            raise ValueError("image grids: conversation data read in tiles has none (native resolution only)")
        self._rows(samples)
        out = []
        for i in samples:
            self._touch(i)
            rec, _, kept = self.conversation(i)
            out.append([self.native.merged_grid(s) for s in rec.sizes[: len(kept)]])
        return {self.encoder: out}

    def loss_tokens(self, step: int) -> int:
        """Sum of `loss_mask` over the whole global batch of `step` (text only: no image decoded)."""
        if step not in self._loss:
            g = self.global_batch
            self._touch(step * g)
            self._loss[step] = int(sum(int(self.text(i)["loss_mask"].sum()) for i in range(step * g, (step + 1) * g)))
        return self._loss[step]

    def step_batch(self, step: int) -> dict:
        """Every sample of step `step` in the batch contract (decoded), plus `keys` and `conversations`."""
        g = self.global_batch
        samples = range(step * g, (step + 1) * g)
        rows = self.batch(samples)
        return {
            **{k: rows[k] for k in ChatRowBatch._KEYS},
            "keys": self.keys(step),
            "conversations": [self.conversation(i)[0].messages for i in samples],
        }


def chat_heldout(
    cfg: CaptionDataConfig,
    tok: CaptionTokenizer,
    template: ChatTemplate,
    *,
    encoder: str,
    seq_length: int,
    global_batch: int,
    split: str = HELDOUT_SPLIT,
    native: Optional[QwenImageProcessor] = None,
) -> ChatBatches:
    """The held-out split read the same way, in stored order (no shuffle): global sample i is held-out
    sample i mod N. ValueError when the split is empty or missing."""
    out = ChatBatches(
        replace(cfg, split=split, shuffle=False),
        tok,
        template,
        encoder=encoder,
        seq_length=seq_length,
        global_batch=global_batch,
        num_workers=0,
        native=native,
    )
    if out.source.samples_per_epoch == 0:
        raise ValueError(f"--data-path {cfg.path}: the held-out split '{split}' is empty")
    return out

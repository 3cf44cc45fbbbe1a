"""Where `train`'s image-caption data comes from, as plain data (pure: no torch; the loader is
`data.energon_data`). `CaptionDataConfig` is the resolved configuration a job carries
(`config.job.JobConfig.data`); `DataFlags` the choice of the data source on `train`'s command
line. The fields with a flag carry its name and help (`layout.flags`): `cli.data.add_train_data_flags`
generates train's data flags from them; train's door reads them into a `DataRequest`, what
`models.caption_runner.caption_job_data` takes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from megatron_hetero.layout.flags import flag_field, flags_of


@dataclass(frozen=True)
class DataFlags:
    """Which data `train` reads: an energon captioning dataset (--data-path), or the synthetic data
    (the default; --mock-data says so explicitly)."""

    data_path: Optional[str] = flag_field(
        None,
        "an energon captioning dataset (image + caption), e.g. from `megatron-hetero data digits`; the "
        "encoder's tokens/features come from its images and --patch-size, the vocabulary from the tokenizer "
        "(default: synthetic data)",
        group="data",
    )
    mock_data: bool = flag_field(False, "synthetic data (the default without --data-path)", group="data")


@dataclass(frozen=True)
class CaptionDataConfig:
    """Where the caption data comes from and how a sample is shaped (see the module docstring).
    `image_size` (H, W) and `channels` None: taken from the data by `resolve_config`."""

    path: str
    tokenizer_model: Optional[str] = flag_field(  # None: the shipped tokenizer (data/tokenizer.py)
        None, "a Hugging Face tokenizer.json (default: the shipped byte-level BPE, no download)", group="data"
    )
    split: str = "train"
    seed: int = 1234  # train: --seed
    patch_size: int = flag_field(
        4, "image patch size in pixels (default {default}): one encoder token per patch", group="data", given=True
    )
    image_size: Optional[tuple[int, int]] = None
    channels: Optional[int] = None
    # --image-processor: the tower's own preprocessing (data/image_processor.py) instead of `patchify`'s
    # [-1, 1] scaling; it fixes image_size (its output size) and channels (3)
    image_processor: Optional[str] = flag_field(
        None,
        "the vision tower's Hugging Face preprocessor_config.json (or the folder holding it): images are "
        "preprocessed as the tower was pretrained (RGB, resize, center crop, rescale, normalise; CLIP and "
        "SigLIP processors) instead of being scaled to [-1, 1]; its output size is the image size",
        group="data",
    )
    prompt: str = flag_field(
        "",
        "text between the image and the caption (not in the loss; default none)",
        flag="--data-prompt",
        group="data",
        given=True,
    )
    shuffle: bool = True
    shuffle_buffer_size: int = 100
    max_samples_per_sequence: int = 100
    # --trust-dataset-code: let the dataset run the code it names (`data.dataset_trust`); `trusted`:
    # what it names (`Finding.line()`s), printed once on rank 0
    trust_code: bool = flag_field(
        False,
        "let the dataset run the code it names (energon sample_loader/part_filter Python files, "
        "__module__/__function__ outside megatron.energon, pickle/torch.load-decoded members); without it "
        "such a dataset is refused (exit 2) and members are decoded in webdataset's secure mode",
        flag="--trust-dataset-code",
        group="data",
    )
    trusted: tuple[str, ...] = ()
    # --num-workers (Megatron's flag and default): threads that decode the next step's images ahead
    # (`caption_batches.CaptionBatches`); the batches do not depend on it
    num_workers: int = flag_field(
        2,
        "threads that decode the next step's images in the background on each rank (default {default}, as "
        "Megatron's; 0: decode when a stage asks); the batches are the same for any value",
        group="data",
    )

    # what the dataset holds: "caption" (image + caption: `caption_runner`) or "chat" (conversations with
    # image tiles: `chat_runner`; `image_size` is then the tile) or "speech" (spoken digits: images and
    # speech clips, `speech_runner`); `job_data` picks it from the dataset
    kind: str = "caption"

    # conversations (`data.chat_batches`): at most this many tiles per image, 0: no bound
    max_image_tiles: int = flag_field(
        0,
        "conversation data: at most N tiles per image; a larger image is resized to fit the grid (1: "
        "every image one tile of the tower's size, as LLaVA-1.5 resizes; default {default}: "
        "ceil(H/tile) x ceil(W/tile) tiles)",
        group="data",
    )

    def resolved(self) -> bool:
        return self.image_size is not None and self.channels is not None

    @property
    def image_tokens(self) -> int:
        h, w = self._size()
        return (h // self.patch_size) * (w // self.patch_size)

    @property
    def feature_dim(self) -> int:
        self._size()
        assert self.channels is not None  # resolved
        return self.channels * self.patch_size**2

    def _size(self) -> tuple[int, int]:
        if self.image_size is None or self.channels is None:
            raise ValueError("caption data config is not resolved (image_size/channels unknown): call resolve_config")
        return self.image_size

    def validate(self) -> None:
        if self.kind not in ("caption", "chat", "speech"):
            raise ValueError(f"data kind {self.kind!r}: caption, chat or speech")
        if self.num_workers < 0:
            raise ValueError(f"--num-workers {self.num_workers}: must be >= 0")
        if self.max_image_tiles < 0:
            raise ValueError(f"--max-image-tiles {self.max_image_tiles}: must be >= 0")
        if self.patch_size < 1:
            raise ValueError(f"--patch-size {self.patch_size}: must be >= 1")
        if self.channels is not None and self.channels not in (1, 3):
            raise ValueError(f"image channels must be 1 (grey) or 3 (RGB), got {self.channels}")
        if self.image_size is not None:
            h, w = self.image_size
            if h % self.patch_size or w % self.patch_size:
                raise ValueError(
                    f"image size {h}x{w} is not divisible by --patch-size {self.patch_size} "
                    f"(remainders {h % self.patch_size}, {w % self.patch_size})"
                )


def _config_default(name: str):
    """The default of `CaptionDataConfig`'s field `name` (its flag's, when not given)."""
    return next(f.default for f in dataclasses.fields(CaptionDataConfig) if f.name == name)


@dataclass(frozen=True)
class DataRequest:
    """What `train`'s flags ask of the data, read once at its door (`cli.train_door.data_request`)
    and taken by `models.job_data.job_data`: the data flags' values (`data_flag_fields`: a flag not
    given holds its field's default), --seed, and the model flags the data fills in or checks (None:
    not given): --vocab-size, --encoder-tokens, --encoder-feature-dim, --audio-model-type, and whether
    --seq-length was given (with --load: the checkpoint's model gives the vocabulary and the sequence length)."""

    data_path: Optional[str] = None
    mock_data: bool = False
    tokenizer_model: Optional[str] = _config_default("tokenizer_model")
    patch_size: int = _config_default("patch_size")
    image_processor: Optional[str] = _config_default("image_processor")
    prompt: str = _config_default("prompt")
    trust_code: bool = _config_default("trust_code")
    num_workers: int = _config_default("num_workers")
    max_image_tiles: int = _config_default("max_image_tiles")
    seed: int = 1234
    vocab_size: Optional[int] = None
    encoder_tokens: Optional[int] = None
    encoder_feature_dim: Optional[int] = None
    audio_model_type: Optional[str] = None
    seq_length_given: bool = False


def data_flag_fields() -> list[dataclasses.Field]:
    """train's data flags, in --help order."""
    return (
        flags_of(DataFlags, ["data_path"])
        + flags_of(CaptionDataConfig, ["tokenizer_model"])
        + flags_of(DataFlags, ["mock_data"])
        + flags_of(
            CaptionDataConfig,
            ["patch_size", "image_processor", "prompt", "trust_code", "num_workers", "max_image_tiles"],
        )
    )

"""The digits conversations read at native resolution by the tiny Qwen2.5-VL tower of
`tests/qwen_train_case.py` through a Qwen image processor config (patch 2, merge 2, max_pixels 144),
shared by the data (tests/e2e) and parity (tests/ranks) tests. The images: 8x8 digits (2 x 2 merged
tokens), 16x16 ones scaled down by the processor to 12x12 (3 x 3), and, in every other sample, its
16x16 images squeezed to 8 rows x 16 columns (2 x 4): images of different heights and widths; the
JSON then holds no "sizes" (the reader takes each image's header)."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

PROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "patch_size": 2,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "min_pixels": 16,
    "max_pixels": 144,
}
GRIDS = {(8, 8): (2, 2), (16, 16): (3, 3), (8, 16): (2, 4)}  # image (H, W) -> (rows, cols) of merged tokens


def _squeeze(png: bytes) -> bytes:
    """A 16x16 PNG as 8 rows x 16 columns (nearest)."""
    from PIL import Image

    with Image.open(io.BytesIO(png)) as im:
        out = io.BytesIO()
        im.resize((16, 8), resample=Image.NEAREST).save(out, format="PNG")
    return out.getvalue()


def _rewrite(tar: Path) -> None:
    from megatron_hetero.data.digits import add_tar_member

    with tarfile.open(tar) as tf:
        members = [(m.name, tf.extractfile(m).read()) for m in tf.getmembers()]
    docs = {n.split(".", 1)[0]: json.loads(d) for n, d in members if n.endswith(".json")}
    with tarfile.open(tar, "w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in members:
            key, part = name.split(".", 1)
            doc = docs[key]
            if part == "json":
                data = json.dumps({k: v for k, v in doc.items() if k != "sizes"}, sort_keys=True).encode()
            elif int(key) % 2 and doc["sizes"][doc["images"].index(part)] == 16:
                data = _squeeze(data)
            add_tar_member(tf, name, data)


def write_case(out: Path, samples: int = 24, val_samples: int = 4) -> tuple[Path, Path]:
    """(the conversation dataset, the folder of its preprocessor_config.json) under `out`."""
    from megatron_hetero.data.digits_chat import prepare_conversations, write_digits_chat_dataset

    data, proc = out / "chat", out / "processor"
    write_digits_chat_dataset(
        data, samples=samples, val_samples=val_samples, train_shards=1, sizes=(8, 16), prepare=False
    )
    for tar in sorted(data.glob("*/shard-*.tar")):
        _rewrite(tar)
    prepare_conversations(data)
    proc.mkdir()
    (proc / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return data, proc

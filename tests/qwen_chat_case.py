"""The digits conversations at 8x8 and 16x16 read at native resolution by the tiny Qwen2.5-VL tower of
`tests/qwen_train_case.py` through a Qwen image processor config (patch 2, merge 2, max_pixels 144:
an 8x8 digit is 2 x 2 merged tokens, a 16x16 one is scaled down to 12x12, 3 x 3), shared by the data
(tests/e2e) and parity (tests/ranks) tests."""

from __future__ import annotations

import json
from pathlib import Path

PROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "patch_size": 2,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "min_pixels": 16,
    "max_pixels": 144,
}
GRIDS = {8: (2, 2), 16: (3, 3)}  # the image side -> its (rows, cols) of merged tokens


def write_case(out: Path, samples: int = 24, val_samples: int = 4) -> tuple[Path, Path]:
    """(the conversation dataset, the folder of its preprocessor_config.json) under `out`."""
    from megatron_hetero.data.digits_chat import write_digits_chat_dataset

    data, proc = out / "chat", out / "processor"
    write_digits_chat_dataset(data, samples=samples, val_samples=val_samples, train_shards=1, sizes=(8, 16))
    proc.mkdir()
    (proc / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return data, proc

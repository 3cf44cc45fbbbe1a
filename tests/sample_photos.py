"""scikit-learn's two bundled photographs (china.jpg, flower.jpg, 640x427 RGB), for the image
preprocessing tests (tests/pure/test_image_processor.py, tests/e2e/test_image_processor_tower.py)."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path


def photos() -> dict:
    """name -> PIL RGB image: the pixels of `sklearn.datasets.load_sample_images()`, read from the
    package's files with PIL as that function reads them, without importing scikit-learn (seconds)."""
    from PIL import Image

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("scikit-learn is not installed (the test extra)")
    folder = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "images"
    out = {}
    for name in ("china", "flower"):
        with Image.open(folder / f"{name}.jpg") as im:
            out[name] = im.convert("RGB")
    assert all(im.size == (640, 427) for im in out.values())
    return out


def energon_decoded(pil):
    """(energon's default decoding of `pil` stored as PNG: webdataset's `torchrgb`, float CHW in
    [0, 1]; the PIL image transformers would be given for the same file)."""
    from PIL import Image
    from webdataset.autodecode import imagehandler

    buf = io.BytesIO()
    pil.save(buf, format="PNG")
    data = buf.getvalue()
    return imagehandler("torchrgb")("sample.png", data), Image.open(io.BytesIO(data))

"""Hardware descriptions shipped with the package (published figures of one accelerator type and
its cluster), for `megatron-hetero search --hardware NAME|FILE` and the simulated regime table.

A preset is `<name>.json` in this folder, read with importlib.resources, so it is found in an
installed wheel as in a source checkout. Pure: no torch.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

DEFAULT_HARDWARE = "h100_80gb"


def hardware_names() -> list[str]:
    """The preset names (file stems), sorted."""
    return sorted(p.name[:-5] for p in resources.files(__name__).iterdir() if p.name.endswith(".json"))


def is_hardware_name(text: str) -> bool:
    """A preset name (no path separator, no .json suffix), as opposed to a file path."""
    return "/" not in text and "\\" not in text and not text.endswith(".json")


def load_hardware(name_or_path: str | Path):
    """The `HardwareSpec` of a preset name (e.g. 'h100_80gb') or of a JSON file path.
    ValueError (exit 2) for an unknown name or an unreadable/invalid file."""
    from megatron_hetero.planner.hardware import HardwareSpec

    text = str(name_or_path)
    if isinstance(name_or_path, Path) or not is_hardware_name(text) or Path(text).is_file():
        return HardwareSpec.load(text)
    names = hardware_names()
    if text not in names:
        raise ValueError(
            f"unknown hardware preset {text!r}: presets are {names}; or give a JSON file path (with "
            f"the keys of megatron_hetero/planner/hardware_presets/{DEFAULT_HARDWARE}.json)"
        )
    doc = resources.files(__name__).joinpath(f"{text}.json").read_text()

    return HardwareSpec.from_dict(json.loads(doc))

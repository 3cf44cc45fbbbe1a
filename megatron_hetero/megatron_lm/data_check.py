"""What the Megatron-LM scripts' data flags would run as code, checked before any rank reads data.

With a layout, `pretrain_gpt.py` reads Megatron's indexed datasets (`--data-path PREFIX ...`,
`--train-data-path`, `--valid-data-path`, `--test-data-path`): `.bin`/`.idx` are read as numpy
buffers, but the index cache (`PREFIX/cache/GPTDataset_indices/*.npy`, or `--data-cache-path`) is
read with `numpy.load(allow_pickle=True)`, which unpickles a file that is not numpy's format.
A path that is an energon dataset (a folder with `.nv-meta/`, or a metadataset YAML) gets the energon
inspection (`data.dataset_trust.inspect_dataset`). `pretrain_vlm.py` reads Megatron's mock
multimodal data (no files).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_hetero.data.dataset_trust import (
    TRUST_FLAG,
    Finding,
    UntrustedDataset,
    inspect_dataset,
    npy_cache_findings,
    refusal,
    trusted_message,
)

#: Megatron-LM's data path flags (argparse dest -> flag)
DATA_FLAGS = {
    "data_path": "--data-path",
    "train_data_path": "--train-data-path",
    "valid_data_path": "--valid-data-path",
    "test_data_path": "--test-data-path",
}


def _is_weight(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


def data_findings(args: Any) -> list[Finding]:
    """Findings of every data path the parsed Megatron arguments name (see the module docstring)."""
    caches: list[Path] = [Path(args.data_cache_path)] if getattr(args, "data_cache_path", None) else []
    found: list[Finding] = []
    for dest in DATA_FLAGS:
        for value in getattr(args, dest, None) or []:
            if _is_weight(value):  # `--data-path 0.3 PREFIX_A 0.7 PREFIX_B`
                continue
            p = Path(value)
            if (p / ".nv-meta").is_dir() or (p.is_file() and p.suffix in (".yaml", ".yml")):
                found += inspect_dataset(p)
            else:
                caches.append(Path(f"{value}") / "cache")
    return found + npy_cache_findings(caches)


def check_script_data(args: Any, rank: int) -> None:
    """`UntrustedDataset` naming every finding unless `--trust-dataset-code`; with it, rank 0 says
    once which code it trusts."""
    found = data_findings(args)
    if not found:
        return
    if not getattr(args, "trust_dataset_code", False):
        raise UntrustedDataset(refusal("the data flags", " ".join(_named(args)), found))
    if rank == 0:
        print(trusted_message(" ".join(_named(args)), [f.line() for f in found]), flush=True)


def _named(args: Any) -> list[str]:
    return [f"{flag} {' '.join(getattr(args, dest))}" for dest, flag in DATA_FLAGS.items() if getattr(args, dest, None)]


__all__ = ["DATA_FLAGS", "TRUST_FLAG", "check_script_data", "data_findings"]

"""Reading torch_dist checkpoint files without running code from them.

Out of the box a torch_dist checkpoint can run code when it is loaded (see docs/checkpoints.md,
"Safety"): torch's `FileSystemReader.read_metadata` reads `.metadata` with a plain
`pickle.load`, Megatron reads `common.pt` with `torch.load`'s default (which an environment variable
turns into an unrestricted load), and a `BytesStorageMetadata` entry makes torch read its bytes with
`torch.load(weights_only=False)`. Every read of our load path (train --load in the launcher and in
the ranks, checkpoint inspect) goes through this module instead:

- `.metadata`: `RestrictedUnpickler`, which resolves only the globals of a checkpoint's metadata (the
  `torch.distributed.checkpoint` metadata dataclasses and its `_StorageInfo` / save-plan records,
  `torch.Size`, dtype names, `torch.serialization._get_layout`); the rest of a metadata file is plain
  pickle data (dicts, lists, tuples, strings, numbers). Any other global, what a `__reduce__` payload
  must name (builtins.exec, os.system, ...), is refused before it is looked up, so nothing of it runs.
  The result must be a `Metadata` of tensors only (no `BytesStorageMetadata`: our checkpoints hold no
  pickled objects) whose storage files are plain names inside the folder.
- `common.pt`: `torch.load(weights_only=True)`, stated explicitly (torch's own restricted unpickler:
  tensors, storages and plain data; TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD does not override an explicit
  value). Sharded-object files (`<key>.pt`) are refused: we save none.
- tensor data in `.distcp` files: torch reads each with `torch.load(weights_only=True)`.

`load` is `dist_checkpointing.load` with the two strategies below; during it the torch_dist strategy's
reader factory returns `SafeFileSystemReader` (a scoped swap of that one module attribute, undone on
exit; the compat table's entry `fix.checkpoint_reader`, which checks the Megatron-core version and whose
spots tests/ranks/test_compat.py checks). Problems are ValueErrors naming the file.
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import re
from pathlib import Path
from typing import Any

METADATA_FILE = ".metadata"
_DCP = "torch.distributed.checkpoint"
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        (f"{_DCP}.metadata", n)
        for n in (
            "Metadata",
            "MetadataIndex",
            "ChunkStorageMetadata",
            "TensorStorageMetadata",
            "TensorProperties",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {(f"{_DCP}.filesystem", "_StorageInfo")}
    | {(f"{_DCP}.planner", n) for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")}
    | {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}
)


class RefusedGlobal(pickle.UnpicklingError):
    """A pickle named a global outside the allow-list."""


def _is_dtype_name(module: str, name: str) -> bool:
    import torch

    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles checkpoint metadata: only `ALLOWED_GLOBALS` and torch dtypes resolve (GLOBAL,
    STACK_GLOBAL and extension codes all come here); anything else raises `RefusedGlobal`."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS or _is_dtype_name(module, name):
            return super().find_class(module, name)
        raise RefusedGlobal(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not allowed")


def restricted_loads(data: bytes) -> Any:
    return RestrictedUnpickler(io.BytesIO(data)).load()


def read_dcp_metadata(model_dir: str | Path):
    """The torch_dist `Metadata` of the checkpoint folder `model_dir`, read with
    `RestrictedUnpickler` and checked (tensors only, storage files inside the folder)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    d = Path(model_dir)
    path = d / METADATA_FILE
    if not path.is_file():
        raise ValueError(f"checkpoint file {path} is missing")
    try:
        md = restricted_loads(path.read_bytes())
    except RefusedGlobal as exc:
        raise ValueError(
            f"checkpoint file {path} is refused: it names {exc}, which checkpoint metadata never "
            f"holds (a crafted file: nothing of it was run)"
        ) from None
    except Exception as exc:  # noqa: BLE001 - truncated or garbled pickle data, wrong constructor arguments
        raise ValueError(f"checkpoint file {path} is corrupt: {type(exc).__name__}: {exc}") from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise ValueError(f"checkpoint file {path} is refused: not torch_dist metadata ({type(md).__name__})")
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise ValueError(
                f"checkpoint file {path} is refused: entry {key!r} is a {type(entry).__name__}, not a "
                f"tensor (this build loads no pickled objects)"
            )
    if not isinstance(md.storage_data, dict):
        raise ValueError(f"checkpoint file {path} is refused: no storage table")
    for info in md.storage_data.values():
        name = getattr(info, "relative_path", None)
        if (
            not isinstance(info, _StorageInfo)
            or not isinstance(name, str)
            or Path(name).name != name
            or name in ("", ".", "..")
        ):
            raise ValueError(f"checkpoint file {path} is refused: storage entry {name!r} is not a file of {d}")
    return md


def _reader_class():
    from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
        CachedMetadataFileSystemReader,
    )

    class SafeFileSystemReader(CachedMetadataFileSystemReader):
        """torch's file reader with `.metadata` read by `read_dcp_metadata`."""

        def read_metadata(self, *args: Any, **kwargs: Any):
            from torch.distributed.checkpoint.metadata import StorageMeta

            if kwargs.get("rank") is not None:
                raise ValueError(f"checkpoint {self.path}: per-rank metadata files are not read")
            if self._cached_metadata is None:
                md = read_dcp_metadata(Path(self.path))
                if md.storage_meta is None:
                    md.storage_meta = StorageMeta()
                md.storage_meta.load_id = self.load_id
                self._cached_metadata = md
            return self._cached_metadata

    return SafeFileSystemReader


@contextlib.contextmanager
def _safe_reader():
    """Megatron's torch_dist strategy makes its reader with the module function
    `_get_filesystem_reader`; for the duration, that function returns `SafeFileSystemReader` (the
    swap is the compat table's entry `fix.checkpoint_reader`: target versions, spots, removal)."""
    from megatron_hetero.compat.fixes import filesystem_reader_swapped

    with filesystem_reader_swapped(_reader_class()):
        yield


def safe_torch_load(path: Path) -> Any:
    """`torch.load(weights_only=True)` of a checkpoint file; ValueError naming it."""
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        m = re.search(r"Unsupported global: GLOBAL (\S+)", text)
        why = (
            f"it names {m.group(1)}, which torch.load(weights_only=True) does not allow"
            if m
            else next((ln.strip() for ln in text.splitlines() if "WeightsUnpickler error" in ln), text[:300])
        )
        raise ValueError(
            f"checkpoint file {path} is refused: {why[:300]} (a crafted file: nothing of it was run)"
        ) from None
    except FileNotFoundError:
        raise ValueError(f"checkpoint file {path} is missing") from None
    except Exception as exc:  # noqa: BLE001 - a damaged zip archive
        raise ValueError(f"checkpoint file {path} is corrupt: {type(exc).__name__}: {str(exc)[:300]}") from None


def strategies():
    """(sharded, common) load strategies for `dist_checkpointing.load`: Megatron's torch_dist ones
    with the reads above."""
    from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME, TorchCommonLoadStrategy
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    class SafeTorchDistLoadStrategy(TorchDistLoadShardedStrategy):
        def load(self, sharded_state_dict, checkpoint_dir):
            with _safe_reader():
                return super().load(sharded_state_dict, checkpoint_dir)

        def load_tensors_metadata(self, checkpoint_dir, metadata=None):
            md = metadata if metadata is not None else read_dcp_metadata(checkpoint_dir)
            return super().load_tensors_metadata(checkpoint_dir, md)

        def load_sharded_metadata(self, checkpoint_dir):
            with _safe_reader():
                return super().load_sharded_metadata(checkpoint_dir)

    class SafeCommonLoadStrategy(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir):
            return safe_torch_load(Path(checkpoint_dir) / COMMON_STATE_FNAME)

        def load_sharded_objects(self, sharded_objects_state_dict, checkpoint_dir):
            raise ValueError(f"checkpoint {checkpoint_dir}: asked for pickled objects; this build loads none")

    return SafeTorchDistLoadStrategy(), SafeCommonLoadStrategy()


def _check_backend(d: Path) -> None:
    path = d / "metadata.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"checkpoint file {path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"checkpoint file {path} is corrupt: {exc}") from None
    if not isinstance(cfg, dict) or cfg.get("sharded_backend") != "torch_dist" or cfg.get("common_backend") != "torch":
        raise ValueError(f"checkpoint file {path}: not a torch_dist checkpoint ({cfg!r:.200})")


def check_shapes(sharded_state_dict: dict, md, model_dir: Path) -> None:
    """Every ShardedTensor asked for exists in `md` with the same global shape; ValueError naming
    the tensor and both shapes."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    def fmt(shape) -> str:
        return "x".join(map(str, shape)) or "scalar"

    for sh in nested_values(sharded_state_dict):
        if not isinstance(sh, ShardedTensor):
            continue
        entry = md.state_dict_metadata.get(sh.key)
        if entry is None:
            raise ValueError(f"checkpoint {model_dir}: tensor {sh.key} is not in it (another model?)")
        if tuple(entry.size) != tuple(sh.global_shape):
            raise ValueError(
                f"checkpoint {model_dir}: tensor {sh.key} is {fmt(entry.size)} in the checkpoint, "
                f"{fmt(sh.global_shape)} in this model (another model shape)"
            )


def load(sharded_state_dict: dict, model_dir: str | Path) -> dict:
    """`dist_checkpointing.load` of one torch_dist folder with every read restricted (above), after
    checking the tensors' shapes against the metadata. Collective (every rank of the job)."""
    from megatron.core import dist_checkpointing

    d = Path(model_dir)
    _check_backend(d)
    check_shapes(sharded_state_dict, read_dcp_metadata(d), d)
    sharded, common = strategies()
    return dist_checkpointing.load(sharded_state_dict, str(d), sharded_strategy=sharded, common_strategy=common)


def tensors_metadata(model_dir: str | Path) -> dict:
    """key -> ShardedTensor (no data) of every tensor in a torch_dist folder, read safely."""
    _check_backend(Path(model_dir))
    sharded, _ = strategies()
    return sharded.load_tensors_metadata(Path(model_dir))

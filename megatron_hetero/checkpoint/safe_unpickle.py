"""Reading torch_dist checkpoint files without running code from them.

Out of the box a torch_dist checkpoint can run code when it is loaded (see docs/checkpoints.md,
"Safety"): torch's `FileSystemReader.read_metadata` reads `.metadata` with a plain `pickle.load`,
and Megatron-core 0.19 keeps a checkpoint's common (non-tensor) state as one bytes entry,
`common_state`, whose bytes (in a `.distcp` file) torch decodes with `torch.load(weights_only=False)`;
a checkpoint written by 0.16.1 has a `common.pt` instead, which Megatron reads with `torch.load`'s
default (an environment variable turns it into an unrestricted load). Every read of our load path
(train --load in the launcher and in the ranks, checkpoint inspect) goes through this module instead:

- `.metadata`: `RestrictedUnpickler`, which resolves only the globals of a checkpoint's metadata (the
  `torch.distributed.checkpoint` metadata dataclasses and its `_StorageInfo` / save-plan records,
  `torch.Size`, dtype names, `torch.serialization._get_layout`); the rest of a metadata file is plain
  pickle data (dicts, lists, tuples, strings, numbers). Any other global, what a `__reduce__` payload
  must name (builtins.exec, os.system, ...), is refused before it is looked up, so nothing of it runs.
  The result must be a `Metadata` of tensors only, but for the one `common_state` bytes entry of the
  0.19 format (our checkpoints hold no other pickled object), whose storage files are plain names
  inside the folder.
- the common state (`read_common_state`): the `common_state` bytes, read from their `.distcp` file
  by offset and length, or a 0.16.1 `common.pt`, decoded with `torch.load(weights_only=True)`,
  stated explicitly (torch's own restricted unpickler: tensors, storages and plain data;
  TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD does not override an explicit value). It must be empty: our saves
  keep the non-tensor state in train_state.json.
- tensor data in `.distcp` files: torch reads each with `torch.load(weights_only=True)`. Sharded
  objects (other bytes entries) are never asked for, and the reader refuses to read any.

`load` is `dist_checkpointing.load` with the torch_dist strategy below; during it the strategy's
reader factory returns `SafeFileSystemReader` and Megatron's `load_common_state_dict` is
`read_common_state` (scoped swaps of those two module attributes, undone on exit; the compat table's
entry `fix.checkpoint_reader`, which checks the Megatron-core version and whose spots
tests/ranks/test_compat.py checks). Problems are ValueErrors naming the file.
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
LEGACY_COMMON_FILE = "common.pt"  # Megatron-core 0.16.1's common state (strategies.common.COMMON_STATE_FNAME)
_DCP = "torch.distributed.checkpoint"
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        (f"{_DCP}.metadata", n)
        for n in (
            "Metadata",
            "MetadataIndex",
            "ChunkStorageMetadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
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


def common_state_key() -> str:
    """The metadata key of Megatron-core 0.19's common-state bytes entry (the unique key of its
    `ShardedObject("common_state", ...)`: `common_state/shard_0_1`)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject("common_state", None, (1,), (0,)).unique_key


def read_dcp_metadata(model_dir: str | Path):
    """The torch_dist `Metadata` of the checkpoint folder `model_dir`, read with
    `RestrictedUnpickler` and checked (tensors only but for the common-state bytes entry, storage
    files inside the folder)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

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
    common = common_state_key()
    for key, entry in md.state_dict_metadata.items():
        if key == common and isinstance(entry, BytesStorageMetadata):
            continue
        if not isinstance(entry, TensorStorageMetadata):
            raise ValueError(
                f"checkpoint file {path} is refused: entry {key!r} is a {type(entry).__name__}, not a "
                f"tensor (this build loads no pickled objects but the {common!r} common state)"
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


def _weights_only_load(data: bytes, path: Path, what: str = "") -> Any:
    """`torch.load(weights_only=True)` of `data` (the bytes of checkpoint file `path`, or `what`
    within it); ValueError naming the file."""
    import torch

    label, part = f"checkpoint file {path}", f"{what}: " if what else ""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        m = re.search(r"Unsupported global: GLOBAL (\S+)", text)
        why = (
            f"it names {m.group(1)}, which torch.load(weights_only=True) does not allow"
            if m
            else next((ln.strip() for ln in text.splitlines() if "WeightsUnpickler error" in ln), text[:300])
        )
        raise ValueError(f"{label} is refused: {part}{why[:300]} (a crafted file: nothing of it was run)") from None
    except Exception as exc:  # noqa: BLE001 - a damaged zip archive
        raise ValueError(f"{label} is corrupt: {part}{type(exc).__name__}: {str(exc)[:300]}") from None


def safe_torch_load(path: Path) -> Any:
    """`torch.load(weights_only=True)` of a checkpoint file; ValueError naming it."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise ValueError(f"checkpoint file {path} is missing") from None
    return _weights_only_load(data, Path(path))


def _holds_values(obj: Any) -> bool:
    if isinstance(obj, dict):
        return any(_holds_values(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_values(v) for v in obj)
    return True


def read_common_state(model_dir: str | Path, md=None) -> dict:
    """The common (non-tensor) state of the torch_dist folder `model_dir`, decoded with
    `torch.load(weights_only=True)`: a 0.16.1 `common.pt` if there is one (Megatron reads it first
    too), else the bytes of 0.19's `common_state` entry (`md`: the folder's metadata, read here if
    None). Ours is always empty; ValueError naming the file otherwise, or if it is missing."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    d = Path(model_dir)
    legacy = d / LEGACY_COMMON_FILE
    if legacy.is_file():
        state, where = safe_torch_load(legacy), legacy
    else:
        md = read_dcp_metadata(d) if md is None else md
        key = common_state_key()
        if not isinstance(md.state_dict_metadata.get(key), BytesStorageMetadata):
            raise ValueError(
                f"checkpoint {d}: no common state (neither {LEGACY_COMMON_FILE} nor a {key!r} bytes entry "
                f"in {d / METADATA_FILE})"
            )
        infos = [info for index, info in md.storage_data.items() if getattr(index, "fqn", None) == key]
        if len(infos) != 1 or infos[0].transform_descriptors:
            raise ValueError(f"checkpoint file {d / METADATA_FILE} is refused: {key!r} is not one plain byte range")
        info = infos[0]
        where = d / info.relative_path
        if not where.is_file():
            raise ValueError(f"checkpoint file {where} is missing")
        with where.open("rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        span = f"its common state (bytes {info.offset}-{info.offset + info.length})"
        if len(data) != info.length:
            raise ValueError(f"checkpoint file {where} is corrupt: {span} ends past the file's end (truncated?)")
        loaded = _weights_only_load(data, where, span)
        if not (isinstance(loaded, list) and len(loaded) == 1):
            raise ValueError(f"checkpoint file {where} is refused: {span} is not a one-element list")
        state = loaded[0]
    if not isinstance(state, dict) or _holds_values(state):
        raise ValueError(
            f"checkpoint file {where} is refused: its common state is not empty ({str(state)[:200]}); this "
            f"build keeps non-tensor state in train_state.json"
        )
    return state


def _reader_class():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.planner import LoadItemType

    class SafeFileSystemReader(FileSystemReader):
        """torch's file reader with `.metadata` read by `read_dcp_metadata` (once per reader) and no
        bytes entry read (torch would decode it with `torch.load(weights_only=False)`)."""

        _safe_metadata = None

        def read_metadata(self, *args: Any, **kwargs: Any):
            from torch.distributed.checkpoint.metadata import StorageMeta

            if kwargs.get("rank") is not None:
                raise ValueError(f"checkpoint {self.path}: per-rank metadata files are not read")
            if self._safe_metadata is None:
                md = read_dcp_metadata(Path(self.path))
                if md.storage_meta is None:
                    md.storage_meta = StorageMeta()
                md.storage_meta.load_id = self.load_id
                self._safe_metadata = md
            return self._safe_metadata

        def read_data(self, plan, planner):
            objects = [item.dest_index.fqn for item in plan.items if item.type == LoadItemType.BYTE_IO]
            if objects:
                raise ValueError(
                    f"checkpoint {self.path}: asked for pickled objects {objects[:3]}; this build loads none"
                )
            return super().read_data(plan, planner)

    return SafeFileSystemReader


@contextlib.contextmanager
def _safe_reads():
    """Megatron's torch_dist strategy makes its reader with the module function
    `_get_filesystem_reader`, and `dist_checkpointing.load` reads the common state with
    `load_common_state_dict`; for the duration they return `SafeFileSystemReader` and
    `read_common_state` (the swap is the compat table's entry `fix.checkpoint_reader`: target
    versions, spots, removal)."""
    from megatron_hetero.compat.fixes import checkpoint_reads_swapped

    with checkpoint_reads_swapped(_reader_class(), read_common_state):
        yield


def strategy():
    """The load strategy for `dist_checkpointing.load`: Megatron's torch_dist one with the reads
    above, refusing to be asked for sharded objects."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    class SafeTorchDistLoadStrategy(TorchDistLoadShardedStrategy):
        def load(self, sharded_state_dict, checkpoint_dir, *args, **kwargs):
            objects = [v.key for v in nested_values(sharded_state_dict) if isinstance(v, ShardedObject)]
            if objects:
                raise ValueError(
                    f"checkpoint {checkpoint_dir}: asked for pickled objects {objects[:3]}; this build loads none"
                )
            with _safe_reads():
                return super().load(sharded_state_dict, checkpoint_dir, *args, **kwargs)

        def load_tensors_metadata(self, checkpoint_dir, metadata=None):
            md = metadata if metadata is not None else read_dcp_metadata(checkpoint_dir)
            return super().load_tensors_metadata(checkpoint_dir, md)

        def load_sharded_metadata(self, checkpoint_dir):
            with _safe_reads():
                return super().load_sharded_metadata(checkpoint_dir)

    return SafeTorchDistLoadStrategy()


def _check_backend(d: Path) -> None:
    """metadata.json names the torch_dist backend (0.19 writes only that; 0.16.1 also a `torch`
    common backend, its common.pt)."""
    path = d / "metadata.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"checkpoint file {path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"checkpoint file {path} is corrupt: {exc}") from None
    if (
        not isinstance(cfg, dict)
        or cfg.get("sharded_backend") != "torch_dist"
        or cfg.get("common_backend", "torch") != "torch"
    ):
        raise ValueError(f"checkpoint file {path}: not a torch_dist checkpoint ({cfg!r:.200})")


def check_folder(model_dir: str | Path):
    """Everything of one torch_dist folder that is read before any tensor: metadata.json, the
    `.metadata` and the common state (the launcher's checks; the ranks read the same way). Returns
    the metadata."""
    d = Path(model_dir)
    _check_backend(d)
    md = read_dcp_metadata(d)
    read_common_state(d, md)
    return md


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
    """`dist_checkpointing.load` of one torch_dist folder (0.19's format or 0.16.1's) with every read
    restricted (above), after checking the tensors' shapes against the metadata. Collective (every
    rank of the job)."""
    from megatron.core import dist_checkpointing

    d = Path(model_dir)
    check_shapes(sharded_state_dict, check_folder(d), d)
    with _safe_reads():
        return dist_checkpointing.load(sharded_state_dict, str(d), sharded_strategy=strategy())


def tensors_metadata(model_dir: str | Path) -> dict:
    """key -> ShardedTensor (no data) of every tensor in a torch_dist folder, read safely."""
    md = check_folder(Path(model_dir))
    return strategy().load_tensors_metadata(Path(model_dir), md)

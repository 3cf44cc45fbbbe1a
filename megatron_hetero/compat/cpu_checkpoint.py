"""CPU table entries (:mod:`.cpu`) for Megatron-core's ``dist_checkpointing.save`` (the async filesystem
writer and the state-dict saver).
"""

from __future__ import annotations

from typing import List

from .table import Patch, Spot
from .cpu_entry import _CKPT, _redirect


#: CHECKPOINT_PATCHES: a part of :data:`.cpu.PATCHES` (reason CPU).
CHECKPOINT_PATCHES: List[Patch] = [
    _redirect(
        "cpu.dist_ckpt_filesystem_async",
        f"{_CKPT}.filesystem_async",
        f"{_CKPT}.filesystem_async: FileSystemWriterAsync.preload_tensors (torch.cuda.synchronize(); every "
        "dist_checkpointing.save)",
        ("torch.cuda.synchronize()",),
        "remove when preload_tensors synchronises only CUDA tensors",
        spots=(
            Spot(
                f"{_CKPT}.filesystem_async:FileSystemWriterAsync.preload_tensors",
                "staticmethod",
                params=("write_buckets",),
                uses=("torch.cuda.synchronize()",),
            ),
        ),
    ),
    _redirect(
        "cpu.dist_ckpt_state_dict_saver",
        f"{_CKPT}.state_dict_saver",
        f"{_CKPT}.state_dict_saver: verify_global_md_reuse, save_state_dict_async_finalize "
        "(torch.tensor(..., device='cuda' | torch.cuda.current_device()) for the all-reduce of plan reuse and "
        "write failures; every dist_checkpointing.save)",
        ('device="cuda"', "device=torch.cuda.current_device()"),
        "remove when the saver's flags are created on the device of the default process group's backend",
        spots=(
            Spot(f"{_CKPT}.state_dict_saver:verify_global_md_reuse", uses=('device="cuda"',)),
            Spot(
                f"{_CKPT}.state_dict_saver:save_state_dict_async_finalize", uses=("device=torch.cuda.current_device()",)
            ),
        ),
    ),
]

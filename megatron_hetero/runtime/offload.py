"""Encoder offload: move a module's state (parameters, gradient buffers, optimizer state) to host
memory during the language-model phase of the colocated schedule, and back before its backward.

Each tensor's *storage* is copied to a host buffer (pinned, asynchronous, when the device is a GPU)
and then resized to zero bytes; restoring resizes it back and copies the bytes in. Tensor objects,
views into them (Megatron DDP's `main_grad`) and autograd's saved references stay valid, so the same
code path runs on CPU (where it frees the module's own allocations, which the memory report shows)
and on GPU (where it frees device memory).
"""

from __future__ import annotations

from typing import Callable

import torch

from megatron_hetero.compat.device import get_device, synchronize


class Offloader:
    """Offload/restore every storage behind the tensors `tensors()` returns."""

    def __init__(self, tensors: Callable[[], list[torch.Tensor]]) -> None:
        self._tensors = tensors
        self._saved: list[tuple[torch.UntypedStorage, int, torch.Tensor]] = []

    @property
    def offloaded(self) -> bool:
        return bool(self._saved)

    def offload(self) -> int:
        """Move the state to host memory; returns the bytes freed on the compute device."""
        if self._saved:
            raise RuntimeError("offload() called twice without restore()")
        on_gpu = get_device().type == "cuda"
        seen: set[int] = set()
        freed = 0
        for t in self._tensors():
            st = t.untyped_storage()
            key = st.data_ptr()
            if st.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st)
            host = torch.empty(st.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=on_gpu)
            host.copy_(raw, non_blocking=on_gpu)
            self._saved.append((st, st.nbytes(), host))
            freed += st.nbytes()
        if on_gpu:
            synchronize()
        for st, _, _ in self._saved:
            st.resize_(0)
        return freed

    def restore(self) -> None:
        """Bring the state back into the same storages."""
        on_gpu = get_device().type == "cuda"
        for st, nbytes, host in self._saved:
            st.resize_(nbytes)
            raw = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)
            raw.copy_(host, non_blocking=on_gpu)
        if on_gpu and self._saved:
            synchronize()
        self._saved = []

"""`--log-memory`: what a rank holds, measured from its tensors.

* `state_bytes(state)`: a module's resident state on this rank in three parts, each the bytes of the
  distinct storages of its tensors (a view into a flat buffer counts the buffer once; a storage is
  counted in the first part that holds it): `params` (the module's parameters; with the distributed
  optimizer DDP's flat parameter buffer), `grads` (DDP's gradient buffers; a frozen module's
  parameters have none), `optimizer` (the torch optimizer's per-parameter state, Adam's moments, and
  the fp32 main parameters the Megatron optimizer keeps beside bf16/fp16 ones).
* `ActivationMeter`: the peak bytes of the activations autograd holds for the backward pass during a
  step, per module. A saved-tensor hook (`torch.autograd.graph.saved_tensors_hooks`, as
  tests/ranks/test_recompute.py measures recompute) counts each saved tensor's storage once while
  any saved reference to it lives (weights are not activations and are skipped); a module's running
  total rises when a tensor is saved inside its forward (forward pre/post hooks on every submodule
  say whose forward runs, so a recomputed layer's forward during the backward counts for its module)
  and falls when autograd frees the saved tensor. The peak is the largest running total of the step;
  the rank's (`total_peak`) the largest sum over its modules at one moment.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any, Iterator

import torch

OTHER = "other"  # saved outside every module's forward (e.g. the loss)


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


def _add(seen: set, tensors: list[torch.Tensor]) -> int:
    total = 0
    for t in tensors:
        key = _storage_key(t)
        if key[1] == 0 or key in seen:
            continue
        seen.add(key)
        total += key[1]
    return total


def state_bytes(state: Any) -> dict[str, int]:
    """{params, grads, optimizer} bytes of `state` (a `runtime.module_state.ModuleState`) on this rank
    (see the module docstring)."""
    seen: set = set()
    params = [p.data for p in state.module.parameters()]
    grads: list[torch.Tensor] = []
    if state.ddp is not None:
        for buf in state.ddp.buffers + state.ddp.expert_parallel_buffers:
            if buf.param_data is not None:
                params.append(buf.param_data)
            grads.append(buf.grad_data)
    optimizer: list[torch.Tensor] = []
    if state.optimizer is not None:
        for opt in getattr(state.optimizer, "chained_optimizers", [state.optimizer]):
            inner = getattr(opt, "optimizer", None)
            if inner is None:
                continue
            for group in inner.param_groups:
                optimizer.extend(p.data for p in group["params"])  # fp32 main weights (or the params: seen)
            for st in inner.state.values():
                optimizer.extend(v for k, v in st.items() if k != "step" and isinstance(v, torch.Tensor))
    return {"params": _add(seen, params), "grads": _add(seen, grads), "optimizer": _add(seen, optimizer)}


class ActivationMeter:
    """Peak activation bytes per module over one `measure()` block (see the module docstring).
    `attach(name, module)` registers the forward hooks of a module's submodules once."""

    def __init__(self) -> None:
        self._stack: list[str] = []
        self._modules: list[torch.nn.Module] = []
        self._weights: set[int] = set()  # the parameters' storages (read again at each `measure`: offload moves them)
        self._live: dict[tuple[int, int], list] = {}  # storage -> [module, bytes, references]
        self._current: dict[str, int] = defaultdict(int)
        self._total = 0
        self.peak: dict[str, int] = {}
        self.total_peak = 0  # the rank's: the largest sum over its modules at one moment
        self.names: list[str] = []

    def attach(self, name: str, module: torch.nn.Module) -> None:
        """Count the tensors saved inside `module`'s forward (and its submodules', recomputed ones
        included) for `name`; its parameters are weights, never counted."""
        self.names.append(name)
        self._modules.append(module)
        for sub in module.modules():
            sub.register_forward_pre_hook(lambda _m, _a, name=name: self._enter(name))
            sub.register_forward_hook(lambda _m, _a, _o: self._exit(), always_call=True)

    def _enter(self, name: str) -> None:
        self._stack.append(name)

    def _exit(self) -> None:
        self._stack.pop()

    def _pack(self, t: torch.Tensor) -> Any:
        try:
            ptr, nbytes = _storage_key(t)
        except (RuntimeError, NotImplementedError):  # no storage (sparse, nested): not counted
            return t
        if ptr in self._weights or nbytes == 0 or _is_weight(t):
            return t
        key = (ptr, nbytes)
        entry = self._live.get(key)
        if entry is None:
            owner = self._stack[-1] if self._stack else OTHER
            entry = self._live[key] = [owner, nbytes, 0]
            self._current[owner] += nbytes
            self.peak[owner] = max(self.peak.get(owner, 0), self._current[owner])
            self._total += nbytes
            self.total_peak = max(self.total_peak, self._total)
        entry[2] += 1
        return _Saved(t, self, key)

    def _release(self, key: tuple[int, int]) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[2] -= 1
        if entry[2] == 0:
            del self._live[key]
            self._current[entry[0]] -= entry[1]
            self._total -= entry[1]

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        """Count within the block; `peak` then holds this block's peak per module (0 for a module
        attached but saving nothing)."""
        self._weights = {p.untyped_storage().data_ptr() for m in self._modules for p in m.parameters()}
        self.peak = {n: self._current.get(n, 0) for n in self.names}
        self.total_peak = self._total  # what an earlier block left saved (0 after its backward)
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

    def live_bytes(self, name: str) -> int:
        """Bytes saved inside `name`'s forward that autograd still holds now."""
        return self._current.get(name, 0)

    def peaks(self) -> dict[str, int]:
        """The last block's peak bytes per module (`other`: saved outside every module, if any)."""
        return {n: v for n, v in self.peak.items() if n in self.names or v}


class _Saved:
    """A saved tensor as autograd holds it; when autograd drops it the meter's total falls."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: torch.Tensor, meter: ActivationMeter, key: tuple[int, int]) -> None:
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self) -> None:
        self.meter._release(self.key)


def _is_weight(t: torch.Tensor) -> bool:
    """A parameter, or a view of one (a transposed weight), is not an activation."""
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


def _unpack(saved: Any) -> torch.Tensor:
    return saved.tensor if isinstance(saved, _Saved) else saved

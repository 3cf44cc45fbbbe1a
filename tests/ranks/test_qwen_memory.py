"""The memory model prices the Qwen2.5-VL tower as the runtime builds and runs it
(`planner/memory_qwen.py`): the bytes autograd saves in one forward of the encoder module equal the
predicted activation bytes (images packed into one sequence: the scores grow with the square of the
images per forward), under TP 1 and TP 2. (The parameter counts: tests/ranks/test_memory_model.py.)"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megatron_hetero.layout import layout_from_dict

from qwen_train_case import SPEC


def _saved_bytes(tp: int, images: int) -> tuple[int, int]:
    """(measured, predicted) bytes one forward of `images` images through the tower keeps on this rank
    (the distinct storages of the saved tensors that are not parameters)."""
    import torch

    from megatron_hetero.planner.memory import ActivationFeatures, stage_activation_bytes
    from megatron_hetero.runtime.topology import Topology
    from megatron_hetero.training.setup import JobConfig, build_module
    from megatron_hetero.training.trainer import prepare_rank

    prepare_rank(JobConfig(spec=SPEC, global_batch_size=4, micro_batch_size=1, train_iters=1))
    doc = {"modules": {"vision": {"tp": tp}, "language": {"dp": tp}}, "edges": ["vision -> language"]}
    layout = layout_from_dict(doc, world_size=dist.get_world_size())
    topo = Topology.build(layout)
    try:
        mod = build_module("vision", layout, SPEC, topo.pg_collection("vision")).train()
        enc = SPEC.encoders["vision"]
        x = torch.randn(images, enc.tokens, enc.feature_dim, generator=torch.Generator().manual_seed(0))
        weights = {p.untyped_storage().data_ptr() for p in mod.parameters()}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in weights:
                seen.setdefault(ptr, t.untyped_storage().nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = mod(x)
        y.sum().backward()
        kept, transient = stage_activation_bytes(layout, SPEC, "vision", 0, images, ActivationFeatures(dtype_bytes=4))
        assert transient == 0
        return sum(seen.values()), kept
    finally:
        topo.destroy()


@pytest.mark.parametrize("tp,images", [(1, 1), (1, 4), (2, 3)])
def test_tower_activation_bytes_equal_what_autograd_saves(tp, images):
    from megatron_hetero.runtime.launcher import run_ranks

    for measured, predicted in run_ranks(tp, _saved_bytes, tp, images):
        print(f"qwen tower tp{tp}, {images} images: measured {measured} bytes, predicted {predicted}")
        assert predicted == measured, (tp, images, measured, predicted)

"""A runtime layout as the cost model sees it: the `Candidate` of what the runtime executes for a layout,
its kind (homogeneous, colocated, disjoint) and the cost model's micro-batch of a `train` run (and
back: `train_micro_batch`). Used by `bench` and by `train --hetero-autotune`. Pure: no torch.
"""

from __future__ import annotations

from megatron_hetero.config.model import language_modules, segment_layers
from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.planner.workload import Candidate, Segment


def cost_micro_batch(layout: HeteroLayout, spec, micro_batch_size: int) -> int:
    """The cost model's `Workload.micro_batch` (samples per replica of the largest language DP) of a
    run with `train --micro-batch-size` (samples per rank of the first language module)."""
    langs = language_modules(layout, spec)
    if layout.placement != "disjoint":
        return micro_batch_size
    samples = micro_batch_size * langs[0].dp  # one micro-batch of the disjoint schedule
    top = max(m.dp for m in langs)
    if samples % top:
        raise ValueError(f"a micro-batch of {samples} samples does not split over dp({top})")
    return samples // top


def train_micro_batch(layout: HeteroLayout, spec, cost_micro_batch_size: int) -> int:
    """`train --micro-batch-size` (samples per rank of the first language module) of a run whose cost
    model micro-batch (`Workload.micro_batch`, samples per replica of the largest language DP) is
    `cost_micro_batch_size`: the inverse of `cost_micro_batch`."""
    if layout.placement != "disjoint":
        return cost_micro_batch_size
    langs = language_modules(layout, spec)
    samples = cost_micro_batch_size * max(m.dp for m in langs)
    if samples % langs[0].dp:
        raise ValueError(f"a micro-batch of {samples} samples does not split over dp({langs[0].dp})")
    return samples // langs[0].dp


def kind_of(layout: HeteroLayout, spec) -> str:
    """'homogeneous' (colocated, every module on the same degrees), 'colocated' or 'disjoint'."""
    if layout.placement == "disjoint":
        return "disjoint"
    degrees = {(m.tp, m.cp, m.pp, m.dp) for m in layout.modules}
    return "homogeneous" if len(degrees) == 1 else "colocated"


def candidate_for(layout: HeteroLayout, spec, offload: bool = False) -> Candidate:
    """The cost model's candidate of what the runtime executes for `layout`. A homogeneous layout
    runs on the colocated three-phase schedule, so it is costed as a colocated candidate."""
    langs = language_modules(layout, spec)
    # in the model's encoder order: the workload's first encoder, then its extra encoders
    encs = [layout.module(n) for n in spec.encoders if n in layout.names]
    if not encs:
        raise ValueError(f"the cost model prices a model with an encoder; the layout has none ({list(layout.names)})")
    segs_e = [Segment(e.par, spec.encoders[e.name].num_layers) for e in encs]
    segs = tuple(Segment(m.par, segment_layers(m, spec).size) for m in langs)
    if layout.placement == "disjoint":
        return Candidate("disjoint", segs_e[0], segs, encoder_ranks=encs[0].size, extra_encoders=tuple(segs_e[1:]))
    return Candidate("colocated", segs_e[0], segs, offload=offload, extra_encoders=tuple(segs_e[1:]))

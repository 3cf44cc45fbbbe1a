"""What one layout cannot tell the autotune: one transformer layer of each module of the job, with the
job's own sizes, timed in-process at the other TP (and, for the language model, CP) degrees the
search may choose (`measure_layer_cases`, collective over the world). The timing kernel is the
`profile` command's (`profiling.run._rank_layers`: a Megatron `TransformerBlock` on a TP x CP x DP =
world grid, every DP replica running the same block at once, forward + backward); the results are
`planner.autotune.LayerCase`s that `fold_layer_measurements` refits the profile with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from megatron_hetero.planner.autotune import LayerCase
from megatron_hetero.planner.profile_fit import slowest_median
from megatron_hetero.planner.workload import ModelSpec, Workload
from megatron_hetero.checkpoint.sharded import rng_states, set_rng_states
from megatron_hetero.profiling.run import _rank_layers
from megatron_hetero.runtime.step import run_collective

#: timed iterations per case (after one warm-up): the cases are small and the search needs their order
ITERS = 3


def _degrees(n: int, world: int) -> list[int]:
    """Degrees 1, 2, 4, ... that divide `n` (heads) and the world size."""
    out, d = [], 1
    while d <= world:
        if n % d == 0 and world % d == 0:
            out.append(d)
        d *= 2
    return out


def layer_case_dicts(wl: Workload, world: int, encoder_images: int) -> list[dict[str, Any]]:
    """The cases to time (the kernel's dicts, a `module` key added: 'llm' or 'encoder'): the language
    model's layer on one micro-batch (`wl.micro_batch` samples) and on twice that at TP1 (two sizes
    split the layer model's fixed part from its per-FLOP part) and at every TP degree (two sizes
    split the all-reduce's latency from its cost per byte: one size keeps the base profile's shape,
    a GPU's, which priced the colocated encoder pass of 4-8 times a micro-batch's images far below
    what these CPU ranks took), and on one micro-batch at every CP degree dividing its sharded
    sequence; the encoder's layer likewise on one micro-batch's `encoder_images` images and twice
    that, at every TP degree (encoders are searched with cp 1)."""

    def case(module: str, spec: ModelSpec, tp: int, cp: int, batch: int) -> dict[str, Any]:
        return {
            "module": module,
            "kind": "llm" if module == "llm" else "encoder",
            "tp": tp,
            "cp": cp,
            "hidden": spec.hidden,
            "heads": spec.heads,
            "ffn_hidden": spec.ffn_hidden,
            "seq": spec.seq,
            "batch": batch,
            "gated": bool(spec.gated),
        }

    b = max(1, int(wl.micro_batch))
    out = [case("llm", wl.llm, 1, 1, b), case("llm", wl.llm, 1, 1, 2 * b)]
    out += [case("llm", wl.llm, t, 1, n) for t in _degrees(wl.llm.heads, world) if t > 1 for n in (b, 2 * b)]
    out += [case("llm", wl.llm, 1, c, b) for c in _degrees(wl.llm.seq, world) if c > 1 and wl.llm.seq % (2 * c) == 0]
    e = max(1, int(encoder_images))
    out += [case("encoder", wl.encoder, 1, 1, e), case("encoder", wl.encoder, 1, 1, 2 * e)]
    out += [
        case("encoder", wl.encoder, t, 1, n) for t in _degrees(wl.encoder.heads, world) if t > 1 for n in (e, 2 * e)
    ]
    return out


@dataclass(frozen=True)
class LayerTimings:
    """`cases` per module ('llm', 'encoder'); `solo_s`: the first case with one rank busy (the
    others waiting), `busy_s` the same case with every rank busy, over `world` ranks."""

    cases: dict
    solo_s: float
    busy_s: float
    world: int

    def shared_profile(self, prof, cpu_cores: float):
        """`prof` as ranks sharing a CPU's cores see it (gloo ranks on one machine): `cores` = world x
        solo / busy (capped at the world), measured with `world` ranks busy (`Profile.shared`), as
        `planner.profile_fit` fits a measured CPU profile."""
        import dataclasses

        cores = min(float(self.world), self.world * self.solo_s / self.busy_s)
        return dataclasses.replace(prof, cores=cores, concurrency=self.world, cpu_cores=float(cpu_cores))


def measure_layer_cases(wl: Workload, encoder_images: int) -> LayerTimings:
    """Time `layer_case_dicts` on every rank of the world (collective) and return, on every rank,
    the `LayerCase`s per module ('llm', 'encoder'): per case the median over iterations of the
    slowest rank's time; and the first case timed with one busy rank. Torch's and Megatron's RNG
    states are restored afterwards (the kernel seeds and draws its own inputs), so training after
    it draws what it would have drawn."""

    world = dist.get_world_size()
    cases = layer_case_dicts(wl, world, encoder_images)
    rng = rng_states()  # as checkpoints keep them
    try:
        mine, solo = _rank_layers(cases, ITERS, 1, 1)
    finally:
        set_rng_states(rng)
    every: list = [None] * world
    run_collective(
        "autotune layer timings all-gather over the world", dist.get_rank(), dist.all_gather_object, every, (mine, solo)
    )
    out: dict[str, list[LayerCase]] = {"llm": [], "encoder": []}
    for i, c in enumerate(cases):
        seconds = slowest_median([r[0][i] for r in every])
        out[c["module"]].append(LayerCase(tp=c["tp"], cp=c["cp"], samples=float(c["batch"]), seconds=seconds))
    import statistics

    solo_s = float(statistics.median(every[0][1]))  # rank 0 ran it alone
    return LayerTimings(out, solo_s, out["llm"][0].seconds, world)

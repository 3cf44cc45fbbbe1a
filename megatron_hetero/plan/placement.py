"""Per-rank placement: which module coordinates every global rank holds.

Megatron's default rank order is used inside each module's range: tp fastest, then cp, then dp,
then pp (`order="tp-cp-ep-dp-pp"` with the dense grid's ep=1). Expert coordinates follow Megatron's
MoE parallel folding: inside one pipeline stage the expert grid is expt_tp fastest, then ep, then
expert-dp, over the same ranks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from megatron_hetero.layout.spec import HeteroLayout, ModuleLayout

AXES = ("tp", "cp", "dp", "pp")  # fastest first: Megatron's default rank order


@dataclass(frozen=True)
class Coord:
    """A rank's coordinates in one module's grid."""

    tp: int
    cp: int
    dp: int
    pp: int
    ep: int = 0
    expt_tp: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def coord_of(m: ModuleLayout, rank: int) -> Coord:
    """Coordinates of global `rank` inside module `m` (which must contain it)."""
    local = rank - m.offset
    if not 0 <= local < m.size:
        raise ValueError(f"rank {rank} is not in module {m.name} (ranks {m.ranks})")
    tp = local % m.tp
    cp = (local // m.tp) % m.cp
    dp = (local // (m.tp * m.cp)) % m.dp
    pp = local // m.stage_size
    in_stage = local % m.stage_size
    return Coord(tp=tp, cp=cp, dp=dp, pp=pp, ep=(in_stage // m.expt_tp) % m.ep, expt_tp=in_stage % m.expt_tp)


def rank_of(m: ModuleLayout, *, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
    """Global rank of the given coordinates in module `m`."""
    for axis, value in (("tp", tp), ("cp", cp), ("dp", dp), ("pp", pp)):
        if not 0 <= value < getattr(m, axis):
            raise ValueError(f"module {m.name}: {axis} coordinate {value} outside 0..{getattr(m, axis) - 1}")
    return m.offset + tp + m.tp * (cp + m.cp * (dp + m.dp * pp))


def stage_ranks(m: ModuleLayout, pp: int) -> list[int]:
    """Global ranks of pipeline stage `pp` of module `m`, in rank order."""
    start = m.offset + pp * m.stage_size
    return list(range(start, start + m.stage_size))


def group_ranks(m: ModuleLayout, dims: list[str] | str) -> list[list[int]]:
    """All groups of module `m` that vary over `dims` (e.g. ["tp"], ["cp", "dp"]), each sorted.

    Groups are listed in order of their smallest rank; this is the membership Megatron-core's
    `HyperCommGrid(shape=[tp, cp, dp, pp], dim_names=["tp","cp","dp","pp"]).create_pg(dims)` builds.
    """
    dims = [dims] if isinstance(dims, str) else list(dims)
    for d in dims:
        if d not in AXES:
            raise ValueError(f"unknown axis {d!r}; axes are {list(AXES)}")
    groups: dict[tuple, list[int]] = {}
    for r in m.rank_range.ranks():
        c = coord_of(m, r)
        key = tuple(getattr(c, a) for a in AXES if a not in dims)
        groups.setdefault(key, []).append(r)
    return sorted(groups.values(), key=lambda g: g[0])


@dataclass(frozen=True)
class RankEntry:
    """One global rank and the coordinates it has in each module it serves."""

    rank: int
    modules: dict[str, Coord]


def rank_map(layout: HeteroLayout) -> list[RankEntry]:
    """For every global rank of a resolved layout, each module it serves and its coordinates."""
    out = []
    for r in range(layout.world_size):
        mods = {m.name: coord_of(m, r) for m in layout.modules if r in m.rank_range.ranks()}
        out.append(RankEntry(rank=r, modules=mods))
    return out

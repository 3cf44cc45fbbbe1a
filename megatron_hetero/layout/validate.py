"""Validation and rank resolution of a `HeteroLayout`.

Every user error raises `ValueError` with the arithmetic spelled out, before any process group
exists. `resolve_layout` returns a new layout whose modules all carry their rank range.
"""

from __future__ import annotations

from typing import Optional

from megatron_hetero.layout.degrees import DEGREE_KEYS, MAX_WORLD_SIZE
from megatron_hetero.layout.graph import topological_order
from megatron_hetero.layout.spec import (
    BOUNDARY_MODES,
    PLACEMENTS,
    RECOMPUTE_GRANULARITIES,
    RECOMPUTE_METHODS,
    ROLES,
    Edge,
    HeteroLayout,
    ModuleLayout,
    RankRange,
    Recompute,
)


def _check_degrees(m: ModuleLayout) -> None:
    for key in DEGREE_KEYS:
        value = getattr(m, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"module {m.name}: {key} must be a positive integer, got {value!r}")
    expert = m.expt_tp * m.ep
    dense = m.tp * m.cp * m.dp
    if dense % expert != 0:
        raise ValueError(
            f"module {m.name}: expert-tp({m.expt_tp})*ep({m.ep})={expert} does not divide "
            f"tp({m.tp})*cp({m.cp})*dp({m.dp})={dense} (Megatron's MoE parallel folding needs it to)"
        )
    if m.role is not None and m.role not in ROLES:
        raise ValueError(f"module {m.name}: role must be one of {list(ROLES)}, got {m.role!r}")
    if m.size > MAX_WORLD_SIZE:
        raise ValueError(
            f"module {m.name}: {m.arithmetic()} ranks is beyond the largest world a layout may have, "
            f"{MAX_WORLD_SIZE} = 2**20 ranks"
        )


def check_experts(layout: HeteroLayout, num_experts: dict[str, Optional[int]]) -> None:
    """The expert layout of every module against its model (ValueError with the arithmetic, before
    any group exists). `num_experts`: module -> its number of experts (None or 0: a dense module;
    modules not listed are dense). Rules: expt_tp*ep divides tp*cp*dp (Megatron's parallel folding,
    also checked by `resolve_layout`); ep divides the number of experts; ep or expt_tp > 1 only on a
    module with experts. Any backend: expert-TP > 1 runs on gloo too (Megatron's expert-TP all-gather
    of uneven token counts goes through compat's `cpu.gloo_uneven_all_gather` there: each piece
    padded to the largest, one equal all-gather, the padding cut)."""
    for m in layout.modules:
        n = num_experts.get(m.name) or 0
        if n and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"module {m.name}: --num-experts must be a positive integer, got {n!r}")
        expert, dense = m.expt_tp * m.ep, m.tp * m.cp * m.dp
        if dense % expert:
            raise ValueError(
                f"module {m.name}: expert-tp({m.expt_tp})*ep({m.ep})={expert} does not divide "
                f"tp({m.tp})*cp({m.cp})*dp({m.dp})={dense}"
            )
        if not n:
            if m.ep > 1 or m.expt_tp > 1:
                raise ValueError(
                    f"module {m.name}: ep({m.ep}) expt_tp({m.expt_tp}) > 1 but the module has no experts "
                    f"(give the language model --num-experts, or drop ep/expt_tp from {m.name})"
                )
            continue
        if n % m.ep:
            raise ValueError(
                f"module {m.name}: ep({m.ep}) does not divide --num-experts {n} "
                f"({n} % {m.ep} = {n % m.ep}); each EP rank holds num_experts/ep experts"
            )


def check_heads(m: ModuleLayout, heads: int, flag: Optional[str] = None) -> None:
    """Tensor parallelism splits a module's attention heads over its tp ranks: `heads` (the module's
    model's) must be divisible by the module's tp. ValueError naming the module, and the flag that gave
    the heads where the caller knows it (`flag`, e.g. "--num-attention-heads")."""
    if heads % m.tp:
        named = f" ({flag})" if flag else ""
        raise ValueError(f"module {m.name}: {heads} attention heads{named} are not divisible by tp({m.tp})")


def _check_edges(layout: HeteroLayout) -> None:
    names = layout.names
    seen: set[Edge] = set()
    for e in layout.edges:
        for end in (e.src, e.dst):
            if end not in names:
                raise ValueError(f"edge {e}: unknown module {end!r}; modules are {names}")
        if e.src == e.dst:
            raise ValueError(f"edge {e}: a module cannot feed itself")
        if e in seen:
            raise ValueError(f"edge {e} is declared twice")
        seen.add(e)
        src, dst = layout.module(e.src), layout.module(e.dst)
        hi, lo = max(src.dp, dst.dp), min(src.dp, dst.dp)
        if hi % lo != 0:
            kind = "fan-in" if src.dp > dst.dp else "fan-out"
            raise ValueError(
                f"edge {e}: src dp({src.dp}) and dst dp({dst.dp}): {kind} factor {hi}/{lo} is not an integer"
            )
    topological_order(layout)  # raises ValueError naming a cycle


def _resolve_colocated(modules: tuple[ModuleLayout, ...], world_size: Optional[int]) -> list[ModuleLayout]:
    explicit = [m for m in modules if m.ranks is not None]
    if explicit:
        first = explicit[0]
        for m in explicit[1:]:
            if m.ranks != first.ranks:
                raise ValueError(
                    f"colocated modules must share one rank range: module {first.name} has ranks "
                    f"{first.ranks} but module {m.name} has ranks {m.ranks}"
                )
        rr = first.rank_range
    else:
        size = world_size if world_size is not None else modules[0].size
        rr = RankRange(0, size - 1)
    if rr.start != 0:
        raise ValueError(
            f"colocated modules span ranks {rr}, so ranks 0-{rr.start - 1} are not assigned to any "
            "module; colocated modules share ranks 0..W-1"
        )
    if world_size is not None and rr.end + 1 != world_size:
        if rr.end + 1 > world_size:
            raise ValueError(f"colocated ranks {rr} need world size {rr.end + 1}, but world size is {world_size}")
        raise ValueError(
            f"ranks {rr.end + 1}-{world_size - 1} of world size {world_size} are not assigned to any "
            f"module: colocated modules span ranks {rr}"
        )
    out = []
    for m in modules:
        if m.size != rr.size:
            raise ValueError(f"module {m.name}: {m.arithmetic()} != ranks {rr} ({rr.size})")
        out.append(m.replace(ranks=rr))
    return out


def _resolve_disjoint(modules: tuple[ModuleLayout, ...], world_size: Optional[int]) -> list[ModuleLayout]:
    out: list[ModuleLayout] = []
    next_free = 0
    for m in modules:
        rr = m.ranks if m.ranks is not None else RankRange(next_free, next_free + m.size - 1)
        if m.size != rr.size:
            raise ValueError(f"module {m.name}: {m.arithmetic()} != ranks {rr} ({rr.size})")
        for other in out:
            if rr.overlaps(other.rank_range):
                raise ValueError(
                    f"disjoint modules overlap: module {m.name} ranks {rr} and module {other.name} ranks {other.ranks}"
                )
        out.append(m.replace(ranks=rr))
        next_free = max(next_free, rr.end + 1)
    total = max(m.rank_range.end for m in out) + 1
    if world_size is not None and total > world_size:
        raise ValueError(
            f"disjoint modules need ranks 0-{total - 1} ({total}) but world size is {world_size}: "
            + ", ".join(f"{m.name} {m.ranks} ({m.arithmetic()})" for m in out)
        )
    span = world_size if world_size is not None else total
    idle, cursor = [], 0  # gaps between the (non-overlapping) islands, as ranges: no per-rank lists
    for m in sorted(out, key=lambda m: m.rank_range.start):
        if m.rank_range.start > cursor:
            idle.append((cursor, m.rank_range.start - 1))
        cursor = m.rank_range.end + 1
    if cursor < span:
        idle.append((cursor, span - 1))
    if idle:
        raise ValueError(
            f"ranks {','.join(str(a) if a == b else f'{a}-{b}' for a, b in idle)} of world size {span} are not "
            "assigned to any module: " + ", ".join(f"{m.name} {m.ranks}" for m in out)
        )
    return out


def resolve_layout(layout: HeteroLayout, world_size: Optional[int] = None) -> HeteroLayout:
    """Validate `layout` and return it with every module's rank range resolved.

    Colocated: every module spans the same ranks (explicit `ranks`, else 0..world_size-1, else
    0..size-1 of the first module). Disjoint: explicit `ranks`, else contiguous islands in
    declaration order; islands must not overlap and, when `world_size` is given, must cover it.
    """
    if layout.placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {list(PLACEMENTS)}, got {layout.placement!r}")
    if not layout.modules:
        raise ValueError("a layout needs at least one module")
    check_boundary_mode(layout.placement, layout.boundary_mode)
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1):
        raise ValueError(f"world size must be a positive integer, got {world_size!r}")
    if world_size is not None and world_size > MAX_WORLD_SIZE:
        raise ValueError(
            f"world size {world_size} is beyond the largest world a layout may have, {MAX_WORLD_SIZE} = 2**20 ranks"
        )
    names = [m.name for m in layout.modules]
    for n in names:
        if not isinstance(n, str) or not n or not n.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"module name {n!r} must be a non-empty name of letters, digits, '_' or '-'")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"module names must be unique; declared twice: {dupes}")
    for m in layout.modules:
        _check_degrees(m)
        if not isinstance(m.frozen, bool):
            raise ValueError(f"module {m.name}: frozen must be true or false, got {m.frozen!r}")
        if m.recompute is not None:
            check_recompute(m.recompute, f"module {m.name}: recompute")
    if layout.placement == "colocated":
        modules = _resolve_colocated(layout.modules, world_size)
    else:
        modules = _resolve_disjoint(layout.modules, world_size)
    resolved = HeteroLayout(
        placement=layout.placement,
        modules=tuple(modules),
        edges=tuple(layout.edges),
        boundary_mode=layout.boundary_mode,
    )
    if resolved.world_size > MAX_WORLD_SIZE:  # disjoint islands side by side
        raise ValueError(
            f"the modules need {resolved.world_size} ranks ("
            + ", ".join(f"{m.name} {m.ranks}" for m in modules)
            + f"), beyond the largest world a layout may have, {MAX_WORLD_SIZE} = 2**20 ranks"
        )
    _check_edges(resolved)  # after the per-module arithmetic, which is the more basic error
    return resolved


def check_boundary_mode(placement: str, mode: str) -> None:
    """`boundary_mode` is one of `BOUNDARY_MODES`; hierarchical (the leader route) only for disjoint
    placement, whose edges cross between rank islands (a colocated edge never leaves its ranks)."""
    if mode not in BOUNDARY_MODES:
        raise ValueError(f"boundary_mode must be one of {list(BOUNDARY_MODES)}, got {mode!r}")
    if mode == "hierarchical" and placement != "disjoint":
        raise ValueError(
            f"boundary_mode hierarchical needs placement disjoint, got {placement}: the leader route "
            "gathers an edge's tensor on one rank of the destination island, and colocated modules share "
            "their ranks (nothing crosses between islands); use boundary_mode direct"
        )


def check_recompute(r: Recompute, where: str) -> None:
    """Megatron's rules for activation recompute (`TransformerConfig.__post_init__`), as ValueError
    naming `where`: full needs a method (uniform or block) and num_layers >= 1; selective takes neither."""
    if r.granularity not in RECOMPUTE_GRANULARITIES:
        raise ValueError(f"{where}: granularity {r.granularity!r} must be one of {list(RECOMPUTE_GRANULARITIES)}")
    if r.granularity == "selective":
        if r.method is not None or r.num_layers is not None:
            raise ValueError(f"{where}: granularity selective takes no method or num_layers (Megatron's rule)")
        return
    if r.method not in RECOMPUTE_METHODS:
        raise ValueError(f"{where}: granularity full needs method {' or '.join(RECOMPUTE_METHODS)}, got {r.method!r}")
    if isinstance(r.num_layers, bool) or not isinstance(r.num_layers, int) or r.num_layers < 1:
        raise ValueError(f"{where}: granularity full needs num_layers >= 1, got {r.num_layers!r}")

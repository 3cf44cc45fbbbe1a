"""Topology: every module's Megatron-core grid and process groups, built from a resolved layout.

Each module gets a `HyperCommGrid(shape=[tp, cp, dp, pp], dim_names=["tp","cp","dp","pp"],
rank_offset=<first rank of the module>)` (Megatron's default rank order, tp fastest) and, on the
ranks it spans, a `ProcessGroupCollection` to pass to Megatron models as `pg_collection=`.
Every module also gets the expert grid `[expt_tp, ep, expt_dp, pp]` over the same ranks (Megatron's
parallel folding; singletons for dense modules, which Megatron DDP still asks for).

Every rank creates every group of every module, in the same order (module declaration order, then
the fixed order of `DENSE_GROUPS`), also groups it is not a member of: gloo and NCCL both require
it, otherwise a later group creation hangs. A module whose grids equal an earlier module's (the
same ranks, tp, cp, dp, pp, ep and expt_tp: colocated modules of equal shape) creates none: it gets
its own `ProcessGroupCollection` of the earlier module's groups (the same rank sets), on every rank
alike, so the count a rank creates and belongs to grows with the distinct module shapes. The Topology owns all groups it created;
`destroy()` releases them, and a failure half-way destroys what was built before re-raising.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch.distributed as dist
from megatron.core.hyper_comm_grid import HyperCommGrid
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_hetero.layout.spec import HeteroLayout, ModuleLayout
from megatron_hetero.layout.degrees import DEFAULT_COMM_TIMEOUT_S
from megatron_hetero.plan.placement import AXES, Coord, coord_of, group_ranks
from megatron_hetero.runtime.faults import fault_point

# (ProcessGroupCollection field, grid dims) in creation order.
DENSE_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("tp", ("tp",)),
    ("cp", ("cp",)),
    ("dp", ("dp",)),
    ("pp", ("pp",)),
    ("dp_cp", ("cp", "dp")),
    ("tp_cp", ("tp", "cp")),
    ("mp", ("tp", "pp")),
    ("tp_dp_cp", ("tp", "cp", "dp")),
)
EXPERT_AXES = ("tp", "ep", "dp", "pp")  # expert grid: expt_tp, ep, expt_dp, pp
EXPERT_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("expt_tp", ("tp",)),
    ("ep", ("ep",)),
    ("expt_dp", ("dp",)),
    ("tp_ep", ("tp", "ep")),
    ("tp_ep_pp", ("tp", "ep", "pp")),
)


@dataclass
class ModuleGrid:
    """One module's grids and, on member ranks, its process groups."""

    layout: ModuleLayout
    grid: HyperCommGrid
    expert_grid: Optional[HyperCommGrid]
    member: bool
    coord: Optional[Coord]
    pgs: Optional[ProcessGroupCollection]
    groups: list = field(default_factory=list)  # every group this rank got back, for destroy()
    #: the groups by ProcessGroupCollection field (and intra_dist_opt), this rank's, or None
    by_field: dict = field(default_factory=dict)
    #: the earlier module whose groups this one uses (equal grids), or None: it created its own
    shares: Optional[str] = None

    @property
    def name(self) -> str:
        return self.layout.name


class GroupCreationError(RuntimeError):
    """Creating a process group failed (a peer died or did not come within the timeout); names the
    group, its ranks and this rank."""


def _named(desc: str, enumeration: list[list[int]], limit: timedelta, fn, *args, **kwargs):
    """`fn(*args, **kwargs)`, the creation of the groups `enumeration`; a failure is re-raised naming
    the groups `desc`, this rank's group among them, and this rank (every rank creates every group, so
    one dead rank stops the creation everywhere)."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the store or a peer failed: say which group
        rank = dist.get_rank()
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
        mine = next((g for g in enumeration if rank in g), None)
        which = f"its group {mine}" if mine is not None else "not a member"
        raise GroupCreationError(
            f"rank {rank}: creating process groups {desc} ({len(enumeration)} group(s), {which}) failed "
            f"(timeout {limit.total_seconds():g} s, --hetero-comm-timeout): {type(exc).__name__}: {first}"
        ) from exc


def _new_groups(enumeration: list[list[int]], backend: Optional[str], timeout: timedelta, desc: str):
    """Create every group of `enumeration` on every rank; return the one this rank is in (or None)."""
    mine, _ = _named(
        desc,
        enumeration,
        timeout,
        dist.new_subgroups_by_enumeration,
        enumeration,
        backend=backend,
        timeout=timeout,
        group_desc=desc,
    )
    return mine


def _grid_key(m: ModuleLayout) -> tuple:
    """What decides a module's groups: its ranks and degrees."""
    return (m.offset, m.size, m.tp, m.cp, m.dp, m.pp, m.ep, m.expt_tp)


def _collection(by_field: dict) -> ProcessGroupCollection:
    """A module's Megatron `ProcessGroupCollection` of its groups (`ModuleGrid.by_field`)."""
    fields = {k: v for k, v in by_field.items() if k != "intra_dist_opt"}
    pgs = ProcessGroupCollection(**fields)
    # One distributed-optimizer instance: the partial DP group is the whole DP x CP group.
    pgs.intra_dp_cp = by_field["dp_cp"]
    pgs.intra_expt_dp = by_field["expt_dp"]
    pgs.intra_dist_opt = by_field["intra_dist_opt"]
    return pgs


class Topology:
    """All process groups of a heterogeneous job on this rank. Build with `Topology.build(layout)`."""

    def __init__(self, layout: HeteroLayout, modules: dict[str, ModuleGrid], backend: Optional[str]) -> None:
        self.layout = layout
        self.modules = modules
        self.backend = backend
        self.rank = dist.get_rank()
        self._destroyed = False

    @classmethod
    def build(
        cls, layout: HeteroLayout, backend: Optional[str] = None, timeout_s: float = DEFAULT_COMM_TIMEOUT_S
    ) -> "Topology":
        """Create every module's groups. `backend` defaults to the world group's backend."""
        if not dist.is_initialized():
            raise RuntimeError("Topology.build needs torch.distributed to be initialized")
        world = dist.get_world_size()
        if layout.world_size != world:
            raise ValueError(
                f"layout uses ranks 0-{layout.world_size - 1} ({layout.world_size}) but the job has world size {world}"
            )
        backend = backend or dist.get_backend()
        timeout = timedelta(seconds=timeout_s)
        rank = dist.get_rank()
        built: dict[str, ModuleGrid] = {}
        try:
            for m in layout.modules:
                cls._build_module(m, rank, backend, timeout, built)
        except BaseException:
            Topology(layout, built, backend).destroy()
            raise
        return cls(layout, built, backend)

    @staticmethod
    def _build_module(
        m: ModuleLayout, rank: int, backend: str, timeout: timedelta, built: dict[str, ModuleGrid]
    ) -> None:
        member = rank in m.ranks.ranks()
        twin = next((b for b in built.values() if b.shares is None and _grid_key(b.layout) == _grid_key(m)), None)
        if twin is not None:  # equal grids: the earlier module's groups, no new ones (module docstring)
            built[m.name] = ModuleGrid(
                layout=m,
                grid=twin.grid,
                expert_grid=twin.expert_grid,
                member=member,
                coord=coord_of(m, rank) if member else None,
                pgs=_collection(twin.by_field) if member else None,
                by_field=twin.by_field,
                shares=twin.name,
            )
            return
        grid = HyperCommGrid([m.tp, m.cp, m.dp, m.pp], list(AXES), rank_offset=m.offset, backend=backend)
        mg = ModuleGrid(
            layout=m, grid=grid, expert_grid=None, member=member, coord=coord_of(m, rank) if member else None, pgs=None
        )
        built[m.name] = mg  # registered first, so a failure below still destroys what was created
        found: dict[str, object] = {}

        def keep(name: str, pg) -> None:
            found[name] = pg
            mg.groups.append(pg)

        for name, dims in DENSE_GROUPS:
            keep(
                name,
                _named(
                    f"{m.name}:{name}",
                    grid.get_rank_enum(list(dims)),
                    timeout,
                    grid.create_pg,
                    list(dims),
                    timeout=timeout,
                    group_desc=f"{m.name}:{name}",
                ),
            )
        fault_point("pg-create", rank)
        # Embedding groups (Megatron semantics): first+last stage of each pipeline, and first stage.
        pp_groups = group_ranks(m, "pp")
        embd = [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in pp_groups]
        keep("embd", _new_groups(embd, backend, timeout, f"{m.name}:embd"))
        keep("pos_embd", _new_groups([[g[0]] for g in pp_groups], backend, timeout, f"{m.name}:pos_embd"))
        # Every module, dense too: Megatron DDP asks for ep/expt_dp (and would otherwise create a
        # group on its member ranks only, which desynchronises group creation across modules).
        expt_dp = m.stage_size // (m.expt_tp * m.ep)
        eg = HyperCommGrid([m.expt_tp, m.ep, expt_dp, m.pp], list(EXPERT_AXES), rank_offset=m.offset, backend=backend)
        mg.expert_grid = eg
        for name, dims in EXPERT_GROUPS:
            keep(
                name,
                _named(
                    f"{m.name}:{name}",
                    eg.get_rank_enum(list(dims)),
                    timeout,
                    eg.create_pg,
                    list(dims),
                    timeout=timeout,
                    group_desc=f"{m.name}:{name}",
                ),
            )
        # The distributed optimizer's gradient-statistics group: every rank of the module (one
        # optimizer instance). Without pipelining that is tp_dp_cp; only pipelined modules create it.
        whole = ("tp", "cp", "dp", "pp")
        if m.pp > 1:
            intra_dist_opt = _named(
                f"{m.name}:intra_dist_opt",
                grid.get_rank_enum(list(whole)),
                timeout,
                grid.create_pg,
                list(whole),
                timeout=timeout,
                group_desc=f"{m.name}:intra_dist_opt",
            )
            mg.groups.append(intra_dist_opt)
        else:
            intra_dist_opt = found["tp_dp_cp"]
        mg.by_field = dict(found, intra_dist_opt=intra_dist_opt)
        if member:
            mg.pgs = _collection(mg.by_field)

    def serves(self, name: str) -> bool:
        """Whether this rank is one of module `name`'s ranks."""
        return self._module(name).member

    def _module(self, name: str) -> ModuleGrid:
        if name not in self.modules:
            raise ValueError(f"unknown module {name!r}; modules are {list(self.modules)}")
        return self.modules[name]

    def pg_collection(self, name: str) -> ProcessGroupCollection:
        """The Megatron `ProcessGroupCollection` of module `name` on this rank."""
        mg = self._module(name)
        if not mg.member:
            raise ValueError(f"rank {self.rank} is not one of module {name}'s ranks ({mg.layout.ranks})")
        assert mg.pgs is not None
        return mg.pgs

    def coord(self, name: str) -> Coord:
        mg = self._module(name)
        if mg.coord is None:
            raise ValueError(f"rank {self.rank} is not one of module {name}'s ranks ({mg.layout.ranks})")
        return mg.coord

    def destroy(self) -> None:
        """Destroy every process group this Topology created (idempotent)."""
        if getattr(self, "_destroyed", False):
            return
        seen: set[int] = set()
        for mg in self.modules.values():
            for g in mg.groups:
                if g is None or g is dist.GroupMember.NON_GROUP_MEMBER or id(g) in seen:
                    continue
                seen.add(id(g))
                dist.destroy_process_group(g)
        self.modules = {}
        self._destroyed = True

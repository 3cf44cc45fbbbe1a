"""Layout declarations: per-module parallel degrees, placement and the edges of the module graph.

Pure data only: no torch, and no imports of the parsing or validation modules (they import this
one). `resolve_layout` (validate.py) resolves every module's rank range and raises `ValueError` with
the arithmetic spelled out; `load_layout` (yaml_io.py) and `layout_from_args` (args.py) build a
validated layout from a YAML file or from parsed `--hetero-*` flags.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from megatron_hetero.layout.degrees import DEGREE_KEYS, Degrees

PLACEMENTS = ("colocated", "disjoint")
#: `boundary_mode:` values: how a disjoint edge's tensor travels (`runtime/boundary.py`): "direct"
#: (point-to-point between the ranks that hold and need each piece) or "hierarchical" (the leader
#: route of `plan/route.py`: gather to leaders, TP-row then DP x CP column broadcasts).
BOUNDARY_MODES = ("direct", "hierarchical")
#: `role:` values a module may declare (`plan/roles.py` decides roles; this only names them).
ROLES = ("language",)


@dataclass(frozen=True)
class RankRange:
    """A contiguous, inclusive range of global ranks `start-end`."""

    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start + 1

    def ranks(self) -> range:
        return range(self.start, self.end + 1)

    def overlaps(self, other: "RankRange") -> bool:
        return self.start <= other.end and other.start <= self.end

    def __str__(self) -> str:
        return f"{self.start}-{self.end}"

    @classmethod
    def parse(cls, text: str, where: str) -> "RankRange":
        """Parse "A-B" (inclusive) or a single "A"."""
        parts = str(text).strip().split("-")
        try:
            if len(parts) == 1:
                start = end = int(parts[0])
            elif len(parts) == 2:
                start, end = int(parts[0]), int(parts[1])
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"{where}: ranks {text!r} is not of the form 'A-B' (e.g. '0-3')") from None
        if start < 0 or end < start:
            raise ValueError(f"{where}: ranks {text!r} must satisfy 0 <= A <= B")
        return cls(start, end)


#: Megatron's `recompute_granularity` and `recompute_method` values.
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")


@dataclass(frozen=True)
class Recompute:
    """Megatron's activation recompute of one module's transformer layers: TransformerConfig's
    `recompute_granularity` (full: whole layers, selective: core attention), `recompute_method`
    (uniform: chunks of `num_layers` layers, block: the first `num_layers` layers of each stage) and
    `recompute_num_layers`. Changes memory and time, never the results. Checked by
    `validate.check_recompute` (Megatron's rules)."""

    granularity: str
    method: Optional[str] = None
    num_layers: Optional[int] = None

    def config_kwargs(self) -> dict:
        """The TransformerConfig fields."""
        return {
            "recompute_granularity": self.granularity,
            "recompute_method": self.method,
            "recompute_num_layers": self.num_layers,
        }

    def to_dict(self) -> dict:
        d: dict = {"granularity": self.granularity}
        if self.method is not None:
            d["method"] = self.method
        if self.num_layers is not None:
            d["num_layers"] = self.num_layers
        return d


@dataclass(frozen=True)
class ModuleLayout:
    """One module's parallel layout.

    Degrees follow Megatron: `tp`, `cp`, `pp`, `dp`, and for MoE modules `ep` with `expt_tp`
    (expert tensor parallel; Megatron's parallel folding requires expt_tp*ep | tp*cp*dp).
    `ranks` is the module's global rank range; `None` until resolved by validation.
    `layers` optionally names the slice of a model this module holds (a pipeline segment).
    `role` optionally names the module's role explicitly (`role: language`; see `plan/roles.py`).
    `recompute` optionally sets the module's own activation recompute (else the job's, if any).
    """

    name: str
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    expt_tp: int = 1
    ranks: Optional[RankRange] = None
    frozen: bool = False
    layers: Optional[RankRange] = None
    role: Optional[str] = None
    recompute: Optional[Recompute] = None

    @property
    def size(self) -> int:
        """Number of ranks this layout needs: tp*cp*pp*dp (`Degrees.size`; asked per rank, so not
        through `par`)."""
        return self.tp * self.cp * self.pp * self.dp

    @property
    def stage_size(self) -> int:
        """Ranks per pipeline stage: tp*cp*dp (`Degrees.stage_size`)."""
        return self.tp * self.cp * self.dp

    @property
    def offset(self) -> int:
        assert self.ranks is not None, f"module {self.name}: ranks not resolved"
        return self.ranks.start

    @property
    def rank_range(self) -> RankRange:
        """`ranks` of a resolved module (validation sets it on every module of a layout)."""
        assert self.ranks is not None, f"module {self.name}: ranks not resolved"
        return self.ranks

    @property
    def par(self) -> Degrees:
        """This module's degrees as the shared `Degrees` type."""
        return Degrees(**{k: getattr(self, k) for k in DEGREE_KEYS})

    def degrees(self) -> dict[str, int]:
        return self.par.as_dict()

    def arithmetic(self) -> str:
        """'tp(2)*cp(1)*pp(2)*dp(2)=8', used in error messages and printouts."""
        return self.par.arithmetic()

    def short(self) -> str:
        """'TP2·CP1·PP2·DP2' (EP shown only when > 1)."""
        return self.par.short()

    def replace(self, **changes) -> "ModuleLayout":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Edge:
    """A directed producer -> consumer connection between two modules."""

    src: str
    dst: str

    def __str__(self) -> str:
        return f"{self.src}->{self.dst}"

    @classmethod
    def parse(cls, text: str) -> "Edge":
        """Parse 'a->b' or 'a -> b'."""
        parts = [p.strip() for p in str(text).split("->")]
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise ValueError(f"edge {text!r} is not of the form 'src -> dst' (e.g. 'vision -> language')")
        return cls(parts[0], parts[1])


@dataclass(frozen=True)
class HeteroLayout:
    """A whole job: placement, modules in declaration order, edges, and the boundary mode of its
    edges (`BOUNDARY_MODES`; hierarchical only with disjoint placement)."""

    placement: str
    modules: tuple[ModuleLayout, ...]
    edges: tuple[Edge, ...] = field(default_factory=tuple)
    boundary_mode: str = "direct"

    def module(self, name: str) -> ModuleLayout:
        for m in self.modules:
            if m.name == name:
                return m
        raise ValueError(f"unknown module {name!r}; modules are {[m.name for m in self.modules]}")

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.modules]

    @property
    def world_size(self) -> int:
        """Ranks used by the job (valid after resolution: the end of the highest range + 1)."""
        return max(m.rank_range.end for m in self.modules) + 1 if all(m.ranks for m in self.modules) else 0

    def producers(self, name: str) -> list[str]:
        return [e.src for e in self.edges if e.dst == name]

    def consumers(self, name: str) -> list[str]:
        return [e.dst for e in self.edges if e.src == name]

    def to_dict(self) -> dict:
        """The YAML/JSON document form (see layout/yaml_io.py)."""
        mods = {}
        for m in self.modules:
            d: dict = {"tp": m.tp, "cp": m.cp, "pp": m.pp, "dp": m.dp}
            if m.ep != 1:
                d["ep"] = m.ep
            if m.expt_tp != 1:
                d["expt_tp"] = m.expt_tp
            if m.ranks is not None:
                d["ranks"] = str(m.ranks)
            if m.frozen:
                d["frozen"] = True
            if m.layers is not None:
                d["layers"] = str(m.layers)
            if m.role is not None:
                d["role"] = m.role
            if m.recompute is not None:
                d["recompute"] = m.recompute.to_dict()
            mods[m.name] = d
        doc: dict = {"placement": self.placement}
        if self.boundary_mode != "direct":
            doc["boundary_mode"] = self.boundary_mode
        doc.update(modules=mods, edges=[f"{e.src} -> {e.dst}" for e in self.edges])
        return doc

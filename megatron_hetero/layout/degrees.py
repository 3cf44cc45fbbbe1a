"""The one type for a module's parallel degrees (and the defaults every floor shares).

Pure data, no torch. `ModuleLayout` (a named module with a rank range) exposes its degrees as a
`Degrees` through `ModuleLayout.par`; the cost model and the search use `Degrees` directly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

DEGREE_KEYS = ("tp", "cp", "pp", "dp", "ep", "expt_tp")

#: The largest world a layout may have (2**20 ranks): beyond it a layout is refused at resolution
#: (`validate.resolve_layout`), before anything plans per rank.
MAX_WORLD_SIZE = 1 << 20

#: Seconds any collective or point-to-point wait may take before it raises (`--hetero-comm-timeout`).
DEFAULT_COMM_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Degrees:
    """Megatron's parallel degrees of one module: tp, cp, pp, dp, and for MoE ep with expt_tp
    (Megatron's parallel folding requires expt_tp*ep | tp*cp*dp)."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    expt_tp: int = 1

    @property
    def size(self) -> int:
        """Ranks these degrees occupy: tp*cp*pp*dp."""
        return self.tp * self.cp * self.pp * self.dp

    @property
    def stage_size(self) -> int:
        """Ranks per pipeline stage: tp*cp*dp."""
        return self.tp * self.cp * self.dp

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in DEGREE_KEYS}

    def arithmetic(self) -> str:
        """'tp(2)*cp(1)*pp(2)*dp(2)=8', used in error messages and printouts."""
        return f"tp({self.tp})*cp({self.cp})*pp({self.pp})*dp({self.dp})={self.size}"

    def short(self) -> str:
        """'TP2·CP1·PP2·DP2' (EP shown only when > 1)."""
        text = f"TP{self.tp}·CP{self.cp}·PP{self.pp}·DP{self.dp}"
        if self.ep > 1 or self.expt_tp > 1:
            text += f"·EP{self.ep}·ETP{self.expt_tp}"
        return text

    def replace(self, **changes) -> "Degrees":
        return dataclasses.replace(self, **changes)

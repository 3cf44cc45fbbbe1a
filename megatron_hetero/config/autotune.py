"""`train --hetero-autotune`'s settings (`AutotuneConfig`, the job's `autotune` section) and their
checks. Pure: no torch. The run itself: `training/autotune_run.py`; the decisions:
`planner/autotune.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from megatron_hetero.layout.flags import flag_field

#: `--autotune-min-gain`'s default: switch only for a predicted step more than 5% faster
MIN_GAIN = 0.05

#: the degrees `--autotune-fix` may pin
FIX_FIELDS = ("tp", "cp", "pp", "dp", "ep")

Fixes = dict[str, dict[str, int]]


# --- --autotune-fix -----------------------------------------------------------------------------
def parse_fix(text: Optional[str]) -> Fixes:
    """`--autotune-fix` "language.tp=4,vision.dp=8" -> {"language": {"tp": 4}, "vision": {"dp": 8}}.

    Items are MODULE.FIELD=INT, comma-separated, FIELD one of `FIX_FIELDS`, INT >= 1; empty text:
    no fixes. ValueError naming the bad item otherwise (or a field given twice)."""
    fixes: Fixes = {}
    if text is None:
        return fixes
    for item in (p.strip() for p in str(text).split(",")):
        if not item:
            continue
        key, eq, value = item.partition("=")
        module, dot, fld = key.strip().rpartition(".")
        module, fld = module.strip(), fld.strip()
        if not eq or not dot or not module:
            raise ValueError(f"--autotune-fix {text!r}: {item!r} is not MODULE.FIELD=INT (e.g. language.tp=4)")
        if fld not in FIX_FIELDS:
            raise ValueError(f"--autotune-fix {text!r}: {item!r}: field {fld!r} is not one of {list(FIX_FIELDS)}")
        try:
            n = int(value.strip())
        except ValueError:
            raise ValueError(f"--autotune-fix {text!r}: {item!r}: {value.strip()!r} is not an integer") from None
        if n < 1:
            raise ValueError(f"--autotune-fix {text!r}: {item!r}: {fld} must be >= 1, got {n}")
        if fld in fixes.get(module, {}):
            raise ValueError(f"--autotune-fix {text!r}: {module}.{fld} given twice")
        fixes.setdefault(module, {})[fld] = n
    return fixes


#: --autotune-steps' default: one warm-up step (dropped) and five measured steps per window
AUTOTUNE_STEPS = 6


@dataclass(frozen=True)
class AutotuneConfig:
    """What `--hetero-autotune` measures and what it may choose (`training/autotune_run.py`)."""

    hetero_autotune: bool = flag_field(
        False,
        "measure the first --autotune-steps steps, fit the cost model to them, and move the run (in the same "
        "processes, through a checkpoint in --save) to a layout predicted faster by more than --autotune-min-gain; "
        "measure it, and go back if it is slower. Writes autotune.json and autotune-layout.yaml into --save",
        group="autotune",
    )
    autotune_steps: int = flag_field(
        AUTOTUNE_STEPS,
        "steps per measured window (the first is a warm-up and not counted; default {default})",
        metavar="K",
        group="autotune",
    )
    autotune_min_gain: float = flag_field(
        MIN_GAIN,
        "switch only when the best layout's predicted step beats the measured one by more than this fraction "
        "(default {default}) and by more than the step noise",
        metavar="F",
        group="autotune",
    )
    autotune_rounds: int = flag_field(
        2,
        "layouts tried at most: after a switch that did not measure faster and went back, the next best predicted "
        "layout not tried yet (default {default})",
        metavar="R",
        group="autotune",
    )
    autotune_fix: Optional[str] = flag_field(
        None,
        "degrees the search keeps, MODULE.FIELD=INT[,...] (fields tp, cp, pp, dp, ep; e.g. language.tp=2)",
        metavar="SPEC",
        group="autotune",
    )
    autotune_profile: Optional[str] = flag_field(
        None,
        "the cost profile the run is calibrated from (megatron-hetero profile's JSON; default: the simulated "
        "--autotune-hardware preset with the job's layers measured in-process)",
        metavar="PROFILE.json",
        group="autotune",
    )
    autotune_hardware: str = flag_field(
        "h100_80gb",
        "hardware preset (or HARDWARE.json) of the simulated profile when no --autotune-profile is given "
        "(default {default}; its device memory is the search's memory limit)",
        metavar="NAME",
        group="autotune",
    )
    autotune_skip_layers: bool = flag_field(
        False,
        "calibrate from the trace alone: skip the in-process measurement of one layer of each module at the "
        "other TP/CP degrees the search may choose",
        group="autotune",
    )

    def validate(self, train_iters: int) -> None:
        """ValueError for a bad setting (before any rank starts)."""
        k = self.autotune_steps
        if isinstance(k, bool) or not isinstance(k, int) or k < 2:
            raise ValueError(f"--autotune-steps must be an integer >= 2 (one warm-up step and one measured), got {k!r}")
        r = self.autotune_rounds
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"--autotune-rounds must be a positive integer, got {r!r}")
        g = float(self.autotune_min_gain)
        if not (math.isfinite(g) and g >= 0):
            raise ValueError(f"--autotune-min-gain must be a fraction >= 0, got {self.autotune_min_gain!r}")
        parse_fix(self.autotune_fix)  # its own ValueError names the bad item
        if train_iters < k:
            raise ValueError(
                f"--hetero-autotune measures --autotune-steps {k} steps first; --train-iters {train_iters} is fewer"
            )

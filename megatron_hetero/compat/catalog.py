"""The whole compat table in one list (the entries of :mod:`.cpu`, :mod:`.megatron_lm` and :mod:`.fixes`),
and as markdown. Imported by nothing in the package (the tests and ``python -m
megatron_hetero.compat.catalog`` read it), so no patch module imports it back.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

from .cpu import PATCHES
from .fixes import FIXES, NO_TE_PATCHES
from .megatron_lm import MEGATRON_LM_PATCHES
from .table import Patch

__all__ = ["every_patch", "markdown_table"]


def every_patch() -> List[Patch]:
    """Every entry: the Megatron-core CPU set, the Megatron-LM CPU set, the fixes (with the no-TE fix of
    the Megatron-LM launcher)."""
    return [*PATCHES, *MEGATRON_LM_PATCHES, *FIXES, *NO_TE_PATCHES]


def markdown_table(patches: Optional[Sequence[Patch]] = None) -> str:
    """The table as markdown: patch, reason, target versions, how it acts, upstream spot, removal condition."""
    rows = [
        "| patch | reason | targets | acts | upstream spot | remove when |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for p in every_patch() if patches is None else patches:
        cells = (p.name, p.reason, ", ".join(p.targets), p.use, p.spot, p.removal)
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())

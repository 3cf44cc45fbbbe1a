"""Shared helpers of the benchmarks: output folder, JSON, optional PNG bar plot, markdown tables."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional


def write_json(path: Path, doc: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def bar_plot(
    path: Path,
    labels: list[str],
    series: dict[str, list[float]],
    ylabel: str,
    title: str,
    reference: Optional[float] = None,
) -> Optional[Path]:
    """Grouped horizontal bars; returns None (and plots nothing) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    n = len(series)
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(labels) * max(n, 1) + 1.5))
    height = 0.8 / max(n, 1)
    for k, (name, values) in enumerate(series.items()):
        ax.barh([i + k * height for i in range(len(labels))], values, height=height, label=name)
    ax.set_yticks([i + height * (n - 1) / 2 for i in range(len(labels))])
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    if reference is not None:
        ax.axvline(reference, color="k", lw=0.8, ls="--")
    ax.set_xlabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def save_figure(fig, path: Path) -> Path:
    """Lay out `fig`, write it to `path` (PNG, 110 dpi; parent folders made) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)

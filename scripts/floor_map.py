"""The floor map of the package, generated from its one source: `FLOORS` in tests/pure/test_imports.py.

    python scripts/floor_map.py            # rewrite README's list, docs/architecture.md's table, docs/img/floors.png
    python scripts/floor_map.py --check    # exit 1 and name what drifted from the table

README.md and docs/architecture.md carry the generated text between `<!-- floors:begin -->` and
`<!-- floors:end -->`; the picture carries the table it was drawn from in its PNG `Description` text
chunk, so a check needs no drawing (tests/pure/test_imports.py runs it). Drawing needs matplotlib.
"""

from __future__ import annotations

import argparse
import importlib.util
import struct
import textwrap
import sys
import zlib
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- floors:begin -->", "<!-- floors:end -->"
README, ARCHITECTURE, PICTURE = (
    REPO / "README.md",
    REPO / "docs" / "architecture.md",
    REPO / "docs" / "img" / "floors.png",
)


def load_floors(repo: Path = REPO) -> Sequence[Any]:
    """FLOORS from the import test (the truth), top to bottom."""
    path = repo / "tests" / "pure" / "test_imports.py"
    spec = importlib.util.spec_from_file_location("_floor_table", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the file runs
    spec.loader.exec_module(mod)
    return tuple(mod.FLOORS)


def _stands_on(f: Any) -> str:
    return ", ".join(f"`{s}/`" for s in f.stands_on) or "-"


def readme_block(floors: Sequence[Any]) -> str:
    """README's package list: one line a floor, top to bottom."""
    lines = [
        "Each floor imports only the floors it stands on, and theirs (`tests/pure/test_imports.py` holds",
        "the table and checks every import); top to bottom:",
        "",
    ]
    for f in floors:
        pure = " (pure)" if f.pure else ""
        on = f"; stands on {_stands_on(f)}" if f.stands_on else "; the ground floor"
        lines.append(f"- `{f.name}/`{pure}: {f.job}{on}")
    return "\n".join(lines)


def architecture_block(floors: Sequence[Any]) -> str:
    """docs/architecture.md's floor table, top to bottom."""
    lines = ["| floor | stands on | pure | its job |", "|---|---|---|---|"]
    for f in floors:
        lines.append(f"| `{f.name}/` | {_stands_on(f)} | {'yes' if f.pure else 'no'} | {f.job} |")
    return "\n".join(lines)


def _between(text: str, where: Path) -> tuple[int, int]:
    a, b = text.find(BEGIN), text.find(END)
    if a < 0 or b < a:
        raise ValueError(f"{where}: no {BEGIN} ... {END} block")
    return a + len(BEGIN), b


def _block_of(path: Path) -> str:
    text = path.read_text()
    a, b = _between(text, path)
    return text[a:b].strip("\n")


def _write_block(path: Path, block: str) -> None:
    text = path.read_text()
    a, b = _between(text, path)
    path.write_text(text[:a] + "\n" + block + "\n" + text[b:])


def png_description(path: Path) -> str | None:
    """The `Description` tEXt chunk of a PNG (None when it has none)."""
    data = path.read_bytes()
    pos = 8
    while pos + 8 <= len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        if kind == b"tEXt" and body.startswith(b"Description\x00"):
            return body.split(b"\x00", 1)[1].decode("latin-1")
        if kind == b"zTXt" and body.startswith(b"Description\x00"):
            return zlib.decompress(body.split(b"\x00", 1)[1][1:]).decode("latin-1")
        pos += 12 + length
    return None


def levels(floors: Sequence[Any]) -> dict[str, int]:
    """Height of each floor above layout (longest chain of stands-on); compat stands beside."""
    by = {f.name: f for f in floors}
    out: dict[str, int] = {}

    def level(n: str) -> int:
        if n not in out:
            out[n] = 1 + max((level(s) for s in by[n].stands_on if s != "compat"), default=-1)
        return out[n]

    for f in floors:
        level(f.name)
    return out


def draw(floors: Sequence[Any], out: Path) -> None:
    """The picture: one row per level, floors of one level side by side, compat beside them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    lv = levels(floors)
    main = [f for f in floors if f.name != "compat"]
    rows = max(lv[f.name] for f in main) + 1
    h, gap, width = 0.7, 0.26, 11.0
    fig, ax = plt.subplots(figsize=(13.5, 0.55 * rows + 1.2))
    top = rows * (h + gap)
    for level in range(rows):
        here = [f for f in main if lv[f.name] == level]
        y = top - (rows - level) * (h + gap)
        w = width / len(here)
        for i, f in enumerate(here):
            x = i * w
            face = "#dbe9f6" if f.pure else "#f6e7d2"
            ax.add_patch(
                FancyBboxPatch(
                    (x + 0.04, y),
                    w - 0.08,
                    h,
                    boxstyle="round,pad=0.02,rounding_size=0.06",
                    facecolor=face,
                    edgecolor="#333333",
                    linewidth=1.0,
                )
            )
            ax.text(
                x + 0.14,
                y + h * 0.76,
                f"{f.name}/",
                va="center",
                ha="left",
                fontsize=10,
                fontweight="bold",
                family="monospace",
            )
            job = textwrap.fill(f.job, int(w * 12))
            ax.text(x + 0.14, y + h * 0.54, job, va="top", ha="left", fontsize=7.2, color="#222222", linespacing=1.0)
        if level > 0:
            ax.add_patch(
                FancyArrowPatch(
                    (width / 2, y - 0.01),
                    (width / 2, y - gap + 0.01),
                    arrowstyle="-|>",
                    mutation_scale=10,
                    color="#555555",
                )
            )
    compat = next(f for f in floors if f.name == "compat")
    # runtime stands on compat, and every floor above may import it
    users = [lv[f.name] for f in main if "compat" in f.stands_on] + [rows - 1]
    lo = top - (rows - min(users)) * (h + gap)
    hi = top - (rows - max(users)) * (h + gap) + h
    ax.add_patch(
        FancyBboxPatch(
            (width + 0.35, lo),
            1.7,
            hi - lo,
            boxstyle="round,pad=0.02,rounding_size=0.08",
            facecolor="#e4f2dc",
            edgecolor="#333333",
            linewidth=1.0,
        )
    )
    ax.text(
        width + 1.2,
        (lo + hi) / 2,
        "compat/\n\n" + textwrap.fill(compat.job, 18),
        va="center",
        ha="center",
        fontsize=8.5,
        family="monospace",
    )
    ax.text(
        0,
        top + 0.1,
        "imports point down: a floor uses only the floors it stands on (tests/pure/test_imports.py)",
        fontsize=9.5,
        color="#444444",
    )
    ax.text(
        0,
        -0.15,
        "blue: pure (no torch, no megatron)   sand: side effects   green: compat, beside the floors that use it",
        fontsize=8.5,
        color="#444444",
        va="top",
    )
    ax.set_xlim(-0.2, width + 2.2)
    ax.set_ylim(-0.5, top + 0.4)
    ax.axis("off")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100, bbox_inches="tight", metadata={"Description": architecture_block(floors)})
    plt.close(fig)


def drift(repo: Path = REPO) -> list[str]:
    """What differs from the table: one line per README, docs page or picture out of date."""
    floors = load_floors(repo)
    problems = []
    for path, want in (
        (repo / README.name, readme_block(floors)),
        (repo / "docs" / ARCHITECTURE.name, architecture_block(floors)),
    ):
        if _block_of(path) != want:
            problems.append(f"{path.relative_to(repo)}: its floor block differs from FLOORS")
    picture = repo / "docs" / "img" / PICTURE.name
    if not picture.exists() or png_description(picture) != architecture_block(floors):
        problems.append(f"{picture.relative_to(repo)}: drawn from another table than FLOORS")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only say what drifted; exit 1 if anything did")
    args = p.parse_args(argv)
    if args.check:
        problems = drift()
        for line in problems:
            print(f"floor_map: {line} (run python scripts/floor_map.py)", file=sys.stderr)
        return 1 if problems else 0
    floors = load_floors()
    _write_block(README, readme_block(floors))
    _write_block(ARCHITECTURE, architecture_block(floors))
    draw(floors, PICTURE)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The import graph of megatron_hetero: floors point down, and no file imports itself back.

The floors, each folder naming one job, and what each stands on are the table `FLOORS` below: the
one floor map of the project (README's list, docs/architecture.md's table and docs/img/floors.png are
generated from it by scripts/floor_map.py). A file may import its own floor and the floors it stands on, down
to layout (BELOW, transitively). Why: each floor can be understood, tested
and reused without the ones above it (a plan for a 1024-rank job is computed and tested on a laptop
without torch; the runtime executes plans without knowing which model runs; the models are
assembled without knowing which entry point trains them). So `layout/` and `plan/` import neither
torch nor megatron at all, and `megatron_hetero/__init__.py` imports nothing of the package (every
import of a submodule runs it first).

And no import cycle between files: Python half-initialises a module while its cycle runs, and the
order a cycle resolves in depends on which file happened to be imported first.

Every import counts: module-level, inside functions, under `if TYPE_CHECKING:`, relative ones, and
`__init__.py` re-exports. `from P import n` counts as an import of the submodule P.n when P/n is a
file, else of P's `__init__.py`. The implicit run of a parent package's `__init__.py` is not counted,
so an `__init__.py` that imports its own submodules is fine, as long as none of them imports that
`__init__.py` back.
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "megatron_hetero"


@dataclass(frozen=True)
class Floor:
    """One floor of the package: its folder, the floors it stands on directly, whether it is pure (no
    torch, no megatron), and its job in a line."""

    name: str
    stands_on: tuple[str, ...]
    pure: bool
    job: str


# THE floor map, top to bottom. It may import the floors it stands on, and theirs, down to layout.
# README's package list, docs/architecture.md's floor table and docs/img/floors.png are generated from
# it (`python scripts/floor_map.py`); test_floor_map_is_generated_from_this_table fails when they drift.
FLOORS: tuple[Floor, ...] = (
    Floor("cli", ("bench",), False, "one file per `megatron-hetero` subcommand; `main` and its exit codes"),
    Floor(
        "bench", ("report", "megatron_lm"), False, "`megatron-hetero bench`: the benchmarks, built on everything below"
    ),
    Floor("report", ("planner",), True, "the plan report (text, JSON) and the rank-map, schedule, timeline drawings"),
    Floor("megatron_lm", ("convert", "profiling"), False, "Megatron-LM's own pretrain scripts on our layouts"),
    Floor("convert", ("training",), False, "Hugging Face weights in and out (builds modules as training does)"),
    Floor(
        "training",
        ("checkpoint", "launch", "profiling"),
        False,
        "the job validated, sessions, the training loop, logs, signals, autotune",
    ),
    Floor("checkpoint", ("models",), False, "save/load under any layout, the file format, the restricted unpickler"),
    Floor("launch", ("models",), False, "the environment torchrun/srun give a rank; SLURM scripts"),
    Floor("profiling", ("models",), False, "`megatron-hetero profile`: timing kernels, model-free and the model's own"),
    Floor("models", ("runtime", "data"), False, "the LLaVA-style model from Megatron-core parts, stage runners"),
    Floor(
        "data", ("config",), False, "datasets, energon readers, chat templates, tokenizers, image and speech processing"
    ),
    Floor("runtime", ("planner", "compat"), False, "process groups, boundaries, schedule interpreters, fork launcher"),
    Floor(
        "compat",
        ("plan",),
        False,
        "beside the floors: Megatron-core on CPU/gloo, the only code asking torch about CUDA",
    ),
    Floor("planner", ("config",), True, "the cost model, hardware presets, profile fit, layout search"),
    Floor(
        "config",
        ("plan",),
        True,
        "the job and its sections (model, optimizer, schedule, data, autotune): typed, their flags on the fields",
    ),
    Floor("plan", ("layout",), True, "per-rank plans: boundary plans, placement, schedule tables and their check"),
    Floor("layout", (), True, "YAML or `--hetero-*` flags -> a validated `HeteroLayout`"),
)
BELOW: dict[str, set[str]] = {f.name: set(f.stands_on) for f in FLOORS}


def _closure(floor: str) -> set[str]:
    out = {floor}
    for below in BELOW[floor]:
        out |= _closure(below)
    return out


ALLOWED: dict[str, set[str]] = {floor: _closure(floor) for floor in BELOW}
ALLOWED["root"] = set()
PURE = {f.name for f in FLOORS if f.pure}
FORBIDDEN_IN_PURE = {"torch", "megatron"}


def floor_of(rel: Path) -> Optional[str]:
    """The floor of a file, from its path relative to the package directory; None if unassigned."""
    top = rel.parts[0]
    if len(rel.parts) == 1:
        if top == "__init__.py":
            return "root"
        if top == "__main__.py" or top.startswith("cli"):
            return "cli"
        return None
    if top == "cli":
        return "cli"
    return top if top in ALLOWED else None


@dataclass(frozen=True)
class Import:
    src: Path  # relative to the package's parent directory, e.g. megatron_hetero/runtime/x.py
    line: int
    text: str  # the import statement (ast.unparse: one line, as written up to spacing)
    module: str  # the absolute module name imported (a package's own file or a third-party module)
    target: Optional[Path]  # the package file it resolves to (None: third-party or unresolved)

    def where(self) -> str:
        return f"{self.src}:{self.line} `{self.text}`"


def _module_file(root: Path, dotted: str) -> Optional[Path]:
    """The file of module `dotted` under `root` (the package's parent directory), relative to
    `root`, or None."""
    base = Path(*dotted.split("."))
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if (root / cand).is_file():
            return cand
    return None


def collect_imports(root: Path, package: str) -> list[Import]:
    """Every import of every .py file of `package` (a directory under `root`)."""
    out: list[Import] = []
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root)
        tree = ast.parse(path.read_text(), filename=str(path))
        # The package a relative import is relative to: the file's own package.
        own_package = list(rel.parent.parts)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = _module_file(root, alias.name) if alias.name.split(".")[0] == package else None
                    out.append(Import(rel, node.lineno, ast.unparse(node), alias.name, target))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    keep = len(own_package) - (node.level - 1)
                    base = own_package[:keep] if keep > 0 else []
                    dotted = ".".join(base + ([node.module] if node.module else []))
                else:
                    dotted = node.module or ""
                text = ast.unparse(node)  # the statement, on one line, without comments
                if dotted.split(".")[0] != package:
                    out.append(Import(rel, node.lineno, text, dotted, None))
                    continue
                for alias in node.names:
                    sub = _module_file(root, f"{dotted}.{alias.name}") if alias.name != "*" else None
                    if sub is not None:
                        out.append(Import(rel, node.lineno, text, f"{dotted}.{alias.name}", sub))
                    else:
                        out.append(Import(rel, node.lineno, text, dotted, _module_file(root, dotted)))
    return out


def floor_violations(root: Path, package: str, imports: Optional[list[Import]] = None) -> list[str]:
    """Reverse imports between floors, files on no floor, unresolved package imports, and torch or
    megatron imported from a pure floor; one message per offending import. `imports`: the package's
    `collect_imports`, where the caller has them already."""
    problems: list[str] = []
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root)
        if floor_of(rel.relative_to(package)) is None:
            problems.append(f"{rel}: on no floor (add it to floor_of in tests/pure/test_imports.py)")
    for imp in collect_imports(root, package) if imports is None else imports:
        src_floor = floor_of(imp.src.relative_to(package))
        if src_floor is None:
            continue
        top = imp.module.split(".")[0]
        if top != package:
            if src_floor in PURE and top in FORBIDDEN_IN_PURE:
                problems.append(f"{imp.where()}: {src_floor}/ is pure and must not import {top}")
            continue
        if imp.target is None:
            problems.append(f"{imp.where()}: {imp.module} is not a module of the package")
            continue
        dst_floor = floor_of(imp.target.relative_to(package))
        if dst_floor is None:
            continue  # reported once as a file on no floor
        if dst_floor == "root" and src_floor != "root":
            continue  # the package's own __init__ runs before any submodule anyway
        if dst_floor not in ALLOWED[src_floor]:
            problems.append(
                f"{imp.where()}: {src_floor} imports {dst_floor} ({imp.target}); "
                f"{src_floor} may import only {sorted(ALLOWED[src_floor])}"
            )
    return list(dict.fromkeys(problems))  # one message per statement, not per imported name


def import_cycles(root: Path, package: str, imports: Optional[list[Import]] = None) -> list[str]:
    """Every strongly connected component of more than one file (or a file importing itself) of the
    package's file import graph, with the imports that close it. `imports`: as in `floor_violations`."""
    imports = [i for i in (collect_imports(root, package) if imports is None else imports) if i.target is not None]
    files = sorted({i.src for i in imports} | {i.target for i in imports})
    succ: dict[Path, list[Path]] = {f: [] for f in files}
    for i in imports:
        if i.target not in succ[i.src]:
            succ[i.src].append(i.target)
    # Tarjan's algorithm, iterative.
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    on_stack: set[Path] = set()
    stack: list[Path] = []
    components: list[list[Path]] = []
    counter = 0
    for start in files:
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            recurse = False
            for j in range(i, len(succ[node])):
                nxt = succ[node][j]
                if nxt not in index:
                    work.append((node, j + 1))
                    work.append((nxt, 0))
                    recurse = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if recurse:
                continue
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                components.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    problems = []
    for comp in components:
        members = set(comp)
        inner = [i for i in imports if i.src in members and i.target in members]
        if len(comp) > 1 or inner:
            inner.sort(key=lambda i: (str(i.src), i.line))
            lines = "\n".join(dict.fromkeys(f"    {i.where()} -> {i.target}" for i in inner))
            problems.append(f"import cycle among {[str(f) for f in comp]}:\n{lines}")
    return sorted(problems)


# --------------------------------------------------------------------------------------------
# The real package
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def package_imports() -> list[Import]:
    """The real package's imports, walked once for the tests below."""
    return collect_imports(REPO, "megatron_hetero")


def test_every_file_is_on_a_floor_and_imports_point_down(package_imports):
    problems = floor_violations(REPO, "megatron_hetero", package_imports)
    assert not problems, "imports against the floors (docs/architecture.md):\n" + "\n".join(problems)


def test_no_import_cycles_between_files(package_imports):
    problems = import_cycles(REPO, "megatron_hetero", package_imports)
    assert not problems, "\n".join(problems)


def test_the_walk_sees_the_package(package_imports):
    # Guard against a walk that silently finds nothing: the layout floor's own imports are seen,
    # including relative and function-level ones elsewhere.
    imports = package_imports
    srcs = {str(i.src) for i in imports}
    assert "megatron_hetero/layout/__init__.py" in srcs and "megatron_hetero/compat/__init__.py" in srcs
    edges = {(str(i.src), str(i.target)) for i in imports if i.target is not None}
    assert ("megatron_hetero/layout/yaml_io.py", "megatron_hetero/layout/validate.py") in edges
    assert ("megatron_hetero/compat/__init__.py", "megatron_hetero/compat/device.py") in edges  # relative


# --------------------------------------------------------------------------------------------
# The checker itself, on synthetic packages
# --------------------------------------------------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    for d in {p.parent for p in root.rglob("*.py")} | {root / "pkg"}:
        (d / "__init__.py").touch(exist_ok=True)


CLEAN = {
    "pkg/__init__.py": "",
    "pkg/layout/__init__.py": "from pkg.layout.spec import Spec\nfrom .parse import parse\n",
    "pkg/layout/spec.py": "import dataclasses\nclass Spec: pass\n",
    "pkg/layout/parse.py": "from pkg.layout.spec import Spec\ndef parse(): return Spec()\n",
    "pkg/plan/__init__.py": "",
    "pkg/plan/table.py": "from pkg.layout import Spec\nimport graphlib\n",
    "pkg/planner/__init__.py": "",
    "pkg/planner/cost.py": "from pkg.plan import table\n",
    "pkg/compat/__init__.py": "import torch\nfrom pkg.layout import spec\n",
    "pkg/runtime/__init__.py": "",
    "pkg/runtime/run.py": "import torch\nfrom pkg.plan import table\nfrom pkg import compat\nfrom pkg.planner import cost\n"
    "def f():\n    from ..plan.table import graphlib\n",
    "pkg/models/m.py": "from pkg.runtime.run import f\nfrom pkg.compat import torch\n",
    "pkg/checkpoint/c.py": "from pkg.models import m\n",
    "pkg/launch/l.py": "from pkg.layout import Spec\n",
    "pkg/profiling/p.py": "from pkg.models.m import f\nfrom pkg.planner import cost\n",
    "pkg/training/t.py": "from pkg.models import m\nfrom pkg.checkpoint import c\nfrom pkg.launch.l import Spec\n",
    "pkg/convert/v.py": "from pkg.training.t import m\nfrom pkg.checkpoint import c\n",
    "pkg/megatron_lm/g.py": "from pkg.convert import v\nfrom pkg.profiling import p\n",
    "pkg/report/r.py": "from pkg.plan import table\n",
    "pkg/bench/b.py": "from pkg.training.t import m\nfrom pkg.megatron_lm import g\nfrom pkg.report import r\n",
    "pkg/cli/main.py": "from pkg.bench import b\nfrom pkg.report import r\n",
    "pkg/cli_extra.py": "from pkg.cli import main\n",
    "pkg/__main__.py": "from pkg.cli_extra import main\n",
}


def test_checker_passes_a_clean_package(tmp_path: Path):
    _write(tmp_path, CLEAN)
    assert floor_violations(tmp_path, "pkg") == []
    assert import_cycles(tmp_path, "pkg") == []
    edges = {(str(i.src), str(i.target)) for i in collect_imports(tmp_path, "pkg") if i.target}
    assert ("pkg/runtime/run.py", "pkg/plan/table.py") in edges  # function-level, relative
    assert ("pkg/layout/__init__.py", "pkg/layout/parse.py") in edges  # relative re-export
    assert ("pkg/runtime/run.py", "pkg/compat/__init__.py") in edges  # `from pkg import compat`


@pytest.mark.parametrize(
    "statement",
    [
        "from pkg.training.t import m",
        "import pkg.training.t",
        "from pkg.training import t",
        "def f():\n    from ..training.t import m",
    ],
)
def test_checker_flags_a_reverse_import(tmp_path: Path, statement: str):
    _write(tmp_path, {**CLEAN, "pkg/runtime/x.py": statement + "\n"})
    problems = floor_violations(tmp_path, "pkg")
    assert len(problems) == 1, problems
    assert problems[0].startswith("pkg/runtime/x.py:")
    assert "runtime imports training (pkg/training/t.py" in problems[0]
    assert statement.splitlines()[-1].strip() in problems[0]  # the import line, as written


@pytest.mark.parametrize(
    "src, statement, dst",
    [
        ("pkg/checkpoint/x.py", "from pkg.training import t", "training"),  # the loop saves; a checkpoint runs no loop
        ("pkg/launch/x.py", "from pkg.training.t import m", "training"),
        ("pkg/checkpoint/x.py", "from pkg.launch import l", "launch"),  # peers on models import neither way
        ("pkg/profiling/x.py", "from pkg.checkpoint import c", "checkpoint"),
        ("pkg/training/x.py", "from pkg.convert import v", "convert"),
        ("pkg/profiling/x.py", "from pkg.training import t", "training"),  # training times layers with it
        ("pkg/plan/x.py", "from pkg.planner import cost", "planner"),
        ("pkg/planner/x.py", "from pkg.runtime import run", "runtime"),
        ("pkg/convert/x.py", "from pkg.megatron_lm import g", "megatron_lm"),
        ("pkg/megatron_lm/x.py", "from pkg.report import r", "report"),
        ("pkg/report/x.py", "from pkg.bench import b", "bench"),
        ("pkg/bench/x.py", "from pkg.cli import main", "cli"),
    ],
)
def test_checker_flags_an_import_up_or_across(tmp_path: Path, src: str, statement: str, dst: str):
    _write(tmp_path, {**CLEAN, src: statement + "\n"})
    problems = floor_violations(tmp_path, "pkg")
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{src}:1 `{statement}`: {src.split('/')[1]} imports {dst} (pkg/{dst}/"), problems


def test_checker_flags_torch_in_a_pure_floor_and_compat_importing_up(tmp_path: Path):
    _write(
        tmp_path,
        {
            **CLEAN,
            "pkg/plan/table.py": "def f():\n    import torch.distributed as dist\n",
            "pkg/layout/spec.py": "from megatron.core import parallel_state\nclass Spec: pass\n",
            "pkg/compat/patch.py": "from pkg.runtime import run\n",
            "pkg/plan/uses_compat.py": "from pkg.compat import patch\n",
            "pkg/stray.py": "",
            "pkg/layout/missing.py": "from pkg.layout.nothing import x\n",
            "pkg/planner/fit.py": "import torch\n",
            "pkg/report/draw.py": "def f():\n    from megatron.core import tensor_parallel\n",
        },
    )
    problems = "\n".join(floor_violations(tmp_path, "pkg"))
    assert "pkg/plan/table.py:2 `import torch.distributed as dist`: plan/ is pure and must not import torch" in problems
    assert "pkg/layout/spec.py:1 `from megatron.core import parallel_state`: layout/ is pure" in problems
    assert "pkg/compat/patch.py:1 `from pkg.runtime import run`: compat imports runtime" in problems
    assert "pkg/plan/uses_compat.py:1 `from pkg.compat import patch`: plan imports compat" in problems
    assert "pkg/stray.py: on no floor" in problems
    assert "pkg/layout/missing.py:1 `from pkg.layout.nothing import x`: pkg.layout.nothing is not a module" in problems
    assert "pkg/planner/fit.py:1 `import torch`: planner/ is pure and must not import torch" in problems
    assert "pkg/report/draw.py:2 `from megatron.core import tensor_parallel`: report/ is pure" in problems
    assert len(problems.splitlines()) == 8, problems


def test_checker_flags_a_two_file_cycle(tmp_path: Path):
    _write(
        tmp_path,
        {
            **CLEAN,
            "pkg/plan/a.py": "from pkg.plan.b import g\ndef f(): pass\n",
            "pkg/plan/b.py": "def g():\n    from .a import f\n",
        },
    )
    assert floor_violations(tmp_path, "pkg") == []  # same floor: only the cycle is wrong
    problems = import_cycles(tmp_path, "pkg")
    assert problems == [
        "import cycle among ['pkg/plan/a.py', 'pkg/plan/b.py']:\n"
        "    pkg/plan/a.py:1 `from pkg.plan.b import g` -> pkg/plan/b.py\n"
        "    pkg/plan/b.py:2 `from .a import f` -> pkg/plan/a.py"
    ]


def test_checker_flags_a_cycle_back_into_an_init(tmp_path: Path):
    # layout/__init__ re-exports parse; parse imports a name from the package __init__: a cycle.
    _write(tmp_path, {**CLEAN, "pkg/layout/parse.py": "from pkg.layout import Spec\ndef parse(): pass\n"})
    problems = import_cycles(tmp_path, "pkg")
    assert len(problems) == 1 and "['pkg/layout/__init__.py', 'pkg/layout/parse.py']" in problems[0], problems


def test_checker_flags_a_long_cycle_and_a_self_import(tmp_path: Path):
    _write(
        tmp_path,
        {
            **CLEAN,
            "pkg/runtime/a.py": "import pkg.runtime.b\n",
            "pkg/runtime/b.py": "import pkg.runtime.c\n",
            "pkg/runtime/c.py": "from pkg.runtime import a\n",
            "pkg/runtime/s.py": "from pkg.runtime.s import x\nx = 1\n",
        },
    )
    problems = import_cycles(tmp_path, "pkg")
    assert len(problems) == 2, problems
    assert "['pkg/runtime/a.py', 'pkg/runtime/b.py', 'pkg/runtime/c.py']" in problems[0]
    assert "['pkg/runtime/s.py']" in problems[1]


# --------------------------------------------------------------------------------------------
# The one floor map: README, docs and picture are generated from FLOORS
# --------------------------------------------------------------------------------------------


def _floor_map_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_floor_map", REPO / "scripts" / "floor_map.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_floor_map_is_generated_from_this_table():
    problems = _floor_map_script().drift(REPO)
    assert not problems, "\n".join(problems) + "\n(run: python scripts/floor_map.py)"


def test_floor_table_is_consistent():
    names = [f.name for f in FLOORS]
    assert len(names) == len(set(names))
    for f in FLOORS:
        assert set(f.stands_on) <= set(names), f
        assert (PACKAGE / f.name).is_dir(), f"{f.name}/ is in FLOORS but not a folder of the package"
    assert {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()} == set(names)


def test_floor_map_check_sees_a_drift(tmp_path: Path):
    fm = _floor_map_script()
    for rel in ("README.md", "docs/architecture.md", "docs/img/floors.png", "tests/pure/test_imports.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes((REPO / rel).read_bytes())
    assert fm.drift(tmp_path) == []
    text = (tmp_path / "README.md").read_text().replace("`plan/` (pure)", "`plan/`")
    (tmp_path / "README.md").write_text(text)
    table = (tmp_path / "tests/pure/test_imports.py").read_text()
    (tmp_path / "tests/pure/test_imports.py").write_text(
        table.replace('"report", ("planner",), True', '"report", ("planner",), False')
    )
    problems = fm.drift(tmp_path)
    assert len(problems) == 3 and problems[0].startswith("README.md"), problems

"""The compat table: every spot where megatron_hetero changes, swaps or works around Megatron-core
(or torch), as data.

Each entry (:class:`Patch`) records

* ``name``: a short unique id (``cpu.*`` / ``megatron_lm.*``: CPU redirections; ``fix.*``: fixes);
* ``reason``: :data:`CPU` (a redirection that makes a CUDA-only call or ``device="cuda"`` work on
  CPU/gloo; applied only where CUDA is absent) or :data:`FIX` (an upstream bug or limitation the
  project works around on every machine, GPU included);
* ``targets``: the Megatron-core versions it was written for (checked against
  ``megatron.core.package_info.__version__`` before anything is patched: :func:`check_targets`);
* ``spots``: the upstream objects it wraps, replaces or relies on, with their kind, the parameters
  it relies on and the upstream text that makes it necessary (``tests/ranks/test_compat.py`` checks every
  one against the installed Megatron-core/torch, so an upgrade names the patch that lost its target);
* ``removal``: when it can be deleted;
* ``apply``: how :func:`megatron_hetero.compat.apply_compat` (or the Megatron-LM launcher) installs it,
  or None for an entry that acts where it is used (``use`` says where: a scoped swap during one
  call, or a helper the model code calls).

No environment variable or argument skips the version check: an untargeted Megatron-core is refused
with :class:`UnsupportedMegatronVersion`; adding a version means checking the spots (the test) and
adding it to the entries' ``targets``.
"""

from __future__ import annotations

import fnmatch
import importlib
import inspect
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, Optional, Tuple

from ._patching import MARK

__all__ = [
    "CPU",
    "FIX",
    "MCORE_0_19",
    "Patch",
    "Spot",
    "UnsupportedMegatronVersion",
    "check_targets",
    "megatron_core_version",
    "patch_problems",
    "spot_problems",
]

#: A CPU redirection: a CUDA-only call, ``device="cuda"`` or a CUDA type check given a CPU meaning.
#: Applied only where ``torch.cuda.is_available()`` is False.
CPU = "cpu"
#: A fix of an upstream bug or limitation that acts on every machine, GPU included.
FIX = "fix"

#: The Megatron-core releases every patch below was written (and measured) for: 0.19.0 (Megatron-LM's
#: core_v0.19.0 tree) and 0.19.2 (the registry's newest, what scripts/install.sh pins).
MCORE_0_19: Tuple[str, ...] = ("0.19.*",)

#: Markers other than MARK that our wrappers carry (followed through ``__wrapped__``).
WRAPPER_MARKS = ("__megatron_hetero_clip_vit_norm__",)

KINDS = ("function", "method", "staticmethod", "class", "torch", "value", "source")


@dataclass(frozen=True)
class Spot:
    """One upstream object a patch wraps, replaces or relies on.

    ``target`` is ``"module:attr.path"`` (``"module:torch"`` for a module's global name ``torch``,
    ``"module:Class.method"`` for an attribute in a class's own ``__dict__``; ``"module"`` alone for
    ``kind="source"``: the module's file, read without importing it). ``kind`` is one of
    :data:`KINDS`; ``params`` the leading parameter names the patch relies on (None: not checked);
    ``uses`` text the upstream source of the object (of the module for ``kind="torch"`` and
    ``"source"``) still holds while the patch is needed (quotes are normalised to ``"``).
    """

    target: str
    kind: str = "function"
    params: Optional[Tuple[str, ...]] = None
    uses: Tuple[str, ...] = ()

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    @property
    def attr(self) -> str:
        return self.target.partition(":")[2]


@dataclass(frozen=True)
class Patch:
    """One entry of the compat table (see the module docstring)."""

    name: str
    reason: str
    spot: str
    action: str
    targets: Tuple[str, ...]
    removal: str
    spots: Tuple[Spot, ...]
    apply: Optional[Callable[[], None]] = None
    use: str = ""  # default: "applied once by apply_compat()" (CPU entries: "..., without CUDA")

    def __post_init__(self) -> None:
        if not self.use:
            object.__setattr__(
                self, "use", "applied once by apply_compat()" + (", without CUDA" if self.reason == CPU else "")
            )
        assert self.reason in (CPU, FIX), f"{self.name}: reason {self.reason!r}"
        assert self.targets and self.spots and self.removal, f"{self.name}: targets, spots and removal are required"
        assert all(s.kind in KINDS for s in self.spots), f"{self.name}: spot kinds {[s.kind for s in self.spots]}"


# --------------------------------------------------------------------------------------------
# The version gate
# --------------------------------------------------------------------------------------------


class UnsupportedMegatronVersion(RuntimeError):
    """The installed Megatron-core is not among a patch's target versions; nothing was patched."""


def megatron_core_version() -> str:
    """The release of the installed Megatron-core: ``megatron.core.package_info.__version__`` without
    its local label (Megatron-core appends ``+<git hash>`` when its files sit inside any git work tree,
    e.g. a ``.venv`` in a clone, or a Megatron-LM checkout: ``0.19.2+3987f83`` is release 0.19.2)."""
    return importlib.import_module("megatron.core.package_info").__version__.split("+", 1)[0]


def targets_version(patch: Patch, version: str) -> bool:
    """Whether ``patch`` was written for ``version`` (a target is a version or a glob: ``"0.19.*"``)."""
    return any(version == t or fnmatch.fnmatchcase(version, t) for t in patch.targets)


def check_targets(patches: Iterable[Patch], version: Optional[str] = None) -> str:
    """Refuse (:class:`UnsupportedMegatronVersion`) when the installed Megatron-core (or ``version``)
    is not a target of every patch in ``patches``; else return the version. Call it before applying
    any of them: a refusal leaves Megatron untouched."""
    patches = list(patches)
    found = megatron_core_version() if version is None else version
    untargeted = [p for p in patches if not targets_version(p, found)]
    if not untargeted:
        return found
    supported = sorted(set.intersection(*(set(p.targets) for p in patches)))
    first = untargeted[0]
    more = untargeted[1:]
    rest = (
        f" (and {len(more)} more: {', '.join(p.name for p in more[:8])}{', ...' if len(more) > 8 else ''})"
        if more
        else ""
    )
    raise UnsupportedMegatronVersion(
        f"megatron-core {found} is installed, but megatron_hetero.compat supports megatron-core "
        f"{' and '.join(supported) or 'no single version'} here: patch {first.name!r} ({first.spot.split(':')[0]}) "
        f"was written for megatron-core {', '.join(first.targets)}{rest}. Nothing was patched. Install a "
        f"supported megatron-core, or port the compat table: check every patched spot against {found} "
        f"(tests/ranks/test_compat.py::test_every_patched_spot_exists) and add {found} to the targets of the "
        f"patches that still apply (megatron_hetero/compat/)"
    )


# --------------------------------------------------------------------------------------------
# The spot checks
# --------------------------------------------------------------------------------------------


def upstream(obj: Any) -> Any:
    """The upstream object behind our wrappers (follows :data:`MARK` and :data:`WRAPPER_MARKS`)."""
    for _ in range(16):
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
            continue
        original = vars(obj).get(MARK) if hasattr(obj, "__dict__") else None
        if original is not None and original is not True:
            obj = original
            continue
        if any(getattr(obj, m, False) is True for m in WRAPPER_MARKS) and hasattr(obj, "__wrapped__"):
            obj = obj.__wrapped__
            continue
        return obj
    raise AssertionError(f"wrapper chain too long at {obj!r}")


def _resolve(spot: Spot) -> Tuple[Any, Any]:
    """(the raw object at the spot, its owner); raises LookupError naming what is missing."""
    try:
        owner: Any = importlib.import_module(spot.module)
    except ImportError as exc:
        raise LookupError(f"module {spot.module} does not import ({exc})") from None
    obj: Any = owner
    parts = spot.attr.split(".") if spot.attr else []
    for i, part in enumerate(parts):
        owner = obj
        if isinstance(obj, type):
            if part not in vars(obj):
                raise LookupError(f"{spot.module}:{'.'.join(parts[: i + 1])} is not defined on {obj.__name__}")
            obj = vars(obj)[part]
        elif not hasattr(obj, part):
            raise LookupError(f"{spot.module}:{'.'.join(parts[: i + 1])} does not exist")
        else:
            obj = getattr(obj, part)
    return obj, owner


def _source(obj: Any) -> str:
    try:
        return inspect.getsource(obj).replace("'", '"')
    except (OSError, TypeError):
        return ""


def spot_problems(spot: Spot) -> List[str]:
    """What no longer holds at ``spot`` in the installed packages (empty: the spot is as written)."""
    if spot.kind == "source":
        from importlib.util import find_spec

        try:
            found = find_spec(spot.module)
        except ImportError as exc:
            return [f"module {spot.module}: {exc}"]
        if found is None or not found.origin or not found.has_location:
            return [f"module {spot.module} does not exist"]
        with open(found.origin, encoding="utf-8") as f:
            text = f.read().replace("'", '"')
        return [
            f"{spot.target} no longer holds {t!r} (fixed upstream? then the patch may be removable)"
            for t in spot.uses
            if t.replace("'", '"') not in text
        ]
    try:
        raw, _ = _resolve(spot)
    except LookupError as exc:
        return [str(exc)]
    obj = upstream(raw)
    problems: List[str] = []
    where = spot.target
    if spot.kind == "torch":
        import torch

        if obj is not torch:
            problems.append(f"{where} is {obj!r}, not the torch module")
        source = _source(importlib.import_module(spot.module))
    else:
        if spot.kind == "staticmethod":
            if not isinstance(raw, staticmethod):
                problems.append(f"{where} is a {type(raw).__name__}, not a staticmethod")
        elif spot.kind == "class":
            if not isinstance(obj, type):
                problems.append(f"{where} is a {type(obj).__name__}, not a class")
        elif spot.kind in ("function", "method"):
            if not isinstance(obj, types.FunctionType):
                problems.append(f"{where} is a {type(obj).__name__}, not a function")
        source = _source(obj) if spot.uses else ""
    if spot.params is not None and not problems:
        try:
            names = tuple(inspect.signature(obj).parameters)
        except (TypeError, ValueError) as exc:
            names = ()
            problems.append(f"{where}: no signature ({exc})")
        if names[: len(spot.params)] != tuple(spot.params):
            problems.append(f"{where} takes ({', '.join(names)}), the patch relies on ({', '.join(spot.params)}, ...)")
    for text in spot.uses:
        if text.replace("'", '"') not in source:
            problems.append(f"{where} no longer holds {text!r} (fixed upstream? then the patch may be removable)")
    return problems


def patch_problems(patch: Patch) -> List[str]:
    """Every problem of every spot of ``patch``, prefixed with its name."""
    return [f"{patch.name}: {p}" for s in patch.spots for p in spot_problems(s)]

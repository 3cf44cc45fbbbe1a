"""Small, explicit monkey-patching helpers shared by the compat patches (the table of patches itself:
:mod:`.table`).

Every wrapper installed through these helpers carries :data:`MARK` (holding the original object), so
applying a patch twice is harmless.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Any, Callable, Iterator, List

#: Attribute set on every wrapper/redirect installed by compat; it holds the original object.
MARK = "__megatron_hetero_compat__"


@contextlib.contextmanager
def swapped(owner: Any, name: str, value: Any) -> Iterator[None]:
    had_own = name in vars(owner)
    old = vars(owner).get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if had_own:
            setattr(owner, name, old)
        else:
            delattr(owner, name)


def wrap_call(fn: Callable, context: Callable[[], contextlib.AbstractContextManager]) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with context():
            return fn(*args, **kwargs)

    setattr(wrapper, MARK, fn)
    return wrapper


def rebind_function(module_names: List[str], attr: str, make: Callable[[Callable], Callable]):
    """Replace function ``attr`` in every listed module (the defining one and those that imported
    it by name) with ``make(original)``; skip modules that already hold our wrapper."""
    original = None
    for name in module_names:
        module = importlib.import_module(name)
        current = getattr(module, attr)
        if hasattr(current, MARK):
            continue
        if original is None:
            original = current
        assert current is original, f"{name}.{attr} is not the function defined upstream"
        wrapper = make(original)
        setattr(wrapper, MARK, original)
        setattr(module, attr, wrapper)


def wrap_method(cls: type, attr: str, make: Callable[[Callable], Callable]) -> None:
    current = vars(cls)[attr]
    if hasattr(current, MARK):
        return
    wrapper = make(current)
    setattr(wrapper, MARK, current)
    setattr(cls, attr, wrapper)

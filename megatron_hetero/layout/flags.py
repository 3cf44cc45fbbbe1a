"""Command-line flags declared on dataclass fields: one declaration carries a setting's default, its
help text and its flag, and the argparse arguments are generated from it.

    @dataclass(frozen=True)
    class OptimConfig:
        lr: float = flag_field(1e-3, "the learning rate", group="training")

`flag_field(default, help, ...)` is a `dataclasses.field` whose metadata says how its flag looks:

    flag    the option string (default: '--' and the field name with '-' for '_')
    dest    the argparse dest (default: the option string without '--', '_' for '-')
    group   the key of the argument group it is listed under (the caller maps keys to titles)
    given   the parser's default is None, so that a caller can tell a given value from the default
            (the model flags: `train --load` builds the model a checkpoint records when no size flag
            is given; `search` takes a preset's sizes for the flags not given); `value` reads the
            field's default back for None
    cli     the flag's default where the command line's differs from the field's (--log-interval:
            `train` prints a line every iteration, a job built in code prints none)
    and argparse's own keywords (type, choices, metavar, action, const), for what the field's type
    does not say.

A help text may name the default as `{default}`. The flag's type comes from the field's annotation
(int, float, str, bool, Optional of one); a bool flag is a switch (`store_true`, or `store_const`
True with default None when `given`). Pure: argparse and dataclasses only.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Iterable, Mapping, Optional, Sequence

_TYPES = {"int": int, "float": float, "str": str, "bool": bool}
_OWN = ("flag", "dest", "group", "given", "cli", "help")


def flag_field(
    default: Any = dataclasses.MISSING,
    help: Optional[str] = None,
    *,
    default_factory: Any = dataclasses.MISSING,
    flag: Optional[str] = None,
    dest: Optional[str] = None,
    group: Optional[str] = None,
    given: bool = False,
    cli: Any = dataclasses.MISSING,
    compare: bool = True,
    **argparse_kw: Any,
) -> Any:
    """A dataclass field with a command-line flag (see the module docstring)."""
    meta: dict[str, Any] = {"flag": flag, "dest": dest, "group": group, "given": given, "help": help}
    if cli is not dataclasses.MISSING:
        meta["cli"] = cli
    meta.update(argparse_kw)
    return dataclasses.field(
        default=default, default_factory=default_factory, compare=compare, metadata={"cli_flag": meta}
    )


def is_flag(f: dataclasses.Field) -> bool:
    return "cli_flag" in f.metadata


def _meta(f: dataclasses.Field) -> dict[str, Any]:
    return f.metadata["cli_flag"]


def option(f: dataclasses.Field) -> str:
    """'--hidden-size' for the field `hidden_size` (or the flag its metadata names)."""
    return _meta(f)["flag"] or "--" + f.name.replace("_", "-")


def dest(f: dataclasses.Field) -> str:
    """The argparse dest of the field's flag ('hidden_size' for '--hidden-size')."""
    return _meta(f)["dest"] or option(f)[2:].replace("-", "_")


def group(f: dataclasses.Field) -> Optional[str]:
    return _meta(f)["group"]


def default(f: dataclasses.Field) -> Any:
    """The field's default (what a flag not given means)."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    if f.default is dataclasses.MISSING:
        raise TypeError(f"field {f.name} has no default")
    return f.default


def flags_of(cls: type, names: Optional[Sequence[str]] = None) -> list[dataclasses.Field]:
    """The fields of dataclass `cls` that have a flag, in declaration order (or in the order of
    `names`, which must all be such fields)."""
    fields = {f.name: f for f in dataclasses.fields(cls) if is_flag(f)}
    if names is None:
        return list(fields.values())
    unknown = [n for n in names if n not in fields]
    assert not unknown, f"{cls.__name__} has no flags for {unknown}"
    return [fields[n] for n in names]


def _argparse_type(f: dataclasses.Field) -> Any:
    text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    text = text.strip()
    if text.startswith("Optional[") and text.endswith("]"):
        text = text[len("Optional[") : -1].strip()
    if text not in _TYPES:
        raise TypeError(f"field {f.name}: type {f.type!r} needs an explicit `type=` or `action=` for its flag")
    return _TYPES[text]


def argument(f: dataclasses.Field, help: Optional[str] = None) -> tuple[tuple[str, ...], dict[str, Any]]:
    """(option strings, keywords) of `parser.add_argument` for the field's flag; `help` replaces the
    field's help text."""
    meta = _meta(f)
    kw = {k: v for k, v in meta.items() if k not in _OWN}
    text = meta["help"] if help is None else help
    if text is not None and "{default}" in text:
        text = text.replace("{default}", str(default(f)))
    if meta["given"]:
        value = None
    elif "cli" in meta:
        value = meta["cli"]
    else:
        value = default(f)
    if "action" not in kw and "type" not in kw:
        t = _argparse_type(f)
        if t is bool and meta["given"]:
            kw.update(action="store_const", const=True)
        elif t is bool:
            kw["action"] = "store_true"
        else:
            kw["type"] = t
    if kw.get("action") != "store_true":
        kw["default"] = value
    elif value:
        raise TypeError(f"field {f.name}: a switch defaults to False")
    kw["dest"] = dest(f)
    if text is not None:
        kw["help"] = text
    return (option(f),), kw


def add_flags(
    parser: argparse.ArgumentParser,
    fields: Iterable[dataclasses.Field],
    titles: Optional[Mapping[str, str]] = None,
    help: Optional[Mapping[str, str]] = None,
) -> None:
    """Add the flags of `fields` to `parser`: each under the argument group `titles[its group]`
    (one group per title and parser, made on first use; no `titles` or no group: the parser
    itself); `help` replaces some fields' help texts, by dest."""
    groups = parser.__dict__.setdefault("_flag_groups", {})
    for f in fields:
        key = group(f)
        target: Any = parser
        if titles is not None and key is not None:
            title = titles[key]
            if title not in groups:
                groups[title] = parser.add_argument_group(title)
            target = groups[title]
        names, kw = argument(f, (help or {}).get(dest(f)))
        target.add_argument(*names, **kw)


def value(args: Any, f: dataclasses.Field) -> Any:
    """The field's value in `args` (an argparse namespace with the field's flag): the flag's value, or
    for a `given` flag not given the field's default. A namespace without the flag is an error (the
    flag belongs to the parser that made `args`)."""
    v = getattr(args, dest(f))
    if v is None and _meta(f)["given"]:
        return default(f)
    return v


def given(args: Any, f: dataclasses.Field) -> bool:
    """Whether a `given` flag was given (its value is not None)."""
    assert _meta(f)["given"], f"--{f.name}: not a flag that tells given from default"
    return getattr(args, dest(f)) is not None


def values(cls: type, args: Any, names: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """{field name: value(args, field)} for the flags of `cls` (or those of `names`): the keywords
    that build a `cls` from parsed flags."""
    return {f.name: value(args, f) for f in flags_of(cls, names)}

"""Which modules are encoders, which form the language model, and which are output modules (pure;
the one place that decides roles, for every floor).

The language model is chosen explicitly, in this order:
  1. the modules that declare `layers` (pipeline segments of one language model, in layer order;
     segment k+1 must start where segment k ends);
  2. the module that declares `role: language`;
  3. the module named `language`;
  4. (older layouts) the module graph's only sink.
Modules upstream of the (first) language module are encoders, whose tokens enter it; modules
downstream of the (last) language module are **output modules** (e.g. a `generator` head that maps
the language model's hidden states of some positions to an output with its own loss). A module that
is neither is an error.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_hetero.layout.spec import HeteroLayout, ModuleLayout


@dataclass(frozen=True)
class Roles:
    """Module names by role: `encoders` in declaration order, `language` segments in layer order,
    `outputs` (modules after the language model) in declaration order."""

    encoders: tuple[str, ...]
    language: tuple[str, ...]
    outputs: tuple[str, ...] = ()

    @property
    def first_language(self) -> str:
        return self.language[0]

    @property
    def last_language(self) -> str:
        return self.language[-1]

    def is_encoder(self, name: str) -> bool:
        return name in self.encoders

    def is_output(self, name: str) -> bool:
        return name in self.outputs

    @property
    def loss_modules(self) -> tuple[str, ...]:
        """Modules whose last stage computes a loss: the last language segment, then each output module."""
        return (self.last_language,) + self.outputs


def language_modules(layout: HeteroLayout) -> list[ModuleLayout]:
    """The language-model modules in layer order (see the module docstring); ValueError when there is
    none, several, or segments whose `layers` leave a gap."""
    with_layers = [m for m in layout.modules if m.layers is not None]
    if with_layers:
        mods = sorted(with_layers, key=lambda m: m.layers.start)  # type: ignore[union-attr]  # all have layers
        expect = 0
        for m in mods:
            assert m.layers is not None  # with_layers holds only these
            if m.layers.start != expect:
                raise ValueError(
                    f"language segments must cover their layers in order from 0; {m.name} starts at "
                    f"layer {m.layers.start}, expected {expect}"
                )
            expect = m.layers.end + 1
        return mods
    declared = [m for m in layout.modules if getattr(m, "role", None) == "language"]
    if len(declared) > 1:
        raise ValueError(
            f"{len(declared)} modules declare role: language ({[m.name for m in declared]}); one "
            "language model per layout (segments declare `layers: A-B` instead)"
        )
    if declared:
        return declared
    if "language" in layout.names:
        return [layout.module("language")]
    sinks = [m for m in layout.modules if not layout.consumers(m.name)]
    if len(sinks) != 1:
        raise ValueError(
            f"no module is the language model: name it `language`, or give it `role: language` "
            f"(the graph has {len(sinks)} sinks {[m.name for m in sinks]}; segments declare `layers: A-B`)"
        )
    return sinks


def _reach(layout: HeteroLayout, start: str, forward: bool) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        n = todo.pop()
        for nxt in layout.consumers(n) if forward else layout.producers(n):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def roles(layout: HeteroLayout) -> Roles:
    """Encoders, language segments and output modules of a layout (see the module docstring)."""
    langs = tuple(m.name for m in language_modules(layout))
    after = _reach(layout, langs[-1], forward=True) - set(langs)
    before = set()
    for name in langs:
        before |= _reach(layout, name, forward=False)
    before -= set(langs)
    both = sorted(before & after)
    if both:
        raise ValueError(f"modules {both} are both before and after the language model {langs[-1]}")
    outputs = tuple(m.name for m in layout.modules if m.name in after)
    encoders = tuple(m.name for m in layout.modules if m.name not in langs and m.name not in after)
    return Roles(encoders=encoders, language=langs, outputs=outputs)


def language_layers(layout: HeteroLayout, num_layers_default: int = 2) -> int:
    """The language model's layer count implied by the layout's segments (`num_layers_default`
    when no module declares `layers`)."""
    ends = [m.layers.end for m in layout.modules if m.layers is not None]
    return max(ends) + 1 if ends else num_layers_default

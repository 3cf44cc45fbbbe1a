"""Which modules are encoders and which form the language model (pure; one rule for every floor).

The language model is the module graph's sink, or, when the language model is cut into pipeline
segments, the modules that declare `layers` (in layer order; segment k+1 must start where segment k
ends). Every other module is an encoder whose tokens enter the first language segment.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_hetero.layout.spec import HeteroLayout, ModuleLayout


@dataclass(frozen=True)
class Roles:
    """Module names by role: `encoders` in declaration order, `language` segments in layer order."""

    encoders: tuple[str, ...]
    language: tuple[str, ...]

    @property
    def first_language(self) -> str:
        return self.language[0]

    @property
    def last_language(self) -> str:
        return self.language[-1]

    def is_encoder(self, name: str) -> bool:
        return name in self.encoders


def language_modules(layout: HeteroLayout) -> list[ModuleLayout]:
    """The language-model modules in layer order; ValueError when there is none, several sinks
    without `layers`, or segments whose `layers` leave a gap."""
    with_layers = [m for m in layout.modules if m.layers is not None]
    if with_layers:
        mods = sorted(with_layers, key=lambda m: m.layers.start)
        expect = 0
        for m in mods:
            if m.layers.start != expect:
                raise ValueError(f"language segments must cover their layers in order from 0; {m.name} starts at "
                                 f"layer {m.layers.start}, expected {expect}")
            expect = m.layers.end + 1
        return mods
    sinks = [m for m in layout.modules if not layout.consumers(m.name)]
    if len(sinks) != 1:
        raise ValueError(f"the language model is the module graph's sink, but the graph has {len(sinks)} sinks "
                         f"({[m.name for m in sinks]}); give language segments `layers: A-B`")
    return sinks


def roles(layout: HeteroLayout) -> Roles:
    """Encoders and language segments of a layout (see the module docstring)."""
    langs = tuple(m.name for m in language_modules(layout))
    return Roles(encoders=tuple(m.name for m in layout.modules if m.name not in langs), language=langs)


def language_layers(layout: HeteroLayout, num_layers_default: int = 2) -> int:
    """The language model's layer count implied by the layout's segments (`num_layers_default`
    when no module declares `layers`)."""
    ends = [m.layers.end for m in layout.modules if m.layers is not None]
    return max(ends) + 1 if ends else num_layers_default

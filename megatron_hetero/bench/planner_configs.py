"""The planner benchmark's model and configurations (`bench/planner.py`, also measured by `bench/e2e.py` and
`bench/cost_check.py`): the tiny LLaVA model with its train flags, the layout documents per world size,
and their resolution and one-line description.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.config.model import EncoderSpec, LlavaSpec, ModelFlags, flag_values, spec_from_flags
from megatron_hetero.layout import layout_from_dict
from megatron_hetero.config.job import JobConfig


WORLDS = (4, 8)


@dataclass(frozen=True)
class BenchModel:
    """The benchmark's model (the model's description, `config.model.LlavaSpec`: the tiny model
    with 4 language-model layers, one `vision` encoder) and batch (train's flags)."""

    spec: LlavaSpec = field(default_factory=lambda: LlavaSpec(num_layers=4))
    global_batch_size: int = 16
    micro_batch_size: int = 2

    @property
    def encoder(self) -> EncoderSpec:
        (e,) = self.spec.encoders.values()
        return e

    def resized(self, **sizes) -> "BenchModel":
        """This model with some of train's size flags changed (by dest: num_layers, encoder_tokens, ...)."""

        unknown = set(sizes) - set(flag_values(self.spec, keep_none=True))
        assert not unknown, f"not size flags: {sorted(unknown)}"
        flags = ModelFlags.from_dests({**flag_values(self.spec, keep_none=True), **sizes})
        return dataclasses.replace(self, spec=spec_from_flags(flags))

    def to_dict(self) -> dict:
        """The model as train's flags (`config.model.flag_values`) and the batch."""
        return {
            **flag_values(self.spec),
            "global_batch_size": self.global_batch_size,
            "micro_batch_size": self.micro_batch_size,
        }

    def job(self, train_iters: int):

        return JobConfig(
            spec=self.spec,
            global_batch_size=self.global_batch_size,
            micro_batch_size=self.micro_batch_size,
            train_iters=train_iters,
        )


# ---------------------------------------------------------------------------------------------
# Configurations
# ---------------------------------------------------------------------------------------------
def _colo(enc: dict, llm: dict) -> dict:
    return {"placement": "colocated", "modules": {"vision": enc, "language": llm}, "edges": ["vision -> language"]}


def _dis(enc: dict, *llm: dict) -> dict:
    if len(llm) == 1:
        return {
            "placement": "disjoint",
            "modules": {"vision": enc, "language": llm[0]},
            "edges": ["vision -> language"],
        }
    mods = {"vision": enc, "language_a": llm[0], "language_b": llm[1]}
    return {"placement": "disjoint", "modules": mods, "edges": ["vision -> language_a", "language_a -> language_b"]}


def _homo(d: dict) -> dict:
    return _colo(dict(d), dict(d))


#: (world, layout document); the benchmark model has 4 LLM layers (heads 4) and 2 encoder layers.
CONFIGS: list[tuple[int, dict]] = [
    # world 4
    (4, _homo({"dp": 4})),
    (4, _homo({"tp": 2, "dp": 2})),
    (4, _homo({"pp": 2, "dp": 2})),
    (4, _homo({"tp": 4})),
    (4, _colo({"dp": 4}, {"tp": 2, "dp": 2})),
    (4, _colo({"dp": 4}, {"pp": 2, "dp": 2})),
    (4, _colo({"dp": 4}, {"cp": 2, "dp": 2})),
    (4, _colo({"tp": 2, "dp": 2}, {"dp": 4})),
    (4, _dis({"dp": 2}, {"dp": 2})),
    (4, _dis({"dp": 2}, {"pp": 2})),
    (4, _dis({"tp": 2}, {"tp": 2})),
    (4, _dis({"pp": 2}, {"dp": 2})),
    # world 8
    (8, _homo({"dp": 8})),
    (8, _homo({"tp": 2, "dp": 4})),
    (8, _homo({"tp": 2, "pp": 2, "dp": 2})),
    (8, _homo({"pp": 2, "dp": 4})),
    (8, _colo({"dp": 8}, {"tp": 2, "pp": 2, "dp": 2})),
    (8, _colo({"dp": 8}, {"tp": 2, "dp": 4})),
    (8, _colo({"dp": 8}, {"cp": 2, "dp": 4})),
    (8, _colo({"tp": 2, "dp": 4}, {"dp": 8})),
    (8, _dis({"dp": 4}, {"tp": 2, "dp": 2})),
    (8, _dis({"dp": 4}, {"dp": 4})),
    (8, _dis({"dp": 4}, {"pp": 2, "dp": 2})),
    (8, _dis({"dp": 2}, {"tp": 2, "layers": "0-1"}, {"tp": 2, "pp": 2, "layers": "2-3"})),
    (8, _dis({"dp": 2}, {"tp": 2, "layers": "0-1"}, {"tp": 2, "dp": 2, "layers": "2-3"})),
]


def resolve(doc: dict, world: int) -> HeteroLayout:
    return layout_from_dict(doc, world_size=world)


def describe(layout: HeteroLayout) -> str:
    parts = []
    for m in layout.modules:
        deg = "·".join(f"{k.upper()}{getattr(m, k)}" for k in ("tp", "cp", "pp", "dp") if getattr(m, k) > 1) or "DP1"
        parts.append(f"{m.name} {deg}@{m.ranks}")
    return ", ".join(parts)

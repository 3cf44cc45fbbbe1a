"""The seam between schedules and models: a toy stage runner (a linear "encoder" and a two-layer
tanh "language model" with a squared-error per-token loss, plain torch, no Megatron model) trains
through both schedules, colocated and disjoint, and matches a single-process torch reference.

If the schedules knew anything about the LLaVA model (its data, its shapes, which module is the
language model by name), this runner could not drive them.
"""

from __future__ import annotations

from typing import Mapping, Optional

import pytest
import torch

from megatron_hetero.layout import layout_from_dict
from megatron_hetero.runtime.launcher import run_ranks
from megatron_hetero.runtime.stage_runner import EdgeTensor, LossSum, StageRunner

FEAT, HID, TOK = 3, 6, 4  # feature size, hidden size, encoder tokens per sample
G, STEPS, LR, MOMENTUM = 8, 3, 0.05, 0.9


def features(index: int) -> torch.Tensor:
    """Sample `index` (every step sees the same G samples, so the loss falls)."""
    return torch.randn(TOK, FEAT, generator=torch.Generator().manual_seed(1000 + index % G))


def target(index: int) -> torch.Tensor:
    return torch.randn(TOK, generator=torch.Generator().manual_seed(5000 + index % G))


def make_modules() -> dict[str, list[torch.nn.Module]]:
    """The whole toy model, deterministically initialised: encoder, then the language model as two
    layers (one pipeline stage each when pp = 2) and a head."""
    torch.manual_seed(0)
    enc = torch.nn.Linear(FEAT, HID)
    l0, l1, head = torch.nn.Linear(HID, HID), torch.nn.Linear(HID, HID), torch.nn.Linear(HID, 1)
    return {"vision": [enc], "language": [l0, l1, head]}


def per_token_loss(y: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    return (y.squeeze(-1) - tgt) ** 2


def reference() -> tuple[list[float], dict[str, list[torch.Tensor]]]:
    """The same training in one process with plain torch (SGD with momentum, as Megatron's)."""
    mods = make_modules()
    params = [p for ms in mods.values() for m in ms for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
    losses = []
    for step in range(STEPS):
        idx = range(step * G, (step + 1) * G)
        x = torch.stack([features(i) for i in idx])
        t = torch.stack([target(i) for i in idx])
        enc, (l0, l1, head) = mods["vision"][0], mods["language"]
        y = head(torch.tanh(l1(torch.tanh(l0(enc(x))))))
        loss = per_token_loss(y, t).sum() / (G * TOK)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: [p.detach().clone() for m in ms for p in m.parameters()] for n, ms in mods.items()}


class ToyStage(torch.nn.Module):
    """This rank's part of one toy module, with the Megatron attributes DDP and the schedules read."""

    def __init__(self, layers: list[torch.nn.Module], config, activation: bool) -> None:
        super().__init__()
        from megatron.core.transformer.enums import ModelType

        self.layers = torch.nn.ModuleList(layers)
        self.config, self.model_type, self.activation = config, ModelType.encoder_or_decoder, activation
        self.input_tensor: Optional[torch.Tensor] = None

    def set_input_tensor(self, t) -> None:
        self.input_tensor = t[0] if isinstance(t, list) else t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
            if self.activation:
                x = torch.tanh(x)
        return x


class ToyRunner(StageRunner):
    """A StageRunner for the toy model: [rows, TOK, HID] on the edge, [TOK, rows, HID] between stages."""

    def __init__(self, plan, states) -> None:
        self.plan, self.states = plan, states

    def loss_modules(self) -> tuple[str, ...]:
        return ("language",)

    def loss_tokens(self, step: int) -> int:
        return G * TOK

    def edge_tensor(self, edge) -> EdgeTensor:
        return EdgeTensor(seq=TOK, hidden=HID)

    def stage_tensor(self, module: str, rows: int):
        return (TOK, rows, HID), torch.float32

    def model(self, module: str) -> torch.nn.Module:
        return self.states[module].model

    def forward(self, module: str, samples: range, inputs: Mapping[str, torch.Tensor], stage_input):
        me, model = self.plan.modules[module], self.states[module].model
        if module == "vision":
            return model(torch.stack([features(i) for i in samples]))
        x = inputs["vision"].transpose(0, 1) if me.first_stage else stage_input
        if x is None:
            x = self.states[module].module.input_tensor  # set by Megatron's pipeline schedule
        h = model(x)
        if not me.last_stage:
            return h
        y = self.states[module].module.head(h).transpose(0, 1)  # [rows, TOK, 1]
        t = torch.stack([target(i) for i in samples])
        return LossSum(per_token_loss(y, t).sum(), torch.tensor(t.numel()))


def _rank(doc: dict) -> dict:
    import torch.distributed as dist
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hetero.plan.rank_plan import rank_plan
    from megatron_hetero.runtime.colocated import ColocatedSchedule
    from megatron_hetero.runtime.config import RuntimeConfig
    from megatron_hetero.runtime.disjoint import DisjointSchedule
    from megatron_hetero.runtime.module_state import ModuleState, OptimConfig
    from megatron_hetero.runtime.topology import Topology

    layout = layout_from_dict(doc, world_size=dist.get_world_size())
    topo = Topology.build(layout, timeout_s=60)
    try:
        plan = rank_plan(layout, topo.rank, G, 2 if layout.placement == "disjoint" else 1)
        full = make_modules()
        states = {}
        for name, me in plan.modules.items():
            m = layout.module(name)
            cfg = TransformerConfig(
                num_layers=1,
                hidden_size=HID,
                num_attention_heads=1,
                use_cpu_initialization=True,
                calculate_per_token_loss=True,
                pipeline_model_parallel_size=m.pp,
                pipeline_dtype=torch.float32,
            )
            if name == "vision":
                stage = ToyStage(full["vision"], cfg, activation=False)
            else:
                layers = full["language"][:2]
                layers = layers if m.pp == 1 else [layers[me.coord.pp]]
                stage = ToyStage(layers, cfg, activation=True)
                if me.last_stage:
                    stage.head = full["language"][2]
            states[name] = ModuleState(name, stage, topo.pg_collection(name), OptimConfig(optimizer="sgd", lr=LR))
        runner = ToyRunner(plan, states)
        assert isinstance(runner, StageRunner)
        cls = ColocatedSchedule if layout.placement == "colocated" else DisjointSchedule
        sched = cls(plan, RuntimeConfig(comm_timeout_s=60), topo, states, runner)
        losses = [sched.step(s).loss for s in range(STEPS)]
        params = {n: [p.detach().clone() for p in s.module.parameters()] for n, s in states.items()}
        return {
            "losses": losses,
            "params": params,
            "coords": {n: me.coord.pp for n, me in plan.modules.items()},
            "pp": {n: me.pp for n, me in plan.modules.items()},
        }
    finally:
        topo.destroy()


CASES = {
    "colocated enc DP2, LM DP2": {
        "placement": "colocated",
        "modules": {"vision": {"dp": 2}, "language": {"dp": 2}},
        "edges": ["vision -> language"],
    },
    "colocated enc DP2, LM TP2 (replicas)": {
        "placement": "colocated",
        "modules": {"vision": {"dp": 2}, "language": {"tp": 2}},
        "edges": ["vision -> language"],
    },
    "disjoint enc DP2 @0-1, LM PP2 @2-3": {
        "placement": "disjoint",
        "modules": {"vision": {"dp": 2}, "language": {"pp": 2}},
        "edges": ["vision -> language"],
    },
}


@pytest.mark.parametrize("case", list(CASES))
def test_toy_runner_trains_through_both_schedules(case):
    doc = CASES[case]
    world = 4 if doc["placement"] == "disjoint" else 2
    ref_losses, ref_params = reference()
    per_rank = run_ranks(world, _rank, doc, timeout=120)
    losses = per_rank[0]["losses"]
    assert len(losses) == STEPS
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= 1e-6 * abs(want), (losses, ref_losses)
    assert ref_losses[-1] < ref_losses[0]  # it learns: the comparison is not of constants
    # every parameter of the whole model, from the ranks that hold it, equals the reference
    checked = 0
    for r in per_rank:
        for name, params in r["params"].items():
            want = ref_params[name]
            if name == "language" and r["pp"]["language"] > 1:  # stage 0: layer 0; stage 1: layer 1 + head
                want = want[:2] if r["coords"]["language"] == 0 else want[2:]
            assert len(params) == len(want), (name, len(params), len(want))
            for got, ref in zip(params, want):
                assert got.shape == ref.shape
                assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item(), name
                checked += 1
    assert checked >= 8

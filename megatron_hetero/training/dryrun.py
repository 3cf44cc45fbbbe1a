"""One rank of `megatron-hetero dryrun`: the setup a rank of `train` runs before its first step, on
torch's fake process-group backend, timed by phase.

`dry_rank(draft)` runs in a process whose torch.distributed is initialised with the "fake"
backend at the layout's world size (`training.dryrun_world` forks one per sampled rank). It calls
train's own setup code, in the Session's order (`training.session.Session`):

* `validate_job` of the job as asked (a `config.job.JobDraft`: train's validation, which each of
  train's processes runs once at its door; the same ValueError, so the same exit-2 message);
* `Topology.build` (every module's groups through Megatron's `HyperCommGrid`), with every
  `new_group` / `new_subgroups_by_enumeration` call counted (`GroupCounter`);
* `rank_plan` (the rank's plan: batch arithmetic and its schedule table);
* the boundaries the rank's schedule builds (`runtime.schedules.schedule_boundaries`) and their
  plans for every sequence length the job's data can produce (`edge_seqs`);
* the modules on the meta device (`training.setup.build_modules`: the real module code, no
  storage), and the state bytes they imply: parameters, DDP's gradient buffer and the optimizer's
  state with Megatron's own buffer layout (`DistributedOptimizer.compute_full_param_layout`, the
  function `runtime.module_state` gives DDP), next to the memory model's
  (`planner.memory.rank_state_bytes`);
* the same modules' grids the way Megatron's MIMO example creates them
  (`examples/mimo/training/topology.py` of the Megatron-LM tree in $MEGATRON_LM, called, not
  copied), and one homogeneous grid of the world (the first language module's TP/CP/PP, DP = the
  rest) through the same code, both counted.

Nothing is sent: collectives of the fake backend return at once. What comes back is a plain dict
(see `dry_rank`). Collective over nothing: each rank's process is alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import sys
import time
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_hetero.runtime.config import runtime_config
from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.config.job import JobConfig, JobDraft
from megatron_hetero.plan.rank_plan import rank_plan
from megatron_hetero.plan.roles import language_modules
from megatron_hetero.planner.memory import rank_state_bytes
from megatron_hetero.planner.memory_terms import StateFeatures

#: the MIMO example's topology file inside a Megatron-LM tree
MIMO_TOPOLOGY = os.path.join("examples", "mimo", "training", "topology.py")


class GroupCounter:
    """While active (`with counter:`), every `torch.distributed.new_group` and
    `new_subgroups_by_enumeration` call is counted: `created` groups in all, and `member`, the sorted
    global ranks of each group this rank belongs to. `backend`: a backend to create every group with
    instead of the caller's (the fake world: Megatron's MIMO example asks for NCCL)."""

    def __init__(self, backend: Optional[str] = None) -> None:
        self.backend = backend
        self.created = 0
        self.member: list[tuple[int, ...]] = []
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> "GroupCounter":
        rank, world = dist.get_rank(), dist.get_world_size()
        real_new_group, real_enum = dist.new_group, dist.new_subgroups_by_enumeration

        def new_group(ranks=None, *args, **kwargs):
            if self.backend is not None:
                kwargs["backend"] = self.backend
            self.created += 1
            members = tuple(sorted(ranks)) if ranks is not None else tuple(range(world))
            if rank in members:
                self.member.append(members)
            return real_new_group(ranks, *args, **kwargs)

        def new_subgroups_by_enumeration(ranks_per_subgroup_list, *args, **kwargs):
            if self.backend is not None:
                kwargs["backend"] = self.backend
            groups = [tuple(sorted(g)) for g in ranks_per_subgroup_list]
            self.created += len(groups)
            self.member.extend(g for g in groups if rank in g)
            return real_enum(ranks_per_subgroup_list, *args, **kwargs)

        self._saved = {"new_group": real_new_group, "new_subgroups_by_enumeration": real_enum}
        dist.new_group = new_group
        dist.new_subgroups_by_enumeration = new_subgroups_by_enumeration
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


@contextlib.contextmanager
def _timed(phases: dict[str, float], name: str) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0


def state_features(job: JobConfig):
    """The memory model's features of the job's optimizer (as `training.run_stats.predicted_memory`)."""

    o = job.optim
    return StateFeatures(
        precision="bf16" if o.bf16 else "fp16" if o.fp16 else "fp32",
        optimizer=o.optimizer,
        distributed_optimizer=o.use_distributed_optimizer,
        grad_reduce_in_fp32=o.grad_reduce_in_fp32,
    )


def built_state_bytes(module: torch.nn.Module, pgs, job: JobConfig) -> dict[str, int]:
    """{params, grads, optimizer} bytes of `module` (built on the meta device) on this rank, as
    `runtime.module_state.ModuleState` allocates them: every parameter at its dtype; DDP's gradient
    buffer (fp32 with grad_reduce_in_fp32 or fp32 parameters), padded as Megatron lays it out under
    the distributed optimizer; the optimizer's fp32 state per trainable element (Adam's two moments,
    SGD's momentum; plus the fp32 main copy under bf16/fp16), only this rank's shard of every
    bucket over the module's DP x CP group (expert parameters: expert-DP) under the distributed
    optimizer. A frozen module: parameters only."""
    o = job.optim
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    trainable = [p for p in module.parameters() if p.requires_grad]
    if not trainable:
        return {"params": params, "grads": 0, "optimizer": 0}
    per_elem = (8 if o.optimizer == "adam" else 4) + (4 if (o.bf16 or o.fp16) else 0)
    low = o.bf16 or o.fp16
    grad_elem = 4 if (o.grad_reduce_in_fp32 or not low) else 2
    if not o.use_distributed_optimizer:
        n = sum(p.numel() for p in trainable)
        return {"params": params, "grads": n * grad_elem, "optimizer": n * per_elem}
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_hetero.runtime.module_state import ModuleState

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=o.grad_reduce_in_fp32, use_distributed_optimizer=True
    )
    bucket = None
    if o.overlap_grad_reduce:
        bucket = (o.ddp_bucket_size or max(40_000_000, 1_000_000 * pgs.dp_cp.size())) if pgs.pp.rank() == 0 else None
    full = ModuleState._param_layout(module, pgs, ddp_config, bucket)
    grads = shard = 0
    for key, lay in full.layouts.items():
        group = pgs.expt_dp if key.is_expert_parallel else pgs.dp_cp
        size, me = group.size(), group.rank()
        grads += lay.bucket_indices[-1][1] * torch.empty(0, dtype=key.grad_dtype).element_size()
        for b, (b0, b1) in enumerate(lay.bucket_indices):
            lo = b0 + me * ((b1 - b0) // size)
            hi = lo + (b1 - b0) // size
            for start, end, bid in lay.param_index_map.values():
                if bid == b:
                    shard += max(0, min(end, hi) - max(start, lo))
    return {"params": params, "grads": grads, "optimizer": shard * per_elem}


def _digest(obj: Any) -> str:
    return hashlib.sha256(repr(obj).encode()).hexdigest()[:16]


def boundary_digest(bnd, seq: int) -> str:
    """What this rank does on one boundary plan: its receives, sends and local copies (a digest)."""
    p = bnd.plan_for(seq)  # this rank's part of the edge's plan
    parts = [sorted(map(repr, f(d))) for f in (p.recvs, p.sends, p.local_copies) for d in ("forward", "backward")]
    return _digest((parts, repr(p.holds)))


def load_mimo_topology(tree: Optional[str]):
    """Megatron-LM's MIMO example topology module (`examples/mimo/training/topology.py`) from the tree
    `tree` (default $MEGATRON_LM), or None when there is none."""
    tree = tree or os.environ.get("MEGATRON_LM")
    if not tree:
        return None
    path = os.path.join(tree, MIMO_TOPOLOGY)
    if not os.path.isfile(path):
        return None
    name = "_megatron_mimo_topology"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _mimo_specs(mimo, layout: HeteroLayout) -> list:
    """The MIMO example's grid specs of the layout's modules (its language key on the first language
    module); ValueError where the example cannot express the layout."""

    langs = language_modules(layout)
    if len(langs) != 1:
        raise ValueError(f"the MIMO example has one language module; the layout has {len(langs)}")
    key = mimo.MIMO_LANGUAGE_MODULE_KEY
    out = []
    for m in layout.modules:
        name = key if m.name == langs[0].name else (m.name if m.name != key else f"{m.name}_")
        out.append(
            mimo.ModuleGridSpec(
                name=name, num_ranks=m.size, tp=m.tp, cp=m.cp, pp=m.pp, ep=m.ep, rank_offset=m.offset, expt_tp=m.expt_tp
            )
        )
    return out


def megatron_baseline(layout: HeteroLayout, tree: Optional[str], backend: Optional[str]) -> dict[str, Any]:
    """The layout's module grids created by Megatron's MIMO example (`create_topology`), and a
    homogeneous grid of the whole world (the first language module's tp/cp/pp, dp = the rest),
    each timed and counted on this rank; `error` where the example is missing or refuses."""

    mimo = load_mimo_topology(tree)
    if mimo is None:
        return {"error": "no Megatron-LM tree with examples/mimo (set $MEGATRON_LM)"}
    out: dict[str, Any] = {}
    for key, specs in (
        ("mimo", lambda: _mimo_specs(mimo, layout)),
        ("homogeneous", lambda: _homogeneous_spec(mimo, layout, language_modules(layout)[0])),
    ):
        try:
            s = specs()
        except ValueError as exc:
            out[key] = {"error": str(exc)}
            continue
        with GroupCounter(backend) as gc:
            t0 = time.perf_counter()
            topo = mimo.create_topology(s)
            seconds = time.perf_counter() - t0
        topo.destroy()
        out[key] = {"s": seconds, "groups_created": gc.created, "groups_member": len(gc.member)}
    return out


def _homogeneous_spec(mimo, layout: HeteroLayout, lang) -> list:
    world = layout.world_size
    if world % (lang.tp * lang.cp * lang.pp):
        raise ValueError(f"world {world} is not divisible by tp*cp*pp of {lang.name}")
    return [
        mimo.ModuleGridSpec(name=mimo.MIMO_LANGUAGE_MODULE_KEY, num_ranks=world, tp=lang.tp, cp=lang.cp, pp=lang.pp)
    ]


def dry_rank(
    draft: JobDraft,
    megatron_lm: Optional[str] = None,
    baseline: bool = True,
    boundaries: bool = True,
) -> dict[str, Any]:
    """Train's setup of this process's rank (module docstring) for the job `draft` (its layout and
    `JobConfig` as the door made them: validating them is the first phase timed), on an initialised
    fake world (`boundaries` False: without the boundary plans, `dryrun --state-only`).
    Returns {rank, plugin_s, groups_s, megatron_baseline_s, groups_member, groups_created,
    group_members (sorted global ranks of every group this rank is in), state_bytes {built,
    predicted, modules}, phases, plan_digest, boundaries {edge: {seq: digest}}, baseline}."""
    from megatron_hetero.runtime.schedules import schedule_boundaries
    from megatron_hetero.runtime.topology import Topology
    from megatron_hetero.models.llava_runner import LlavaStageRunner
    from megatron_hetero.training.setup import build_modules, validate_job
    from megatron_hetero.training.trainer import prepare_rank

    layout, job = draft.layout, draft.config
    rank = dist.get_rank()
    forced = None if dist.get_backend() != "fake" else "fake"
    phases: dict[str, float] = {}
    with _timed(phases, "validate"):
        validate_job(draft)
    prepare_rank(job)
    with GroupCounter(forced) as gc:
        t0 = time.perf_counter()
        topo = Topology.build(layout, timeout_s=job.comm_timeout_s)
        groups_s = time.perf_counter() - t0
    try:
        with _timed(phases, "rank_plan"):
            plan = rank_plan(layout, rank, job.global_batch_size, job.micro_batch_size, job.offload_encoder)
        runner = LlavaStageRunner(job.spec, plan, {})
        planned: dict[str, dict[str, str]] = {}
        with _timed(phases, "boundary"):
            bnds = schedule_boundaries(plan, runtime_config(job, rank), topo, runner) if boundaries else {}
            for key, bnd in bnds.items():
                seqs = runner.edge_seqs(bnd.edge)
                planned[str(key)] = {str(s): boundary_digest(bnd, s) for s in seqs}
        with _timed(phases, "modules_meta"):
            with torch.device("meta"):
                modules = build_modules(plan, job, topo, device=torch.device("meta"))
        per_module = {n: built_state_bytes(mod, pgs, job) for n, (mod, pgs) in modules.items()}
        predicted = rank_state_bytes(layout, job.spec, rank, state_features(job))
        plan_digest = _digest(plan)
    finally:
        topo.destroy()
    base = megatron_baseline(layout, megatron_lm, forced) if baseline else {}
    plugin_s = phases["validate"] + phases["rank_plan"] + phases["boundary"]
    return {
        "rank": rank,
        "plugin_s": plugin_s,
        "groups_s": groups_s,
        "megatron_baseline_s": base.get("mimo", {}).get("s"),
        "groups_member": len(gc.member),
        "groups_created": gc.created,
        "group_members": sorted(gc.member),
        "state_bytes": {
            "built": sum(sum(v.values()) for v in per_module.values()),
            "predicted": sum(sum(v.values()) for v in predicted.values()),
            "modules": {n: {"built": per_module[n], "predicted": predicted.get(n)} for n in per_module},
        },
        "phases": phases,
        "plan_digest": plan_digest,
        "boundaries": planned,
        "baseline": base,
    }

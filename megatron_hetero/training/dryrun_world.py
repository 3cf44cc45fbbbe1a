"""`megatron-hetero dryrun`'s world: which ranks to sample, one forked process per sampled rank on
torch's fake process-group backend (`training.dryrun.dry_rank` in each), and the schedule check once
for the whole world in the parent.

Every sampled rank runs in a process of its own, forked from this one (torch and Megatron-core are
imported once), at most `jobs` at a time; each initialises torch.distributed with the "fake"
backend (`torch.testing._internal.distributed.fake_pg.FakeStore`: no peer, no rendezvous, every
collective returns at once) at the layout's world size and its own rank, and sends its result dict
back pickled through the pool's pipe.
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Any, Optional

from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.config.job import Job, JobDraft
from megatron_hetero.plan.colocated import check_colocated_tables, colocated_tables
from megatron_hetero.plan.rank_plan import step_micro_batching
from megatron_hetero.plan.schedule import build_tables
from megatron_hetero.plan.schedule_check import check_tables

#: `--ranks all` is refused above this world size (one process per rank)
ALL_RANKS_LIMIT = 256


def default_ranks(layout: HeteroLayout) -> list[int]:
    """Rank 0, the last rank, the first rank of every module stage, and every boundary leader (the
    first rank of an edge's source module's last stage and of its destination's first stage)."""
    out = {0, layout.world_size - 1}
    for m in layout.modules:
        stage = m.size // m.pp  # ranks of one pipeline stage (pp is the slowest axis)
        out.update(m.offset + p * stage for p in range(m.pp))
    for e in layout.edges:
        src, dst = layout.module(e.src), layout.module(e.dst)
        out.add(src.offset + (src.pp - 1) * (src.size // src.pp))
        out.add(dst.offset)
    return sorted(out)


def parse_ranks(text: Optional[str], layout: HeteroLayout) -> list[int]:
    """`--ranks`: None (the default sample), `all` (every rank, worlds up to ALL_RANKS_LIMIT), or a
    comma list of ranks where `N-1` (or `N-k`) counts from the world size. ValueError otherwise."""
    n = layout.world_size
    if text is None:
        return default_ranks(layout)
    if text.strip() == "all":
        if n > ALL_RANKS_LIMIT:
            raise ValueError(
                f"--ranks all: {n} ranks (one process each); give a list, at most {ALL_RANKS_LIMIT} for all"
            )
        return list(range(n))
    out = set()
    for item in text.split(","):
        item = item.strip()
        try:
            r = n - int(item[2:]) if item.startswith("N-") else int(item)
        except ValueError:
            raise ValueError(f"--ranks {text!r}: {item!r} is not a rank (0, 17, N-1, or 'all')") from None
        if not 0 <= r < n:
            raise ValueError(f"--ranks {text!r}: rank {r} is outside the world of {n} ranks")
        out.add(r)
    if not out:
        raise ValueError(f"--ranks {text!r}: no rank given")
    return sorted(out)


def _one_rank(task: tuple) -> dict[str, Any]:
    """Body of one forked process: the fake world at `rank`, then `dry_rank`."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_hetero.training.dryrun import dry_rank

    rank, draft, megatron_lm, baseline, boundaries = task
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    dist.init_process_group("fake", rank=rank, world_size=draft.layout.world_size, store=FakeStore())
    init_s = time.perf_counter() - t0
    try:
        out = dry_rank(draft, megatron_lm=megatron_lm, baseline=baseline, boundaries=boundaries)
    finally:
        dist.destroy_process_group()
    out["phases"]["init_fake_world"] = init_s
    return out


def schedule_check(job: Job) -> dict[str, Any]:
    """The schedule checker over every rank's table of the validated `job`, once for the world: the colocated tables'
    simulation (`plan.colocated.check_colocated_tables`) or the disjoint 1F1B tables in rendezvous
    mode (`plan.schedule_check.check_tables`, what the runtime's batches do). ValueError on failure."""

    layout, config = job.layout, job.config
    t0 = time.perf_counter()
    if layout.placement == "colocated":
        tables = colocated_tables(layout, config.global_batch_size, config.micro_batch_size, config.offload_encoder)
        check_colocated_tables(tables)
        what = f"colocated tables of {len(tables)} ranks"
    else:
        m = step_micro_batching(layout, config.global_batch_size, config.micro_batch_size).count
        tables = build_tables(layout, m)
        check_tables(tables, layout=layout, micro_batches=m, mode="rendezvous")
        what = f"1F1B tables of {len(tables)} stages, {m} micro-batches, rendezvous"
    return {"ok": True, "what": what, "s": time.perf_counter() - t0}


def dry_world(
    draft: JobDraft,
    ranks: list[int],
    jobs: int = 2,
    megatron_lm: Optional[str] = None,
    baseline: bool = True,
    boundaries: bool = True,
) -> dict[str, Any]:
    """Validate the job `draft` (its layout and `JobConfig` as the door made them; train's
    `validate_job`: ValueError before any process starts), check the validated job's schedule once for
    the world, then run `dry_rank` of `draft` for each of `ranks` in its own forked process (each
    validates it, as each of train's processes does at its door), at most
    `jobs` at a time (`boundaries` False: no boundary plans, `baseline` False: no Megatron grids). Returns {world_size, placement, schedule_check, ranks: [per-rank dicts]}."""
    from megatron_hetero.training.setup import validate_job

    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"--jobs must be a positive integer, got {jobs!r}")
    t0 = time.perf_counter()
    job = validate_job(draft)
    validate_s = time.perf_counter() - t0
    check = schedule_check(job)
    ctx = multiprocessing.get_context("fork")
    tasks = [(r, draft, megatron_lm, baseline, boundaries) for r in ranks]
    t0 = time.perf_counter()
    with ctx.Pool(processes=min(jobs, len(tasks)), maxtasksperchild=1) as pool:
        results = pool.map(_one_rank, tasks, chunksize=1)
    return {
        "world_size": job.layout.world_size,
        "placement": job.layout.placement,
        "validate_s": validate_s,
        "schedule_check": check,
        "wall_s": time.perf_counter() - t0,
        "ranks": results,
    }

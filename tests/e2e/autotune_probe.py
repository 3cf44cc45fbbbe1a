"""A `tests/megatron_fork.py` probe (`MEGATRON_FORK_PROBE`) that forces `--hetero-autotune`'s decision in
a patched Megatron-LM script's ranks, so a test checks the switch's mechanics, not this CPU's timings
(as `tests/ranks/test_autotune_switch.py` does for `megatron-hetero train` by patching `plan_switch`).

`AUTOTUNE_FORCE` in the run's environment: JSON `{"target": LAYOUT, "measured_s": S}`: every round decides
to switch to the layout `LAYOUT` (a layout YAML's mapping, placed on the run's world), predicted 1 ms,
the current layout recorded as measured `S` seconds (a tiny `S`: the new layout measures slower and the
run goes back). `report()`: one line `autotune probe rank R: {"rounds": N, "sessions": [...]}`, with
the live process groups, threads and open file descriptors (`bench soak`'s counters) right after each
`training.session.Session` of the run was built, in order.
"""

from __future__ import annotations

import json
import os

ROUNDS = {"n": 0}
SESSIONS: list[dict] = []


def install() -> None:
    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.planner import autotune as A
    from megatron_hetero.training import autotune_run as R
    from megatron_hetero.planner.layout_cost import candidate_for
    from megatron_hetero.config.job import JobDraft

    force = json.loads(os.environ["AUTOTUNE_FORCE"])
    target = layout_from_dict(force["target"], world_size=int(os.environ["WORLD_SIZE"]))

    def plan(trace, run, iteration, world, timings=None, shared=False, tried=(), check=None):
        ROUNDS["n"] += 1
        if check is not None:
            check(JobDraft(target, run.config))  # the script's own check of a candidate must take the target
        spec = run.config.spec
        cur, to = candidate_for(run.layout, spec), candidate_for(target, spec)
        d = A.Decision(True, "switch: forced by the test", to, 1e-3, 999.0)
        rec = A.record_of(iteration, cur, d, float(force["measured_s"]))
        return R.Plan(d, rec, 0.0, {"iteration": iteration}, target)

    R.plan_switch = plan

    from megatron_hetero.bench.soak import probe
    from megatron_hetero.training.session import Session

    build = Session.__init__

    def counted(self, *args, **kwargs):
        build(self, *args, **kwargs)
        p = probe()
        SESSIONS.append({k: p[k] for k in ("process_groups", "threads", "open_fds")})

    Session.__init__ = counted


def report() -> str:
    doc = {"rounds": ROUNDS["n"], "sessions": SESSIONS}
    return f"autotune probe rank {os.environ.get('RANK')}: {json.dumps(doc)}"

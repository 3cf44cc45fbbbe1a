"""Run several Megatron-LM script runs one after the other, each on its own N ranks forked from ONE
process that imported everything once: `tests/megatron_fork.py` for a batch of runs.

    python tests/megatron_fork_batch.py RUNS.json
    python tests/megatron_fork_batch.py --serve     (one run per JSON line on stdin: `serve`)

RUNS.json: a list of `{"nproc": N, "script": PATH, "args": [...], "out": PATH}`; every run's ranks
write their stdout and stderr to its `out` file, and its exit code (as `megatron_fork.py` gives it)
is appended to the batch's stdout as `run I: rc N`. The scripts must come from trees whose
`megatron/training` is the same (a pristine tree and its patched copy: the patches touch only the
scripts' `__main__` blocks): the first run's tree is imported here, each rank adds its own script's
tree (`megatron_lm.run.run_script`). This process never initialises torch.distributed, so every run
starts from the same imported, untouched state. Exit code: 0 when every run's was 0, else 1.
"""

from __future__ import annotations

import json
import os
import sys
import time

import megatron_fork


def _launch(nproc: int, script: str, args: list[str], out: str, env: dict | None = None) -> int:
    """One run on `nproc` forked ranks (their output to `out`, their environment `env` when given);
    its exit code, as megatron_fork's."""
    port = megatron_fork._free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    pids: dict[int, int] = {}
    with open(out, "w") as log:
        for rank in range(nproc):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    os.setpgid(0, 0)
                    if env is not None:
                        os.environ.clear()
                        os.environ.update(env)
                    os.dup2(log.fileno(), 1)
                    os.dup2(log.fileno(), 2)
                    code = megatron_fork._rank(rank, nproc, port, script, args)
                finally:
                    megatron_fork.flush_std()
                    os._exit(code)
            pids[pid] = rank
    return megatron_fork.wait_ranks(pids)


def _warm() -> None:
    """Imports and probes every rank of every run repeats alike, done once here (fork inherits them):
    the compiler stack that the ranks' first torch.compile'd kernel imports (~700 modules), the CPU's
    vector instruction set (torch builds and loads a small C++ probe to find it), the models, datasets
    and the plugin's driver."""
    import importlib

    for name in (
        "torch._inductor.compile_fx",
        "torch._inductor.codecache",
        "megatron.core.models.multimodal.llava_model",
        "megatron.core.models.gpt.gpt_model",
        "torch._dynamo.backends.inductor",
        "megatron.core.datasets.gpt_dataset",
        "megatron.core.datasets.multimodal_dataset",
        "megatron.core.datasets.blended_megatron_dataset_builder",
        "megatron.core.models.mimo",
        "megatron.core.models.multimodal.llava_spec",
        "megatron.core.models.vision.vit_layer_specs",
        "megatron.core.tokenizers.text.models",
        "megatron_hetero.megatron_lm.vlm",
        "megatron_hetero.megatron_lm.gpt",
        "megatron_hetero.megatron_lm.runner",
        "megatron_hetero.megatron_lm.build",
        "megatron_hetero.runtime.schedules",
    ):
        importlib.import_module(name)
    from torch._inductor import cpu_vec_isa

    cpu_vec_isa.pick_vec_isa()


def serve(requests, replies) -> int:
    """`--serve`: one run per JSON line read from `requests` (`{"nproc", "script", "args", "out",
    "env"}`: the environment the run's ranks get), its exit code written to `replies` as one JSON
    line (`{"rc": N, "seconds": S}`), until `requests` ends. The first request's tree is imported and
    warmed once (as for a batch); the test suite keeps one such process for all its script runs
    (`tests/e2e/test_megatron_lm.py` `torchrun`)."""
    warmed = False
    for line in requests:
        if not line.strip():
            continue
        r = json.loads(line)
        if not warmed:
            os.environ.update(r.get("env") or {})
            megatron_fork._prepare(r["script"])
            _warm()
            warmed = True
        t0 = time.monotonic()
        rc = _launch(int(r["nproc"]), r["script"], list(r["args"]), r["out"], r.get("env"))
        replies.write(json.dumps({"rc": rc, "seconds": round(time.monotonic() - t0, 1)}) + "\n")
        replies.flush()
    return 0


def main(argv: list[str]) -> int:
    if argv == ["--serve"]:
        return serve(sys.stdin, sys.stdout)
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        runs = json.load(f)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    megatron_fork._prepare(runs[0]["script"])
    _warm()
    failed = False
    for i, r in enumerate(runs):
        t0 = time.monotonic()
        rc = _launch(int(r["nproc"]), r["script"], list(r["args"]), r["out"])
        print(f"run {i}: rc {rc} in {time.monotonic() - t0:.1f} s", flush=True)
        failed |= rc != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

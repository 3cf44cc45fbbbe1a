"""Run one of Megatron-LM's scripts on N local ranks forked from one process: the test suite's stand-in
for `torchrun --nproc-per-node N -m megatron_hetero.megatron_lm.run SCRIPT ARGS...`.

    python tests/megatron_fork.py N SCRIPT ARGS...

Why: every torchrun rank is a fresh Python that imports torch, Megatron-core and the tree's
`megatron.training` (several seconds of CPU each on the 2-core CI machines), and torchrun's agent
imports torch too. Here that happens once: this process does what the launcher does before the
script (`megatron_lm.run`: Megatron-core imported through `compat.startup`, the tree bound with
`use_tree`, the CPU redirections applied, the tree's training package imported), then forks one child
per rank. Each child gets torchrun's rendezvous environment (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and runs the script as `__main__` through
`megatron_lm.run.run_script`, exactly as under torchrun; the script's own
`torch.distributed.init_process_group` does the rendezvous.

A test may instrument the ranks: `MEGATRON_FORK_PROBE=/path/to/probe.py` in the run's environment
loads that file in each rank before the script and calls its `install()`, then after the script its
`report()`, whose string the rank prints (the test reads it from the run's output).

Exit code: 0 when every rank exits 0; otherwise the first failing rank's code, and once a rank fails
the others get `GRACE_S` seconds, then are killed (as torchrun stops the group). Output: the ranks
write to this process's stdout/stderr. Real torchrun stays covered by the tests that run it
(`tests/e2e/test_megatron_lm.py` keeps one, `tests/e2e/test_torchrun_nodes.py`).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
import traceback

GRACE_S = 10.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _prepare(script: str) -> None:
    """What every rank would do before the script, done once here (inherited by fork)."""
    from megatron_hetero.compat.startup import import_megatron_core
    from megatron_hetero.megatron_lm.run import use_tree

    import_megatron_core()
    use_tree(os.path.dirname(os.path.abspath(script)))
    from megatron_hetero.compat.megatron_lm import apply_megatron_lm_cpu_compat

    apply_megatron_lm_cpu_compat()
    import megatron.training.training  # noqa: F401  # the script's heavy imports, once:

    # every tokenizer Megatron builds (NullTokenizer too) imports megatron.core.tokenizers.text,
    # which imports transformers (and with it torch._dynamo, sklearn): ~10 s of CPU per rank here
    import megatron.core.tokenizers.text  # noqa: F401


def _rank(rank: int, nproc: int, port: int, script: str, args: list[str]) -> int:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch

    from megatron_hetero.megatron_lm.run import run_script

    torch.set_num_threads(1)
    if "--async-save" not in args:
        # torch_dist saves: the writer's results in this process, not in a spawn-mode Manager, which
        # outlives a rank that leaves with os._exit and keeps this process's output pipe open
        from megatron_hetero.checkpoint.save_load import _writer_results_in_process

        _writer_results_in_process()
    probe = _load_probe(os.environ.get("MEGATRON_FORK_PROBE"))
    try:
        run_script(script, args)
        return 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return int(exc.code or 0)
        print(exc.code, file=sys.stderr)
        return 1
    except ValueError as exc:  # what megatron_lm.run's main reports
        print(f"megatron-hetero megatron-lm: invalid input: {exc}", file=sys.stderr)
        return 2
    except BaseException:  # noqa: BLE001 - a rank's failure is printed, its exit code says it
        traceback.print_exc()
        return 1
    finally:
        if probe is not None:
            sys.stdout.write(probe.report() + "\n")  # one write: the ranks share the output file
            sys.stdout.flush()


def _load_probe(path: str | None):
    """The test's instrumentation module at `path` (installed), or None without one."""
    if not path:
        return None
    import importlib.util

    spec = importlib.util.spec_from_file_location("megatron_fork_probe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.install()
    return module


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    nproc, script, args = int(argv[0]), argv[1], argv[2:]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _prepare(script)
    port = _free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    pids: dict[int, int] = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.setpgid(0, 0)  # its own group: the kill below reaches its workers too
                code = _rank(rank, nproc, port, script, args)
            finally:
                flush_std()
                os._exit(code)
        pids[pid] = rank
    return wait_ranks(pids)


def flush_std() -> None:
    """Flush stdout and stderr before a forked rank's `os._exit` (which skips Python's own flush)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass


def wait_ranks(pids: dict[int, int]) -> int:
    """Wait for the forked ranks `pids` (pid -> rank): 0 when all exit 0, else the first failure's
    exit code; the ranks still running GRACE_S after a failure are killed (process group first)."""
    first_failure: int | None = None
    deadline: float | None = None
    while pids:
        if deadline is not None and time.monotonic() > deadline:
            for pid, rank in pids.items():
                print(
                    f"megatron_fork: rank {rank} still running {GRACE_S:g} s after a failure: killed", file=sys.stderr
                )
                for kill in (lambda p: os.killpg(p, signal.SIGKILL), lambda p: os.kill(p, signal.SIGKILL)):
                    try:
                        kill(pid)
                    except OSError:
                        pass
            for pid in list(pids):
                os.waitpid(pid, 0)
            break
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.05)
            continue
        if pids.pop(pid, None) is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and first_failure is None:
            first_failure = code if code > 0 else 1
            deadline = time.monotonic() + GRACE_S
    return first_failure or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

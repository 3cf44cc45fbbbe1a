"""Fork launcher: run a function on N local ranks, forked from the current process.

Forking from a parent that has already imported torch and Megatron-core makes a multi-rank case cost
a few seconds instead of the ~30 s a torchrun launch spends re-importing in every rank. The same
launcher is used by ``megatron-hetero train`` to spawn ranks on one machine.

Each child rank:

1. becomes its own process group leader (so the parent can kill it together with anything it spawned),
2. sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT`` and the
   caller's ``env``, and ``torch.set_num_threads(1)``,
3. optionally calls ``torch.distributed.init_process_group`` and, on gloo, a barrier of the world, so
   that no rank runs ``fn`` (and may finish and exit, rank 0 with the store) while a peer still
   connects (a failure there is a *setup failure*: a broken connection of the store or of gloo's full
   mesh; the parent then runs the whole world once more on a new port, and says so on stderr),
4. runs ``fn(*args, **kwargs)`` and sends the pickled return value (or the formatted traceback)
   back through its own pipe,
5. destroys the process group, flushes stdout/stderr and leaves with ``os._exit`` so that no atexit
   handler inherited from the parent (pytest, hypothesis, ...) runs in the child.

The parent reads every pipe while it waits (a large return value never blocks a child), enforces one
overall deadline, and stops waiting shortly after the first failure: the other ranks typically hang in
a collective that will never complete, so they are killed after a short grace period.

The device is not chosen here: with ``backend="nccl"`` the function (or the ``compat`` layer) selects
its device from ``LOCAL_RANK``. CUDA must not have been initialised in the parent before forking.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

__all__ = ["RankFailure", "RankTimeout", "free_port", "run_ranks"]

T = TypeVar("T")

#: Seconds the other ranks get to finish (or fail on their own) after the first rank failed.
FAILURE_GRACE_S = 5.0
#: Seconds to wait for a child that already reported its result to exit before it is killed.
_EXIT_GRACE_S = 5.0

_OK = "ok"
_ERR = "error"
_SETUP = "setup"  # init_process_group itself raised: nothing of ``fn`` ran on that rank


class RankFailure(RuntimeError):
    """One or more ranks raised or died without reporting.

    ``failures`` lists ``(rank, text)`` in arrival order (the first failure first); ``text`` is the
    rank's full formatted traceback, or a line with its exit code if it died without reporting.
    ``killed`` lists the ranks that were still running after the grace period and were killed.
    """

    def __init__(self, failures: list[tuple[int, str]], killed: list[int], setup_failed: bool = False) -> None:
        self.failures = list(failures)
        self.killed = list(killed)
        #: some rank failed in ``init_process_group`` (before its ``fn``); the others failed after it
        self.setup_failed = setup_failed
        ranks = [r for r, _ in self.failures]
        parts = [f"{len(ranks)} rank(s) failed: {ranks} (first failure first)"]
        for rank, text in self.failures:
            parts.append(f"--- rank {rank} ---\n{text.rstrip()}")
        if self.killed:
            parts.append(
                f"ranks {self.killed} were still running {FAILURE_GRACE_S:g} s after the first failure and were killed"
            )
        super().__init__("\n".join(parts))


class RankTimeout(RuntimeError):
    """Some ranks did not finish within the timeout; they were killed.

    ``hung`` are the ranks that never reported, ``finished`` those that returned a result.
    """

    def __init__(self, timeout: float, hung: list[int], finished: list[int]) -> None:
        self.timeout = timeout
        self.hung = list(hung)
        self.finished = list(finished)
        super().__init__(
            f"ranks {self.hung} did not finish within {timeout:g} s and were killed; ranks {self.finished} finished"
        )


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free when this function looked."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _describe_exit(exitcode: int | None) -> str:
    """Human-readable exit status of a child, e.g. ``exit code -11 (signal SIGSEGV)``."""
    if exitcode is None:
        return "unknown exit code"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"exit code {exitcode} (signal {name})"
    return f"exit code {exitcode}"


def _child_main(
    rank: int,
    world_size: int,
    port: int,
    writer: Connection,
    inherited: list[Connection],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout: float,
    backend: str,
    init_distributed: bool,
    env: dict[str, str] | None,
) -> None:
    """Body of one forked rank; never returns (ends with ``os._exit``)."""
    code = 1
    try:
        try:
            os.setpgid(0, 0)
        except OSError:
            pass
        for conn in inherited:  # read ends of the other ranks' pipes, copied by fork
            conn.close()
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        if env:
            os.environ.update(env)
        torch.set_num_threads(1)
        try:
            if init_distributed:
                try:
                    dist.init_process_group(
                        backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
                    )
                    if backend == "gloo":
                        # Every rank holds the whole mesh before any runs `fn`: gloo's full mesh is no
                        # barrier, so a rank done with its side could finish `fn` and exit (rank 0
                        # taking the store with it) while a slower peer still reads its handshake or
                        # the store ("Connection closed by peer", "Failed to recv, got 0 bytes").
                        dist.barrier()
                except BaseException:  # noqa: BLE001 - reported as a setup failure
                    writer.send_bytes(pickle.dumps((_SETUP, traceback.format_exc())))
                    writer.close()
                    return
            result = fn(*args, **kwargs)
            payload = pickle.dumps((_OK, result), protocol=pickle.HIGHEST_PROTOCOL)
            code = 0
        except BaseException:  # noqa: BLE001 - everything, including SystemExit, is reported
            payload = pickle.dumps((_ERR, traceback.format_exc()))
        writer.send_bytes(payload)
        writer.close()
        if init_distributed and dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - last resort: show it, the parent sees the exit code
        traceback.print_exc()
        code = code or 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def _forward(signals: tuple[int, ...], procs: list) -> dict[int, Any]:
    """Install handlers that send each of `signals` on to the ranks still running; returns the previous
    handlers (none from a thread other than the main one, where Python cannot set handlers)."""
    import threading

    if not signals or threading.current_thread() is not threading.main_thread():
        return {}

    def handler(signum: int, frame: Any) -> None:
        for proc in procs:
            if proc.pid is not None and proc.exitcode is None:
                try:
                    os.kill(proc.pid, signum)
                except OSError:
                    pass

    return {signum: signal.signal(signum, handler) for signum in signals}


def _kill(proc: multiprocessing.process.BaseProcess) -> None:
    """SIGKILL a child's process group (it leads one) and the child itself."""
    if proc.pid is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        os.kill(proc.pid, signal.SIGKILL)
    except OSError:
        pass


def run_ranks(
    world_size: int,
    fn: Callable[..., T],
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    init_distributed: bool = True,
    env: dict[str, str] | None = None,
    forward_signals: tuple[int, ...] = (),
    pg_timeout: float | None = None,
    **kwargs: Any,
) -> list[T]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks forked from this process.

    The rank is available inside ``fn`` as ``torch.distributed.get_rank()`` (when
    ``init_distributed``) or ``int(os.environ["RANK"])``. ``timeout`` is the overall deadline in
    seconds for all ranks; ``pg_timeout`` the world process group's timeout (default ``timeout``;
    training passes its communication timeout, so a collective over the world that waits on a
    stuck rank fails on its own, as under torchrun). ``env`` is added to each rank's environment.
    ``forward_signals``: signals this process passes on to every rank while they run (the ranks lead
    their own process groups, so a signal to this one's group misses them; set only from the main
    thread, the previous handlers are restored). Keyword arguments named ``timeout``, ``backend``,
    ``init_distributed``, ``env``, ``pg_timeout`` or ``forward_signals`` are taken by this function,
    not passed to ``fn``.

    Returns the ranks' return values in rank order (they must be picklable).

    Raises:
        RankFailure: a rank raised, or died without reporting (its exit code is given). The other
            ranks get ``FAILURE_GRACE_S`` seconds, then are killed.
        RankTimeout: no failure, but some ranks had not finished when ``timeout`` expired.
        ValueError: ``world_size < 1`` or ``timeout <= 0``.

    A rank whose ``init_process_group`` raised (a setup failure: the store's or gloo's connection
    broke) makes the whole world run once more on a new port, with a line on stderr; a second setup
    failure is raised.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    if pg_timeout is not None and pg_timeout <= 0:
        raise ValueError(f"pg_timeout must be > 0 seconds, got {pg_timeout}")
    options = (timeout, backend, init_distributed, env, forward_signals, pg_timeout)
    try:
        return _run_world(world_size, fn, args, kwargs, *options)
    except RankFailure as exc:
        if not exc.setup_failed:
            raise
        first = next(text for _, text in exc.failures if _SETUP_MARK in text).strip().splitlines()[-1]
        print(
            f"run_ranks: creating the world process group failed ({first}); running all {world_size} ranks "
            "once more on a new port",
            file=sys.stderr,
            flush=True,
        )
    return _run_world(world_size, fn, args, kwargs, *options)


#: first line of a setup failure's text, so that it is told apart in ``RankFailure.failures``
_SETUP_MARK = "init_process_group failed:"


def _run_world(
    world_size: int,
    fn: Callable[..., T],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout: float,
    backend: str,
    init_distributed: bool,
    env: dict[str, str] | None,
    forward_signals: tuple[int, ...],
    pg_timeout: float | None,
) -> list[T]:
    """One launch of ``world_size`` forked ranks on a fresh port (`run_ranks` says what happens)."""
    ctx = multiprocessing.get_context("fork")
    port = free_port()
    procs: list[multiprocessing.process.BaseProcess] = []
    readers: list[Connection] = []
    start = time.monotonic()
    deadline = start + timeout
    results: dict[int, Any] = {}
    failures: list[tuple[int, str]] = []
    setup_failed = False
    previous: dict[int, Any] = {}
    try:
        # Everything the parent holds goes to the permanent generation while the ranks fork: their
        # garbage collections then never walk the inherited objects, which would write to (and so
        # copy) nearly every page the parent has (about 10% less CPU per forked multi-rank test run
        # here); the parent takes them back once every rank has started.
        gc.freeze()
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child_main,
                name=f"rank{rank}",
                args=(
                    rank,
                    world_size,
                    port,
                    writer,
                    readers + [reader],
                    fn,
                    args,
                    kwargs,
                    pg_timeout or timeout,
                    backend,
                    init_distributed,
                    env,
                ),
                daemon=False,  # a rank may start its own workers (e.g. DataLoader)
            )
            proc.start()
            writer.close()  # only the child holds the write end: EOF when it dies
            procs.append(proc)
            readers.append(reader)
        gc.unfreeze()
        previous = _forward(forward_signals, procs)

        pending = set(range(world_size))
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            owner: dict[Any, int] = {}
            for rank in pending:
                owner[readers[rank]] = rank
                owner[procs[rank].sentinel] = rank
            for obj in wait(list(owner), timeout=remaining):
                rank = owner[obj]
                if rank not in pending:
                    continue  # pipe and sentinel of the same rank both ready
                pending.discard(rank)
                status, value = _collect(rank, readers[rank], procs[rank])
                if status == _OK:
                    results[rank] = value
                else:
                    if not failures:
                        deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
                    failures.append((rank, value))
                    setup_failed = setup_failed or status == _SETUP

        unfinished = sorted(pending)
        if failures:
            raise RankFailure(failures, killed=unfinished, setup_failed=setup_failed)
        if unfinished:
            raise RankTimeout(timeout, hung=unfinished, finished=sorted(results))
        # Everyone reported; give them a moment to tear down and exit on their own.
        exit_deadline = time.monotonic() + _EXIT_GRACE_S
        for proc in procs:
            proc.join(max(0.0, exit_deadline - time.monotonic()))
        return [results[rank] for rank in range(world_size)]
    finally:
        gc.unfreeze()  # also when a fork failed (a no-op when nothing is frozen)
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        for proc in procs:
            if proc.is_alive():
                _kill(proc)
        for proc in procs:
            proc.join()
            proc.close()
        for reader in readers:
            reader.close()


def _collect(rank: int, reader: Connection, proc: multiprocessing.process.BaseProcess) -> tuple[str, Any]:
    """Read one rank's report: ``(_OK, value)``, ``(_SETUP, failure text)`` or ``(_ERR, failure text)``."""
    data: bytes | None = None
    try:
        if reader.poll():
            data = reader.recv_bytes()
    except (EOFError, OSError):
        data = None
    if data is None:  # died without reporting (or mid-report)
        proc.join(_EXIT_GRACE_S)
        return _ERR, f"rank {rank} died without reporting a result: {_describe_exit(proc.exitcode)}"
    try:
        status, value = pickle.loads(data)
    except Exception:  # noqa: BLE001 - e.g. a class that cannot be imported in the parent
        return _ERR, f"rank {rank}: cannot unpickle its result:\n{traceback.format_exc()}"
    if status == _OK:
        return _OK, value
    if status == _SETUP:
        return _SETUP, f"{_SETUP_MARK}\n{value}"
    return _ERR, str(value)

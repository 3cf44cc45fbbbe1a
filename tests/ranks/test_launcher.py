"""Tests for the fork launcher (megatron_hetero.runtime.launcher)."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_hetero.runtime import launcher
from megatron_hetero.runtime.launcher import RankFailure, RankTimeout, free_port, run_ranks

LARGE_N = 10 * 1024 * 1024 // 4  # ~10 MB of float32


def _all_reduce_rank() -> float:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


@pytest.mark.timeout(120)
def test_all_reduce_world8() -> None:
    assert run_ranks(8, _all_reduce_rank) == [28.0] * 8


def _identity_and_large(scale: int, *, offset: int) -> object:
    rank = dist.get_rank()
    assert int(os.environ["RANK"]) == rank
    if rank == 1:
        return torch.arange(LARGE_N, dtype=torch.float32) * scale
    if rank == 2:
        return np.full(LARGE_N, rank + offset, dtype=np.float32)
    return (rank, dist.get_world_size(), rank * scale + offset)


@pytest.mark.timeout(120)
def test_values_in_rank_order_with_large_values() -> None:
    out = run_ranks(4, _identity_and_large, 3, offset=100)
    assert out[0] == (0, 4, 100)
    assert out[3] == (3, 4, 109)
    assert isinstance(out[1], torch.Tensor) and out[1].shape == (LARGE_N,)
    assert torch.equal(out[1], torch.arange(LARGE_N, dtype=torch.float32) * 3)
    assert isinstance(out[2], np.ndarray) and out[2].shape == (LARGE_N,)
    assert (out[2] == 102).all()


def _raise_on_rank(bad: int) -> int:
    if dist.get_rank() == bad:
        raise ValueError("boom from the bad rank")
    dist.barrier()  # never completes: the bad rank does not join
    return dist.get_rank()


@pytest.mark.timeout(120)
def test_failure_reported_without_waiting_for_timeout() -> None:
    timeout = 60.0
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(4, _raise_on_rank, 3, timeout=timeout)
    elapsed = time.monotonic() - start
    # Hang check, not a timing assertion: without early abort this would take `timeout`.
    assert elapsed < timeout / 2, elapsed
    exc = info.value
    assert exc.failures[0][0] == 3  # the first failure comes first
    first = exc.failures[0][1]
    assert "ValueError" in first and "boom from the bad rank" in first
    assert "Traceback" in first and "_raise_on_rank" in first
    msg = str(exc)
    assert "rank 3" in msg and "ValueError" in msg and "boom from the bad rank" in msg


def _raise_or_sleep() -> None:
    if int(os.environ["RANK"]) == 0:
        raise ValueError("first")
    time.sleep(1000)  # not a collective: nothing tells these ranks that rank 0 failed


@pytest.mark.timeout(120)
def test_failure_kills_other_ranks_after_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "FAILURE_GRACE_S", 0.5)
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(3, _raise_or_sleep, timeout=60, init_distributed=False)
    assert time.monotonic() - start < 30  # hang check: killed after the grace, not at the timeout
    assert [r for r, _ in info.value.failures] == [0]
    assert info.value.killed == [1, 2]
    assert "ValueError: first" in str(info.value) and "[1, 2]" in str(info.value)


def _hang_on_rank(bad: int) -> int:
    rank = int(os.environ["RANK"])
    if rank == bad:
        time.sleep(1000)
    return rank


@pytest.mark.timeout(120)
def test_hanging_rank_times_out_and_is_named() -> None:
    # no process group: with gloo, 4 ranks forked on a loaded 2-core machine did not always finish
    # connecting within the 3 s deadline (a RankFailure from init_process_group, once, in a clean-clone
    # run with 2 test workers); the deadline here is for the hang, not for start-up
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_ranks(4, _hang_on_rank, 1, timeout=5, init_distributed=False)
    elapsed = time.monotonic() - start
    assert elapsed < 30, elapsed  # hang check: killed shortly after the 5 s deadline
    assert info.value.hung == [1]
    assert info.value.finished == [0, 2, 3]
    assert "[1]" in str(info.value) and "did not finish" in str(info.value)


def _exit_on_rank(bad: int) -> int:
    if int(os.environ["RANK"]) == bad:
        os._exit(3)
    return int(os.environ["RANK"])


@pytest.mark.timeout(120)
def test_child_exit_without_report_is_a_failure() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(4, _exit_on_rank, 2)
    assert [r for r, _ in info.value.failures] == [2]
    assert "exit code 3" in str(info.value) and "rank 2" in str(info.value)


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.timeout(60)
def test_child_killed_by_signal_is_a_failure() -> None:
    with pytest.raises(RankFailure, match="exit code -9 \\(signal SIGKILL\\)"):
        run_ranks(1, _kill_self, init_distributed=False)


def _environment() -> dict[str, object]:
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "HETERO_TEST_VAR")
    out: dict[str, object] = {k: os.environ.get(k) for k in keys}
    out["initialized"] = dist.is_initialized()
    out["threads"] = torch.get_num_threads()
    return out


@pytest.mark.timeout(60)
def test_without_init_distributed_and_env() -> None:
    before = dict(os.environ)
    out = run_ranks(3, _environment, init_distributed=False, env={"HETERO_TEST_VAR": "x"})
    assert [o["RANK"] for o in out] == ["0", "1", "2"]
    assert [o["LOCAL_RANK"] for o in out] == ["0", "1", "2"]
    assert {o["WORLD_SIZE"] for o in out} == {"3"}
    assert {o["MASTER_ADDR"] for o in out} == {"127.0.0.1"}
    assert len({o["MASTER_PORT"] for o in out}) == 1
    assert {o["HETERO_TEST_VAR"] for o in out} == {"x"}
    assert not any(o["initialized"] for o in out)
    assert {o["threads"] for o in out} == {1}
    assert dict(os.environ) == before  # the parent's environment is untouched


def _unpicklable() -> object:
    return lambda: None


@pytest.mark.timeout(60)
def test_unpicklable_return_value_is_a_failure() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(1, _unpicklable, init_distributed=False)
    assert info.value.failures[0][0] == 0
    assert "pickle" in str(info.value).lower()


def test_free_port_and_argument_checks() -> None:
    port = free_port()
    assert isinstance(port, int) and 0 < port < 65536
    with pytest.raises(ValueError, match="world_size"):
        run_ranks(0, _environment)
    with pytest.raises(ValueError, match="timeout"):
        run_ranks(1, _environment, timeout=0)


def _compat_state() -> tuple[bool, bool]:
    from megatron.core.transformer.moe import moe_utils

    from megatron_hetero.compat import compat_applied, cpu_compat_applied
    from megatron_hetero.compat._patching import MARK

    # a CPU redirection's marker on the Megatron function itself (cpu.moe_split_sizes_numpy)
    patched = hasattr(moe_utils.maybe_move_tensor_to_cpu, MARK)
    return compat_applied(), cpu_compat_applied() and patched


@pytest.mark.timeout(60)
def test_forked_ranks_inherit_the_session_compat() -> None:
    """tests/conftest.py applies compat once in the pytest process; every forked rank sees it (applied
    on every machine, the CPU redirects where there is no CUDA)."""
    assert _compat_state() == (True, not torch.cuda.is_available())
    assert run_ranks(2, _compat_state, init_distributed=False) == [(True, not torch.cuda.is_available())] * 2


def _init_breaks_once_on_rank1(marker: str, always: bool):
    """A stand-in for ``init_process_group`` whose first call on rank 1 (every call, if ``always``)
    raises the network error CI saw when a store connection broke; the others go through."""
    real = dist.init_process_group

    def init(*args, **kwargs):
        if kwargs.get("rank") == 1 and (always or not os.path.exists(marker)):
            open(marker, "w").close()
            raise dist.DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed.")
        return real(*args, **kwargs)

    return init


def _world_sum() -> float:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return float(t.item())


def test_setup_failure_runs_the_world_once_more(tmp_path, monkeypatch, capfd) -> None:
    marker = str(tmp_path / "broke")
    monkeypatch.setattr(dist, "init_process_group", _init_breaks_once_on_rank1(marker, always=False))
    monkeypatch.setattr(launcher, "FAILURE_GRACE_S", 1.0)
    assert run_ranks(3, _world_sum, timeout=60, pg_timeout=20) == [6.0, 6.0, 6.0]
    err = capfd.readouterr().err
    assert (
        "run_ranks: creating the world process group failed (torch.distributed.DistNetworkError: Failed to recv" in err
    )
    assert "running all 3 ranks once more on a new port" in err


def test_second_setup_failure_is_raised(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(dist, "init_process_group", _init_breaks_once_on_rank1(str(tmp_path / "m"), always=True))
    monkeypatch.setattr(launcher, "FAILURE_GRACE_S", 1.0)
    with pytest.raises(RankFailure) as info:
        run_ranks(3, _world_sum, timeout=60, pg_timeout=20)
    assert info.value.setup_failed and info.value.failures[0][0] == 1
    assert info.value.failures[0][1].startswith("init_process_group failed:")


def _init_last_rank_lingers(go: str, seen: str):
    """A stand-in for ``init_process_group``: the real one, then the last rank stays in setup for up to
    a second, watching for `go` (which rank 0 writes when its `fn` starts), and writes to `seen`
    whether it saw it."""
    real = dist.init_process_group

    def init(*args, **kwargs):
        real(*args, **kwargs)
        if kwargs["rank"] == kwargs["world_size"] - 1:
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline and not os.path.exists(go):
                time.sleep(0.01)
            with open(seen, "w") as f:
                f.write("seen" if os.path.exists(go) else "not seen")

    return init


def _rank0_says_go(go: str) -> int:
    if dist.get_rank() == 0:
        open(go, "w").close()
    return dist.get_rank()


def test_no_rank_runs_fn_before_every_rank_finished_setup(tmp_path, monkeypatch) -> None:
    """gloo's full mesh is no barrier: without the launcher's barrier after it, rank 0 would start (and
    could finish and exit, taking the store with it) while the last rank is still in its setup."""
    go, seen = str(tmp_path / "go"), tmp_path / "seen"
    monkeypatch.setattr(dist, "init_process_group", _init_last_rank_lingers(go, str(seen)))
    assert run_ranks(3, _rank0_says_go, go, timeout=60) == [0, 1, 2]
    assert seen.read_text() == "not seen"


def test_failure_in_fn_is_not_retried(tmp_path) -> None:
    calls = tmp_path / "calls"

    def fn():
        with open(calls, "a") as f:
            f.write("x")
        raise ValueError("boom")

    with pytest.raises(RankFailure) as info:
        run_ranks(1, fn, timeout=30)
    assert not info.value.setup_failed and calls.read_text() == "x"

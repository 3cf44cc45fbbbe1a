"""rank_env: the rank a launcher (torchrun, srun) described in the environment; pure, no processes."""

from __future__ import annotations

import pytest

from megatron_hetero.launch.rank_env import (
    RankEnv,
    apply_rank_env,
    check_world_size,
    first_host,
    port_from_job_id,
    rank_env,
)

TORCHRUN = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "gpu-a17",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "42",
    # torchrun under srun: the SLURM variables describe the node's agent task, not this rank
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "1",
    "SLURM_NTASKS": "2",
    "SLURM_LOCALID": "0",
}

SRUN = {
    "SLURM_JOB_ID": "123456",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_STEP_NODELIST": "node[01-02]",
    "SLURM_JOB_NODELIST": "node[01-02]",
}


def test_no_launcher_is_none():
    assert rank_env({}) is None
    assert rank_env({"PATH": "/usr/bin", "HOME": "/root"}) is None


def test_batch_script_and_salloc_shell_are_not_ranks():
    # an sbatch script sets SLURM_PROCID/NTASKS but runs no job step: `train` spawns its ranks itself
    batch = {k: v for k, v in SRUN.items() if not k.startswith("SLURM_STEP")}
    assert rank_env(batch) is None


def test_single_task_srun_step_is_not_a_rank():
    assert (
        rank_env(
            {
                **SRUN,
                "SLURM_PROCID": "0",
                "SLURM_LOCALID": "0",
                "SLURM_NODEID": "0",
                "SLURM_STEP_NUM_TASKS": "1",
                "SLURM_STEP_TASKS_PER_NODE": "1",
            }
        )
        is None
    )


def test_torchrun_env():
    env = rank_env(TORCHRUN)
    assert env == RankEnv(
        rank=5,
        world_size=8,
        local_rank=1,
        local_world_size=4,
        node_rank=1,
        master_addr="gpu-a17",
        master_port=29500,
        launcher="torchrun",
    )
    assert "rank 5 of WORLD_SIZE=8 from torchrun" in env.describe()


def test_plain_rank_env_without_torchelastic_is_launcher_env():
    env = rank_env({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1234"})
    assert env.launcher == "env" and env.local_world_size is None and env.node_rank is None


@pytest.mark.parametrize(
    "drop, named",
    [
        ("WORLD_SIZE", "WORLD_SIZE missing"),
        ("RANK", "RANK"),
        ("LOCAL_RANK", "LOCAL_RANK"),
        ("MASTER_ADDR", "MASTER_ADDR missing"),
        ("MASTER_PORT", "MASTER_PORT missing"),
    ],
)
def test_torchrun_partial_env_is_an_error(drop, named):
    environ = {k: v for k, v in TORCHRUN.items() if k != drop}
    with pytest.raises(ValueError, match=named):
        rank_env(environ)


def test_rank_without_world_size_message():
    with pytest.raises(ValueError) as err:
        rank_env({"RANK": "0"})
    msg = str(err.value)
    assert "RANK set but WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT missing" in msg


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"RANK": "8"}, r"RANK=8 is not a rank of WORLD_SIZE=8 \(ranks are 0..7\)"),
        ({"RANK": "-1"}, "RANK=-1 must be >= 0"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be >= 1"),
        ({"WORLD_SIZE": "eight"}, "WORLD_SIZE='eight' is not an integer"),
        ({"LOCAL_RANK": "4"}, "LOCAL_RANK=4 is not a local rank of the 4 ranks"),
        ({"LOCAL_WORLD_SIZE": "16"}, "16 ranks on this node but WORLD_SIZE=8"),
        ({"MASTER_PORT": "70000"}, "not a TCP port"),
    ],
)
def test_torchrun_inconsistent_env_is_an_error(changes, named):
    with pytest.raises(ValueError, match=named):
        rank_env({**TORCHRUN, **changes})


def test_srun_env_bracket_nodelist():
    env = rank_env(SRUN)
    assert env == RankEnv(
        rank=3,
        world_size=4,
        local_rank=1,
        local_world_size=2,
        node_rank=1,
        master_addr="node01",
        master_port=20000 + 123456 % 20000,
        launcher="srun",
    )


def test_srun_env_comma_nodelist_and_job_nodelist_fallback():
    environ = {k: v for k, v in SRUN.items() if k != "SLURM_STEP_NODELIST"}
    environ["SLURM_JOB_NODELIST"] = "a,b"
    assert rank_env(environ).master_addr == "a"


def test_srun_env_explicit_master_wins():
    env = rank_env({**SRUN, "MASTER_ADDR": "head.example", "MASTER_PORT": "29400"})
    assert (env.master_addr, env.master_port) == ("head.example", 29400)


def test_srun_env_ntasks_fallback_and_uneven_tasks_per_node():
    environ = {k: v for k, v in SRUN.items() if k not in ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE")}
    environ.update(SLURM_NTASKS="5", SLURM_TASKS_PER_NODE="3,2", SLURM_PROCID="4")
    env = rank_env(environ)
    assert (env.world_size, env.local_world_size, env.node_rank) == (5, 2, 1)


@pytest.mark.parametrize("drop, named", [("SLURM_PROCID", "without SLURM_PROCID"), ("SLURM_LOCALID", "SLURM_LOCALID")])
def test_srun_partial_env_is_an_error(drop, named):
    with pytest.raises(ValueError, match=named):
        rank_env({k: v for k, v in SRUN.items() if k != drop})


def test_srun_without_task_count_is_an_error():
    environ = {k: v for k, v in SRUN.items() if k not in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")}
    with pytest.raises(ValueError, match="SLURM_STEP_NUM_TASKS"):
        rank_env(environ)


def test_srun_without_any_master_address_is_an_error_not_localhost():
    environ = {k: v for k, v in SRUN.items() if "NODELIST" not in k}
    with pytest.raises(ValueError, match="no rendezvous address: set MASTER_ADDR"):
        rank_env(environ)


def test_srun_without_any_port_is_an_error():
    environ = {k: v for k, v in SRUN.items() if k != "SLURM_JOB_ID"}
    with pytest.raises(ValueError, match="no rendezvous port: set MASTER_PORT"):
        rank_env(environ)


def test_srun_rank_out_of_range():
    with pytest.raises(ValueError, match=r"SLURM_PROCID=4 is not a rank of SLURM_STEP_NUM_TASKS=4"):
        rank_env({**SRUN, "SLURM_PROCID": "4"})


@pytest.mark.parametrize(
    "nodelist, host",
    [
        ("node[01-02]", "node01"),
        ("a,b", "a"),
        ("gpu7", "gpu7"),
        ("node[3,5-9],other[1-2]", "node3"),
        ("rack[2-3]-n[07-08]", "rack2-n07"),
        (" x[10-11] ", "x10"),
    ],
)
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


@pytest.mark.parametrize("bad", ["", "node[01-02", "[]", ",a"])
def test_first_host_rejects_garbage(bad):
    with pytest.raises(ValueError):
        first_host(bad)


def test_port_from_job_id_range():
    assert port_from_job_id(0) == 20000 and port_from_job_id(19999) == 39999 and port_from_job_id(20000) == 20000


def test_apply_rank_env_sets_env_init_variables():
    target = {"UNRELATED": "1"}
    apply_rank_env(rank_env(SRUN), target)
    assert target == {
        "UNRELATED": "1",
        "MASTER_ADDR": "node01",
        "MASTER_PORT": str(20000 + 123456 % 20000),
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
    }


def test_check_world_size():
    env = rank_env(SRUN)
    check_world_size(env, 4)
    with pytest.raises(ValueError) as err:
        check_world_size(env, 8)
    msg = str(err.value)
    assert "WORLD_SIZE=4 ranks = 2 nodes x 2 ranks per node" in msg and "the layout uses 8 ranks (8 != 4)" in msg

"""Ranks started by someone else: read the rank a launcher described in the environment.

`megatron-hetero train` either spawns its ranks itself, or, when the environment already describes a
rank, runs as that one rank. Two launchers are recognised:

- **torchrun / torch elastic** (or any launcher that sets the same variables): ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` are all required once any of ``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK`` is set; ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK`` (the node rank) are read
  when present. This takes precedence over SLURM variables (torchrun under srun is the usual case).
- **srun without torchrun**: a task of a job step (``SLURM_STEP_ID`` set) with ``SLURM_PROCID``,
  ``SLURM_STEP_NUM_TASKS`` (else ``SLURM_NTASKS``/``SLURM_NPROCS``) and ``SLURM_LOCALID``; the node rank
  from ``SLURM_NODEID``, the ranks on this node from ``SLURM_STEP_TASKS_PER_NODE`` (e.g. ``2(x3),1``).
  The rendezvous address is ``MASTER_ADDR`` if set, else the first host of ``SLURM_STEP_NODELIST`` /
  ``SLURM_JOB_NODELIST`` / ``SLURM_NODELIST`` (``node[01-02]`` -> ``node01``); the port is
  ``MASTER_PORT`` if set, else ``20000 + SLURM_JOB_ID % 20000`` (the rule the generated sbatch script
  uses too, see `port_from_job_id`).

Not a rank description (returns None; `train` spawns its ranks itself): no launcher variables at all;
a SLURM batch script or `salloc` shell (``SLURM_PROCID`` set but no job step); a single-task srun step
such as ``srun --pty bash`` (one task of one: nothing to join).

Pure: reads a mapping, never `os.environ` unless given it; nothing assumes one host (there is no
127.0.0.1 default: a missing rendezvous address is an error).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping, MutableMapping, Optional

TORCHRUN_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
NODELIST_KEYS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
PORT_BASE, PORT_SPAN = 20000, 20000
#: names the stop-marker file rank 0 writes on the exit signal (`training.signals`); the sbatch script sets it
MARKER_ENV = "MH_EXIT_SIGNAL_MARKER"


def port_from_job_id(job_id: int) -> int:
    """The rendezvous port of a SLURM job: ``20000 + job_id % 20000`` (20000..39999)."""
    return PORT_BASE + job_id % PORT_SPAN


@dataclass(frozen=True)
class RankEnv:
    """One rank as its launcher described it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: Optional[int]
    node_rank: Optional[int]
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" (torch elastic), "env" (RANK/WORLD_SIZE set by another tool), "srun"

    def describe(self) -> str:
        where = f"rank {self.rank} of WORLD_SIZE={self.world_size} from {self.launcher}"
        if self.local_world_size is not None:
            where += f" (local rank {self.local_rank} of {self.local_world_size}"
            where += f" on node {self.node_rank})" if self.node_rank is not None else ")"
        return where + f", rendezvous {self.master_addr}:{self.master_port}"


def _int(environ: Mapping[str, str], key: str, source: str, minimum: int = 0) -> int:
    text = environ[key]
    try:
        value = int(str(text).strip())
    except ValueError:
        raise ValueError(f"{source}: {key}={text!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{source}: {key}={value} must be >= {minimum}")
    return value


def _port(text: str, where: str) -> int:
    try:
        port = int(str(text).strip())
    except ValueError:
        raise ValueError(f"{where}: MASTER_PORT={text!r} is not an integer") from None
    if not 1 <= port <= 65535:
        raise ValueError(f"{where}: MASTER_PORT={port} is not a TCP port (1..65535)")
    return port


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list: ``node[01-02]`` -> ``node01``, ``a,b`` -> ``a``,
    ``rack[1-2]-n[3,5]`` -> ``rack1-n3``; what ``scontrol show hostnames LIST | head -n1`` prints."""
    text = nodelist.strip()
    depth, end = 0, len(text)
    for i, ch in enumerate(text):  # the first comma outside brackets ends the first item
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            end = i
            break
    item = text[:end].strip()
    if depth < 0 or item.count("[") != item.count("]"):
        raise ValueError(f"host list {nodelist!r} has unbalanced brackets")

    def first_of(match: re.Match) -> str:
        return re.split(r"[,-]", match.group(1), maxsplit=1)[0].strip()

    host = re.sub(r"\[([^\]]*)\]", first_of, item)
    if not host or "[" in host or "]" in host:
        raise ValueError(f"host list {nodelist!r} does not start with a host name")
    return host


def _tasks_on_node(spec: str, node: int) -> Optional[int]:
    """Tasks on node NODE from a SLURM tasks-per-node string like ``2(x3),1``; None if not covered."""
    seen = 0
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            return None
        count, repeat = int(m.group(1)), int(m.group(2) or 1)
        if node < seen + repeat:
            return count
        seen += repeat
    return None


def _check_ranges(env: RankEnv, source: str, rank_key: str, world_key: str, local_key: str) -> RankEnv:
    if env.world_size < 1:
        raise ValueError(f"{source}: {world_key}={env.world_size} must be >= 1")
    if env.rank >= env.world_size:
        raise ValueError(
            f"{source}: {rank_key}={env.rank} is not a rank of {world_key}={env.world_size} "
            f"(ranks are 0..{env.world_size - 1})"
        )
    if env.local_world_size is not None:
        if env.local_world_size > env.world_size:
            raise ValueError(
                f"{source}: {env.local_world_size} ranks on this node but {world_key}={env.world_size} in all"
            )
        if env.local_rank >= env.local_world_size:
            raise ValueError(
                f"{source}: {local_key}={env.local_rank} is not a local rank of the "
                f"{env.local_world_size} ranks on this node (0..{env.local_world_size - 1})"
            )
    elif env.local_rank >= env.world_size:
        raise ValueError(f"{source}: {local_key}={env.local_rank} >= {world_key}={env.world_size}")
    return env


def _from_torchrun(environ: Mapping[str, str]) -> RankEnv:
    launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in environ else "env"
    source = "torchrun environment" if launcher == "torchrun" else "launcher environment (RANK/WORLD_SIZE)"
    present = [k for k in TORCHRUN_KEYS if k in environ]
    missing = [k for k in TORCHRUN_KEYS + ("MASTER_ADDR", "MASTER_PORT") if not str(environ.get(k, "")).strip()]
    if missing:
        raise ValueError(
            f"{source}: {', '.join(present)} set but {', '.join(missing)} missing; a rank started "
            f"by a launcher needs all of RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT "
            f"(or unset them all to let `train` spawn its ranks itself)"
        )
    local_world = _int(environ, "LOCAL_WORLD_SIZE", source, 1) if "LOCAL_WORLD_SIZE" in environ else None
    node_rank = _int(environ, "GROUP_RANK", source) if "GROUP_RANK" in environ else None
    env = RankEnv(
        rank=_int(environ, "RANK", source),
        world_size=_int(environ, "WORLD_SIZE", source, 1),
        local_rank=_int(environ, "LOCAL_RANK", source),
        local_world_size=local_world,
        node_rank=node_rank,
        master_addr=environ["MASTER_ADDR"].strip(),
        master_port=_port(environ["MASTER_PORT"], source),
        launcher=launcher,
    )
    return _check_ranges(env, source, "RANK", "WORLD_SIZE", "LOCAL_RANK")


def _from_srun(environ: Mapping[str, str]) -> Optional[RankEnv]:
    source = "srun environment"
    world_key = next((k for k in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS") if k in environ), None)
    missing = [k for k in ("SLURM_PROCID", "SLURM_LOCALID") if k not in environ]
    if world_key is None:
        missing.insert(1, "SLURM_STEP_NUM_TASKS (or SLURM_NTASKS)")
    if missing:
        raise ValueError(
            f"{source}: a job step task (SLURM_STEP_ID={environ.get('SLURM_STEP_ID')!r}) without "
            f"{', '.join(missing)}; cannot tell this rank's place"
        )
    world = _int(environ, world_key, source, 1)
    if world == 1:
        return None  # one task of one (`srun --pty bash`, a 1-task step): `train` spawns its ranks itself
    node_rank = _int(environ, "SLURM_NODEID", source) if "SLURM_NODEID" in environ else None
    local_world = None
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if per_node and node_rank is not None:
        local_world = _tasks_on_node(per_node, node_rank)

    addr = str(environ.get("MASTER_ADDR", "")).strip()
    if not addr:
        nodelist_key = next((k for k in NODELIST_KEYS if str(environ.get(k, "")).strip()), None)
        if nodelist_key is None:
            raise ValueError(
                f"{source}: no rendezvous address: set MASTER_ADDR, or run inside a job whose "
                f"SLURM_JOB_NODELIST names its nodes (the first host is used)"
            )
        addr = first_host(environ[nodelist_key])
    port_text = str(environ.get("MASTER_PORT", "")).strip()
    if port_text:
        port = _port(port_text, source)
    elif str(environ.get("SLURM_JOB_ID", "")).strip():
        port = port_from_job_id(_int(environ, "SLURM_JOB_ID", source))
    else:
        raise ValueError(
            f"{source}: no rendezvous port: set MASTER_PORT, or run inside a job "
            f"(SLURM_JOB_ID gives {PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN})"
        )
    env = RankEnv(
        rank=_int(environ, "SLURM_PROCID", source),
        world_size=world,
        local_rank=_int(environ, "SLURM_LOCALID", source),
        local_world_size=local_world,
        node_rank=node_rank,
        master_addr=addr,
        master_port=port,
        launcher="srun",
    )
    return _check_ranges(env, source, "SLURM_PROCID", world_key, "SLURM_LOCALID")


def rank_env(environ: Mapping[str, str]) -> Optional[RankEnv]:
    """The rank the environment describes, or None when it describes none (see the module docstring).

    Raises ValueError, naming the variables, for partial or inconsistent descriptions (RANK without
    WORLD_SIZE, a rank >= the world size, a srun task without a rendezvous address, ...)."""
    if any(k in environ for k in TORCHRUN_KEYS):
        return _from_torchrun(environ)
    if "SLURM_STEP_ID" in environ or "SLURM_STEPID" in environ:
        return _from_srun(environ)
    return None


def apply_rank_env(env: RankEnv, environ: Optional[MutableMapping[str, str]] = None) -> None:
    """Set what torch.distributed's ``env://`` init reads (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, and ``LOCAL_WORLD_SIZE`` when known) in ENVIRON (default
    `os.environ`): needed for srun tasks, a no-op in effect under torchrun."""
    target = os.environ if environ is None else environ
    target.update(
        MASTER_ADDR=env.master_addr,
        MASTER_PORT=str(env.master_port),
        RANK=str(env.rank),
        WORLD_SIZE=str(env.world_size),
        LOCAL_RANK=str(env.local_rank),
    )
    if env.local_world_size is not None:
        target["LOCAL_WORLD_SIZE"] = str(env.local_world_size)


def check_world_size(env: RankEnv, layout_world: int) -> None:
    """ValueError with the arithmetic when the launcher's world differs from the layout's."""
    if env.world_size == layout_world:
        return
    shape = ""
    if env.local_world_size is not None and env.world_size % env.local_world_size == 0:
        shape = f" = {env.world_size // env.local_world_size} nodes x {env.local_world_size} ranks per node"
    raise ValueError(
        f"the launcher ({env.launcher}) started WORLD_SIZE={env.world_size} ranks{shape}, but the layout "
        f"uses {layout_world} ranks ({layout_world} != {env.world_size}); start {layout_world} ranks "
        f"(nodes x ranks per node = {layout_world}) or change the layout's degrees"
    )

"""`megatron-hetero slurm`: the generated sbatch script (text, validation, and what it runs when executed
by bash with srun/scontrol/torchrun/python replaced by recording stubs). No SLURM needed."""

from __future__ import annotations

import argparse
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

from megatron_hetero.launch.sbatch import sbatch_script
from megatron_hetero.launch.slurm import add_arguments, run

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = ROOT / "examples" / "layouts"
FAN_IN = str(LAYOUTS / "colocated_fan_in.yaml")  # world 8

HOSTILE_VALUES = ["$(touch x)", "`touch x`", "; touch x", "a b", "'\"", "*", "$HOME", "line1\nline2", "\\", "--", ""]
# train arguments that the train parser accepts, carrying the hostile strings (argparse: the last one wins)
HOSTILE = [f"--log-jsonl={v}" for v in HOSTILE_VALUES] + ["--log-jsonl", "$(touch x)", "--seed", "7"]


def parse(*argv: str) -> argparse.Namespace:
    from megatron_hetero.cli.train import add_parser as add_train_parser

    return add_arguments(
        argparse.ArgumentParser(prog="megatron-hetero slurm"), add_train_parser=add_train_parser
    ).parse_args(list(argv))


def sbatch_lines(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.startswith("#SBATCH")]


def test_script_text_gpu_case(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the layout path is the user's, written as given: relative here
    rc = run(
        parse(
            "--nodes",
            "2",
            "--gpus-per-node",
            "4",
            "--hetero-layout",
            "examples/layouts/colocated_fan_in.yaml",
            "--partition",
            "gpu",
            "--time",
            "01:00:00",
            "--account",
            "proj7",
            "--job-name",
            "llava",
            "--output",
            "logs/%x-%j.out",
            "--dry-run",
            "--",
            "--train-iters",
            "3",
            "--log-jsonl",
            "out/log.jsonl",
        )
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert out.startswith("#!/bin/bash\n")
    assert sbatch_lines(out) == [
        "#SBATCH --job-name=llava",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=01:00:00",
        "#SBATCH --account=proj7",
        "#SBATCH --output=logs/%x-%j.out",
    ]
    # no executable line before the last #SBATCH line (sbatch stops reading options at the first one)
    last = max(i for i, line in enumerate(out.splitlines()) if line.startswith("#SBATCH"))
    assert all(not line or line.startswith("#") for line in out.splitlines()[:last])
    assert "nnodes=${MH_NNODES:-2}" in out and "nproc_per_node=${MH_NPROC_PER_NODE:-4}" in out
    assert 'head=$(set +o pipefail; scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)' in out
    assert "port=${MH_MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}" in out
    assert "python=${MH_PYTHON:-python3}" in out and '"$python" -m torch.distributed.run' in out
    assert '--nnodes="$nnodes" --nproc-per-node="$nproc_per_node"' in out
    assert '--rdzv-backend="$rdzv_backend" --rdzv-endpoint="$head:$port"' in out
    assert "rdzv_backend=${MH_RDZV_BACKEND:-c10d}" in out
    assert 'if [ -z "$script" ]; then entry=(-m "$entry_module" train)' in out
    assert '"${entry[@]}" --hetero-layout "$layout"' in out
    assert 'srun_args=(--nodes="$nnodes" --ntasks="$nnodes" --ntasks-per-node=1' in out
    assert "train_args=(\n  --train-iters\n  3\n  --log-jsonl\n  out/log.jsonl\n)" in out
    for var in (
        "MH_PYTHON",
        "MH_TORCHRUN",
        "MH_NNODES",
        "MH_NPROC_PER_NODE",
        "MH_MASTER_ADDR",
        "MH_MASTER_PORT",
        "MH_RDZV_BACKEND",
        "MH_TORCHRUN_ARGS",
        "MH_SRUN_ARGS",
        "MH_CONTAINER_IMAGE",
        "MH_TRAIN_ARGS",
    ):
        assert f"#   {var} " in out, var  # documented at the top
    assert "generated_layout=examples/layouts/colocated_fan_in.yaml" in out
    assert "/work/" not in out and "/root" not in out and "/home" not in out  # no user-specific paths


def test_script_text_cpu_case_and_no_gpu_request():
    text = sbatch_script(nodes=2, ranks_per_node=2, gpus_per_node=0, layout="l.yaml", train_args=[])
    assert "--gpus-per-node" not in "\n".join(sbatch_lines(text))
    assert sbatch_lines(text) == [
        "#SBATCH --job-name=megatron-hetero",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
    ]
    assert "CPU ranks (gloo)" in text and "train_args=()" in text
    text = sbatch_script(
        nodes=2,
        ranks_per_node=8,
        gpus_per_node=8,
        layout="l.yaml",
        request_gpus=False,
        cpus_per_task=64,
        sbatch_options=["--exclusive", "--mem=0"],
    )
    assert sbatch_lines(text)[2:] == [
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --cpus-per-task=64",
        "#SBATCH --exclusive",
        "#SBATCH --mem=0",
    ]


def test_world_size_mismatch_exits_2_with_arithmetic(capsys):
    rc = run(
        parse(
            "--nodes",
            "2",
            "--gpus-per-node",
            "0",
            "--cpu-ranks-per-node",
            "2",
            "--hetero-layout",
            FAN_IN,
            "--",
            "--train-iters",
            "3",
        )
    )
    cap = capsys.readouterr()
    assert rc == 2 and cap.out == ""
    assert "uses 8 ranks, but --nodes 2 x 2 ranks per node (--cpu-ranks-per-node) = 4 ranks (8 != 4)" in cap.err, (
        cap.err
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpus-per-node", "0"], "give --cpu-ranks-per-node R"),
        (["--gpus-per-node", "4", "--cpu-ranks-per-node", "4"], "give one of them"),
        (["--gpus-per-node", "4", "--job-name", "two words"], "may not contain whitespace"),
        (["--gpus-per-node", "4", "--job-name", "x\ntouch pwned"], "may not contain whitespace"),
        (["--gpus-per-node", "4", "--partition", "p'q"], "quotes"),
        (["--gpus-per-node", "4", "--sbatch-option", "--mem=1G\necho hi"], "--sbatch-option"),
        (["--gpus-per-node", "4", "--", "--hetero-layout", "other.yaml"], "--hetero-layout is set by this command"),
        (["--gpus-per-node", "4", "--", "--nproc-per-node=8"], "--nproc-per-node is set by this command"),
        (["--gpus-per-node", "4", "--", "--nproc", "8"], "--nproc-per-node is set by this command"),
        (["--gpus-per-node", "4", "--", "--train-iterz", "3"], "do not parse"),
    ],
)
def test_invalid_input_exits_2(capsys, argv, message):
    rc = run(parse("--nodes", "2", "--hetero-layout", FAN_IN, *argv))
    cap = capsys.readouterr()
    assert rc == 2 and cap.out == "", cap
    assert message in cap.err, cap.err


def test_missing_layout_exits_2(capsys, tmp_path):
    rc = run(parse("--nodes", "1", "--gpus-per-node", "8", "--hetero-layout", str(tmp_path / "nope.yaml")))
    assert rc == 2 and "cannot read layout file" in capsys.readouterr().err


STUB = """#!/bin/bash
# records its argv (NUL-separated) in $STUB_LOG/NAME, one file per call
n=0; while [ -e "$STUB_LOG/{name}.$n" ]; do n=$((n + 1)); done
printf '%s\\0' "$@" > "$STUB_LOG/{name}.$n"
{tail}
"""


def make_stubs(tmp_path: Path) -> tuple[Path, Path]:
    bin_dir, log_dir = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    log_dir.mkdir()
    tails = {
        "scontrol": "echo node01; echo node02",
        # srun: drop its own options, run the command (the python or torchrun stub) like a task would
        "srun": 'while [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do shift; done; exec "$@"',
        "torchrun": "",
        "python3": "",
    }
    for name, tail in tails.items():
        path = bin_dir / name
        path.write_text(STUB.format(name=name, tail=tail))
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return bin_dir, log_dir


def calls(log_dir: Path, name: str) -> list[list[str]]:
    out = []
    for f in sorted(log_dir.glob(f"{name}.*")):
        out.append(f.read_bytes().decode().split("\0")[:-1])
    return out


def run_script(tmp_path: Path, script: str, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    bin_dir, log_dir = make_stubs(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    base = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "STUB_LOG": str(log_dir),
        "HOME": str(tmp_path),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node[01-02]",
    }
    proc = subprocess.run(
        ["bash", str(path)], cwd=work, env={**base, **env}, capture_output=True, text=True, timeout=60
    )
    return proc, log_dir


def test_hostile_arguments_arrive_verbatim_and_run_nothing(tmp_path, capsys):
    layout = tmp_path / "$(touch x) `touch x`.yaml"  # a hostile file name that is also a valid layout
    layout.write_text(Path(FAN_IN).read_text())
    hostile_image = "img$(touch x)`touch x`"
    rc = run(
        parse(
            "--nodes",
            "2",
            "--gpus-per-node",
            "4",
            "--hetero-layout",
            str(layout),
            "--container-image",
            hostile_image,
            "--",
            *HOSTILE,
        )
    )
    script = capsys.readouterr().out
    assert rc == 0
    proc, log_dir = run_script(tmp_path, script)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "work" / "x").exists() and not (tmp_path / "x").exists()
    assert not list(tmp_path.rglob("x")), "a hostile argument ran as shell code"
    (srun,) = calls(log_dir, "srun")
    (python,) = calls(log_dir, "python3")
    assert srun[:5] == [
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        f"--container-image={hostile_image}",
    ]
    assert srun[5:] == ["python3", *python]
    assert python == [
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=4",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=node01:{20000 + 4242 % 20000}",
        "--rdzv-id=4242",
        "-m",
        "megatron_hetero",
        "train",
        "--hetero-layout",
        str(layout),
        *HOSTILE,
    ]
    assert calls(log_dir, "scontrol") == [["show", "hostnames", "node[01-02]"]]


def test_environment_overrides(tmp_path):
    script = sbatch_script(
        nodes=2,
        ranks_per_node=2,
        gpus_per_node=0,
        layout="l.yaml",
        train_args=["--train-iters", "3"],
        container_image="img",
    )
    proc, log_dir = run_script(
        tmp_path,
        script,
        MH_PYTHON="/opt/py/bin/python",
        MH_TORCHRUN="torchrun",
        MH_NNODES="1",
        MH_NPROC_PER_NODE="3",
        MH_MASTER_ADDR="head.example",
        MH_MASTER_PORT="29999",
        MH_RDZV_BACKEND="static",
        MH_TORCHRUN_ARGS="--max-restarts=1 --log-dir=/tmp/l",
        MH_SRUN_ARGS="--label",
        MH_CONTAINER_IMAGE="",
        MH_ENTRY_MODULE="megatron_hetero",
        MH_HETERO_LAYOUT="other.yaml",
        MH_TRAIN_ARGS="--train-iters 5",
    )
    assert proc.returncode == 0, proc.stderr
    (srun,) = calls(log_dir, "srun")
    (torchrun,) = calls(log_dir, "torchrun")
    assert calls(log_dir, "scontrol") == [] and calls(log_dir, "python3") == []
    assert srun == [
        "--nodes=1",
        "--ntasks=1",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        "--label",
        "torchrun",
        *torchrun,
    ]
    assert torchrun == [
        "--nnodes=1",
        "--nproc-per-node=3",
        "--rdzv-backend=static",
        "--rdzv-endpoint=head.example:29999",
        "--rdzv-id=4242",
        "--max-restarts=1",
        "--log-dir=/tmp/l",
        "-m",
        "megatron_hetero",
        "train",
        "--hetero-layout",
        "other.yaml",
        "--train-iters",
        "3",
        "--train-iters",
        "5",
    ]


def test_script_outside_sbatch_fails_clearly(tmp_path):
    script = sbatch_script(nodes=1, ranks_per_node=1, gpus_per_node=0, layout="l.yaml")
    proc, _ = run_script(tmp_path, script, SLURM_JOB_ID="")
    assert proc.returncode != 0 and "run this script with sbatch" in proc.stderr


def test_submit_writes_script_and_prints_job_id(tmp_path, capsys, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text('#!/bin/bash\n[ "$1" = --parsable ] && [ -f "$2" ] && echo "777;cluster"\n')
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    out_file = tmp_path / "job.sbatch"
    rc = run(
        parse(
            "--nodes",
            "4",
            "--gpus-per-node",
            "2",
            "--hetero-layout",
            FAN_IN,
            "--submit",
            "--script-file",
            str(out_file),
        )
    )
    cap = capsys.readouterr()
    assert rc == 0 and cap.out == "777\n", cap
    assert out_file.read_text().startswith("#!/bin/bash") and "submitted job 777" in cap.err


def test_submit_failure_exits_1_with_sbatch_message(tmp_path, capsys, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text("#!/bin/bash\necho 'sbatch: error: invalid partition specified: nope' >&2\nexit 1\n")
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    rc = run(
        parse(
            "--nodes",
            "4",
            "--gpus-per-node",
            "2",
            "--hetero-layout",
            FAN_IN,
            "--submit",
            "--script-file",
            str(tmp_path / "job.sbatch"),
            "--partition",
            "nope",
        )
    )
    cap = capsys.readouterr()
    assert rc == 1 and cap.out == ""
    assert re.search(r"sbatch failed \(exit 1\): sbatch: error: invalid partition specified: nope", cap.err)


def test_registered_as_a_subcommand_train_arguments_follow_the_separator(capsys):
    """How the CLI registers it: `megatron-hetero slurm ... -- <train arguments>`; flags after `--` belong
    to train even when the slurm command has a flag of the same name."""
    from megatron_hetero import cli

    top = cli.build_parser()
    args = top.parse_args(
        [
            "slurm",
            "--nodes",
            "2",
            "--gpus-per-node",
            "4",
            "--hetero-layout",
            FAN_IN,
            "--",
            "--train-iters",
            "3",
            "--seed",
            "9",
        ]
    )
    assert args.train_args == ["--train-iters", "3", "--seed", "9"] and args.hetero_layout == FAN_IN
    assert args.func(args) == 0
    assert "train_args=(\n  --train-iters\n  3\n  --seed\n  9\n)" in capsys.readouterr().out
    args = top.parse_args(
        [
            "slurm",
            "--nodes",
            "2",
            "--gpus-per-node",
            "4",
            "--hetero-layout",
            FAN_IN,
            "--",
            "--hetero-layout",
            "other.yaml",
        ]
    )
    assert args.func(args) == 2 and "--hetero-layout is set by this command" in capsys.readouterr().err


def test_train_parser_can_be_supplied_by_the_cli(capsys):
    """The CLI may pass its own `train` registration (when the train parser moves out of training/)."""
    seen = []

    def add_train(sub):
        seen.append(True)
        p = sub.add_parser("train")
        p.add_argument("--hetero-layout")
        p.add_argument("--only-flag")

    args = add_arguments(argparse.ArgumentParser(), add_train_parser=add_train).parse_args(
        ["--nodes", "2", "--gpus-per-node", "4", "--hetero-layout", FAN_IN, "--", "--train-iters", "3"]
    )
    assert run(args) == 2 and seen and "do not parse" in capsys.readouterr().err
    args.train_args = ["--only-flag", "v"]
    assert run(args) == 0


@pytest.mark.parametrize("gpus", [0, 4])
def test_megatron_lm_script_runs_with_the_layout(tmp_path, gpus):
    """`--script PRETRAIN.py`: torchrun runs Megatron-LM's (patched) script with --hetero-layout and the
    Megatron flags verbatim; on CPU nodes through megatron_hetero.megatron_lm.run (its CPU redirections)."""
    hostile_script = "/opt/Megatron LM/$(touch x)/pretrain_vlm.py"
    script = sbatch_script(
        nodes=2,
        ranks_per_node=2 if gpus == 0 else gpus,
        gpus_per_node=gpus,
        layout="l.yaml",
        train_args=["--num-layers", "2", "$(touch x)"],
        script=hostile_script,
    )
    proc, log_dir = run_script(tmp_path, script)
    assert proc.returncode == 0, proc.stderr
    assert not list(tmp_path.rglob("x")), "a hostile argument ran as shell code"
    (python,) = calls(log_dir, "python3")
    entry = ["-m", "megatron_hetero.megatron_lm.run", hostile_script] if gpus == 0 else [hostile_script]
    tail = [*entry, "--hetero-layout", "l.yaml", "--num-layers", "2", "$(touch x)"]
    assert python[-len(tail) :] == tail, python


def test_megatron_lm_script_flag_skips_train_parsing(capsys):
    args = parse(
        "--nodes",
        "2",
        "--gpus-per-node",
        "4",
        "--hetero-layout",
        FAN_IN,
        "--script",
        "pretrain_vlm.py",
        "--",
        "--encoder-num-layers",
        "1",
        "--tokenizer-type",
        "NullTokenizer",
    )
    assert run(args) == 0
    out = capsys.readouterr().out
    assert "generated_script=pretrain_vlm.py" in out and "--encoder-num-layers" in out


# --- SIGTERM before the time limit: stop with a checkpoint, requeue, resume -------------------------------


def test_signal_lines_default_with_save_and_checks(capsys):
    rc = run(parse("--nodes", "2", "--gpus-per-node", "4", "--hetero-layout", FAN_IN, "--", "--save", "ck"))
    out = capsys.readouterr().out
    assert rc == 0
    assert sbatch_lines(out)[-3:] == ["#SBATCH --signal=B:TERM@120", "#SBATCH --requeue", "#SBATCH --open-mode=append"]
    assert "train_args=(\n  --save\n  ck\n  --exit-signal-handler\n)" in out and "save_dir=ck" in out
    assert "exec " not in out and 'scontrol requeue "$SLURM_JOB_ID"' in out
    rc = run(
        parse(
            "--nodes",
            "2",
            "--gpus-per-node",
            "4",
            "--hetero-layout",
            FAN_IN,
            "--signal-seconds",
            "300",
            "--",
            "--save=a",
            "--exit-signal-handler",
            "--save",
            "b c",
        )
    )
    out = capsys.readouterr().out
    assert rc == 0 and "#SBATCH --signal=B:TERM@300" in out and "save_dir='b c'" in out
    assert out.count("--exit-signal-handler\n") == 1  # not added twice
    # off: without --save, or with --signal-seconds 0
    for argv in (["--"], ["--signal-seconds", "0", "--", "--save", "ck"]):
        rc = run(parse("--nodes", "2", "--gpus-per-node", "4", "--hetero-layout", FAN_IN, *argv))
        out = capsys.readouterr().out
        assert rc == 0 and "--signal" not in out and "--requeue" not in out and 'exec "${cmd[@]}"' in out
    for argv, message in (
        (["--signal-seconds", "60"], "no --save DIR"),
        (["--signal-seconds", "-1", "--", "--save", "x"], "--signal-seconds must be >= 0"),
    ):
        rc = run(parse("--nodes", "2", "--gpus-per-node", "4", "--hetero-layout", FAN_IN, *argv))
        assert rc == 2 and message in capsys.readouterr().err


# srun stand-in: announces itself, then on SIGTERM writes the marker as global rank 0 does after the
# checkpoint (when FAKE_MARK=1) and exits 1 as torchrun does after passing a signal on
FAKE_SRUN = """#!/bin/bash
printf '%s\\0' "$@" > "$STUB_LOG/srun.0"
env > "$STUB_LOG/fake_srun_env"
on_term() {
  [ "${FAKE_MARK:-1}" = 1 ] && echo "7 $FAKE_SAVE" > "$MH_EXIT_SIGNAL_MARKER"
  exit 1
}
trap on_term TERM
echo $$ > "$STUB_LOG/fake_srun_pid"
touch "$STUB_LOG/fake_srun_started"
for _ in $(seq 600); do sleep 0.1; done
exit 5
"""


def _signal_job(tmp_path: Path, mark: bool, checkpoint: bool) -> tuple[subprocess.CompletedProcess, Path, Path]:
    import signal
    import time

    save = tmp_path / "ck"
    save.mkdir()
    if checkpoint:
        (save / "latest_checkpointed_iteration.txt").write_text("4\n")
    script = sbatch_script(
        nodes=2,
        ranks_per_node=2,
        gpus_per_node=0,
        layout="l.yaml",
        train_args=["--save", str(save), "--train-iters", "100"],
        signal_seconds=90,
        save_dir=str(save),
    )
    bin_dir, log_dir = make_stubs(tmp_path)
    (bin_dir / "srun").write_text(FAKE_SRUN)
    # scancel --signal=TERM JOB: slurmctld signals the step's tasks (here: the fake srun)
    (bin_dir / "scancel").write_text(STUB.format(name="scancel", tail='kill -TERM "$(cat "$STUB_LOG/fake_srun_pid")"'))
    (bin_dir / "scancel").chmod(0o755)
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "STUB_LOG": str(log_dir),
        "HOME": str(tmp_path),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node[01-02]",
        "FAKE_SAVE": str(save),
        "FAKE_MARK": "1" if mark else "0",
    }
    proc = subprocess.Popen(
        ["bash", str(path)], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 30
    while not (log_dir / "fake_srun_started").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # what SLURM does with --signal=B:TERM@90, or scancel --batch --signal=TERM
    out, err = proc.communicate(timeout=30)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), log_dir, save


def test_sigterm_reaches_srun_and_a_marked_stop_requeues(tmp_path):
    proc, log_dir, save = _signal_job(tmp_path, mark=True, checkpoint=False)
    assert proc.returncode == 0, proc.stderr
    assert "got SIGTERM: passing it to the ranks" in proc.stderr
    assert "stopped on SIGTERM after iteration 7 with a checkpoint in" in proc.stderr and "requeueing" in proc.stderr
    assert calls(log_dir, "scontrol")[-1] == ["requeue", "4242"]
    assert calls(log_dir, "scancel") == [["--signal=TERM", "4242"]]
    env = dict(line.split("=", 1) for line in (log_dir / "fake_srun_env").read_text().splitlines() if "=" in line)
    assert env["MH_EXIT_SIGNAL_MARKER"] == f"{save}/.exit-signal.4242"
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "90"
    assert not (save / ".exit-signal.4242").exists()  # consumed
    (srun,) = calls(log_dir, "srun")
    # no checkpoint yet: no --load
    assert srun[-5:] == ["--save", str(save), "--train-iters", "100", "--exit-signal-handler"]


def test_unmarked_stop_fails_without_requeue_and_a_checkpoint_is_resumed(tmp_path):
    proc, log_dir, save = _signal_job(tmp_path, mark=False, checkpoint=True)
    assert proc.returncode == 1, proc.stderr  # srun's status: the ranks did not confirm a checkpoint
    assert not [c for c in calls(log_dir, "scontrol") if c[:1] == ["requeue"]]
    assert f"resuming from iteration 4 in {save}" in proc.stderr
    (srun,) = calls(log_dir, "srun")
    assert srun[-7:] == ["--save", str(save), "--train-iters", "100", "--exit-signal-handler", "--load", str(save)]

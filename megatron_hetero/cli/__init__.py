"""`megatron-hetero` command line: one module per subcommand, one `main`.

Exit codes: 0 ok, 2 invalid input (`megatron-hetero CMD: invalid input: MESSAGE` on stderr, one
paragraph, no traceback; argparse's own usage errors exit 2 too), 1 runtime failure (a
`CommandFailed` prints `megatron-hetero CMD: MESSAGE`, one line naming the cause and what to do;
anything else prints `megatron-hetero CMD: internal error: TYPE: MESSAGE`). Tracebacks (a
`CommandFailed`'s `details`, an unexpected exception's traceback) never reach the terminal unless
`--debug` is given (before or after the subcommand): they go to `megatron-hetero-error.log` in the
command's `--save` directory, else beside its `--log-jsonl`, else in a new file of the system's
temporary directory, whose path the line names (`cli/failure.py`).

A subcommand is a module `megatron_hetero.cli.<module>` listed in `SUBCOMMANDS` that defines
    NAME: str                                   the subcommand as typed (`megatron-lm` for megatron_lm)
    add_parser(subparsers) -> ArgumentParser    subparsers.add_parser(NAME, ...) and its flags
    run(args) -> int                            parse-level checks, call the domain packages, print;
                                                raise ValueError for invalid input, CommandFailed for
                                                a failure with a one-line reason; return the exit code
and, if it builds or runs Megatron models,
    USES_MEGATRON = True                        `run_command` applies `megatron_hetero.compat` (once,
                                                before `run`): the CLI is the entry point that does,
                                                also for every rank under torchrun/srun
    precheck(args) -> None                      optional: pure input checks (no torch) that
                                                `run_command` runs BEFORE compat imports torch and
                                                Megatron-core (~10 s of CPU here), so that input
                                                fails at once (ValueError: exit 2)
Importing a subcommand module must not import torch (the parser of every subcommand is built on
each call); import domain code inside `run`. Shared flags: `cli.model_flags`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Optional, Sequence

EXIT_OK, EXIT_FAILURE, EXIT_INVALID = 0, 1, 2

# Module names under megatron_hetero.cli, in `--help` order. Adding a subcommand is one entry here.
SUBCOMMANDS: tuple[str, ...] = (
    "plan",
    "train",
    "dryrun",
    "schedule",
    "profile",
    "search",
    "bench",
    "slurm",
    "data",
    "checkpoint",
    "convert",
    "timeline",
    "megatron_lm",
)


class CommandFailed(Exception):
    """A runtime failure the subcommand explains in one line (exit 1, no traceback); `details`: the
    full text behind it (e.g. every rank's traceback), written to the log file or, with `--debug`,
    to stderr."""

    def __init__(self, message: str, details: Optional[str] = None) -> None:
        super().__init__(message)
        self.details = details


def subcommand_modules() -> dict[str, ModuleType]:
    """NAME -> module of every registered subcommand."""
    mods = [importlib.import_module(f"{__name__}.{name}") for name in SUBCOMMANDS]
    return {m.NAME: m for m in mods}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-hetero", description="Per-module parallel layouts for multimodal training on Megatron-core."
    )
    debug_help = "on failure, print the full tracebacks on stderr (default: to a log file the error line names)"
    parser.add_argument("--debug", action="store_true", help=debug_help)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for mod in subcommand_modules().values():
        p = mod.add_parser(sub)
        # also after the subcommand; SUPPRESS: not given there, the top-level value stays
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    return parser


def _report(name: str, line: str, details: Optional[str], args: argparse.Namespace) -> None:
    """Print the failure's one line on stderr; `details` (tracebacks) go before it with --debug, else
    to the log file the line names (`cli/failure.py`)."""
    if details:
        if getattr(args, "debug", False):
            print(details.rstrip(), file=sys.stderr)
        else:
            from megatron_hetero.cli.failure import write_log

            log_jsonl = getattr(args, "log_jsonl", None)
            dirs = (getattr(args, "save", None), str(Path(log_jsonl).parent) if log_jsonl else None)
            path = write_log(details, dirs)
            line += (
                f" [tracebacks: {path}; or rerun with --debug]" if path else " [rerun with --debug for the tracebacks]"
            )
    print(f"megatron-hetero {name}: {line}", file=sys.stderr, flush=True)


def _silence_stdout() -> None:
    import os

    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # stdout without a file descriptor (captured): nothing to flush
        pass


def run_command(name: str, args: argparse.Namespace) -> int:
    """Run subcommand `name` on parsed `args`, mapping exceptions to exit codes (see module docstring)."""
    mod = subcommand_modules()[name]
    try:
        precheck = getattr(mod, "precheck", None)
        if precheck is not None:
            precheck(args)
        if getattr(mod, "USES_MEGATRON", False):
            from megatron_hetero.compat import UnsupportedMegatronVersion, apply_compat
            from megatron_hetero.training.job import quiet_upstream_warnings

            quiet_upstream_warnings()  # before Megatron is imported (its import-time warnings too)
            try:
                apply_compat()
            except UnsupportedMegatronVersion as exc:
                raise CommandFailed(str(exc)) from None
        return int(mod.run(args) or EXIT_OK)
    except CommandFailed as exc:
        _report(name, str(exc), exc.details, args)
        return EXIT_FAILURE
    except ValueError as exc:
        print(f"megatron-hetero {name}: invalid input: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except KeyboardInterrupt:
        return EXIT_FAILURE
    except BrokenPipeError:  # the reader went away (`... | head`): no traceback, stdout is gone
        _silence_stdout()
        return EXIT_FAILURE
    except Exception as exc:  # noqa: BLE001 - the CLI reports any unexpected failure with exit 1
        if hasattr(exc, "failures") and hasattr(exc, "killed"):  # the fork launcher's RankFailure (any command)
            from megatron_hetero.cli.failure import rank_failure_line

            line = "failed: " + rank_failure_line(exc.failures, exc.killed, getattr(args, "save", None))
            _report(name, line, str(exc), args)
            return EXIT_FAILURE
        first = (str(exc).strip().splitlines() or [""])[0]
        _report(name, f"internal error: {type(exc).__name__}: {first}", traceback.format_exc(), args)
        return EXIT_FAILURE


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The `megatron-hetero` console script; returns the exit code (argparse errors raise SystemExit(2))."""
    args = build_parser().parse_args(None if argv is None else list(argv))
    return run_command(args.command, args)


__all__ = [
    "CommandFailed",
    "EXIT_FAILURE",
    "EXIT_INVALID",
    "EXIT_OK",
    "SUBCOMMANDS",
    "build_parser",
    "main",
    "run_command",
    "subcommand_modules",
]

"""The entry point: build the parser from the argument table, dispatch to a subcommand and map
its outcome to an exit status (`models.cli.errors.EXIT_STATUSES`)."""

from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import sys
from collections.abc import Callable, Sequence

from models.cli.bench import bench
from models.cli.bringup import bringup
from models.cli.diagram import MACHINES, lifecycle_diagram
from models.cli.errors import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_STATUSES,
    EXIT_USAGE,
    PROG,
    PipeClosed,
    UsageError,
    print_error,
    report,
)
from models.cli.generate import generate
from models.cli.options import OPTION_OVERRIDES, OPTIONS, SUBCOMMAND_OPTIONS, HelpFormatter

SUBCOMMANDS: dict[str, tuple[str, str, Callable[[argparse.Namespace], int]]] = {
    "generate": (
        "generate text (continuous batching, prefix cache, streaming)",
        "Generate completions. One prompt streams its text; several print each completion as "
        "it finishes; --json prints JSON lines.",
        generate,
    ),
    "bringup": (
        "step through every phase with timings, coverage and the journal",
        "Run every lifecycle phase one call at a time, with a table, the coverage manifest "
        "and the journal; --fault rehearses failures.",
        bringup,
    ),
    "bench": (
        "decode-only and end-to-end tokens/s (and transformers' with --compare)",
        "Measure generation throughput per batch size (models/benchmark/); each "
        "phase is announced on stderr with its estimated length.",
        bench,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The whole command-line surface, built from OPTIONS and SUBCOMMAND_OPTIONS."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="An execution runtime for LLM inference.",
        epilog=EXIT_STATUSES,
        formatter_class=HelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)

    lifecycle = commands.add_parser(
        "lifecycle", help="inspect the lifecycle state machines", epilog=EXIT_STATUSES
    )
    lifecycle_commands = lifecycle.add_subparsers(dest="lifecycle_command", required=True)
    diagram = lifecycle_commands.add_parser(
        "diagram",
        help="print a machine as mermaid text, the current state highlighted",
        formatter_class=HelpFormatter,
        epilog=EXIT_STATUSES,
    )
    diagram.add_argument(
        "--machine", choices=sorted(MACHINES), default="host", help="which state machine"
    )
    diagram.add_argument(
        "--current", default=None, help="state to highlight (default: the initial state)"
    )
    diagram.add_argument("--debug", **OPTIONS["--debug"])
    diagram.set_defaults(handler=lifecycle_diagram)

    for name, (summary, description, handler) in SUBCOMMANDS.items():
        sub = commands.add_parser(
            name,
            help=summary,
            description=description,
            epilog=EXIT_STATUSES,
            formatter_class=HelpFormatter,
        )
        for flag in SUBCOMMAND_OPTIONS[name]:
            sub.add_argument(flag, **{**OPTIONS[flag], **OPTION_OVERRIDES.get((name, flag), {})})
        sub.set_defaults(handler=handler, command_name=name)
    return parser


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse, dispatch, map failures to exit statuses (EXIT_STATUSES)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    debug = bool(getattr(args, "debug", False))
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.DEBUG if debug else logging.WARNING,
            format=f"{PROG}: %(levelname)s: %(message)s",
        )
    try:
        status: int = args.handler(args)
    except UsageError as error:
        report(error, debug)
        return EXIT_USAGE
    except PipeClosed:
        _silence_stdout()
        return EXIT_OK
    except BrokenPipeError as error:
        if _stdout_closed():  # any subcommand piped into `head`: stop quietly
            _silence_stdout()
            return EXIT_OK
        report(error, debug, prefix=f"{type(error).__name__}: ")
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print_error("interrupted")
        return EXIT_INTERRUPTED
    except Exception as error:
        report(error, debug, prefix=f"{type(error).__name__}: ")
        return EXIT_FAILURE
    return status


def _stdout_closed() -> bool:
    """Whether stdout's reader went away (a broken pipe elsewhere is a real failure).

    A pipe whose read end is closed polls as an error condition on its write end.
    """
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll(), or stdout is not a real file
        return False


def run() -> None:
    """Console-script wrapper: exit with `main`'s status.

    A Ctrl-C that lands after `main` handled its own (while it returns, or while lane
    workers are joined at exit) still ends with status 130 and one line, not a traceback.
    """
    try:
        status = main()
    except KeyboardInterrupt:
        print_error("interrupted")
        status = EXIT_INTERRUPTED
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the rest is interpreter teardown
    sys.exit(status)

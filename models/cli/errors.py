"""Exit statuses and the one-line error report every subcommand shares.

A subcommand raises `UsageError` for bad input (exit 2, nothing ran) and `PipeClosed` when
stdout's reader went away; `models.cli.main` maps those and any other failure to a status.
"""

from __future__ import annotations

import sys
import traceback

PROG = "llm-runtime"
EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_STATUSES = (
    "exit status: 0 ok; 2 bad input (arguments, files, models: nothing ran); 1 runtime "
    "failure; 130 interrupted (Ctrl-C: what finished was printed)"
)


class UsageError(Exception):
    """Bad arguments or a missing model: exit status 2."""


class PipeClosed(Exception):
    """stdout's reader went away (e.g. `| head`): stop quietly."""


def one_line(error: BaseException | str) -> str:
    """An error's text on one line (the report is always a single stderr line)."""
    text = error if isinstance(error, str) else (str(error) or type(error).__name__)
    return " ".join(text.split())


def print_error(message: BaseException | str) -> None:
    print(f"{PROG}: error: {one_line(message)}", file=sys.stderr)


def report(error: BaseException, debug: bool, *, prefix: str = "") -> None:
    """One line on stderr; the traceback too with --debug (else a hint that it exists)."""
    if debug:
        traceback.print_exception(error, file=sys.stderr)
    hint = (
        "" if debug or isinstance(error, UsageError) else " (rerun with --debug for the traceback)"
    )
    print_error(f"{prefix}{error}{hint}")

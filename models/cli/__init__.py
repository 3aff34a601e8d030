"""The `llm-runtime` command.

Subcommands are small functions over one argparse parser built from a table of options
(`OPTIONS`, `SUBCOMMAND_OPTIONS`); each returns an exit status (0 ok, 2 bad input: arguments,
files, models, checked before any work; 1 runtime failure; 130 interrupted), and errors go to
stderr as one line naming the flag, the value and what is allowed (`--debug`: traceback).
Progress goes to stderr (`models.progress`), only on a terminal unless `--progress always`.

* `lifecycle diagram`: a state machine as mermaid text.
* `generate`: continuous-batching generation (streams one prompt; JSON lines with `--json`).
* `bringup`: every phase one call at a time, with a table, the coverage manifest and the
  journal; rehearses failures with `--fault`.
* `bench`: decode-only and end-to-end throughput against Hugging Face transformers
  (models/benchmark/).

Layout: `options` (the argument table) and `argument_types` (its parsers); `main` (parser and
dispatch); one module per subcommand (`diagram`, `generate`, `bringup`, `bench`) with its
printing beside it (`generate_output`, `bringup_report`); `loading` (argument checks and
executor loading the subcommands share); `errors` (exit statuses, the one-line report).
"""

from models.cli.main import build_parser, main, run
from models.cli.options import OPTIONS, SUBCOMMAND_OPTIONS

__all__ = ["OPTIONS", "SUBCOMMAND_OPTIONS", "build_parser", "main", "run"]

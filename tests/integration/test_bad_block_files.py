"""Damaged GGUF block files are refused by the CLI before anything is allocated: exit 2,
naming the file, the tensor and its type (fixtures from `tests.gguf_files`)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from models.decoder import random_state_dict
from models.llama import LlamaArgs
from tests.gguf_files import (
    BadFile,
    write_misaligned_rows_gguf,
    write_truncated_gguf,
    write_unknown_type_gguf,
)

ARGS = LlamaArgs.tiny_random("q256")
CASES: dict[str, tuple[Callable[..., BadFile], str]] = {
    "truncated": (write_truncated_gguf, r"truncated"),
    "misaligned": (write_misaligned_rows_gguf, r"not a multiple of the type's block"),
    "unknown type": (write_unknown_type_gguf, r"unknown type code 99"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_block_file_exits_2_naming_file_and_tensor(tmp_path: Path, case: str) -> None:
    writer, pattern = CASES[case]
    # Misaligned rows need a row length that is no multiple of 256: the 64-wide preset.
    args = LlamaArgs.tiny_random("gqa") if case == "misaligned" else ARGS
    bad = writer(tmp_path / "bad.gguf", args, random_state_dict(args, seed=1))
    command = [sys.executable, "-m", "models.cli", "generate", "--model", str(bad.path)]
    done: Any = subprocess.run(
        [*command, "--prompt", "hi", "--max-new-tokens", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert str(bad.path) in done.stderr and bad.tensor in done.stderr, done.stderr
    assert __import__("re").search(pattern, done.stderr), done.stderr
    assert "warm" not in done.stderr.lower() and "allocate" not in done.stderr, done.stderr

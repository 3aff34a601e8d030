"""A large `--max-batch` is never silent: it starts with a line per warmup case (i/n), or is
refused before anything loads (exit 2, naming the flag) where the slots cannot be given one
KV block each."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from models.cli import main
from models.cli.errors import UsageError
from models.cli.loading import check_slot_capacity, model_args

REPO = Path(__file__).resolve().parents[2]
TINY = ["generate", "--model", "tiny-random", "--prompt", "hi", "--max-new-tokens", "2"]


def test_a_large_batch_prints_each_warmup_case_before_it_finishes() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "models.cli", *TINY, "--max-batch", "2048", "--progress", "always"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    err = done.stderr
    for operation in ("prefill", "decode"):
        found = [
            (int(i), int(n))
            for i, n in re.findall(rf"^warmup {operation} (\d+)/(\d+): ", err, re.M)
        ]
        assert found, err
        total = found[0][1]
        assert found == [(i, total) for i in range(1, total + 1)], err
    assert "warmup decode 1/" in err and "decode batch=2048" in err
    assert "derive warmup coverage: done" in err and "measure kernels" in err
    # The per-case lines come before the run's result.
    assert err.index("warmup decode 1/") < err.index("tokens/s")


def test_more_slots_than_blocks_is_refused_naming_both_flags(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status = main([*TINY, "--max-batch", "16", "--num-blocks", "4"])
    err = capsys.readouterr().err
    assert status == 2
    assert "--num-blocks 4 is too small for --max-batch 16" in err
    assert "allowed is --num-blocks >= 16, or --max-batch <= 4" in err
    assert "load model" not in err
    # Per lane: 16 slots over 2 lanes are 8 per lane, and --num-blocks is per lane.
    status = main([*TINY, "--max-batch", "16", "--num-blocks", "8", "--lanes", "2"])
    assert status == 0, capsys.readouterr().err


def test_slots_beyond_host_memory_are_refused_at_the_boundary(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status = main([*TINY, "--max-batch", str(10**9)])
    err = capsys.readouterr().err
    assert status == 2
    assert f"--max-batch {10**9} is invalid" in err
    assert "needs at least one KV block of its own" in err and "allowed is 1.." in err


def _args(max_batch: int, lanes: int = 1) -> argparse.Namespace:
    return argparse.Namespace(
        model="tiny-random",
        max_batch=max_batch,
        lanes=lanes,
        num_blocks=None,
        device="cpu",
        dtype="float32",
        block_size=32,
    )


def test_the_memory_bound_is_one_block_per_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    import runtime.backends.memory as memory

    model = model_args("tiny-random")
    per_block = 2 * model.n_layers * model.n_kv_heads * model.head_dim * 32 * 4
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 100 * per_block)
    check_slot_capacity(_args(100), model)  # exactly fits: accepted
    with pytest.raises(UsageError, match=r"--max-batch 101 is invalid.*allowed is 1\.\.100$"):
        check_slot_capacity(_args(101), model)
    with pytest.raises(UsageError, match=r"allowed is 1\.\.96 \(a multiple of --lanes 8\)"):
        check_slot_capacity(_args(104, lanes=8), model)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: None)
    check_slot_capacity(_args(10**9), model)  # the platform does not say: nothing to bound

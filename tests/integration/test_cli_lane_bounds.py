"""`--lanes` is never silent: lanes the host cannot hold are refused before anything starts
(exit 2, naming the flag and the arithmetic), and process lanes report their start-up, load
and warmup lines while they run."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import runtime.backends.memory as memory
from models.cli import main
from models.cli.errors import UsageError
from models.cli.lane_bounds import check_lane_memory, process_base_bytes, weight_bytes
from models.cli.loading import model_args
from models.decoder.model import DecoderModel

REPO = Path(__file__).resolve().parents[2]
TINY = ["generate", "--model", "tiny-random", "--prompt", "hi", "--max-new-tokens", "2"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_bytes_are_the_models_parameters(dtype: torch.dtype) -> None:
    args = model_args("tiny-random")
    model = DecoderModel(args, dtype=dtype)
    want = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_bytes(args, str(dtype).removeprefix("torch.")) == want


def _args(lanes: int, transport: str) -> argparse.Namespace:
    return argparse.Namespace(
        model="tiny-random", lanes=lanes, lane_transport=transport, device="cpu", dtype="float32"
    )


def test_the_bound_is_workers_plus_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    model = model_args("tiny-random")
    weights = weight_bytes(model, "float32")
    worker = weights + process_base_bytes()
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 8 * worker + 1)
    check_lane_memory(_args(8, "process"), model)  # fits: accepted
    with pytest.raises(UsageError, match=r"--lanes 9 is invalid: each process lane .* allowed is"):
        check_lane_memory(_args(9, "process"), model)
    # In-process lanes share this interpreter: only their weights count.
    check_lane_memory(_args(9, "inprocess"), model)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 3 * weights)
    with pytest.raises(UsageError, match=r"its own copy of the weights .* --lanes 1\.\.3 "):
        check_lane_memory(_args(4, "inprocess"), model)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: None)
    check_lane_memory(_args(10**6, "process"), model)  # the platform does not say: unbounded


def test_too_many_lanes_exit_2_before_any_lane_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 2 * 1024**3)
    status = main([*TINY, "--lanes", "64", "--max-batch", "64", "--progress", "always"])
    err = capsys.readouterr().err
    assert status == 2
    assert "--lanes 64 is invalid" in err and "this host has 2.1 GB available" in err
    assert "start 64 lane processes" not in err and "load model" not in err


def test_process_lanes_report_start_up_load_and_warmup() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "models.cli",
            *TINY,
            "--lanes",
            "2",
            "--max-batch",
            "2",
            "--trace",
            "decode_only",
            "--progress",
            "always",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0].startswith("start 2 lane processes: each worker imports torch"), lines
    for want in ("lane 0: load model tiny-random: done", "lane 0: warmup decode 1/"):
        assert any(line.startswith(want) for line in lines), done.stderr
    # Whole lines only: a worker's line never shares a line with another process's.
    assert all(line.count("lane 0: ") <= 1 for line in lines), done.stderr
    start = next(i for i, line in enumerate(lines) if "lane 0: warmup decode 1/" in line)
    assert start < next(i for i, line in enumerate(lines) if "tokens/s" in line)


def test_ctrl_c_while_process_lanes_start_exits_130_without_worker_tracebacks() -> None:
    command = [sys.executable, "-m", "models.cli", *TINY, "--lanes", "2", "--max-batch", "2"]
    process = subprocess.Popen(
        [*command, "--progress", "always"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        start_new_session=True,  # its own process group: the signal reaches the workers too
    )
    assert process.stderr is not None
    first = process.stderr.readline()
    assert first.startswith("start 2 lane processes:"), first
    time.sleep(1.0)  # the workers are importing torch
    os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends
    _, rest = process.communicate(timeout=120)
    assert process.returncode == 130, rest
    assert "Traceback" not in rest and "KeyboardInterrupt" not in rest, rest
    assert "start 2 lane processes 0/2: stopped after" in rest, rest
    assert rest.rstrip().endswith("llm-runtime: error: interrupted"), rest

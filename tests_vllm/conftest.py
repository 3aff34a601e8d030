"""Fixtures of the vLLM end-to-end tests: the HF folders vLLM serves, and the CLI oracle."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAIN_VENV_CLI = ROOT / ".venv" / "bin" / "llm-runtime"
INSTALL_HINT = "install vLLM and this plugin with `make vllm`, then run `make test-vllm`"

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        f"vLLM is not installed in this environment; {INSTALL_HINT}", allow_module_level=True
    )


def cli() -> list[str]:
    """The `llm-runtime` command: this environment's, else the main venv's."""
    local = Path(sys.executable).with_name("llm-runtime")
    return [str(local if local.exists() else MAIN_VENV_CLI)]


def generate_oracle(
    model: str, prompts: list[str], max_new_tokens: int, *extra: str
) -> list[dict[str, Any]]:
    """`llm-runtime generate --json *extra` for `prompts` (greedy): prompt and generated ids."""
    command = [*cli(), "generate", "--model", model, "--max-new-tokens", str(max_new_tokens)]
    for prompt in prompts:
        command += ["--prompt", prompt]
    command += ["--json", "--temperature", "0", *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return sorted((r for r in rows if "index" in r), key=lambda r: r["index"])


def run_offline(tmp: Path, model: Path, requests: list[dict[str, Any]], *extra: str) -> Any:
    """`python -m models.vllm_plugin.offline` in a fresh process; its JSON report."""
    request_file, out = tmp / "requests.json", tmp / "report.json"
    request_file.write_text(json.dumps(requests))
    command = [sys.executable, "-m", "models.vllm_plugin.offline", "--model", str(model)]
    command += ["--requests", str(request_file), "--out", str(out), *extra]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=900, check=False, cwd=ROOT, env=env
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-6000:])
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from models.vllm_plugin.hf_folder import write_hf_folder

    return write_hf_folder("tiny-random", tmp_path_factory.mktemp("tiny-random-hf"))


@pytest.fixture(scope="session")
def smollm2_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from models.decoder.sources import ModelNotAvailableError, smollm2_gguf_path
    from models.vllm_plugin.hf_folder import write_hf_folder

    try:
        smollm2_gguf_path()
    except ModelNotAvailableError as error:
        pytest.skip(str(error))
    return write_hf_folder("smollm2-135m", tmp_path_factory.mktemp("smollm2-hf"))

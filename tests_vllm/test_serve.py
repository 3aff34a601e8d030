"""`vllm serve` through the plugin on 127.0.0.1: start, one completion, clean shutdown.

The server runs as `python -m models.vllm_plugin.cli serve` (`tests_vllm.serving`).
"""

from __future__ import annotations

from pathlib import Path

from tests_vllm.conftest import generate_oracle
from tests_vllm.serving import assert_family_gone, request, running_server


def test_vllm_serve_completion_and_clean_shutdown(tmp_path: Path, tiny_folder: Path) -> None:
    oracle = generate_oracle("tiny-random", ["hello world"], 8)[0]
    log = tmp_path / "serve.log"
    extra = ("--skip-tokenizer-init", "--max-num-seqs", "4", "--served-model-name", "tiny")
    with running_server(tiny_folder, log, *extra) as server:
        family = server.family
        reply = request(
            server.base + "/v1/completions",
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
    assert len(family) >= 2, "the engine core should run in its own process"
    assert_family_gone(server)

"""`vllm serve` through the plugin on 127.0.0.1: start, one completion, clean shutdown.

The server runs as `python -m models.vllm_plugin.cli serve` (`tests_vllm.serving`).
"""

from __future__ import annotations

import json
import time
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


def test_vllm_serve_on_the_wheels_gguf_keeps_its_blocks_and_equals_generate_stored(
    tmp_path: Path, smollm2_folder: Path
) -> None:
    """The Q4_1 GGUF served through the plugin: the projections stay in their blocks (the
    worker's counters say so) and the greedy tokens equal `generate --weights stored`."""
    prompt = "The three primary colours are"
    oracle = generate_oracle("smollm2-135m", [prompt], 12, "--weights", "stored")[0]
    stats_file = tmp_path / "stats.json"
    settings = {"stats_interval_s": 0.5, "stats_file": str(stats_file)}
    extra = (
        "--max-num-seqs", "2",
        "--max-model-len", "256",
        "--served-model-name", "smollm2",
        "--additional-config", json.dumps({"llm_runtime": settings}),
    )  # fmt: skip
    payload = {
        "model": "smollm2",
        "prompt": oracle["prompt_token_ids"],
        "max_tokens": 12,
        "temperature": 0,
        "return_token_ids": True,
    }
    with running_server(smollm2_folder, tmp_path / "serve.log", *extra) as server:
        reply = request(server.base + "/v1/completions", payload, timeout=300)
        time.sleep(1.0)  # the next request's first step reports the counters (stats_file)
        request(server.base + "/v1/completions", {**payload, "max_tokens": 1}, timeout=300)
    assert_family_gone(server)
    assert reply["choices"][0]["token_ids"] == oracle["token_ids"], (reply, oracle)
    stats = json.loads(stats_file.read_text())["stats"]
    # 30 layers x (wqkv, wo, w13, w2) held as blocks, about 100 MB rather than 540 MB of float32.
    assert stats["block_weight_projections"] >= 120, stats
    assert stats["weight_bytes"] < 150e6, stats

"""vLLM's sleep mode through the plugin: `LLM(enable_sleep_mode=True)` and `vllm serve
--enable-sleep-mode`'s endpoints drive the facade's drain, sleep, staged wake and reload.

The tokens after a sleep/wake (and, at level 2, a reload) equal those before and those of
`llm-runtime generate`; the engine says it sleeps until the KV cache is awake again.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests_vllm.conftest import generate_oracle, run_offline
from tests_vllm.serving import assert_family_gone, request, request_status, running_server
from tests_vllm.test_offline import assert_same_tokens, requests_from, tiny_prompts


def test_llm_sleep_wake_and_reload_between_two_generates(tmp_path: Path, tiny_folder: Path) -> None:
    oracle = generate_oracle("tiny-random", tiny_prompts()[:4], 8)
    report = run_offline(
        tmp_path,
        tiny_folder,
        requests_from(oracle, 8, [2]),
        "--sleep-cycle", "2",
        "--trace-mode", "decode_only",
        "--max-num-seqs", "4",
    )  # fmt: skip
    first, second = report["runs"][0]["outputs"], report["runs"][-1]["outputs"]
    assert second == first
    assert_same_tokens(report, oracle)
    cycle = report["sleep_cycle"]
    assert cycle["sleeping_after_sleep"] and cycle["sleeping_after_wake_weights"], cycle
    assert cycle["sleeping_after_reload"], cycle  # reload keeps the KV stage asleep
    assert not cycle["sleeping_after_wake_kv_cache"], cycle


def test_serve_sleep_endpoints_drive_the_worker(tmp_path: Path, tiny_folder: Path) -> None:
    oracle = generate_oracle("tiny-random", ["hello world"], 8)[0]
    extra = ("--skip-tokenizer-init", "--max-num-seqs", "2", "--served-model-name", "tiny")
    env = {"VLLM_SERVER_DEV_MODE": "1"}  # vLLM serves /sleep, /wake_up only in dev mode
    payload = {
        "model": "tiny",
        "prompt": oracle["prompt_token_ids"],
        "max_tokens": 8,
        "temperature": 0,
        "return_token_ids": True,
        "stop_token_ids": [2],
    }
    log = tmp_path / "serve.log"
    with running_server(tiny_folder, log, "--enable-sleep-mode", *extra, env=env) as server:
        base = server.base
        before = request(base + "/v1/completions", payload, timeout=120)
        assert request(base + "/is_sleeping")["is_sleeping"] is False
        assert request_status(base + "/sleep?level=1", {})[0] == 200
        assert request(base + "/is_sleeping")["is_sleeping"] is True
        status, body = request_status(base + "/wake_up?tags=weights", {})
        assert status == 200 and body["status"] == "sleeping", body
        status, body = request_status(base + "/wake_up?tags=kv_cache", {})
        assert status == 200 and body["status"] == "awake", body
        after = request(base + "/v1/completions", payload, timeout=120)
        status, body = request_status(base + "/collective_rpc", {"method": "runtime_stats"})
        assert status == 200, body
    assert_family_gone(server)
    assert before["choices"][0]["token_ids"] == oracle["token_ids"], (before, oracle)
    assert after["choices"][0]["token_ids"] == oracle["token_ids"], (after, oracle)
    text = log.read_text()
    assert "llm-runtime asleep (level 1)" in text and "llm-runtime woke" in text, text[-3000:]
    assert json.dumps(body)  # the worker's counters reach the client (dev mode)

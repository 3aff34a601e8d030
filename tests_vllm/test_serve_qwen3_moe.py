"""`vllm serve` on a tiny Qwen3-MoE folder through the plugin equals `llm-runtime generate`.

The folder is built with transformers' own `Qwen3MoeConfig` / `Qwen3MoeForCausalLM`
(`tests.models.qwen3_moe_checkpoint`); nothing names the family: the plugin finds it in the
registry from the config's `Qwen3MoeForCausalLM`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests_vllm.conftest import generate_oracle
from tests_vllm.serving import assert_family_gone, request, running_server


@pytest.fixture(scope="module")
def qwen3_moe_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.models.qwen3_moe_checkpoint import write_tiny_qwen3_moe

    folder, _ = write_tiny_qwen3_moe(tmp_path_factory.mktemp("qwen3-moe-hf") / "tiny-qwen3-moe")
    return folder


def test_vllm_serve_on_tiny_qwen3_moe_equals_generate(
    tmp_path: Path, qwen3_moe_folder: Path
) -> None:
    from tests.models.qwen3_checkpoint import EOS_ID

    prompts = ["hello experts", "the runtime routes each token to two of eight"]
    oracles = generate_oracle(str(qwen3_moe_folder), prompts, 10)
    extra = ("--skip-tokenizer-init", "--max-num-seqs", "4", "--served-model-name", "qwen3-moe")
    with running_server(qwen3_moe_folder, tmp_path / "serve.log", *extra) as server:
        for oracle in oracles:
            reply = request(
                server.base + "/v1/completions",
                {
                    "model": "qwen3-moe",
                    "prompt": oracle["prompt_token_ids"],
                    "max_tokens": 10,
                    "temperature": 0,
                    "return_token_ids": True,
                    "stop_token_ids": [EOS_ID],
                },
                timeout=120,
            )
            choice = reply["choices"][0]
            assert choice["token_ids"] == oracle["token_ids"], (choice, oracle)
        log = server.log_text()
        assert "llm-runtime" in log or "llm_runtime" in log
    assert_family_gone(server)

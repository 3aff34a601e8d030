"""`vllm serve` on a tiny Qwen3-MoE folder through the plugin equals `llm-runtime generate`.

The folder is built with transformers' own `Qwen3MoeConfig` / `Qwen3MoeForCausalLM`
(`tests.models.qwen3_moe_checkpoint`); nothing names the family: the plugin finds it in the
registry from the config's architecture.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests_vllm.serving import assert_serve_equals_generate


def test_vllm_serve_on_tiny_qwen3_moe_equals_generate(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from tests.models.qwen3_checkpoint import EOS_ID
    from tests.models.qwen3_moe_checkpoint import write_tiny_qwen3_moe

    folder, _ = write_tiny_qwen3_moe(tmp_path_factory.mktemp("qwen3-moe-hf") / "tiny-qwen3-moe")
    prompts = ["hello experts", "the runtime routes each token to two of eight"]
    assert_serve_equals_generate(folder, tmp_path / "serve.log", prompts, "qwen3-moe", EOS_ID)

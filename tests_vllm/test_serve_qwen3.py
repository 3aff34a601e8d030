"""`vllm serve` on a tiny Qwen3 folder through the plugin equals `llm-runtime generate`.

The folder is built with transformers' own `Qwen3Config` / `Qwen3ForCausalLM`
(`tests.models.qwen3_checkpoint`); nothing names the family: the plugin finds it in the
registry from the config's architecture.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests_vllm.serving import assert_serve_equals_generate


def test_vllm_serve_on_tiny_qwen3_equals_generate(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from tests.models.qwen3_checkpoint import EOS_ID, write_tiny_qwen3

    folder, _ = write_tiny_qwen3(tmp_path_factory.mktemp("qwen3-hf") / "tiny-qwen3")
    prompts = ["hello qwen", "the runtime serves another family"]
    assert_serve_equals_generate(folder, tmp_path / "serve.log", prompts, "qwen3", EOS_ID)

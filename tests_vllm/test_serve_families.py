"""`vllm serve` on a tiny folder of each new family through the plugin equals `llm-runtime
generate`.

Each folder is built with transformers' own classes (`Qwen3Config` / `Qwen3ForCausalLM`,
`Qwen3MoeConfig` / `Qwen3MoeForCausalLM`: `tests.models.qwen3_checkpoint`,
`tests.models.qwen3_moe_checkpoint`); nothing names the family: the plugin finds it in the
registry from the config's architecture.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests_vllm.conftest import generate_oracle
from tests_vllm.serving import assert_family_gone, request, running_server


def _qwen3(folder: Path) -> Any:
    from tests.models.qwen3_checkpoint import write_tiny_qwen3

    return write_tiny_qwen3(folder)


def _qwen3_moe(folder: Path) -> Any:
    from tests.models.qwen3_moe_checkpoint import write_tiny_qwen3_moe

    return write_tiny_qwen3_moe(folder)


FAMILIES: dict[str, tuple[Callable[[Path], Any], list[str]]] = {
    "qwen3": (_qwen3, ["hello qwen", "the runtime serves another family"]),
    "qwen3-moe": (_qwen3_moe, ["hello experts", "the runtime routes each token to two of eight"]),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_vllm_serve_on_a_tiny_folder_equals_generate(
    family: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from tests.models.qwen3_checkpoint import EOS_ID

    write, prompts = FAMILIES[family]
    folder, _ = write(tmp_path_factory.mktemp(f"{family}-hf") / f"tiny-{family}")
    oracles = generate_oracle(str(folder), prompts, 10)
    extra = ("--skip-tokenizer-init", "--max-num-seqs", "4", "--served-model-name", family)
    with running_server(folder, tmp_path / "serve.log", *extra) as server:
        for oracle in oracles:
            reply = request(
                server.base + "/v1/completions",
                {
                    "model": family,
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

"""Which model family's vLLM facade serves a Hugging Face architecture."""

from __future__ import annotations

import importlib
from typing import Any

FACADES: dict[str, str] = {
    "LlamaForCausalLM": "models.llama.vllm:LlamaVLLMModel",
}


def facade_class(hf_config: Any) -> Any:
    """The facade class for `hf_config.architectures` (a clear error when there is none)."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    for name in architectures:
        target = FACADES.get(name)
        if target is not None:
            module, _, attribute = target.partition(":")
            return getattr(importlib.import_module(module), attribute)
    raise ValueError(
        f"llm-runtime has no vLLM facade for architectures {architectures}; supported are "
        f"{sorted(FACADES)} (serve other models with vLLM's own platform: "
        "LLM_RUNTIME_VLLM_PLATFORM=0)"
    )

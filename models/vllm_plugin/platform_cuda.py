"""vLLM's CUDA platform with this runtime's worker (where vLLM's CUDA wheel is installed)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.platforms.cuda import CudaPlatform

from models.vllm_plugin.platform import adapt_config, validate_sampling

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class LLMRuntimeCudaPlatform(CudaPlatform):
    """vLLM's CUDA platform, executing through `llm-runtime`'s torch CUDA backend."""

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        adapt_config(vllm_config, super().check_and_update_config)

    @classmethod
    def validate_request(cls, processed_inputs: Any, params: Any) -> None:
        super().validate_request(processed_inputs, params)
        validate_sampling(params)

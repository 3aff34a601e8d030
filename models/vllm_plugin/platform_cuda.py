"""vLLM's CUDA platform with this runtime's worker (where vLLM's CUDA wheel is installed).

Its own module because `vllm.platforms.cuda` is importable only on vLLM's CUDA build; the
behaviour is `RuntimePlatform`'s, shared with the CPU platform.
"""

from __future__ import annotations

from vllm.platforms.cuda import CudaPlatform

from models.vllm_plugin.platform import RuntimePlatform


class LLMRuntimeCudaPlatform(RuntimePlatform, CudaPlatform):  # type: ignore[misc]
    """vLLM's CUDA platform, executing through `llm-runtime`'s torch CUDA backend."""

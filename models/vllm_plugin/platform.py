"""The vLLM platforms of this runtime: vLLM's own CPU (or CUDA) platform with our worker.

Everything device-generic (distributed backend, memory queries, the CPU kernels vLLM's
sampler uses) stays vLLM's; the platform swaps in `LLMRuntimeWorker`, takes the runtime's
block size unless the user chose one, keeps vLLM's async scheduling where the facade
declares async decode (vLLM's CPU platform turns it off; `--no-async-scheduling` still
does), turns off what the worker does not do (vLLM's graph capture and compilation: the
runtime captures its own traces) and refuses requests whose sampling options the worker
would not honour.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.platforms.cpu import CpuPlatform

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

WORKER_CLS = "models.vllm_plugin.worker.LLMRuntimeWorker"
DEFAULT_BLOCK_SIZE = 32


def adapt_config(vllm_config: VllmConfig, parent_check: Any) -> None:
    """Run the parent platform's config checks, then the runtime's settings on top."""
    from vllm.config import CompilationMode
    from vllm.config.compilation import CUDAGraphMode

    # Imported here: this module loads while vLLM is still resolving its platform.
    parallel = vllm_config.parallel_config
    if parallel.worker_cls == "auto":
        parallel.worker_cls = WORKER_CLS
    cache = vllm_config.cache_config
    user_block_size = bool(cache.user_specified_block_size)
    # vLLM has resolved its default (on unless --no-async-scheduling) before this hook.
    wanted_async = bool(vllm_config.scheduler_config.async_scheduling)
    parent_check(vllm_config)
    if not user_block_size:
        cache.block_size = DEFAULT_BLOCK_SIZE
    vllm_config.scheduler_config.async_scheduling = async_scheduling(vllm_config, wanted_async)
    compilation = vllm_config.compilation_config
    compilation.mode = CompilationMode.NONE
    compilation.cudagraph_mode = CUDAGraphMode.NONE
    compilation.cudagraph_capture_sizes = []
    if vllm_config.model_config is not None:
        vllm_config.model_config.enforce_eager = True
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        size = getattr(parallel, name, 1)
        if size != 1:
            raise ValueError(
                f"--{name.replace('_', '-')} {size} is not supported by the llm-runtime worker "
                "(one device per engine); scale out with vLLM's --data-parallel-size instead"
            )
    if vllm_config.speculative_config is not None:
        raise ValueError("speculative decoding is not supported by the llm-runtime worker")
    check_settings(vllm_config)
    logger.info(
        "llm-runtime platform: worker %s, KV blocks of %d tokens",
        parallel.worker_cls,
        cache.block_size,
    )


def async_scheduling(vllm_config: VllmConfig, wanted: bool) -> bool:
    """vLLM's async scheduling: on where wanted and the model's facade declares async decode
    (its output is read after the next step is scheduled)."""
    model_config = vllm_config.model_config
    if not wanted or model_config is None:
        return False
    from models.vllm_plugin.facades import facade_class

    capabilities = getattr(facade_class(model_config.hf_config), "model_capabilities", None)
    declared = bool((capabilities or {}).get("supports_async_decode", False))
    if not declared:
        logger.info("llm-runtime worker: async scheduling off (the facade has no async decode)")
    return declared


def check_settings(vllm_config: VllmConfig) -> None:
    """Refuse a bad `additional_config` or dtype here, before any process or weight load."""
    import torch

    from models.vllm_plugin.settings import PluginSettings

    PluginSettings.from_additional_config(vllm_config.additional_config)
    model_config = vllm_config.model_config
    if model_config is not None and model_config.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(
            f"--dtype {str(model_config.dtype).removeprefix('torch.')} is not supported by the "
            "llm-runtime worker; allowed are float32 and bfloat16"
        )


def validate_sampling(params: Any) -> None:
    """Refuse a request whose sampling options the worker would not honour."""
    from vllm.sampling_params import SamplingParams

    from models.vllm_plugin.sampling import unsupported_options

    if isinstance(params, SamplingParams):
        found = unsupported_options(params)
        if found:
            raise ValueError(
                f"the llm-runtime vLLM worker does not support {', '.join(found)}; "
                "drop these options or serve with vLLM's own platform (VLLM_PLUGINS='')"
            )
    elif params is not None:
        raise ValueError("the llm-runtime vLLM worker serves generation only (no pooling)")


class RuntimePlatform:
    """What this runtime adds to a vLLM platform; mixed in before vLLM's class, whose checks
    run first (`super()` is the vLLM platform in the subclass's MRO)."""

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        adapt_config(vllm_config, super().check_and_update_config)  # type: ignore[misc]

    @classmethod
    def validate_request(cls, processed_inputs: Any, params: Any) -> None:
        super().validate_request(processed_inputs, params)  # type: ignore[misc]
        validate_sampling(params)


class LLMRuntimeCpuPlatform(RuntimePlatform, CpuPlatform):  # type: ignore[misc]
    """vLLM's CPU platform, executing through `llm-runtime`'s torch CPU backend."""

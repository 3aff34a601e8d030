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
from collections.abc import Callable
from typing import TYPE_CHECKING

from vllm.exceptions import VLLMValidationError
from vllm.platforms.cpu import CpuPlatform

from models.vllm_plugin.request_options import refusal_message, unsupported_options

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.inputs import EngineInput
    from vllm.pooling_params import PoolingParams
    from vllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

WORKER_CLS = "models.vllm_plugin.worker.LLMRuntimeWorker"
DEFAULT_BLOCK_SIZE = 32


def adapt_config(vllm_config: VllmConfig, parent_check: Callable[[VllmConfig], None]) -> None:
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


class UnsupportedRequestError(VLLMValidationError, ValueError):  # type: ignore[misc]
    """A request the worker would not honour: vLLM's validation error, so its OpenAI server
    answers HTTP 400 with this message (any other error there becomes an empty 500), and a
    `ValueError` for callers of `vllm.LLM`."""

    def __init__(self, message: str, *, parameter: str, value: object = None) -> None:
        VLLMValidationError.__init__(self, message, parameter=parameter, value=value)


def validate_sampling(params: SamplingParams | PoolingParams | None) -> None:
    """Refuse a request whose sampling options the worker would not honour
    (`request_options` holds the rule)."""
    from vllm.sampling_params import SamplingParams  # not at import: vLLM is still starting

    if isinstance(params, SamplingParams):
        found = unsupported_options(params)
        if found:
            first = found[0]
            raise UnsupportedRequestError(
                refusal_message(found),
                parameter=(first.asked_as or (first.parameter,))[0],
                value=first.value,
            )
    elif params is not None:
        raise UnsupportedRequestError(
            "the llm-runtime vLLM worker serves generation only (no pooling); serve pooling "
            "models with vLLM's own runner (LLM_RUNTIME_VLLM_PLATFORM=0)",
            parameter="task",
        )


class RuntimePlatform:
    """What this runtime adds to a vLLM platform; mixed in before vLLM's class, whose checks
    run first (`super()` is the vLLM platform in the subclass's MRO)."""

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        adapt_config(vllm_config, super().check_and_update_config)  # type: ignore[misc]

    def is_sleep_mode_available(self) -> bool:
        """`--enable-sleep-mode`: the worker's facade sleeps and wakes through its lifecycle
        (drain, sleep, staged wake, reload), whatever vLLM's platform would say."""
        return True

    @classmethod
    def validate_request(
        cls, processed_inputs: EngineInput | None, params: SamplingParams | PoolingParams | None
    ) -> None:
        super().validate_request(processed_inputs, params)  # type: ignore[misc]
        validate_sampling(params)


class LLMRuntimeCpuPlatform(RuntimePlatform, CpuPlatform):  # type: ignore[misc]
    """vLLM's CPU platform, executing through `llm-runtime`'s torch CPU backend."""

"""The plugin's platform: selected by vLLM, and refusing what the worker would not honour.

These build vLLM's configuration in this process (no engine starts), so they are quick.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar

import pytest


def engine_config(folder: Path, **options: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(folder), dtype=options.pop("dtype", "float32"), **options)
    return args.create_engine_config()


def test_vllm_selects_this_runtime_platform_and_worker(tiny_folder: Path) -> None:
    from vllm.platforms import current_platform

    from models.vllm_plugin.platform import LLMRuntimeCpuPlatform

    assert os.environ.get("LLM_RUNTIME_VLLM_PLATFORM", "1") != "0"
    assert isinstance(current_platform, LLMRuntimeCpuPlatform)
    config = engine_config(tiny_folder, skip_tokenizer_init=True)
    assert config.parallel_config.worker_cls == "models.vllm_plugin.worker.LLMRuntimeWorker"
    assert config.cache_config.block_size == 32  # the runtime's default block size
    assert config.model_config.enforce_eager is True


def test_async_scheduling_follows_the_facade_and_the_flag(
    tiny_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On where the facade declares async decode (vLLM's CPU platform would turn it off),
    off with vLLM's --no-async-scheduling or a facade without async decode."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from models.vllm_facade.facade import DecoderVLLMModel
    from models.vllm_plugin import facades

    assert DecoderVLLMModel.model_capabilities["supports_async_decode"] is True
    config = engine_config(tiny_folder, skip_tokenizer_init=True)
    assert config.scheduler_config.async_scheduling is True
    assert config.scheduler_config.get_scheduler_cls() is AsyncScheduler
    config = engine_config(tiny_folder, skip_tokenizer_init=True, async_scheduling=False)
    assert config.scheduler_config.async_scheduling is False

    class SyncOnlyFacade(DecoderVLLMModel):
        model_capabilities: ClassVar[dict[str, bool]] = {
            **DecoderVLLMModel.model_capabilities,
            "supports_async_decode": False,
        }

    monkeypatch.setattr(facades, "facade_class", lambda hf_config: SyncOnlyFacade)
    config = engine_config(tiny_folder, skip_tokenizer_init=True)
    assert config.scheduler_config.async_scheduling is False


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"additional_config": {"llm_runtime": {"trace_mode": "sometimes"}}},
            r"additional_config\['llm_runtime'\]\['trace_mode'\] must be one of",
        ),
        ({"dtype": "float16"}, r"--dtype float16 is not supported by the llm-runtime worker"),
    ],
)
def test_bad_settings_are_refused_before_any_engine_starts(
    tiny_folder: Path, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        engine_config(tiny_folder, skip_tokenizer_init=True, **options)


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"min_tokens": 3}, "min_tokens=3"),
        ({"prompt_logprobs": 1}, "prompt_logprobs=1"),
        ({"logit_bias": {5: 1.0}}, "logit_bias"),
        ({"min_p": 0.1}, "min_p=0.1"),
    ],
)
def test_requests_with_unimplemented_options_are_refused(
    params: dict[str, Any], named: str
) -> None:
    from vllm import SamplingParams

    from models.vllm_plugin.platform import LLMRuntimeCpuPlatform

    LLMRuntimeCpuPlatform.validate_request(None, SamplingParams(temperature=0.7, top_k=5))
    with pytest.raises(ValueError, match=rf"does not support {named}"):
        LLMRuntimeCpuPlatform.validate_request(None, SamplingParams(**params))


def test_device_sampling_follows_the_facade_and_the_setting(
    tiny_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On where the facade declares it, off on request; `true` is refused without it."""
    import torch

    from models.vllm_facade.facade import DecoderVLLMModel
    from models.vllm_plugin import model_runner
    from models.vllm_plugin.model_runner import LLMRuntimeModelRunner

    def runner(section: dict[str, Any]) -> LLMRuntimeModelRunner:
        config = engine_config(
            tiny_folder, skip_tokenizer_init=True, additional_config={"llm_runtime": section}
        )
        return LLMRuntimeModelRunner(config, torch.device("cpu"))

    assert DecoderVLLMModel.model_capabilities["supports_sample_on_device"] is True
    assert runner({}).device_sampling is True
    assert runner({"device_sampling": False}).device_sampling is False

    class HostOnlyFacade(DecoderVLLMModel):
        model_capabilities: ClassVar[dict[str, bool]] = {
            **DecoderVLLMModel.model_capabilities,
            "supports_sample_on_device": False,
        }

    monkeypatch.setattr(model_runner, "facade_class", lambda hf_config: HostOnlyFacade)
    assert runner({}).device_sampling is False
    with pytest.raises(ValueError, match=r"\['device_sampling'\] is true but the facade"):
        runner({"device_sampling": True})

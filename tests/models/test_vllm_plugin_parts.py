"""Parts of the vLLM plugin that need no vLLM: the HF folder writer and the plugin settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from models.decoder.sources import load_model
from models.vllm_plugin import ENABLE_ENV, register_platform
from models.vllm_plugin.hf_folder import write_hf_folder
from models.vllm_plugin.settings import PluginSettings


def test_hf_folder_round_trips_tiny_random_weights(tmp_path: Path) -> None:
    folder = write_hf_folder("tiny-random", tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "float32"
    original, reloaded = load_model("tiny-random"), load_model(str(folder))
    assert reloaded.args.n_layers == original.args.n_layers
    assert reloaded.args.eos_token_ids == original.args.eos_token_ids
    ours, theirs = original.model.state_dict(), reloaded.model.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_hf_folder_refuses_a_folder_and_a_bad_dtype(tmp_path: Path) -> None:
    folder = write_hf_folder("tiny-random", tmp_path / "hf")
    with pytest.raises(ValueError, match="already a Hugging Face folder"):
        write_hf_folder(folder, tmp_path / "again")
    with pytest.raises(ValueError, match=r"dtype must be one of \['float32', 'bfloat16'\]"):
        write_hf_folder("tiny-random", tmp_path / "x", dtype=torch.float16)


def test_settings_read_the_llm_runtime_section() -> None:
    assert PluginSettings.from_additional_config({}) == PluginSettings()
    settings = PluginSettings.from_additional_config(
        {"llm_runtime": {"trace_mode": "decode_only", "max_prefill_chunk_size": 512}, "other": 1}
    )
    assert settings == PluginSettings(trace_mode="decode_only", max_prefill_chunk_size=512)
    assert settings.device_sampling is None  # unset: on where the facade declares it
    off = PluginSettings.from_additional_config({"llm_runtime": {"device_sampling": False}})
    assert off.device_sampling is False


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"trace_mode": "sometimes"}, r"\['trace_mode'\] must be one of \['none', 'decode_only'"),
        ({"max_prefill_chunk_size": 0}, r"\['max_prefill_chunk_size'\] must be a positive"),
        ({"max_prefill_chunk_size": True}, r"must be a positive integer, got True"),
        ({"tracemode": "all"}, r"unknown keys \['tracemode'\]; allowed are"),
        ({"device_sampling": "off"}, r"\['device_sampling'\] must be true, false or null"),
        ({"device_sampling": 0}, r"\['device_sampling'\] must be true, false or null"),
    ],
)
def test_settings_errors_name_the_key(section: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PluginSettings.from_additional_config({"llm_runtime": section})


def test_platform_plugin_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENABLE_ENV, "0")
    assert register_platform() is None
    monkeypatch.setenv(ENABLE_ENV, "1")
    assert register_platform() in (
        "models.vllm_plugin.platform.LLMRuntimeCpuPlatform",
        "models.vllm_plugin.platform_cuda.LLMRuntimeCudaPlatform",
    )

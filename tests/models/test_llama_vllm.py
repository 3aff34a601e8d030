"""`DecoderVLLMModel` construction, capacity and argument checks (the engine-facing surface)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from lifecycle import Phase
from models.llama import LlamaArgs
from models.vllm_facade.engine_args import HUB_ALIASES, WEIGHTS_SOURCE_KEY, engine_model_name
from models.vllm_facade.facade import (
    DecodeOutput,
    DecoderVLLMModel,
    HostDecodeOutput,
)
from runtime.backends import TorchDevice

TINY = LlamaArgs.tiny_random()
HF: dict[str, Any] = {**TINY.to_hf_config(), "_name_or_path": "tiny-random"}
OPTIONS: dict[str, Any] = {"block_size": 4, "max_prefill_chunk_size": 32}


def build(**overrides: Any) -> DecoderVLLMModel:
    kwargs: dict[str, Any] = {"max_seq_len": 64, **OPTIONS}
    kwargs.update(overrides)
    return DecoderVLLMModel.initialize_vllm_model(HF, "cpu", 4, **kwargs)


def test_capabilities_are_declared() -> None:
    assert DecoderVLLMModel.model_capabilities == {
        "supports_prefix_caching": True,
        "supports_sample_on_device": True,
        "supports_async_decode": True,
        "supports_sleep_mode": True,
    }


def test_capacity_classmethods() -> None:
    tokens = DecoderVLLMModel.get_max_tokens_all_users(
        model_name="x", num_devices=1, tt_data_parallel=1, max_model_len=2048, max_num_seqs=8
    )
    assert tokens == 8 * 2048
    with pytest.raises(ValueError, match="max_num_seqs must be a positive integer"):
        DecoderVLLMModel.get_max_tokens_all_users(max_model_len=64, max_num_seqs=0)
    assert DecoderVLLMModel.get_kv_cache_spec(object()) is None


def test_initialize_builds_a_constructed_facade() -> None:
    model = build()
    assert model.phase is Phase.CONSTRUCTED
    assert model.max_batch_size == 4 and model.max_seq_len == 64
    assert model.kv_cache_dtype is torch.float32
    assert model.adapter.config.expected_num_layers == TINY.n_layers
    assert model.adapter.config.expected_kv_heads_per_device == TINY.n_kv_heads
    assert model.adapter.config.expected_head_dim == TINY.head_dim
    assert model.device.live_allocations == 0
    model.close()
    assert model.closed


def test_performance_optimizations_mean_bfloat16() -> None:
    model = build(optimizations="performance")
    assert model.kv_cache_dtype is torch.bfloat16
    with pytest.raises(ValueError, match="does not match the model-owned KV cache dtype"):
        model.allocate_kv_cache((32, 2, 4, 16), torch.float32, 2)
    assert model.phase is Phase.CONSTRUCTED
    model.close()


def test_a_runtime_device_is_used_as_is() -> None:
    device = TorchDevice("cpu")
    model = DecoderVLLMModel.initialize_vllm_model(HF, device, 2, max_seq_len=32, **OPTIONS)
    assert model.device is device
    model.close()


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        ({"max_batch_size": 0}, ValueError, "max_batch_size must be a positive integer"),
        ({"tt_data_parallel": 2}, ValueError, "tt_data_parallel=2 needs a lane group"),
        ({"optimizations": "fast"}, ValueError, "optimizations must be one of"),
        ({"max_seq_len": 100_000}, ValueError, "exceeds the model's maximum sequence length 512"),
        ({"max_seq_len": 0}, ValueError, "max_seq_len must be a positive integer"),
        ({"trace_mode": "sometimes"}, ValueError, "Unsupported trace mode: 'sometimes'"),
        ({"colour": "red"}, TypeError, r"unknown option\(s\) \['colour'\]; allowed options"),
        ({"block_size": 6}, ValueError, r"multiple of block_size \(6\)"),
        ({"device_sampling": 1}, TypeError, "device_sampling must be a bool"),
        ({"mesh_device": 3.5}, TypeError, "mesh_device must be None"),
        ({"hf_config": {**HF, "num_hidden_layers": 7}}, ValueError, "num_hidden_layers=7"),
        ({"hf_config": {"vocab_size": 256}}, ValueError, "hf_config names no model"),
    ],
)
def test_bad_arguments_are_refused(
    overrides: dict[str, Any], error: type[Exception], message: str
) -> None:
    hf_config = overrides.pop("hf_config", HF)
    mesh_device = overrides.pop("mesh_device", "cpu")
    max_batch_size = overrides.pop("max_batch_size", 4)
    kwargs: dict[str, Any] = {"max_seq_len": 64, **OPTIONS, **overrides}
    with pytest.raises(error, match=message):
        DecoderVLLMModel.initialize_vllm_model(hf_config, mesh_device, max_batch_size, **kwargs)


def test_hub_ids_of_shipped_weights_are_aliased() -> None:
    assert HUB_ALIASES["HuggingFaceTB/SmolLM2-135M-Instruct"] == "smollm2-135m"


def test_a_folder_written_from_a_gguf_serves_the_gguf(tmp_path: Path) -> None:
    """vLLM passes its model folder as `model`; a folder that names its GGUF serves the
    GGUF's blocks, any other folder itself."""
    written, plain = tmp_path / "from-gguf", tmp_path / "plain"
    for folder, config in (
        (written, {WEIGHTS_SOURCE_KEY: "/models/x.Q4_1.gguf", "_name_or_path": "x"}),
        (plain, {"_name_or_path": "y"}),
    ):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
    names_gguf = {WEIGHTS_SOURCE_KEY: "/models/x.Q4_1.gguf", "_name_or_path": str(written)}
    assert engine_model_name(names_gguf, str(written)) == "/models/x.Q4_1.gguf"
    assert engine_model_name(names_gguf, None) == "/models/x.Q4_1.gguf"
    assert engine_model_name({"_name_or_path": str(plain)}, str(plain)) == str(plain)
    assert engine_model_name(names_gguf, "tiny-random") == "tiny-random"  # a caller's choice


def test_engine_geometry_is_adopted_and_bad_specs_change_nothing() -> None:
    model = build(block_size=8)
    placeholder = model.executor
    with pytest.raises(ValueError, match="does not match the model's 2 layers"):
        model.allocate_kv_cache((40, 2, 4, 16), torch.float32, 3)
    with pytest.raises(ValueError, match="KV heads per device"):
        model.allocate_kv_cache((40, 3, 4, 16), torch.float32, 2)
    with pytest.raises(ValueError, match="block_size 12 does not divide"):
        model.allocate_kv_cache((40, 2, 12, 16), torch.float32, 2)
    assert model.executor is placeholder and model.phase is Phase.CONSTRUCTED
    handle = model.allocate_kv_cache((40, 2, 4, 16), torch.float32, 2)
    assert model.executor is not placeholder and placeholder.is_terminal
    assert model.phase is Phase.ALLOCATED
    assert (model.executor.block_size, model.executor.num_blocks) == (4, 40)
    assert model.adapter.config.paged_kv_cache.num_blocks == 40
    assert [tuple(k.shape) for k, _v in handle] == [(40, 2, 4, 16)] * 2
    model.close()
    assert model.device.live_allocations == 0


def test_a_smaller_engine_cache_reuses_the_executor() -> None:
    model = build()
    lane = model.executor
    model.allocate_kv_cache((20, 2, 4, 16), torch.float32, 2)
    assert model.executor is lane and lane.num_blocks == 20
    model.close()


def test_decode_handles_are_checked() -> None:
    model = build()
    with pytest.raises(TypeError, match="expects the DecodeOutput"):
        model.read_decode_output(torch.zeros(4), async_read=True)
    with pytest.raises(TypeError, match="expects a HostDecodeOutput"):
        model.process_decode_output_host(torch.zeros(4), is_tokens=True)
    with pytest.raises(TypeError, match="async_read must be a bool"):
        model.read_decode_output(DecodeOutput(raw=None, is_tokens=True), async_read=1)  # type: ignore[arg-type]
    logits = HostDecodeOutput(host=None, is_tokens=False)
    with pytest.raises(ValueError, match="is_tokens=True but this decode step ran without"):
        model.process_decode_output_host(logits, is_tokens=True)
    model.close()

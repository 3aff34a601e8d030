"""Every rule of reference 2.21 for `runtime.vllm_adapter` (types, values, messages)."""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from runtime.config import PagedKVCacheConfig, TraceConfig
from runtime.sampling import SamplingParams
from runtime.vllm_adapter import (
    IGNORED_VLLM_KWARGS,
    VLLMAdapter,
    VLLMAdapterConfig,
    torch_surrogate,
)

PAGED = PagedKVCacheConfig(block_size=32, max_num_blocks=128, dtype=torch.float32)


@attrs.frozen
class SubTrace(TraceConfig):
    """A subclass: the adapter must refuse it."""


@attrs.frozen
class SubPaged(PagedKVCacheConfig):
    """A subclass: the adapter must refuse it."""


def config(**overrides: Any) -> VLLMAdapterConfig:
    settings: dict[str, Any] = {
        "trace": TraceConfig(mode="decode_only"),
        "paged_kv_cache": PAGED,
        "expected_num_layers": 2,
        "expected_kv_heads_per_device": 8,
        "expected_head_dim": 128,
        "model_kv_cache_dtype": torch.float32,
    }
    settings.update(overrides)
    return VLLMAdapterConfig.resolve(**settings)


def adapter(**overrides: Any) -> VLLMAdapter:
    return VLLMAdapter(config(**overrides))


# -- VLLMAdapterConfig.resolve -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value", "kind"),
    [
        ("trace", SubTrace(mode="all"), "TraceConfig"),
        ("trace", "all", "TraceConfig"),
        ("paged_kv_cache", SubPaged(block_size=32, max_num_blocks=8, dtype=torch.float32), "Paged"),
        ("paged_kv_cache", {"block_size": 32}, "PagedKVCacheConfig"),
    ],
)
def test_collaborators_must_be_exact_types(name: str, value: object, kind: str) -> None:
    with pytest.raises(TypeError, match=rf"{name} must be exactly {kind}"):
        config(**{name: value})


@pytest.mark.parametrize(
    "name", ["expected_num_layers", "expected_kv_heads_per_device", "expected_head_dim"]
)
@pytest.mark.parametrize(
    ("value", "expected"), [(32.0, 32), (np.int64(4), 4), (np.float32(2.0), 2), (7, 7)]
)
def test_integral_values_are_coerced(name: str, value: object, expected: int) -> None:
    kwargs: dict[str, Any] = {name: value}
    if name == "expected_num_layers":
        kwargs["model_kv_cache_dtype"] = torch.float32
    resolved = config(**kwargs)
    assert getattr(resolved, name) == expected
    assert type(getattr(resolved, name)) is int


@pytest.mark.parametrize(
    "name", ["expected_num_layers", "expected_kv_heads_per_device", "expected_head_dim"]
)
@pytest.mark.parametrize("value", [True, False, 0, -1, 8.5, "8", np.bool_(True), float("nan")])
def test_bad_counts_are_value_errors(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"{name} must be a positive integer"):
        config(**{name: value})


def test_optional_expectations_may_be_none() -> None:
    resolved = config(expected_kv_heads_per_device=None, expected_head_dim=None)
    assert resolved.expected_kv_heads_per_device is None
    assert resolved.expected_head_dim is None


def test_missing_dtype_is_a_type_error() -> None:
    with pytest.raises(
        TypeError, match="model_kv_cache_dtype must be supplied from model metadata"
    ):
        config(model_kv_cache_dtype=None)


def test_dtypes_become_a_tuple() -> None:
    assert config(model_kv_cache_dtype=torch.float32).model_kv_cache_dtypes == (torch.float32,)
    per_layer = [torch.float32, torch.float32]
    resolved = config(model_kv_cache_dtype=per_layer)
    assert resolved.model_kv_cache_dtypes == (torch.float32, torch.float32)
    assert per_layer == [torch.float32, torch.float32]  # the caller's list is untouched


def test_empty_dtypes_are_refused() -> None:
    with pytest.raises(ValueError, match="model_kv_cache_dtypes cannot be empty"):
        config(model_kv_cache_dtype=())


def test_dtypes_need_one_per_layer_or_one() -> None:
    with pytest.raises(ValueError, match="one dtype per model layer"):
        config(model_kv_cache_dtype=(torch.float32,) * 3)


def test_uniform_dtype_must_equal_the_paged_dtype() -> None:
    with pytest.raises(ValueError, match="model-owned KV cache dtype"):
        config(model_kv_cache_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="model-owned KV cache dtype"):
        config(model_kv_cache_dtype=[torch.bfloat16, torch.bfloat16])


def test_mixed_per_layer_dtypes_are_allowed_but_have_no_engine_dtype() -> None:
    mixed = config(model_kv_cache_dtype=[torch.float32, torch.bfloat16])
    with pytest.raises(ValueError, match="no unique torch surrogate"):
        VLLMAdapter(mixed).resolve_legacy_kv_cache_config((4, 8, 32, 128), torch.float32, 2)


def test_device_dtypes_have_torch_surrogates() -> None:
    ttnn_like = types.SimpleNamespace(name="BFLOAT8_B")
    assert torch_surrogate(ttnn_like) is torch.bfloat16
    assert torch_surrogate("DataType.FLOAT32") is torch.float32
    with pytest.raises(ValueError, match="has no torch surrogate"):
        torch_surrogate("int4")


def test_config_is_frozen_and_direct_construction_checks_invariants() -> None:
    resolved = config()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        resolved.expected_num_layers = 3  # type: ignore[misc]
    with pytest.raises(ValueError, match="positive integer"):
        attrs.evolve(resolved, expected_num_layers=2.0)
    with pytest.raises(TypeError, match="must be a tuple"):
        attrs.evolve(resolved, model_kv_cache_dtypes=[torch.float32])


# -- VLLMAdapter ----------------------------------------------------------------------------------


def test_adapter_needs_a_config_and_holds_only_it() -> None:
    with pytest.raises(TypeError, match="config must be a VLLMAdapterConfig"):
        VLLMAdapter(PAGED)  # type: ignore[arg-type]
    instance = adapter()
    with pytest.raises(AttributeError):
        instance.extra = 1  # type: ignore[attr-defined]
    assert VLLMAdapter.__slots__ == ("config",)


def prefill_args() -> dict[str, Any]:
    return {
        "tokens": torch.tensor([[5, 6, 7, 0], [8, 9, 10, 11]], dtype=torch.int32),
        "page_table": torch.tensor([[1, 0], [2, 3]], dtype=torch.int32),
    }


def decode_args() -> dict[str, Any]:
    return {
        "tokens": torch.tensor([[5], [6], [0]], dtype=torch.int32),
        "start_pos": torch.tensor([3, 9, -1], dtype=torch.int32),
        "page_table": torch.tensor([[1, 0], [2, 3], [0, 0]], dtype=torch.int64),
    }


@pytest.mark.parametrize("value", [1, 0, None, "True", np.bool_(True)])
def test_enable_trace_must_be_a_real_bool(value: object) -> None:
    with pytest.raises(TypeError, match="enable_trace must be a bool"):
        adapter().normalize_prefill(**prefill_args(), enable_trace=value)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="enable_trace must be a bool"):
        adapter().normalize_decode(**decode_args(), enable_trace=value)  # type: ignore[arg-type]


def test_enable_trace_is_required() -> None:
    with pytest.raises(TypeError, match="enable_trace"):
        adapter().normalize_prefill(**prefill_args())  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("mode", "prefill_ok", "decode_ok"),
    [("none", False, False), ("decode_only", False, True), ("all", True, True)],
)
def test_enable_trace_against_static_policy(mode: str, prefill_ok: bool, decode_ok: bool) -> None:
    instance = adapter(trace=TraceConfig(mode=mode))  # type: ignore[arg-type]
    for operation, ok, call in (
        (
            "prefill_forward",
            prefill_ok,
            lambda t: instance.normalize_prefill(**prefill_args(), enable_trace=t),
        ),
        (
            "decode_forward",
            decode_ok,
            lambda t: instance.normalize_decode(**decode_args(), enable_trace=t),
        ),
    ):
        assert call(False)[1] is False  # False is always accepted
        if ok:
            assert call(True)[1] is True
        else:
            message = (
                rf"enable_trace=True for {operation} disagrees with static TraceConfig "
                r"policy \(False\)"
            )
            with pytest.raises(ValueError, match=message):
                call(True)


def test_warmup_calls_are_checked_against_the_same_policy() -> None:
    instance = adapter(trace=TraceConfig(mode="decode_only"))
    assert instance.check_enable_trace("warmup_model_decode", True) is True
    with pytest.raises(ValueError, match="for warmup_model_prefill disagrees"):
        instance.check_enable_trace("warmup_model_prefill", True)


def test_prefill_key_order_and_conversions() -> None:
    args = prefill_args()
    tokens_before = args["tokens"].clone()
    prompt_lens = np.array([3, 4], dtype=np.int64)
    start_pos = np.array([0, 2], dtype=np.int32)
    normalized, trace = adapter().normalize_prefill(
        **args,
        enable_trace=False,
        prompt_lens=prompt_lens,
        start_pos=start_pos,
        empty_slots=np.array([2, 0]),
        kv_cache="handle",
    )
    assert list(normalized) == [
        "tokens",
        "page_table",
        "prompt_lens",
        "start_pos",
        "empty_slots",
        "kv_cache",
        "sampling_params",
        "prompt_tokens",
        "output_tokens",
        "slot_remap",
    ]
    assert trace is False
    assert normalized["tokens"].dtype == torch.long
    assert torch.equal(normalized["tokens"], tokens_before.long())
    assert normalized["page_table"].dtype == torch.int32
    assert normalized["prompt_lens"] is not None and normalized["prompt_lens"].dtype == torch.long
    assert normalized["prompt_lens"].tolist() == [3, 4]
    assert normalized["start_pos"] is not None and normalized["start_pos"].dtype == torch.long
    assert normalized["start_pos"].tolist() == [0, 2]
    assert normalized["empty_slots"] == [2, 0]
    assert normalized["kv_cache"] == "handle"
    assert normalized["sampling_params"] is None
    # The caller's values keep their dtypes and contents.
    assert args["tokens"].dtype == torch.int32 and torch.equal(args["tokens"], tokens_before)
    assert start_pos.dtype == np.int32 and prompt_lens.dtype == np.int64


def test_prefill_lists_and_defaults() -> None:
    normalized, _ = adapter().normalize_prefill(
        [[1, 2, 3]], [[0, 1]], enable_trace=False, prompt_lens=[3], start_pos=None
    )
    assert normalized["tokens"].dtype == torch.long and normalized["tokens"].shape == (1, 3)
    assert normalized["page_table"].dtype == torch.int32
    assert normalized["prompt_lens"] is not None and normalized["prompt_lens"].tolist() == [3]
    assert normalized["start_pos"] is None and normalized["empty_slots"] is None


def test_decode_key_order_and_conversions() -> None:
    args = decode_args()
    normalized, trace = adapter().normalize_decode(**args, enable_trace=True, reset_batch=True)
    assert list(normalized) == [
        "tokens",
        "start_pos",
        "page_table",
        "kv_cache",
        "sampling_params",
        "prompt_tokens",
        "output_tokens",
        "slot_remap",
        "reset_batch",
    ]
    assert trace is True
    assert normalized["tokens"].shape == (3,) and normalized["tokens"].dtype == torch.long
    assert normalized["tokens"].tolist() == [5, 6, 0]
    assert normalized["start_pos"].dtype == torch.long
    assert normalized["start_pos"].tolist() == [3, 9, -1]
    assert normalized["page_table"].dtype == torch.int32
    assert normalized["reset_batch"] is True
    assert args["tokens"].shape == (3, 1)  # the caller's tensor is not reshaped


def test_decode_flat_tokens_and_numpy_positions() -> None:
    normalized, _ = adapter().normalize_decode(
        np.array([4, 5], dtype=np.int32),
        np.array([1, -1], dtype=np.int32),
        np.zeros((2, 2), dtype=np.int64),
        enable_trace=False,
    )
    assert normalized["tokens"].tolist() == [4, 5]
    assert normalized["start_pos"].dtype == torch.long
    assert normalized["page_table"].dtype == torch.int32


@pytest.mark.parametrize(
    ("name", "value"), [("tokens", "abc"), ("page_table", 3), ("tokens", None)]
)
def test_unreadable_tensors_name_the_argument(name: str, value: object) -> None:
    args = prefill_args()
    args[name] = value
    with pytest.raises(TypeError, match=rf"{name} must be a torch.Tensor, a numpy array"):
        adapter().normalize_prefill(**args, enable_trace=False)


def test_compatibility_keywords_forwarded_or_discarded() -> None:
    five = {
        "page_tables_per_layer",
        "prompt_tokens",
        "output_tokens",
        "slot_remap",
        "rope_deltas_all_users",
    }
    assert five == IGNORED_VLLM_KWARGS
    extra = {
        "page_tables_per_layer": [torch.zeros(2, 2)],
        "prompt_tokens": "prompt",
        "output_tokens": "output",
        "slot_remap": "remap",
        "rope_deltas_all_users": [0, 0],
    }
    before = dict(extra)
    for normalized, _ in (
        adapter().normalize_prefill(
            **prefill_args(), enable_trace=False, compatibility_kwargs=extra
        ),
        adapter().normalize_decode(**decode_args(), enable_trace=False, compatibility_kwargs=extra),
    ):
        assert normalized["prompt_tokens"] == "prompt"
        assert normalized["output_tokens"] == "output"
        assert normalized["slot_remap"] == "remap"
        assert "page_tables_per_layer" not in normalized
        assert "rope_deltas_all_users" not in normalized
    assert extra == before and list(extra) == list(before)  # never mutated


def test_read_only_mapping_is_enough() -> None:
    frozen = types.MappingProxyType({"slot_remap": [1, 0]})
    normalized, _ = adapter().normalize_decode(
        **decode_args(), enable_trace=False, compatibility_kwargs=frozen
    )
    assert normalized["slot_remap"] == [1, 0]


@pytest.mark.parametrize("operation", ["prefill_forward", "decode_forward"])
def test_unknown_keyword_is_refused(operation: str) -> None:
    instance = adapter()
    extra = {"slot_remap": None, "mystery": 1}
    message = rf"{operation} got an unexpected keyword argument 'mystery'"
    with pytest.raises(TypeError, match=message):
        if operation == "prefill_forward":
            instance.normalize_prefill(
                **prefill_args(), enable_trace=False, compatibility_kwargs=extra
            )
        else:
            instance.normalize_decode(
                **decode_args(), enable_trace=False, compatibility_kwargs=extra
            )
    assert extra == {"slot_remap": None, "mystery": 1}


def test_sampling_params_pass_through_or_are_read_from_engine_dataclasses() -> None:
    params = SamplingParams(temperature=[0.0, 0.5], top_k=[1, 8], top_p=[1.0, 0.9])
    normalized, _ = adapter().normalize_prefill(
        **prefill_args(), enable_trace=False, sampling_params=params
    )
    assert normalized["sampling_params"] is params

    @dataclasses.dataclass(frozen=True)
    class EngineParams:
        temperature: list[float]
        top_k: list[int]
        top_p: list[float]
        seed: list[int | None]
        num_logprobs: list[int]
        enable_log_probs: list[bool]
        unrelated: str = "ignored"

    engine = EngineParams([0.0, 0.5], [1, 8], [1.0, 0.9], [None, 7], [-2, 0], [False, True])
    normalized, _ = adapter().normalize_prefill(
        **prefill_args(), enable_trace=False, sampling_params=engine
    )
    converted = normalized["sampling_params"]
    assert isinstance(converted, SamplingParams)
    assert converted.temperature == (0.0, 0.5) and converted.top_k == (1, 8)
    assert converted.seed == (None, 7)
    assert converted.num_logprobs == (0, 0)  # -2 is the engine's "no log-probs"
    assert converted.enable_log_probs == (False, True)
    with pytest.raises(TypeError, match=r"sampling_params must be a runtime\.sampling"):
        adapter().normalize_prefill(**prefill_args(), enable_trace=False, sampling_params={})


@given(
    st.lists(st.integers(0, 255), min_size=1, max_size=8),
    st.sampled_from([np.int32, np.int64, np.int16]),
)
def test_any_integer_array_form_normalizes_to_the_same_tensor(
    row: list[int], dtype: type[np.integer[Any]]
) -> None:
    forms: list[Any] = [
        [row],
        np.array([row], dtype=dtype),
        torch.tensor([row], dtype=torch.int32),
    ]
    results = [
        adapter().normalize_prefill(form, [[0]], enable_trace=False)[0]["tokens"] for form in forms
    ]
    for result in results:
        assert result.dtype == torch.long
        assert result.tolist() == [row]


# -- resolve_legacy_kv_cache_config ----------------------------------------------------------------


def test_legacy_spec_resolves_a_new_config() -> None:
    base = PagedKVCacheConfig(
        block_size=32, max_num_blocks=128, dtype=torch.float32, memory_config="l1"
    )
    before = attrs.evolve(base)
    instance = VLLMAdapter(config(paged_kv_cache=base))
    resolved = instance.resolve_legacy_kv_cache_config((129, 8, 64, 128), torch.float32, 2)
    assert resolved is not base
    assert (resolved.block_size, resolved.max_num_blocks, resolved.num_blocks) == (64, 129, 129)
    assert resolved.dtype is torch.float32 and resolved.memory_config == "l1"
    assert base == before and base.num_blocks is None  # the base is untouched
    assert instance.config.paged_kv_cache is base


def test_legacy_spec_accepts_torch_size_and_lists() -> None:
    instance = adapter()
    assert (
        instance.resolve_legacy_kv_cache_config(
            torch.Size([4, 8, 16, 128]), torch.float32, 2
        ).num_blocks
        == 4
    )
    assert (
        instance.resolve_legacy_kv_cache_config([4, 8, 16, 128], torch.float32, 2).block_size == 16
    )


@pytest.mark.parametrize(
    ("shape", "error", "message"),
    [
        ("4,8,16,128", TypeError, "kv_cache_shape must be a sequence"),
        (7, TypeError, "kv_cache_shape must be a sequence"),
        ((4, 8, 16), ValueError, "must have rank 4"),
        ((4, 8, 16, 128, 1), ValueError, "must have rank 4"),
        ((0, 8, 16, 128), ValueError, "num_blocks must be a positive integer"),
        ((4, 8, 0, 128), ValueError, "block_size must be a positive integer"),
        ((4, 4, 16, 128), ValueError, "4 KV heads per device; the model has 8"),
        ((4, 8, 16, 64), ValueError, "head_dim 64 does not match the model's head_dim 128"),
    ],
)
def test_legacy_spec_shape_rules(shape: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        adapter().resolve_legacy_kv_cache_config(shape, torch.float32, 2)


def test_unset_expectations_are_not_checked() -> None:
    instance = adapter(expected_kv_heads_per_device=None, expected_head_dim=None)
    resolved = instance.resolve_legacy_kv_cache_config((4, 3, 16, 40), torch.float32, 2)
    assert resolved.num_blocks == 4


@pytest.mark.parametrize("layers", [1, 3, True, 2.5])
def test_legacy_spec_layer_count(layers: object) -> None:
    with pytest.raises(ValueError, match="does not match the model's 2 layers"):
        adapter().resolve_legacy_kv_cache_config((4, 8, 16, 128), torch.float32, layers)


def test_legacy_spec_dtype_rules() -> None:
    with pytest.raises(TypeError, match=r"dtype must be a torch\.dtype"):
        adapter().resolve_legacy_kv_cache_config((4, 8, 16, 128), "float32", 2)
    with pytest.raises(ValueError, match="does not match the model-owned KV cache dtype"):
        adapter().resolve_legacy_kv_cache_config((4, 8, 16, 128), torch.bfloat16, 2)


def test_already_resolved_base_must_agree() -> None:
    instance = adapter(paged_kv_cache=PAGED.with_num_blocks(64))
    assert (
        instance.resolve_legacy_kv_cache_config((64, 8, 32, 128), torch.float32, 2).num_blocks == 64
    )
    with pytest.raises(ValueError, match="already resolved to 64 blocks"):
        instance.resolve_legacy_kv_cache_config((65, 8, 32, 128), torch.float32, 2)

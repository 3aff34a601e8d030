"""Validation rules and derived values of the static configuration (reference section 2.1)."""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from runtime.config import (
    PagedKVCacheConfig,
    PageTableLayout,
    TraceConfig,
    WarmupConfig,
)

# --- TraceConfig ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "prefill", "decode"),
    [("none", False, False), ("decode_only", False, True), ("all", True, True)],
)
def test_trace_config_modes(mode: Any, prefill: bool, decode: bool) -> None:
    config = TraceConfig(mode=mode)
    assert (config.prefill_enabled, config.decode_enabled) == (prefill, decode)


def test_trace_config_default_is_decode_only() -> None:
    assert TraceConfig().mode == "decode_only"


@pytest.mark.parametrize("mode", ["prefill_only", "ALL", "", None, 1])
def test_trace_config_rejects_unknown_mode(mode: Any) -> None:
    with pytest.raises(ValueError, match="Unsupported trace mode") as info:
        TraceConfig(mode=mode)
    assert "'none', 'decode_only', 'all'" in str(info.value)


def test_configs_are_frozen() -> None:
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        TraceConfig().mode = "all"  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        WarmupConfig().include_decode_top_k = True  # type: ignore[misc]


# --- WarmupConfig --------------------------------------------------------------------------


def _kwargs(field: str, value: object) -> dict[str, Any]:
    return {field: value}


def test_warmup_defaults() -> None:
    config = WarmupConfig()
    assert config.prefill_seq_lens is None
    assert config.prefill_batch_sizes == (1, 2, 4, 8, 16, 32)
    assert config.include_decode_top_k is False


@pytest.mark.parametrize("field", ["prefill_seq_lens", "prefill_batch_sizes"])
def test_warmup_tuple_must_be_a_tuple(field: str) -> None:
    with pytest.raises(TypeError, match="must be a tuple so WarmupConfig remains immutable"):
        WarmupConfig(**_kwargs(field, [128, 256]))


@pytest.mark.parametrize("field", ["prefill_seq_lens", "prefill_batch_sizes"])
def test_warmup_tuple_must_be_non_empty(field: str) -> None:
    with pytest.raises(ValueError, match=f"{field} must be a non-empty tuple"):
        WarmupConfig(**_kwargs(field, ()))


@pytest.mark.parametrize("bad", [0, -4, True, 2.0, "8"])
@pytest.mark.parametrize("field", ["prefill_seq_lens", "prefill_batch_sizes"])
def test_warmup_values_must_be_positive_non_bool_ints(field: str, bad: Any) -> None:
    with pytest.raises(ValueError, match=f"{field} item must be a positive integer"):
        WarmupConfig(**_kwargs(field, (1, bad)))


@pytest.mark.parametrize("field", ["prefill_seq_lens", "prefill_batch_sizes"])
def test_warmup_values_must_be_unique(field: str) -> None:
    with pytest.raises(ValueError, match=r"must contain unique values, got duplicates \[4\]"):
        WarmupConfig(**_kwargs(field, (4, 2, 4)))


def test_warmup_include_top_k_must_be_bool() -> None:
    with pytest.raises(TypeError, match="include_decode_top_k must be a bool"):
        WarmupConfig(include_decode_top_k=1)  # type: ignore[arg-type]


# --- PagedKVCacheConfig --------------------------------------------------------------------


def test_paged_kv_config_unresolved_and_resolved() -> None:
    config = PagedKVCacheConfig(block_size=32, max_num_blocks=64, dtype=torch.bfloat16)
    assert not config.is_resolved()
    assert config.memory_config == "dram"
    assert config.max_capacity_tokens == 2048
    assert config.capacity_tokens is None

    resolved = config.with_num_blocks(10)
    assert resolved.is_resolved()
    assert resolved.capacity_tokens == 320
    assert resolved.max_capacity_tokens == 2048
    assert config.num_blocks is None, "with_num_blocks must return a copy"


@pytest.mark.parametrize("field", ["block_size", "max_num_blocks"])
@pytest.mark.parametrize("bad", [0, -1, True, 3.0, None])
def test_paged_kv_geometry_must_be_positive_ints(field: str, bad: Any) -> None:
    kwargs: dict[str, Any] = {"block_size": 32, "max_num_blocks": 8, "dtype": torch.float32}
    kwargs[field] = bad
    with pytest.raises(ValueError, match=f"{field} must be a positive integer"):
        PagedKVCacheConfig(**kwargs)


@pytest.mark.parametrize("bad", [0, -3, False, 1.5])
def test_paged_kv_num_blocks_must_be_positive_int(bad: Any) -> None:
    with pytest.raises(ValueError, match="num_blocks must be a positive integer"):
        PagedKVCacheConfig(block_size=32, max_num_blocks=8, dtype=torch.float32, num_blocks=bad)


def test_paged_kv_num_blocks_cannot_exceed_ceiling() -> None:
    config = PagedKVCacheConfig(block_size=32, max_num_blocks=8, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"num_blocks \(9\) exceeds max_num_blocks \(8\)") as info:
        config.with_num_blocks(9)
    assert "allowed: 1..8" in str(info.value)
    assert config.with_num_blocks(8).capacity_tokens == 256


def test_paged_kv_dtype_and_memory_config_types() -> None:
    with pytest.raises(TypeError, match=r"dtype must be a torch\.dtype"):
        PagedKVCacheConfig(block_size=32, max_num_blocks=8, dtype="bfloat16")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="memory_config must be a non-empty string"):
        PagedKVCacheConfig(block_size=32, max_num_blocks=8, dtype=torch.float32, memory_config="")


# --- PageTableLayout -----------------------------------------------------------------------


def test_page_table_layout_reference_example() -> None:
    layout = PageTableLayout.resolve(
        block_size=32,
        model_max_sequence_length=4096,
        physical_num_blocks=100,
        max_prefill_chunk_size=2048,
    )
    assert (layout.raw_capacity_width, layout.decode_width, layout.prefill_width) == (
        100,
        104,
        168,
    )
    assert layout.block_size == 32


def test_page_table_layout_model_width_limits_raw() -> None:
    layout = PageTableLayout.resolve(
        block_size=32,
        model_max_sequence_length=100,
        physical_num_blocks=1000,
        max_prefill_chunk_size=32,
    )
    # ceil(100/32) = 4 model blocks; ceil(31/32) = 1 padding block.
    assert (layout.raw_capacity_width, layout.decode_width, layout.prefill_width) == (4, 8, 8)


@pytest.mark.parametrize(
    "name",
    ["block_size", "model_max_sequence_length", "physical_num_blocks", "max_prefill_chunk_size"],
)
@pytest.mark.parametrize("bad", [0, -2, True, 32.0])
def test_page_table_layout_resolve_rejects_bad_inputs(name: str, bad: Any) -> None:
    kwargs: dict[str, Any] = {
        "block_size": 32,
        "model_max_sequence_length": 4096,
        "physical_num_blocks": 100,
        "max_prefill_chunk_size": 2048,
    }
    kwargs[name] = bad
    with pytest.raises(ValueError, match=f"{name} must be a positive integer"):
        PageTableLayout.resolve(**kwargs)


def test_page_table_layout_direct_construction_rules() -> None:
    PageTableLayout(block_size=32, raw_capacity_width=10, prefill_width=16, decode_width=16)
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        PageTableLayout(block_size=0, raw_capacity_width=10, prefill_width=16, decode_width=16)
    with pytest.raises(ValueError, match="raw_capacity_width must be a positive integer"):
        PageTableLayout(block_size=32, raw_capacity_width=0, prefill_width=16, decode_width=16)
    with pytest.raises(ValueError, match=r"decode_width \(8\) must be >= raw_capacity_width"):
        PageTableLayout(block_size=32, raw_capacity_width=10, prefill_width=16, decode_width=8)
    with pytest.raises(ValueError, match=r"prefill_width \(8\) must be >= raw_capacity_width"):
        PageTableLayout(block_size=32, raw_capacity_width=10, prefill_width=8, decode_width=16)
    with pytest.raises(ValueError, match=r"prefill_width \(20\) must be a multiple of 8") as info:
        PageTableLayout(block_size=32, raw_capacity_width=10, prefill_width=20, decode_width=16)
    assert "next allowed value is 24" in str(info.value)
    with pytest.raises(ValueError, match=r"decode_width \(12\) must be a multiple of 8"):
        PageTableLayout(block_size=32, raw_capacity_width=10, prefill_width=16, decode_width=12)


def test_page_table_layout_custom_alignment() -> None:
    layout = PageTableLayout.resolve(
        block_size=16,
        model_max_sequence_length=100,
        physical_num_blocks=100,
        max_prefill_chunk_size=16,
        alignment=4,
    )
    assert (layout.raw_capacity_width, layout.decode_width, layout.prefill_width) == (7, 8, 8)
    assert layout.alignment == 4


@given(
    block=st.integers(1, 256),
    max_seq=st.integers(1, 1 << 17),
    physical=st.integers(1, 4096),
    chunk=st.integers(1, 1 << 14),
)
def test_page_table_layout_formulas(block: int, max_seq: int, physical: int, chunk: int) -> None:
    layout = PageTableLayout.resolve(
        block_size=block,
        model_max_sequence_length=max_seq,
        physical_num_blocks=physical,
        max_prefill_chunk_size=chunk,
    )
    raw = min(math.ceil(max_seq / block), physical)
    assert layout.raw_capacity_width == raw
    assert layout.decode_width == math.ceil(raw / 8) * 8
    assert layout.prefill_width == math.ceil((raw + math.ceil((chunk - 1) / block)) / 8) * 8
    # A chunk starting anywhere inside capacity fits the prefill width.
    assert layout.prefill_width * block >= raw * block + chunk - 1

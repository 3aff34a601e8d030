"""The vLLM boundary: normalize a serving engine's calls before they reach an executor.

A serving engine (vLLM with a Tenstorrent-style model runner) calls a model-owned facade with
its own argument forms: int32 tensors, numpy arrays, `[B, 1]` decode tokens, a per-call
`enable_trace` hint and a handful of compatibility keywords. `VLLMAdapter` turns those into
the runtime's forms (reference section 2.21) and checks the engine's KV cache spec against
the model's metadata, so every refusal happens here, before any device work:

* `normalize_prefill` / `normalize_decode` return a new keyword dict for the executor and the
  validated `enable_trace`; the caller's arguments and mappings are never mutated;
* `check_enable_trace` refuses `enable_trace=True` for an operation whose static trace policy
  is off (False is always accepted: the operation then runs eagerly);
* `resolve_legacy_kv_cache_config` turns the engine's `(num_blocks, kv_heads, block_size,
  head_dim)` spec into a new, resolved `PagedKVCacheConfig` (the base stays untouched).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypedDict

import attrs
import numpy as np
import torch

from runtime.config import PagedKVCacheConfig, TraceConfig
from runtime.sampling import SamplingParams

__all__ = [
    "IGNORED_VLLM_KWARGS",
    "NormalizedDecodeKwargs",
    "NormalizedPrefillKwargs",
    "VLLMAdapter",
    "VLLMAdapterConfig",
]

Operation = Literal[
    "prefill_forward", "decode_forward", "warmup_model_prefill", "warmup_model_decode"
]

FORWARDED_VLLM_KWARGS: tuple[str, ...] = ("prompt_tokens", "output_tokens", "slot_remap")
"""Compatibility keywords that carry request-owned sampling state into the executor."""

DISCARDED_VLLM_KWARGS: tuple[str, ...] = ("page_tables_per_layer", "rope_deltas_all_users")
"""Compatibility keywords accepted and dropped (uniform-attention models without mrope)."""

IGNORED_VLLM_KWARGS: frozenset[str] = frozenset(FORWARDED_VLLM_KWARGS + DISCARDED_VLLM_KWARGS)
"""The only compatibility keywords the adapter accepts (the reference's five)."""

_SAMPLING_FIELDS: tuple[str, ...] = tuple(field.name for field in attrs.fields(SamplingParams))


class NormalizedPrefillKwargs(TypedDict):
    """Executor keywords of one prefill call, in the reference's order."""

    tokens: torch.Tensor
    page_table: torch.Tensor
    prompt_lens: torch.Tensor | None
    start_pos: torch.Tensor | None
    empty_slots: list[int] | None
    kv_cache: object
    sampling_params: SamplingParams | None
    prompt_tokens: object
    output_tokens: object
    slot_remap: object


class NormalizedDecodeKwargs(TypedDict):
    """Executor keywords of one decode call, in the reference's order."""

    tokens: torch.Tensor
    start_pos: torch.Tensor
    page_table: torch.Tensor
    kv_cache: object
    sampling_params: SamplingParams | None
    prompt_tokens: object
    output_tokens: object
    slot_remap: object
    reset_batch: bool


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


def _exact_type(name: str, value: object, kind: type) -> None:
    if type(value) is not kind:
        raise TypeError(
            f"{name} must be exactly {kind.__name__} (subclasses are not accepted), got "
            f"{type(value).__name__}"
        )


def _positive_integer(name: str, value: object) -> int:
    """An int >= 1; integral floats (32.0) are accepted, bools and fractions are not."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if isinstance(value, numbers.Integral):
        number = int(value)
    else:
        as_float = float(value)
        if not as_float.is_integer():
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
        number = int(as_float)
    if number <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return number


def _optional_positive_integer(name: str, value: object) -> int | None:
    return None if value is None else _positive_integer(name, value)


_SURROGATE_NAMES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat8_b": torch.bfloat16,
    "bfloat4_b": torch.bfloat16,
}


def torch_surrogate(dtype: object) -> torch.dtype:
    """The torch dtype a model KV dtype stands for (a torch dtype is its own surrogate).

    Device dtypes such as `ttnn.bfloat16` / `ttnn.bfloat8_b` map to the torch dtype the engine
    allocates with (block-float formats are bfloat16 on the host).
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(getattr(dtype, "name", dtype)).rsplit(".", 1)[-1].lower()
    surrogate = _SURROGATE_NAMES.get(name)
    if surrogate is None:
        raise ValueError(
            f"model KV cache dtype {dtype!r} has no torch surrogate; allowed are torch dtypes "
            f"and device dtypes named {sorted(_SURROGATE_NAMES)}"
        )
    return surrogate


def _dtype_tuple(value: object) -> tuple[object, ...]:
    if value is None:
        raise TypeError("model_kv_cache_dtype must be supplied from model metadata")
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return tuple(value)
    return (value,)


@attrs.frozen
class VLLMAdapterConfig:
    """What the boundary checks engine calls against: static trace policy and KV metadata.

    Build it with `resolve(...)`, which checks exact collaborator types and coerces counts.
    """

    trace: TraceConfig
    paged_kv_cache: PagedKVCacheConfig
    expected_num_layers: int
    expected_kv_heads_per_device: int | None
    expected_head_dim: int | None
    model_kv_cache_dtypes: tuple[object, ...]

    def __attrs_post_init__(self) -> None:
        _exact_type("trace", self.trace, TraceConfig)
        _exact_type("paged_kv_cache", self.paged_kv_cache, PagedKVCacheConfig)
        for name in ("expected_num_layers", "expected_kv_heads_per_device", "expected_head_dim"):
            value = getattr(self, name)
            if value is None and name != "expected_num_layers":
                continue
            if type(value) is not int or value <= 0:
                raise ValueError(
                    f"{name} must be a positive integer, got {value!r}; build the config "
                    "with VLLMAdapterConfig.resolve(), which coerces integral values"
                )
        dtypes = self.model_kv_cache_dtypes
        if not isinstance(dtypes, tuple):
            raise TypeError(
                f"model_kv_cache_dtypes must be a tuple, got {type(dtypes).__name__}; "
                "VLLMAdapterConfig.resolve() converts a sequence or a single dtype"
            )
        if not dtypes:
            raise ValueError("model_kv_cache_dtypes cannot be empty; supply the model's KV dtype")
        if len(dtypes) not in (1, self.expected_num_layers):
            raise ValueError(
                f"model_kv_cache_dtypes has {len(dtypes)} entries; give one dtype for the whole "
                f"model or one dtype per model layer ({self.expected_num_layers})"
            )
        surrogates = {torch_surrogate(dtype) for dtype in dtypes}
        if len(surrogates) == 1 and next(iter(surrogates)) != self.paged_kv_cache.dtype:
            raise ValueError(
                f"paged_kv_cache.dtype {self.paged_kv_cache.dtype} disagrees with the "
                f"model-owned KV cache dtype {dtypes[0]!r} "
                f"(torch surrogate {next(iter(surrogates))})"
            )

    @classmethod
    def resolve(
        cls,
        *,
        trace: TraceConfig,
        paged_kv_cache: PagedKVCacheConfig,
        expected_num_layers: object,
        expected_kv_heads_per_device: object = None,
        expected_head_dim: object = None,
        model_kv_cache_dtype: object,
    ) -> VLLMAdapterConfig:
        """Validate the collaborators once and fix the model's KV expectations."""
        _exact_type("trace", trace, TraceConfig)
        _exact_type("paged_kv_cache", paged_kv_cache, PagedKVCacheConfig)
        return cls(
            trace=trace,
            paged_kv_cache=paged_kv_cache,
            expected_num_layers=_positive_integer("expected_num_layers", expected_num_layers),
            expected_kv_heads_per_device=_optional_positive_integer(
                "expected_kv_heads_per_device", expected_kv_heads_per_device
            ),
            expected_head_dim=_optional_positive_integer("expected_head_dim", expected_head_dim),
            model_kv_cache_dtypes=_dtype_tuple(model_kv_cache_dtype),
        )

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """The one torch dtype an engine must allocate with (per-layer dtypes must agree)."""
        surrogates = {torch_surrogate(dtype) for dtype in self.model_kv_cache_dtypes}
        if len(surrogates) != 1:
            raise ValueError(
                f"the model's per-layer KV dtypes {self.model_kv_cache_dtypes} have no unique "
                "torch surrogate; a single engine dtype cannot describe them"
            )
        return next(iter(surrogates))


# --------------------------------------------------------------------------------------------
# Argument conversion
# --------------------------------------------------------------------------------------------


def _as_tensor(name: str, value: object, dtype: torch.dtype) -> torch.Tensor:
    """A tensor (`.to`), a numpy array or a list (`torch.as_tensor`) as `dtype`."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype)
    if isinstance(value, np.ndarray | np.generic | list | tuple):
        try:
            return torch.as_tensor(value, dtype=dtype)
        except (TypeError, ValueError, RuntimeError) as error:
            raise ValueError(f"{name} could not be read as a {dtype} tensor: {error}") from error
    raise TypeError(
        f"{name} must be a torch.Tensor, a numpy array or a list of integers, got "
        f"{type(value).__name__}"
    )


def _optional_tensor(name: str, value: object, dtype: torch.dtype) -> torch.Tensor | None:
    return None if value is None else _as_tensor(name, value, dtype)


def _slot_list(value: object) -> list[int] | None:
    """Global slots as a list of ints (numpy arrays and tensors are flattened)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor | np.ndarray):
        return [int(slot) for slot in value.reshape(-1).tolist()]
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        slots: list[int] = []
        for index, slot in enumerate(value):
            if isinstance(slot, bool | np.bool_) or not isinstance(slot, numbers.Integral):
                raise TypeError(f"empty_slots[{index}] must be an integer slot, got {slot!r}")
            slots.append(int(slot))
        return slots
    raise TypeError(
        f"empty_slots must be a list of global slots (or a numpy array), got {type(value).__name__}"
    )


def _sampling(value: object) -> SamplingParams | None:
    """The runtime's `SamplingParams`; an engine dataclass with the same field names is read."""
    if value is None or isinstance(value, SamplingParams):
        return value
    kind = type(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        known = {field.name for field in dataclasses.fields(value)}
    elif attrs.has(kind):
        known = {field.name for field in attrs.fields(kind)}
    else:
        raise TypeError(
            "sampling_params must be a runtime.sampling.SamplingParams or a dataclass with its "
            f"fields {list(_SAMPLING_FIELDS)}, got {type(value).__name__}"
        )
    fields: dict[str, Any] = {}  # per-field value types differ; SamplingParams checks them
    for name in _SAMPLING_FIELDS:
        item = getattr(value, name, None) if name in known else None
        if item is None:
            continue
        if isinstance(item, np.ndarray | torch.Tensor):
            item = item.tolist()
        if name == "num_logprobs":
            item = _logprob_counts(item)
        fields[name] = item
    return SamplingParams(**fields)


def _logprob_counts(value: object) -> int | list[int]:
    """The engine encodes "no log-probs" as a negative count (-2); the runtime uses 0."""
    if isinstance(value, list | tuple):
        return [max(0, int(item)) for item in value]
    if not isinstance(value, int | float | np.integer | np.floating):
        raise TypeError(f"sampling_params num_logprobs must be integers, got {value!r}")
    return max(0, int(value))


# --------------------------------------------------------------------------------------------
# The adapter
# --------------------------------------------------------------------------------------------


class VLLMAdapter:
    """Normalizes engine calls for one executor; holds nothing but its `config`."""

    __slots__ = ("config",)

    def __init__(self, config: VLLMAdapterConfig) -> None:
        if not isinstance(config, VLLMAdapterConfig):
            raise TypeError(f"config must be a VLLMAdapterConfig, got {type(config).__name__}")
        self.config = config

    # -- policy ----------------------------------------------------------------------------------

    def check_enable_trace(self, operation: Operation, enable_trace: object) -> bool:
        """`enable_trace` must be a real bool and True only where the static policy traces."""
        if type(enable_trace) is not bool:
            raise TypeError(
                f"enable_trace must be a bool (True or False) for {operation}, got "
                f"{enable_trace!r} of type {type(enable_trace).__name__}"
            )
        trace = self.config.trace
        static = trace.prefill_enabled if "prefill" in operation else trace.decode_enabled
        if enable_trace and not static:
            raise ValueError(
                f"enable_trace=True for {operation} disagrees with static TraceConfig policy "
                f"({static}); trace mode {trace.mode!r} does not trace it. Tell the engine the "
                "same trace mode the facade was built with, or pass enable_trace=False"
            )
        return enable_trace

    def _compatibility(
        self, operation: Operation, compatibility_kwargs: Mapping[str, object] | None
    ) -> dict[str, object]:
        """The forwarded compatibility values (None when absent); unknown names refused."""
        forwarded: dict[str, object] = dict.fromkeys(FORWARDED_VLLM_KWARGS)
        if compatibility_kwargs is None:
            return forwarded
        if not isinstance(compatibility_kwargs, Mapping):
            raise TypeError(
                f"compatibility_kwargs must be a mapping, got {type(compatibility_kwargs).__name__}"
            )
        for name in compatibility_kwargs:
            if name not in IGNORED_VLLM_KWARGS:
                raise TypeError(f"{operation} got an unexpected keyword argument {name!r}")
        for name in FORWARDED_VLLM_KWARGS:
            if name in compatibility_kwargs:
                forwarded[name] = compatibility_kwargs[name]
        return forwarded

    # -- calls -----------------------------------------------------------------------------------

    def normalize_prefill(
        self,
        tokens: object,
        page_table: object,
        *,
        enable_trace: bool,
        prompt_lens: object = None,
        start_pos: object = None,
        empty_slots: object = None,
        kv_cache: object = None,
        sampling_params: object = None,
        compatibility_kwargs: Mapping[str, object] | None = None,
    ) -> tuple[NormalizedPrefillKwargs, bool]:
        """Executor keywords for one prefill call and the validated `enable_trace`."""
        trace = self.check_enable_trace("prefill_forward", enable_trace)
        extra = self._compatibility("prefill_forward", compatibility_kwargs)
        normalized = NormalizedPrefillKwargs(
            tokens=_as_tensor("tokens", tokens, torch.long),
            page_table=_as_tensor("page_table", page_table, torch.int32),
            prompt_lens=_optional_tensor("prompt_lens", prompt_lens, torch.long),
            start_pos=_optional_tensor("start_pos", start_pos, torch.long),
            empty_slots=_slot_list(empty_slots),
            kv_cache=kv_cache,
            sampling_params=_sampling(sampling_params),
            prompt_tokens=extra["prompt_tokens"],
            output_tokens=extra["output_tokens"],
            slot_remap=extra["slot_remap"],
        )
        return normalized, trace

    def normalize_decode(
        self,
        tokens: object,
        start_pos: object,
        page_table: object,
        *,
        enable_trace: bool,
        kv_cache: object = None,
        sampling_params: object = None,
        reset_batch: bool = False,
        compatibility_kwargs: Mapping[str, object] | None = None,
    ) -> tuple[NormalizedDecodeKwargs, bool]:
        """Executor keywords for one decode step (`[B, 1]` tokens flattened to `[B]`)."""
        trace = self.check_enable_trace("decode_forward", enable_trace)
        extra = self._compatibility("decode_forward", compatibility_kwargs)
        flat_tokens = _as_tensor("tokens", tokens, torch.long)
        if flat_tokens.dim() == 2 and flat_tokens.shape[1] == 1:
            flat_tokens = flat_tokens.reshape(-1)
        normalized = NormalizedDecodeKwargs(
            tokens=flat_tokens,
            start_pos=_as_tensor("start_pos", start_pos, torch.long),
            page_table=_as_tensor("page_table", page_table, torch.int32),
            kv_cache=kv_cache,
            sampling_params=_sampling(sampling_params),
            prompt_tokens=extra["prompt_tokens"],
            output_tokens=extra["output_tokens"],
            slot_remap=extra["slot_remap"],
            reset_batch=reset_batch,
        )
        return normalized, trace

    # -- KV cache spec ---------------------------------------------------------------------------

    def resolve_legacy_kv_cache_config(
        self, kv_cache_shape: object, dtype: object, num_layers: object
    ) -> PagedKVCacheConfig:
        """A new resolved config for the engine's `(num_blocks, kv_heads, block_size, head_dim)`.

        The base config is never changed; capacity and block size come from the engine.
        """
        config = self.config
        if isinstance(kv_cache_shape, str | bytes) or not isinstance(
            kv_cache_shape, Sequence | torch.Size
        ):
            raise TypeError(
                "kv_cache_shape must be a sequence (num_blocks, kv_heads, block_size, head_dim), "
                f"got {type(kv_cache_shape).__name__}"
            )
        shape = tuple(kv_cache_shape)
        if len(shape) != 4:
            raise ValueError(
                "kv_cache_shape must have rank 4 (num_blocks, kv_heads, block_size, head_dim), "
                f"got {shape}"
            )
        num_blocks = _positive_integer("kv_cache_shape num_blocks", shape[0])
        kv_heads = _positive_integer("kv_cache_shape kv_heads", shape[1])
        block_size = _positive_integer("kv_cache_shape block_size", shape[2])
        head_dim = _positive_integer("kv_cache_shape head_dim", shape[3])
        expected_heads = config.expected_kv_heads_per_device
        if expected_heads is not None and kv_heads != expected_heads:
            raise ValueError(
                f"kv_cache_shape has {kv_heads} KV heads per device; the model has {expected_heads}"
            )
        if config.expected_head_dim is not None and head_dim != config.expected_head_dim:
            raise ValueError(
                f"kv_cache_shape head_dim {head_dim} does not match the model's head_dim "
                f"{config.expected_head_dim}"
            )
        if isinstance(num_layers, bool) or num_layers != config.expected_num_layers:
            raise ValueError(
                f"num_layers {num_layers!r} does not match the model's "
                f"{config.expected_num_layers} layers"
            )
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        expected_dtype = config.kv_cache_torch_dtype
        if dtype != expected_dtype:
            raise ValueError(
                f"KV cache dtype {dtype} does not match the model-owned KV cache dtype "
                f"{expected_dtype}; start the engine with that dtype"
            )
        base = config.paged_kv_cache
        if base.num_blocks is not None and base.num_blocks != num_blocks:
            raise ValueError(
                f"paged KV capacity is already resolved to {base.num_blocks} blocks; the engine "
                f"asked for {num_blocks}"
            )
        return attrs.evolve(
            base, block_size=block_size, max_num_blocks=num_blocks, num_blocks=num_blocks
        )

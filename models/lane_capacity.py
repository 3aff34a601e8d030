"""Capacity checks of one lane: device memory for its KV cache, a server's cache spec, and
the extent a serving engine warms up for.

Each runs before any device work, so a refused capacity leaves the lane as it was.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.backends.base import Device
from runtime.backends.memory import available_memory_bytes, format_bytes
from runtime.paged_kv_cache import PagedKVCacheManager
from runtime.validation import is_int


class KVCapacityError(ValueError):
    """The paged KV cache asked for does not fit in the memory the device has left."""


def check_kv_memory(manager: PagedKVCacheManager, device: Device, num_blocks: int) -> None:
    """Refuse a KV cache of `num_blocks` blocks larger than the memory `device` has left."""
    needed = manager.bytes_per_block * num_blocks
    available = available_memory_bytes(device.torch_device)
    if available is not None and needed > available:
        per_block = needed // max(1, num_blocks)
        raise KVCapacityError(
            f"a paged KV cache of {num_blocks} blocks needs {format_bytes(needed)} "
            f"({format_bytes(per_block)} per block of {manager.config.block_size} tokens) but "
            f"only {format_bytes(available)} is available on {device.name}; at most "
            f"{available // max(1, per_block)} blocks fit"
        )


def server_cache_blocks(
    manager: PagedKVCacheManager,
    kv_cache_shape: Sequence[int] | None,
    dtype: torch.dtype | None,
    num_layers: int | None,
) -> int | None:
    """The block count a server's physical cache spec asks for (None: no spec given).

    A server passes its spec whole (shape, dtype and layer count) or not at all; the spec
    must match the model's layers, block size and dtype.
    """
    given = [value is not None for value in (kv_cache_shape, dtype, num_layers)]
    if any(given) and not all(given):
        raise TypeError(
            "allocate_kv_cache takes kv_cache_shape, dtype and num_layers together or not at all"
        )
    if kv_cache_shape is None:
        return None
    shape = tuple(kv_cache_shape)
    if len(shape) != 4:
        raise ValueError(
            f"kv_cache_shape must have rank 4 [num_blocks, kv_heads, block_size, "
            f"head_dim], got {shape}"
        )
    if num_layers != manager.num_layers:
        raise ValueError(
            f"num_layers {num_layers} does not match the model's {manager.num_layers} layers"
        )
    manager.validate_vllm_cache_spec(block_size=shape[2], dtype=dtype, num_blocks=shape[0])
    return shape[0]


def check_server_cache_shape(manager: PagedKVCacheManager, kv_cache_shape: Sequence[int]) -> None:
    """Once capacity is resolved, the server's shape must be every layer's model shape."""
    expected = manager.cache_shapes
    if any(tuple(kv_cache_shape) != shape for shape in expected):
        raise ValueError(
            f"kv_cache_shape {tuple(kv_cache_shape)} does not match the model-derived "
            f"shapes {sorted(set(expected))}"
        )


def check_warmup_extent(
    lane_capacity: int, physical_blocks: int, max_batch_size: object, num_blocks: object
) -> None:
    """A decode warmup may ask for at most the lane's rows and the allocated blocks."""
    if max_batch_size is not None and (
        not is_int(max_batch_size) or not 1 <= max_batch_size <= lane_capacity
    ):
        raise ValueError(
            f"max_batch_size={max_batch_size!r} is outside the lane capacity: allowed is an "
            f"int in 1..{lane_capacity} (ModelExecutorConfig.max_batch_size); decode always "
            "runs the whole lane"
        )
    if num_blocks is not None and (
        not is_int(num_blocks) or not 1 <= num_blocks <= physical_blocks
    ):
        raise ValueError(
            f"num_blocks={num_blocks!r} is outside the allocated paged KV cache: allowed is "
            f"an int in 1..{physical_blocks} (the resolved num_blocks)"
        )

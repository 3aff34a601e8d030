"""The caller-input checks of `DecoderModel`'s public calls (the `PagedModel` contract).

The model is itself a public boundary: engineers bringing a family up call `prefill`/`decode`
directly, and the runtime's own checks (`DecodeRuntime.prepare`, the prefill planner) cover
its plans, not every value a direct call can pass. Shape and dtype checks read no tensor
values, so they are legal inside a CUDA-graph capture; the value checks (page-table entries,
positions) read the host and are skipped while capturing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.model_contract import PagedAttentionConfig
from runtime.validation import check_block_ids, is_int

LayerCaches = tuple[tuple[torch.Tensor, torch.Tensor], ...]


def check_paged_geometry(block_size: object, max_num_blocks: object) -> None:
    """`configure_paged_attention`'s arguments: positive integers."""
    for name, value in (("block_size", block_size), ("max_num_blocks", max_num_blocks)):
        if not is_int(value) or value <= 0:
            raise ValueError(f"{name}={value!r} is invalid: allowed is a positive integer")


def check_kv_cache(
    cache: object,
    paged: PagedAttentionConfig,
    *,
    n_layers: int,
    n_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> LayerCaches:
    """The per-layer `(K, V)` pairs of `cache`, each `[num_blocks, n_kv_heads, block_size,
    head_dim]` of the model's dtype and device, contiguous; or the first problem, raised."""
    if isinstance(cache, torch.Tensor) or not isinstance(cache, Sequence):
        raise TypeError(
            f"cache must be a sequence of (K, V) pairs, one per layer, got {type(cache).__name__}"
        )
    if len(cache) != n_layers:
        raise ValueError(f"cache has {len(cache)} layer(s): allowed is exactly n_layers={n_layers}")
    expected_tail = (n_kv_heads, paged.block_size, head_dim)
    num_blocks: int | None = None
    bound: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i, pair in enumerate(cache):
        if isinstance(pair, torch.Tensor) or len(pair) != 2:
            raise ValueError(f"cache[{i}] must be a (K, V) pair")
        for which, tensor in zip("KV", pair, strict=True):
            where = f"cache[{i}].{which}"
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{where} must be a torch.Tensor, got {type(tensor).__name__}")
            shape = tuple(tensor.shape)
            if len(shape) != 4 or shape[1:] != expected_tail:
                raise ValueError(
                    f"{where} has shape {list(shape)}: allowed is [num_blocks, "
                    f"{expected_tail[0]}, {expected_tail[1]}, {expected_tail[2]}] "
                    "([num_blocks, n_kv_heads, block_size, head_dim])"
                )
            if num_blocks is None:
                num_blocks = shape[0]
            if shape[0] != num_blocks or not 0 < shape[0] <= paged.max_num_blocks:
                raise ValueError(
                    f"{where} has {shape[0]} blocks: allowed is the same count in every "
                    f"layer ({num_blocks}), between 1 and max_num_blocks={paged.max_num_blocks}"
                )
            _check_tensor_home(where, tensor, dtype, device)
        bound.append((pair[0], pair[1]))
    return tuple(bound)


def _check_tensor_home(
    where: str, tensor: torch.Tensor, dtype: torch.dtype, device: torch.device
) -> None:
    if tensor.dtype != dtype:
        raise ValueError(
            f"{where} has dtype {tensor.dtype}: allowed is the model's KV dtype {dtype}"
        )
    if tensor.device != device:
        raise ValueError(f"{where} is on {tensor.device}: allowed is the model device {device}")
    if not tensor.is_contiguous():
        raise ValueError(f"{where} is not contiguous: allowed are contiguous tensors")


def check_page_table_layout(page_table: torch.Tensor, batch: int) -> None:
    """Shape and dtype only: reads no values, so it is legal inside a capture."""
    if page_table.dim() != 2 or page_table.shape[0] != batch:
        raise ValueError(f"page_table has shape {list(page_table.shape)}: allowed is [{batch}, W]")
    if page_table.dtype.is_floating_point or page_table.dtype == torch.bool:
        raise ValueError(f"page_table has dtype {page_table.dtype}: allowed is an integer dtype")


def check_page_table(page_table: torch.Tensor, batch: int, num_blocks: int) -> None:
    """Layout, then entries: -1 (unmapped) or a block id of the bound cache (a host read)."""
    check_page_table_layout(page_table, batch)
    check_block_ids(page_table, num_blocks)


def check_decode_shapes(
    tokens: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor
) -> None:
    """A decode's `tokens` `[B]`, `positions` `[B]` and `page_table` `[B, W]` (no value reads)."""
    if tokens.dim() != 1:
        raise ValueError(f"tokens has shape {list(tokens.shape)}: allowed is [B]")
    batch = tokens.shape[0]
    if positions.shape != (batch,):
        raise ValueError(f"positions has shape {list(positions.shape)}: allowed is [{batch}]")
    check_page_table_layout(page_table, batch)


def check_prefill_shapes(
    tokens: torch.Tensor,
    page_table: torch.Tensor,
    prompt_lens: torch.Tensor,
    chunk_start: torch.Tensor,
) -> None:
    """A prefill's chunk `tokens` `[B, S >= 1]`, per-row `[B]` values and `[B, W]` table."""
    if tokens.dim() != 2:
        raise ValueError(f"tokens has shape {list(tokens.shape)}: allowed is [B, S]")
    batch, seq = tokens.shape
    if seq == 0:
        raise ValueError("tokens has 0 columns: allowed is a chunk of at least one token")
    for name, value in (("prompt_lens", prompt_lens), ("chunk_start", chunk_start)):
        if value.shape != (batch,):
            raise ValueError(f"{name} has shape {list(value.shape)}: allowed is [{batch}]")
    check_page_table_layout(page_table, batch)


def decode_extent(
    pos: torch.Tensor | list[int], *, width: int, block_size: int, max_seq_len: int
) -> int:
    """Host check of active positions `pos` (non-empty): below max_seq_len, pages to hold
    them. Returns the highest position."""
    top = max(pos) if isinstance(pos, list) else int(pos.max())
    if top >= max_seq_len:
        raise ValueError(
            f"positions up to {top} exceed max_seq_len={max_seq_len}: allowed are "
            "positions < max_seq_len"
        )
    n_blocks = top // block_size + 1
    if n_blocks > width:
        raise ValueError(
            f"page_table is too narrow: width {width}, but position {top} needs "
            f"{n_blocks} block(s) of {block_size} tokens"
        )
    return top


def prefill_extent(
    lens: torch.Tensor,
    start: torch.Tensor,
    *,
    seq: int,
    block_size: int,
    width: int,
    max_seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate chunk starts and lengths on the host; `(real, start)` per row.

    `real` counts each row's real tokens in this chunk; rows without any read from 0.
    """
    if bool((start < 0).any()):
        raise ValueError(f"chunk_start={start.tolist()} is invalid: allowed are values >= 0")
    real = (lens - start).clamp(min=0, max=seq)  # real tokens of each row in this chunk
    # Rows with nothing to do in this chunk (padding, or prompt already done) read nothing.
    start = torch.where(real > 0, start, torch.zeros_like(start))
    end = start + real
    if bool((end > max_seq_len).any()):
        raise ValueError(
            f"prompt positions up to {int(end.max()) - 1} exceed max_seq_len="
            f"{max_seq_len}: allowed are positions < max_seq_len"
        )
    needed = int(((end + block_size - 1) // block_size).max())
    if needed > width:
        raise ValueError(
            f"page_table is too narrow: width {width}, but a row needs {needed} block(s) "
            f"of {block_size} tokens"
        )
    return real, start

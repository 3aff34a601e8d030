"""Warmup's choice between the in-place decode attention's two prefetch placements.

The native kernel (`native/paged_decode_attention.c`) reads each page of K/V, then runs the
page's math from L1; the next page is prefetched either into L1 during that read pass
(`paged_inplace`) or into L2, most of it during the read pass and all of it again a few
lines at a time through the math (`paged_inplace_spread`). The
results are identical; the speed depends on the CPU. On Zen 4, whose math is twice Zen 5's,
the spread placement took a batch-32 step's attention from 19.7 to 14.5 ms, while on Zen 5
spreading prefetches through the math measured slower (`benchmarks/RESULTS.md`). So warmup
times both on a K/V cache larger than the last-level cache, once per process and geometry.
"""

from __future__ import annotations

import time

import torch

from models.decoder.kernels import READ_PASS, SPREAD
from runtime.backends import native_kernels

# K/V bytes the timing reads in one call: twice the 32 MiB L3 these 2-core hosts show, so
# that both placements are timed reading memory, where they differ; freed right after, and
# small next to a model's weights (the peak RSS of a SmolLM2 Q4_1 run is ~420 MB).
TIMED_BYTES = 64 << 20
_BLOCK_SIZE = 32
_ROUNDS = 3

_ChoiceKey = tuple[int, int, int, torch.dtype, int]
_CHOSEN: dict[_ChoiceKey, tuple[str, str]] = {}


def choose_in_place_attention(
    *, n_kv_heads: int, group: int, head_dim: int, dtype: torch.dtype
) -> tuple[str, str]:
    """The faster placement for this geometry and cache dtype, and a note with both times."""
    kv_dtype = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
    key = (n_kv_heads, group, head_dim, kv_dtype, torch.get_num_threads())
    chosen = _CHOSEN.get(key)
    if chosen is None:
        read_pass, spread = _time_placements(n_kv_heads, group, head_dim, kv_dtype)
        kind = SPREAD if spread < read_pass else READ_PASS
        note = (
            f"decode attention prefetch timed over {TIMED_BYTES >> 20} MiB of K/V: "
            f"read pass {read_pass * 1e3:.2f} ms, spread through the math {spread * 1e3:.2f} ms"
        )
        chosen = _CHOSEN[key] = (kind, note)
    return chosen


def _time_placements(
    n_kv_heads: int, group: int, head_dim: int, dtype: torch.dtype
) -> tuple[float, float]:
    """Best seconds of one call reading `TIMED_BYTES` of K/V: read pass, then spread.

    32 rows of equal length over pages in shuffled order, as a batch-32 step's pages lie
    after many requests; the two placements alternate so that drift hits both alike.
    """
    rows = 32
    token_bytes = 2 * n_kv_heads * head_dim * dtype.itemsize
    pages_per_row = max(1, TIMED_BYTES // (token_bytes * _BLOCK_SIZE * rows))
    blocks = rows * pages_per_row
    generator = torch.Generator().manual_seed(0)
    shape = (blocks, n_kv_heads, _BLOCK_SIZE, head_dim)
    # Written, not zeroed: untouched zero pages would all map to one page that stays cached.
    k_cache = torch.rand(shape, generator=generator).to(dtype)
    v_cache = torch.rand(shape, generator=generator).to(dtype)
    pages = torch.randperm(blocks, generator=generator).reshape(rows, pages_per_row)
    n_keys = torch.full((rows,), pages_per_row * _BLOCK_SIZE, dtype=torch.int64)
    q = torch.rand(rows, n_kv_heads, group, head_dim, generator=generator)
    attention = native_kernels.paged_decode_attention()
    scale = head_dim**-0.5
    best = [float("inf"), float("inf")]
    for _ in range(_ROUNDS):
        for index, spread in enumerate((False, True)):
            start = time.perf_counter()
            attention.unchecked(q, k_cache, v_cache, pages, n_keys, scale, spread=spread)
            best[index] = min(best[index], time.perf_counter() - start)
    return best[0], best[1]

"""Transparent huge pages for large CPU allocations (the paged KV cache above all).

Why: a decode step's attention visits the K/V pages of every row, scattered over the cache.
With 4 KiB memory pages each visit costs a TLB miss, and the memory under one KV page is a
few unrelated 4 KiB frames. Asking Linux for 2 MiB pages (`madvise(MADV_HUGEPAGE)` before the
memory is first touched) measured on Zen 4, batch 32, 405 MB of K/V, 20 rounds alternating
with a read probe: attention 1.36 -> 1.26x of the read floor (median), its page walk 1.27 ->
1.20x. Elsewhere than Linux, or where the kernel's THP setting is `never`, this is a no-op.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from collections.abc import Callable, Sequence

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h
# Below two huge pages the aligned interior is too small to be worth a system call.
MIN_BYTES = 2 * HUGE_PAGE


def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    advise: Callable[[int, int, int], int] = function
    return advise


_MADVISE = _madvise()


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask for huge pages over the 2 MiB-aligned interior of a CPU tensor's memory; effective
    for memory not yet touched. True when the advice was taken."""
    if _MADVISE is None or tensor.device.type != "cpu":
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = (start + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    last = end // HUGE_PAGE * HUGE_PAGE
    if last - first < HUGE_PAGE or end - start < MIN_BYTES:
        return False
    if _MADVISE(first, last - first, MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
        return False
    return True


def full(
    dims: Sequence[int], fill: float, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """`torch.full`, on huge pages where the allocation is on the CPU and large enough."""
    tensor = torch.empty(tuple(dims), dtype=dtype, device=device)
    advise_huge_pages(tensor)
    return tensor.fill_(fill)

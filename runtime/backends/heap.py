"""Hand the C heap's free pages back to the kernel after a phase that frees a lot (glibc).

Why: glibc keeps memory freed inside its heap resident (and, once large blocks were freed,
serves blocks up to that size from the heap rather than fresh maps). Loading weights (block
parts joined, temporaries dropped) and warmup's kernel timing (each projection tried in
layouts it then drops) leave tens to hundreds of MB of such free memory, which would count in
the process's resident size for its whole life. `malloc_trim(0)` returns those pages.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None where the C library has none (musl, macOS)."""
    try:
        libc = ctypes.CDLL(None)  # the symbols already loaded: the process's C library
    except OSError:
        return None
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    function: Callable[[int], int] = trim
    return function


def heap_trim_available() -> bool:
    """Whether `release_free_heap` can do anything here (glibc's `malloc_trim` exists)."""
    return _malloc_trim() is not None


def release_free_heap() -> bool:
    """`malloc_trim(0)` where glibc has it: True when pages went back to the kernel."""
    trim = _malloc_trim()
    return trim is not None and bool(trim(0))

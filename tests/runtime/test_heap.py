"""`release_free_heap` gives memory freed inside the C heap back to the kernel (glibc)."""

from __future__ import annotations

import ctypes
import platform

import pytest

from runtime.backends.heap import heap_trim_available, release_free_heap

_CHUNK = 64 * 1024  # under glibc's mmap threshold: served from the heap itself
_COUNT = 768  # 48 MiB


def _resident() -> int:
    with open("/proc/self/statm", encoding="ascii") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_freed_heap_pages_leave_the_resident_set() -> None:
    assert heap_trim_available()
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    chunks = [libc.malloc(_CHUNK) for _ in range(_COUNT)]
    guard = libc.malloc(_CHUNK)  # keeps the freed run off the heap's top, which free() trims
    for chunk in chunks:
        ctypes.memset(chunk, 1, _CHUNK)
    for chunk in chunks:
        libc.free(chunk)
    before = _resident()
    assert release_free_heap()
    released = before - _resident()
    libc.free(guard)
    assert released > _CHUNK * _COUNT // 2, released
    release_free_heap()  # nothing left to give: still safe to call

"""Ownership helpers: release owned tensor trees best-effort, retry what failed, report it.

Owners (KV cache, compilers, decode staging, the executor) release what they own exactly once,
keep going when one release fails, retry the failures later, and attach them to the primary
error as ``cleanup_failures``. These helpers implement that contract over the `Device`
protocol, so they work for every backend.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Iterator, MutableSequence
from typing import Any

import attrs
import torch

from lifecycle.errors import (
    CLEANUP_NOTE_PREFIX,
    attach_cleanup_failures,
    raise_cleanup_failures,
)
from runtime.backends.base import Device

__all__ = [
    "CLEANUP_NOTE_PREFIX",
    "TensorResourceOrphan",
    "attach_cleanup_failures",
    "best_effort_deallocate_owned_tensors",
    "deallocate_owned_tensors",
    "raise_cleanup_failures",
    "release_or_orphan",
    "release_orphans",
    "trim_host_allocator",
]

logger = logging.getLogger(__name__)


@attrs.define(eq=False)
class TensorResourceOrphan:
    """An owned tensor tree whose release partially failed.

    Retrying (`release`) walks `values` again; `deallocated_tensor_ids` remembers what was
    already released so a retry never deallocates a tensor twice. `values` keeps the tree
    alive, so the recorded ids cannot be reused by other objects meanwhile.
    """

    values: Any
    device: Device
    deallocated_tensor_ids: set[int] = attrs.field(factory=set)

    def release(self) -> list[BaseException]:
        """Retry the release; returns the failures that remain (empty when fully released)."""
        return best_effort_deallocate_owned_tensors(
            self.values, self.device, self.deallocated_tensor_ids
        )


def _owned_tensor_values(value: object) -> Any:
    method = getattr(value, "owned_tensor_values", None)
    return method() if callable(method) else _NOT_AN_OWNER


_NOT_AN_OWNER = object()


def _iter_owned_leaves(
    value: Any, device: Device, completed: set[int], failures: list[BaseException] | None
) -> Iterator[Any]:
    """Yield each owned, not yet completed leaf of `value` once, depth first in order.

    Containers are walked: dict values, list/tuple/set/frozenset items, and the result of an
    object's callable ``owned_tensor_values()``. Anything else is a leaf; a leaf the device
    does not own (borrowed, foreign, already released) is skipped. When `failures` is given,
    an ``owned_tensor_values()`` or ``is_owned`` error is collected and the walk continues;
    otherwise it propagates.
    """
    visited: set[int] = set()
    keepalive: list[object] = []  # walked objects must outlive their ids during the walk
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if item is None:
            continue  # an absent optional value: nothing to walk or release
        key = id(item)
        if key in visited:
            continue
        visited.add(key)
        keepalive.append(item)
        if isinstance(item, torch.Tensor):
            # A tensor is always a leaf (it never owns values): skip the owner lookup.
            if key not in completed and device.is_owned(item):
                yield item
            continue
        if isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
            continue
        if isinstance(item, list | tuple | set | frozenset):
            stack.extend(reversed(list(item)))
            continue
        try:
            children = _owned_tensor_values(item)
            if children is not _NOT_AN_OWNER:
                stack.append(children)
                continue
            if id(item) in completed or not device.is_owned(item):
                continue
        except Exception as exc:
            if failures is None:
                raise
            logger.warning("walking owned values of %s failed: %r", type(item).__name__, exc)
            failures.append(exc)
            continue
        yield item


def best_effort_deallocate_owned_tensors(
    value: Any, device: Device, completed: set[int] | None = None
) -> list[BaseException]:
    """Deallocate every owned tensor in `value`; collect failures instead of stopping.

    `completed` (tensor ids already released) is updated in place, so passing the same set on
    a retry never deallocates a tensor twice. Returns the failures, empty when all succeeded.
    """
    done = completed if completed is not None else set()
    failures: list[BaseException] = []
    for tensor in _iter_owned_leaves(value, device, done, failures):
        try:
            device.deallocate(tensor)
        except Exception as exc:
            logger.warning("deallocating an owned tensor failed: %r", exc)
            failures.append(exc)
            continue
        done.add(id(tensor))
    return failures


def deallocate_owned_tensors(value: Any, device: Device, completed: set[int] | None = None) -> None:
    """Strict variant: deallocate owned tensors in `value`, raising on the first failure.

    Tensors released before the failure are recorded in `completed` (when given), so a caller
    can fall back to `best_effort_deallocate_owned_tensors` with the same set.
    """
    done = completed if completed is not None else set()
    for tensor in _iter_owned_leaves(value, device, done, None):
        device.deallocate(tensor)
        done.add(id(tensor))


def release_or_orphan(
    value: Any, device: Device
) -> tuple[TensorResourceOrphan | None, list[BaseException]]:
    """Release `value` best-effort; on failure return an orphan that a later retry can finish."""
    done: set[int] = set()
    failures = best_effort_deallocate_owned_tensors(value, device, done)
    if not failures:
        return None, failures  # the per-step case: no orphan record is built
    return TensorResourceOrphan(values=value, device=device, deallocated_tensor_ids=done), failures


def release_orphans(orphans: MutableSequence[TensorResourceOrphan]) -> list[BaseException]:
    """Retry every orphan in place; keep only those that still fail; return all failures."""
    failures: list[BaseException] = []
    remaining: list[TensorResourceOrphan] = []
    for orphan in list(orphans):
        orphan_failures = orphan.release()
        if orphan_failures:
            remaining.append(orphan)
            failures.extend(orphan_failures)
    orphans[:] = remaining
    return failures


_malloc_trim: Any = None
_malloc_trim_looked_up = False


def trim_host_allocator() -> bool:
    """Return freed host heap to the OS (glibc ``malloc_trim(0)``); no-op where unavailable.

    Large host staging buffers freed after a run otherwise stay in the process heap. Returns
    whether a trim was performed.
    """
    global _malloc_trim, _malloc_trim_looked_up
    if not _malloc_trim_looked_up:
        _malloc_trim_looked_up = True
        library = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(library) if library else None
            _malloc_trim = getattr(libc, "malloc_trim", None)
        except OSError as exc:
            logger.debug("libc is not loadable (%r); trim_host_allocator is a no-op", exc)
            _malloc_trim = None
        if _malloc_trim is not None:
            _malloc_trim.argtypes = [ctypes.c_size_t]
            _malloc_trim.restype = ctypes.c_int
    if _malloc_trim is None:
        return False
    _malloc_trim(0)
    return True

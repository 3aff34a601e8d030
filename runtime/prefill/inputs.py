"""Prefill staging: the host inputs of one model invocation and their device copies.

One invocation (a chunk of a planned request) needs four tensors: the chunk's token slice
`[B, S]`, the request's page table `[B, W]` (regular requests: `-1` beyond each row's
allocated prefix; chunked requests: the full table with its non-negative filler), each row's
total prompt length `[B]` (0 for padding rows, so they write nothing) and each row's absolute
chunk start `[B]` (cached prefix plus the chunk's relative start).

Eager invocations copy them to owned transients; traces allocate them once as persistent
inputs and refresh them in place before every replay. A refresh checks the whole structure
(and every shape and dtype) before it copies anything, so a mismatch never leaves a
persistent input half refreshed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import overload

import attrs
import torch

from lifecycle.errors import attach_cleanup_failures
from runtime.backends.base import Device, DeviceTensor
from runtime.prefill.request import PrefillChunk, PrefillRequest, chunk_tokens

logger = logging.getLogger(__name__)

ReleaseTransient = Callable[[object], list[BaseException]]
"""Release an owned value tree best-effort; failures are returned (and retried later)."""

INPUT_FIELDS: tuple[str, ...] = ("tokens", "page_table", "prompt_lens", "chunk_start")
"""What every invocation stages, and what a trace replay refreshes."""


@attrs.frozen(eq=False)
class PrefillHostInputs:
    """Host tensors of one invocation: tokens int64, page table int32, lengths/starts int64."""

    tokens: torch.Tensor
    page_table: torch.Tensor
    prompt_lens: torch.Tensor
    chunk_start: torch.Tensor

    def values(self) -> tuple[torch.Tensor, ...]:
        """In `INPUT_FIELDS` order."""
        return (self.tokens, self.page_table, self.prompt_lens, self.chunk_start)


@attrs.frozen(eq=False)
class PrefillDeviceInputs:
    """Device copies of `PrefillHostInputs` (owned transients, or trace-owned persistents)."""

    tokens: DeviceTensor
    page_table: DeviceTensor
    prompt_lens: DeviceTensor
    chunk_start: DeviceTensor

    def values(self) -> tuple[DeviceTensor, ...]:
        """In `INPUT_FIELDS` order."""
        return (self.tokens, self.page_table, self.prompt_lens, self.chunk_start)

    def owned_tensor_values(self) -> tuple[DeviceTensor, ...]:
        """What a release walks."""
        return self.values()


def _chunk_of(request: PrefillRequest, chunk: PrefillChunk | None) -> PrefillChunk:
    if chunk is None:
        return request.first_chunk
    for planned in request.chunks:
        if chunk is planned:
            return chunk
    if not isinstance(chunk, PrefillChunk):
        raise TypeError(f"chunk must be a PrefillChunk or None, got {type(chunk).__name__}")
    if not any(chunk == planned for planned in request.chunks):
        raise ValueError(
            f"chunk {chunk.token_slice!r} at start {chunk.chunk_start_idx} is not one of the "
            f"{len(request.chunks)} planned chunks of the request for source rows "
            f"{request.source_rows}"
        )
    return chunk


def host_inputs(request: PrefillRequest, chunk: PrefillChunk | None = None) -> PrefillHostInputs:
    """Host inputs of `chunk` of `request` (default: its first chunk), padded geometry.

    Active rows carry their prompt length and absolute chunk start; padding rows carry 0 for
    both, which the model treats as "nothing to do". A planned request's chunk tokens are
    copied from the caller's token matrix (only the chunk's columns, `chunk_tokens`), so this
    raises if the caller changed its tokens or page table in place since planning.
    """
    step = _chunk_of(request, chunk)
    relative = step.token_slice.start
    batch = request.padded_batch_size
    starts = [cached + relative for cached in request.cached_tokens]
    if request.kind == "single" and starts[0] != step.chunk_start_idx:
        raise ValueError(
            f"chunk_start_idx {step.chunk_start_idx} disagrees with cached "
            f"{request.cached_tokens[0]} + relative start {relative}"
        )
    # Built from Python ints in one call each: element-wise tensor writes cost microseconds.
    if batch == 1:
        prompt_lens = torch.full((1,), request.prompt_lengths[0], dtype=torch.int64)
        chunk_start = torch.full((1,), starts[0], dtype=torch.int64)
    else:
        padding = [0] * (batch - len(starts))
        prompt_lens = torch.tensor([*request.prompt_lengths, *padding], dtype=torch.int64)
        chunk_start = torch.tensor([*starts, *padding], dtype=torch.int64)
    tokens = chunk_tokens(request, step)  # first: it checks the caller's tensors
    page_table = request.page_table
    if page_table.dtype != torch.int32:
        page_table = page_table.to(torch.int32)
    return PrefillHostInputs(
        tokens=tokens,
        page_table=page_table.contiguous(),
        prompt_lens=prompt_lens,
        chunk_start=chunk_start,
    )


@overload
def allocate_device_tensors(
    device: Device, hosts: Sequence[torch.Tensor], release: ReleaseTransient
) -> tuple[DeviceTensor, ...]: ...


@overload
def allocate_device_tensors(
    device: Device, hosts: Sequence[torch.Tensor | None], release: ReleaseTransient
) -> tuple[DeviceTensor | None, ...]: ...


def allocate_device_tensors(
    device: Device, hosts: Sequence[torch.Tensor | None], release: ReleaseTransient
) -> tuple[DeviceTensor | None, ...]:
    """Copy each host tensor to a new owned device tensor; `None` stays `None`.

    On failure, what was already allocated is released through `release` and its failures
    are attached to the primary error.
    """
    created: list[DeviceTensor | None] = []
    try:
        for host in hosts:
            created.append(None if host is None else device.from_host(host))
    except BaseException as error:
        attach_cleanup_failures(error, release(tuple(created)), note="staging prefill inputs")
        raise
    return tuple(created)


def _describe(value: object) -> str:
    if value is None:
        return "None"
    return f"{tuple(getattr(value, 'shape', ()))} {getattr(value, 'dtype', '?')}"


def copy_into_device_tensors(
    device: Device, hosts: Sequence[torch.Tensor | None], devices: Sequence[DeviceTensor | None]
) -> None:
    """Refresh persistent device tensors in place from `hosts`, all or nothing.

    The structure (length and which entries are `None`) and every shape and dtype are checked
    before the first copy, so a mismatch leaves every persistent tensor untouched.
    """
    hosts_none = tuple(host is None for host in hosts)
    devices_none = tuple(value is None for value in devices)
    if len(hosts) != len(devices) or hosts_none != devices_none:
        raise ValueError(
            f"host/device optional tensor structure changed: host entries "
            f"{[_describe(h) for h in hosts]}, device entries {[_describe(d) for d in devices]}"
        )
    for index, (host, target) in enumerate(zip(hosts, devices, strict=True)):
        if host is None:
            continue
        shape = tuple(getattr(target, "shape", ()))
        if tuple(host.shape) != shape or host.dtype != getattr(target, "dtype", None):
            raise ValueError(
                f"host/device tensor {index} changed geometry: host {_describe(host)}, "
                f"persistent {_describe(target)}; a persistent input keeps its shape and dtype"
            )
    for host, target in zip(hosts, devices, strict=True):
        if host is not None and target is not None:  # the structure check matched the Nones
            device.from_host(host, into=target)


class PrefillInputStager:
    """Stages invocation inputs on `device`; partial allocations go to `release_transient`."""

    def __init__(self, *, device: Device, release_transient: ReleaseTransient) -> None:
        self._device = device
        self._release = release_transient

    def host_inputs(
        self, request: PrefillRequest, chunk: PrefillChunk | None = None
    ) -> PrefillHostInputs:
        """See `host_inputs`."""
        return host_inputs(request, chunk)

    def trace_inputs(self, request: PrefillRequest) -> PrefillHostInputs:
        """What a trace is captured with: the first chunk (all physical rows of a wave)."""
        return host_inputs(request, request.first_chunk)

    def stage(self, host: PrefillHostInputs) -> PrefillDeviceInputs:
        """New owned device copies of `host` (released by the caller, or here on failure)."""
        tokens, page_table, prompt_lens, chunk_start = allocate_device_tensors(
            self._device, host.values(), self._release
        )
        return PrefillDeviceInputs(tokens, page_table, prompt_lens, chunk_start)

    def refresh(self, host: PrefillHostInputs, persistent: PrefillDeviceInputs) -> None:
        """Copy `host` into `persistent` in place (all checks before the first copy)."""
        copy_into_device_tensors(self._device, host.values(), persistent.values())

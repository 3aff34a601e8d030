"""Decode value types and host-side staging helpers (reference §2.15, rule 20).

`runtime.decode` owns the decode lifecycle; this module holds what it stages and returns from
a checked `PreparedDecode` (`runtime.decode_batch`): device inputs, invocation results,
external output leases, trace capture plans and persistent inputs, plus the two pure host
transformations decode needs every step: page-table normalisation (with identity caching)
and output normalisation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeAlias

import attrs
import torch

from runtime.backends.base import Device
from runtime.config import PageTableLayout
from runtime.decode_batch import PreparedDecode
from runtime.identity import ProgramKey
from runtime.output_reader import OUTPUT_READ_TABLE, PendingRead, ReadState
from runtime.sampling import PreparedSamplingParams
from runtime.trace_compiler import (
    InputRefreshPolicy,
    PersistentInputs,
    TraceArtifact,
    TraceCapturePlan,
)

logger = logging.getLogger(__name__)

DecodeHostOutput: TypeAlias = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""A read decode step: float32 logits `[lane, 1, vocab]`, int64 tokens `[lane]`, or
`(tokens, float32 log_probs [lane])`."""

DECODE_REFRESH_POLICY = InputRefreshPolicy(every_replay=("sampling",))
"""Decode replays refresh sampling inputs every time; everything else per the decision."""


# --------------------------------------------------------------------------------------------
# Device values
# --------------------------------------------------------------------------------------------


@attrs.define(eq=False)
class DecodeDeviceInputs:
    """Device copies of one step's inputs; history tensors exist only with penalties."""

    tokens: Any
    positions: Any
    page_table: Any
    prompt_tokens: Any = None
    output_tokens: Any = None

    def owned_tensor_values(self) -> tuple[Any, ...]:
        """What a release walks (leaves the device does not own are skipped)."""
        return (
            self.tokens,
            self.positions,
            self.page_table,
            self.prompt_tokens,
            self.output_tokens,
        )


@attrs.frozen(eq=False)
class DecodeInvocationResult:
    """What `invoke` returns: the raw device output, what the caller must release, its kind.

    `value` is logits `[lane, vocab]` or `(tokens, log_probs | None)`; trace outputs are
    trace-owned and come with `owned=None` (never released by the decode runtime).
    """

    value: Any
    owned: Any
    is_tokens: bool


@attrs.define(eq=False)
class _LeaseRecord:
    """Where a lease is in `OUTPUT_READ_TABLE` (a dictionary lookup per move, no machine)."""

    state: ReadState = ReadState.IDLE

    def move(self, trigger: str) -> None:
        dest = OUTPUT_READ_TABLE.dest(trigger, self.state)
        if dest is None:
            raise RuntimeError(
                f"decode output lease cannot {trigger} from {self.state.value}; each decode "
                "output is read once and released once"
            )
        assert isinstance(dest, ReadState)
        self.state = dest


@attrs.define(eq=False)
class DecodeOutputLease:
    """A raw decode output handed to an external scheduler, with what must be released.

    The decode runtime keeps the lease until the output was read (`read_decode_output` then
    `process_decode_output_host`) or drained; only then are `owned_values` released.
    """

    raw_value: Any
    owned_values: Any
    is_tokens: bool
    host_value: Any = None
    pending: PendingRead | None = None
    _record: _LeaseRecord = attrs.field(factory=_LeaseRecord, repr=False)

    @property
    def state(self) -> ReadState:
        """idle (raw held), pending (read submitted), completed, or released."""
        return self._record.state

    @property
    def released(self) -> bool:
        """Whether the owned values were handed to release (terminal)."""
        return self._record.state is ReadState.RELEASED

    def move(self, trigger: str) -> None:
        """Advance along `OUTPUT_READ_TABLE`; an illegal move raises `RuntimeError`."""
        self._record.move(trigger)


# --------------------------------------------------------------------------------------------
# Trace parts
# --------------------------------------------------------------------------------------------


@attrs.define(eq=False)
class DecodePersistentInputs:
    """Trace-owned decode inputs, refreshed in place before every replay.

    `sampling` holds trace-owned copies of the device sampler's per-row buffers (the sampler's
    buffers are shared by every trace and by prefill, so each replay copies its own values back
    into them on device); `sampling_signature` is the prepared value those copies hold, so a
    refresh restages only when it changed. `sampler_buffers` pins the sampler buffer objects
    the trace was captured against.
    """

    device_inputs: DecodeDeviceInputs
    captured_sampling: PreparedSamplingParams | None = None
    sampler_plan: Any = None
    sampling: dict[str, Any] | None = None
    sampling_signature: PreparedSamplingParams | None = None
    sampler_buffers: dict[str, torch.Tensor] | None = None
    device_feedback: bool = False

    def owned_tensor_values(self) -> tuple[Any, ...]:
        """What a release walks: the device inputs and the sampling copies."""
        return (self.device_inputs, self.sampling)


@attrs.frozen(eq=False)
class DecodeCapturePlan:
    """How to capture one decode trace: allocate persistent inputs, then run the body on them.

    `prepare_inputs()` allocates every buffer the capture reads; `capture(persistent)` only
    reads persistent tensors (nothing is allocated through the device inside it).
    """

    prepare_inputs: Callable[[], DecodePersistentInputs]
    capture: Callable[[PersistentInputs | DecodePersistentInputs], Any]
    refresh_policy: InputRefreshPolicy = DECODE_REFRESH_POLICY

    def to_trace_capture_plan(
        self, program_key: ProgramKey, trace_signature: object
    ) -> TraceCapturePlan:
        """The `TraceCompiler` plan for `program_key` (operation "decode")."""
        return TraceCapturePlan(
            program_key=program_key,
            trace_signature=trace_signature,
            operation="decode",
            prepare_inputs=self.prepare_inputs,
            capture=self.capture,
            refresh_policy=self.refresh_policy,
        )


# --------------------------------------------------------------------------------------------
# Page-table normalisation (rule 20)
# --------------------------------------------------------------------------------------------


@attrs.define(eq=False)
class PageTableNormalizer:
    """Re-emits caller page tables as zero-filled int32 `[rows, decode_width]`, with caching.

    When the caller table equals the previous source (shape, dtype, device and values) and the
    copy counts, layout and feedback are unchanged, the previous normalised tensor object is
    returned. The source is cloned, so an in-place mutation of the caller's table is detected.
    """

    layout: PageTableLayout
    _source: torch.Tensor | None = None
    _counts: torch.Tensor | None = None
    _feedback: bool = False
    _normalized: torch.Tensor | None = None
    hits: int = 0

    def normalize(
        self, page_table: torch.Tensor, counts: torch.Tensor, *, device_feedback: bool
    ) -> torch.Tensor:
        """The normalised table keeping `counts[row]` blocks of each row (see the class doc).

        `counts` come from `page_table_copy_counts`, which already refused positions the
        table or the layout cannot hold.
        """
        assert counts.shape == (int(page_table.shape[0]),)
        cached = self.cached(page_table, counts, device_feedback=device_feedback)
        if cached is not None:
            return cached
        rows = int(page_table.shape[0])
        width = self.layout.decode_width
        cols = min(int(page_table.shape[1]), width)
        normalized = torch.zeros((rows, width), dtype=torch.int32)
        if cols:
            src = page_table[:, :cols].to(device="cpu", dtype=torch.int32)
            keep = torch.arange(cols).unsqueeze(0) < counts.unsqueeze(1)
            normalized[:, :cols] = torch.where(keep, src, torch.zeros_like(src))
        self._source = page_table.detach().clone()
        self._counts = counts
        self._feedback = device_feedback
        self._normalized = normalized
        return normalized

    def cached(
        self, page_table: torch.Tensor, counts: torch.Tensor, *, device_feedback: bool
    ) -> torch.Tensor | None:
        """The previous normalised table when `page_table` and `counts` equal the previous
        source (counted as a hit), else None. Only a step that passed the boundary's checks
        is normalised, so a hit is also a table those checks already accepted."""
        source = self._source
        if (
            source is not None
            and self._normalized is not None
            and self._counts is not None
            and self._feedback == device_feedback
            and source.shape == page_table.shape
            and source.dtype == page_table.dtype
            and source.device == page_table.device
            and torch.equal(self._counts, counts)
            and torch.equal(source, page_table)
        ):
            self.hits += 1
            return self._normalized
        return None


# --------------------------------------------------------------------------------------------
# Output normalisation
# --------------------------------------------------------------------------------------------


def normalize_logits(host: object, *, lane_capacity: int, vocab_size: int) -> torch.Tensor:
    """Host logits `[>=lane, >=vocab]` -> float32 `[lane, 1, vocab]`."""
    if not isinstance(host, torch.Tensor):
        raise TypeError(f"decode logits must be a torch.Tensor on host, got {type(host).__name__}")
    flat = host.reshape(-1, host.shape[-1]) if host.dim() != 2 else host
    if flat.shape == (lane_capacity, vocab_size) and flat.dtype == torch.float32:
        return flat.reshape(lane_capacity, 1, vocab_size)  # the model's exact output: no copy
    if flat.shape[0] < lane_capacity or flat.shape[1] < vocab_size:
        raise ValueError(
            f"decode logits have shape {tuple(host.shape)}; expected at least "
            f"[{lane_capacity}, {vocab_size}] (lane capacity, vocab size)"
        )
    logits = flat[:lane_capacity, :vocab_size].to(torch.float32)
    return logits.reshape(lane_capacity, 1, vocab_size)


def normalize_tokens(host: object, *, lane_capacity: int) -> DecodeHostOutput:
    """Host sampled output -> int64 `[lane]` tokens, or `(tokens, float32 [lane] log_probs)`.

    Accepts a bare token tensor or a `(tokens, log_probs | None)` tuple.
    """
    log_probs: object = None
    if isinstance(host, tuple | list):
        if len(host) != 2:
            raise TypeError(
                f"sampled decode output must be (tokens, log_probs), got a {type(host).__name__} "
                f"of {len(host)} item(s)"
            )
        tokens, log_probs = host
    else:
        tokens = host
    out_tokens = _lane_values(tokens, "tokens", lane_capacity, torch.int64)
    if log_probs is None:
        return out_tokens
    return out_tokens, _lane_values(log_probs, "log_probs", lane_capacity, torch.float32)


def _lane_values(value: object, name: str, lane_capacity: int, dtype: torch.dtype) -> torch.Tensor:
    """The first `lane_capacity` values of a decode output, flattened, as `dtype`."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"decode {name} must be a torch.Tensor, got {type(value).__name__}")
    flat = value.reshape(-1)
    if flat.shape[0] < lane_capacity:
        raise ValueError(
            f"decode {name} hold {flat.shape[0]} value(s); expected the lane capacity "
            f"{lane_capacity}"
        )
    return flat[:lane_capacity].to(dtype)


# --------------------------------------------------------------------------------------------
# Device staging and the decode body
# --------------------------------------------------------------------------------------------


def unwrap_persistent(value: object) -> DecodePersistentInputs:
    """The decode persistent inputs inside a trace artifact or `PersistentInputs`."""
    if isinstance(value, TraceArtifact):
        value = value.persistent_inputs
    if isinstance(value, PersistentInputs):
        value = value.values
    if not isinstance(value, DecodePersistentInputs):
        raise TypeError(
            "expected a decode TraceArtifact, PersistentInputs or DecodePersistentInputs, got "
            f"{type(value).__name__}"
        )
    return value


def ready_sampler(model: Any, device: Device) -> Any:
    """`model.sampling` with its buffers materialised on `device` (idempotent).

    The sampler owns its buffers; they are released by the executor's cleanup, not here.
    """
    sampler = model.sampling
    materialize = getattr(sampler, "materialize", None)
    if callable(materialize) and not getattr(sampler, "materialized", False):
        materialize(device)
    return sampler


def sampler_buffers(sampler: Any) -> dict[str, torch.Tensor]:
    """The sampler's persistent per-row buffers (what a traced replay must refresh)."""
    buffers = getattr(sampler, "buffers", None)
    if buffers is None or not hasattr(buffers, "items"):
        raise RuntimeError(
            "traced decode sampling needs model.sampling.buffers (the sampler's persistent "
            f"per-row buffers); {type(sampler).__name__} exposes none"
        )
    return dict(buffers.items())


def stage_inputs(
    device: Device, prepared: PreparedDecode, created: list[Any]
) -> DecodeDeviceInputs:
    """Copy host inputs to new owned device tensors; `created` collects them as they come.

    Penalty history is staged only when penalties are enabled (the sampler reads it only then).
    """

    def put(host: torch.Tensor) -> Any:
        tensor = device.from_host(host)
        created.append(tensor)
        return tensor

    inputs = DecodeDeviceInputs(
        tokens=put(prepared.tokens),
        positions=put(prepared.start_pos),
        page_table=put(prepared.page_table),
    )
    sampling = prepared.prepared_sampling
    if sampling is not None and sampling.penalties_enabled:
        if sampling.prompt_tokens is not None:
            inputs.prompt_tokens = put(sampling.prompt_tokens)
        if sampling.output_tokens is not None:
            inputs.output_tokens = put(sampling.output_tokens)
    return inputs


def run_decode_body(
    model: Any, inputs: DecodeDeviceInputs, plan: Any, *, device_feedback: bool, traced: bool
) -> Any:
    """The decode computation: logits `[lane, vocab]`, or sampled tokens.

    Eager sampled output is `(tokens, log_probs | None)`; a traced one is `tokens` or
    `(tokens, log_probs)` (trace outputs hold tensors only). With `device_feedback` the sampled
    tokens become the next token input and `model.increment_positions` advances positions.
    """
    logits = model.decode(inputs.tokens, positions=inputs.positions, page_table=inputs.page_table)
    if plan is None:
        return logits
    out = model.sampling.run(
        logits,
        plan,
        positions=inputs.positions,
        prompt_tokens=inputs.prompt_tokens,
        output_tokens=inputs.output_tokens,
    )
    tokens = out.tokens
    log_probs = out.log_probs
    if device_feedback:
        inputs.tokens.copy_(tokens)
        model.increment_positions(inputs.positions)
    if traced:
        return tokens if log_probs is None else (tokens, log_probs)
    return tokens, log_probs


def snapshot_sampling(
    sampler: Any, values: DecodePersistentInputs, sampling: PreparedSamplingParams, rows: int
) -> Any:
    """Stage `sampling` into the shared sampler buffers and copy them into the trace's copies.

    Returns the sampler plan. Refuses when the sampler's buffers are not the ones the trace
    was captured against (a released and re-materialised sampler).
    """
    current = sampler_buffers(sampler)
    pinned = values.sampler_buffers or {}
    if any(current.get(name) is not buffer for name, buffer in pinned.items()):
        raise RuntimeError(
            "the device sampler's buffers changed after capture (released or materialized "
            "again); release the decode traces and capture again"
        )
    plan = sampler.stage(sampling)
    copies = values.sampling or {}
    with torch.inference_mode():
        for name, copy in copies.items():
            copy.copy_(current[name][:rows])
    values.sampling_signature = sampling
    return plan


def check_trace_sampling(
    values: DecodePersistentInputs, sampling: PreparedSamplingParams | None
) -> None:
    """A replay may not move between sampled/unsampled or change the compiled sampling facts."""
    captured = values.captured_sampling
    if (captured is None) != (sampling is None):
        raise RuntimeError(
            "sampling parameters changed the compiled sampling path: the trace was captured "
            f"{'without' if captured is None else 'with'} device sampling, the request is "
            f"{'unsampled' if sampling is None else 'sampled'}"
        )
    if captured is None or sampling is None:
        return
    compiled = (captured.sampling_path, captured.penalties_enabled, captured.log_probs_enabled)
    wanted = (sampling.sampling_path, sampling.penalties_enabled, sampling.log_probs_enabled)
    if compiled != wanted:
        raise RuntimeError(
            "sampling parameters changed the compiled sampling path: (path, penalties, "
            f"log_probs) captured {compiled}, requested {wanted}"
        )


def refresh_history(
    device: Device, inputs: DecodeDeviceInputs, sampling: PreparedSamplingParams
) -> None:
    """Copy penalty history into the trace's fixed-shape history inputs (-1 when absent)."""
    for name in ("prompt_tokens", "output_tokens"):
        target = getattr(inputs, name)
        host: torch.Tensor | None = getattr(sampling, name)
        if target is None:
            if host is not None and sampling.penalties_enabled:
                raise RuntimeError(
                    f"penalty history {name} was not captured in this trace; capture with a "
                    "fixed-length, -1 padded history"
                )
            continue
        if host is None:
            host = torch.full(tuple(target.shape), -1, dtype=torch.int64)
        if tuple(host.shape) != tuple(target.shape):
            raise RuntimeError(
                f"penalty history {name} has shape {tuple(host.shape)} but the trace was "
                f"captured with {tuple(target.shape)}; pad history to a fixed length with -1"
            )
        device.from_host(host, into=target)

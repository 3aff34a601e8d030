"""The decode runtime: prepare, stage, run and read one decode step of a lane.

Its static policy is a `DecodeRuntimeConfig` (`runtime.decode_config`, checked once).
`prepare` is the decode boundary: it checks the caller's step with `runtime.decode_batch`
and returns a frozen `PreparedDecode` that everything below trusts. `DecodeRuntime` then
serves the seed's decode call chains:

* eager: `prepare` -> `invoke` -> `consume` (blocking read, or an external lease);
* asynchronous reads: `consume(read_from_device=False)` -> `read_decode_output(async_read=True)`
  -> `process_decode_output_host`, with `drain_external_outputs` retiring what was not read;
* traced: `capture_plan` (persistent inputs + body) for the `TraceCompiler`, and
  `refresh_trace` to copy a prepared step into the persistent inputs before each replay.

The model contract is `model.decode(tokens [B], *, positions [B], page_table [B, W])` ->
logits `[B, vocab]`. Device sampling (`model.sampling`, e.g. a `DecoderSampler`) is used through
`stage(prepared) -> plan` and `run(logits, plan, ...)`. Device position feedback (sampled tokens
written back into the token input and `model.increment_positions(positions)` advancing the
positions in place) is used only by compile and traced replay, as in the reference.
"""

from __future__ import annotations

import logging
from typing import Literal, Unpack, overload

import torch

from lifecycle.errors import attach_cleanup_failures
from runtime.backends.base import Device, DeviceTensor, Event, TraceOutputs, as_torch
from runtime.config import PageTableLayout
from runtime.decode_batch import (
    DecodeOptions,
    LaneInputs,
    LaneSamplingMemo,
    PreparedDecode,
    assert_lane_batch,
    check_decode_options,
    check_lane_inputs,
    check_sampling_arguments,
    check_token_ids,
    page_table_copy_counts,
    require_prepared,
)
from runtime.decode_config import DecodeRuntimeConfig
from runtime.decode_signatures import DecodeSignature
from runtime.decode_staging import (
    DecodeCapturePlan,
    DecodeDeviceInputs,
    DecodeHostOutput,
    DecodeInvocationResult,
    DecodeOutputLease,
    DecodePersistentInputs,
    PageTableNormalizer,
    check_trace_sampling,
    normalize_logits,
    normalize_tokens,
    ready_sampler,
    refresh_history,
    run_decode_body,
    sampler_buffers,
    snapshot_sampling,
    stage_inputs,
    unwrap_persistent,
)
from runtime.output_reader import ReadState
from runtime.sampling import (
    PreparedSamplingParams,
    SamplerPlan,
    SamplingParams,
    SamplingPath,
)
from runtime.steps import DecodeCheck, DecodeStep
from runtime.tensor_resources import TensorResourceOrphan, release_or_orphan, release_orphans
from runtime.trace_compiler import PersistentInputs, RefreshDecision, TraceArtifact
from runtime.validation import check_block_ids, require_bool

__all__ = [
    "DecodeCapturePlan",
    "DecodeDeviceInputs",
    "DecodeInvocationResult",
    "DecodeOutputLease",
    "DecodePersistentInputs",
    "DecodeRuntime",
    "DecodeRuntimeConfig",
    "PreparedDecode",
]

logger = logging.getLogger(__name__)

_ORPHAN_REFUSAL = "DecodeRuntime has unreleased transient resources; clean up this runtime"


class DecodeRuntime:
    """Owns decode transients, external output leases and the submitted page-table state.

    The model, device, output reader, KV cache and sampler buffers are borrowed and never
    released here; staged device inputs and leased outputs are owned and released exactly
    once (failures become orphans that `cleanup_transients` retries).
    """

    def __init__(self, config: DecodeRuntimeConfig) -> None:
        if not isinstance(config, DecodeRuntimeConfig):
            raise TypeError(
                f"config must be a DecodeRuntimeConfig (use DecodeRuntimeConfig.resolve), got "
                f"{type(config).__name__}"
            )
        self._config = config
        self._device: Device = config.device
        self._check = _check_of(config)
        self._normalizer = PageTableNormalizer(config.page_table_layout)
        self._sampling_memo = LaneSamplingMemo()
        self._last_submitted: torch.Tensor | None = None
        self._signatures: dict[tuple[SamplingPath, bool, bool, bool], DecodeSignature] = {}
        self._orphans: list[TensorResourceOrphan] = []
        self._leases: dict[int, DecodeOutputLease] = {}
        self._leases_by_host: dict[int, DecodeOutputLease] = {}

    # -- introspection ------------------------------------------------------------------------

    @property
    def config(self) -> DecodeRuntimeConfig:
        """The resolved static policy."""
        return self._config

    def configure_page_table_layout(self, layout: PageTableLayout) -> None:
        """Adopt late (smaller) physical geometry before serving; the runtime object stays."""
        config = self._config.with_page_table_layout(layout)
        self._config = config
        self._check = _check_of(config)
        self._normalizer = PageTableNormalizer(config.page_table_layout)
        self._sampling_memo = LaneSamplingMemo()
        self._last_submitted = None
        self._signatures.clear()

    @property
    def transient_orphan_count(self) -> int:
        """Owned values whose release failed; `prepare` is refused until they are released."""
        return len(self._orphans)

    @property
    def outstanding_lease_count(self) -> int:
        """Raw outputs handed out with `consume(read_from_device=False)` and not yet released."""
        return len(self._leases)

    @property
    def outstanding_leases(self) -> tuple[DecodeOutputLease, ...]:
        """A snapshot of the outstanding leases, oldest first."""
        return tuple(self._leases.values())

    @property
    def page_table_cache_hits(self) -> int:
        """How often `prepare` returned the previous normalised page table object."""
        return self._normalizer.hits

    # -- prepare ------------------------------------------------------------------------------

    def prepare(
        self,
        tokens: torch.Tensor,
        start_pos: torch.Tensor,
        page_table: torch.Tensor,
        **options: Unpack[DecodeOptions],
    ) -> PreparedDecode:
        """The decode boundary: check one lane step, normalise its page table, classify it.

        Every caller error is raised here, before anything is staged. A row is active iff
        `start_pos >= 0`; sampling parameters are slot-indexed over the lane and inactive
        rows are neutral. Nothing touches the device.
        """
        check_decode_options("DecodeRuntime.prepare", options)
        self._refuse_while_orphaned()
        sampling_params = options.get("sampling_params")
        prompt_tokens = options.get("prompt_tokens")
        output_tokens = options.get("output_tokens")
        slot_remap = options.get("slot_remap")
        reset_batch = options.get("reset_batch", False)
        config = self._config
        lane = check_lane_inputs(config.lane_capacity, tokens, start_pos, page_table)
        require_bool("reset_batch", reset_batch)
        params = check_sampling_arguments(
            config.device_sampling_enabled,
            sampling_params,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            slot_remap=slot_remap,
        )
        check_token_ids(lane, config.vocab_size)
        sampling = None
        if params is not None:
            sampling = self._sampling_memo.prepare(
                config,
                params,
                lane,
                prompt_tokens=prompt_tokens,
                output_tokens=output_tokens,
                slot_remap=slot_remap,
            )
        device_feedback = params is not None and config.position_feedback_capable
        counts = page_table_copy_counts(
            lane.page_table,
            lane.positions,
            layout=config.page_table_layout,
            device_feedback=device_feedback,
        )
        pool = config.page_table_layout.num_blocks
        cached = self._normalizer.cached(lane.page_table, counts, device_feedback=device_feedback)
        if pool is not None and cached is None:  # an unchanged table was judged when it came
            check_block_ids(lane.page_table, pool, read=counts)
        return self._checked_step(
            lane, params, sampling, counts, reset_batch, device_feedback, cached
        )

    def prepare_step(self, step: DecodeStep) -> PreparedDecode:
        """`prepare` of a typed step; one a group boundary checked against this lane's own
        geometry (`step.checked`, see `runtime.steps`) is not checked again."""
        if step.checked is None or step.checked != self._check:
            return self.prepare(
                step.tokens,
                step.start_pos,
                step.page_table,
                sampling_params=step.sampling_params,
                prompt_tokens=step.prompt_tokens,
                output_tokens=step.output_tokens,
                slot_remap=step.slot_remap,
                reset_batch=step.reset_batch,
            )
        self._refuse_while_orphaned()
        config = self._config
        lane = LaneInputs(
            tokens=step.tokens.to(device="cpu", dtype=torch.int64, copy=True),
            positions=step.start_pos.to(device="cpu", dtype=torch.int64, copy=True),
            page_table=step.page_table,
        )
        params = step.sampling_params
        sampling = None
        if params is not None:
            sampling = self._sampling_memo.prepare(
                config,
                params,
                lane,
                prompt_tokens=step.prompt_tokens,
                output_tokens=step.output_tokens,
                slot_remap=step.slot_remap,
            )
        device_feedback = params is not None and config.position_feedback_capable
        counts = page_table_copy_counts(
            lane.page_table,
            lane.positions,
            layout=config.page_table_layout,
            device_feedback=device_feedback,
        )
        pool = config.page_table_layout.num_blocks
        if device_feedback and pool is not None:
            # Feedback reads a look-ahead block the group's check (without it) did not judge.
            check_block_ids(lane.page_table, pool, read=counts)
        return self._checked_step(lane, params, sampling, counts, step.reset_batch, device_feedback)

    def _checked_step(
        self,
        lane: LaneInputs,
        params: SamplingParams | None,
        sampling: PreparedSamplingParams | None,
        counts: torch.Tensor,
        reset_batch: bool,
        device_feedback: bool,
        cached: torch.Tensor | None = None,
    ) -> PreparedDecode:
        """The frozen step of checked inputs: nothing below here is the caller's fault.

        `cached`: the normaliser's previous table, when the caller already found it equal.
        """
        normalized = (
            cached
            if cached is not None
            else self._normalizer.normalize(
                lane.page_table, counts, device_feedback=device_feedback
            )
        )
        last = self._last_submitted
        path: SamplingPath = "logits" if sampling is None else sampling.sampling_path
        prepared = PreparedDecode(
            tokens=lane.tokens,
            start_pos=lane.positions,
            page_table=normalized,
            sampling_params=params,
            prepared_sampling=sampling,
            sampling_path=path,
            reset_batch=reset_batch,
            device_feedback=device_feedback,
            # The normaliser hands back its cached table object for an unchanged one, and no
            # normalised table is written after it is made: the same object is the same table.
            page_table_changed=last is None
            or (normalized is not last and not torch.equal(normalized, last)),
            signature=self._signature(path, device_feedback, sampling),
        )
        config = self._config
        assert_lane_batch(prepared, config.lane_capacity, config.page_table_layout.decode_width)
        return prepared

    def _signature(
        self, path: SamplingPath, device_feedback: bool, sampling: PreparedSamplingParams | None
    ) -> DecodeSignature:
        """The step's program and trace identity: one per sampling facts, built once each."""
        penalties = sampling is not None and sampling.penalties_enabled
        logprobs = sampling is not None and sampling.log_probs_enabled
        facts = (path, device_feedback, penalties, logprobs)
        signature = self._signatures.get(facts)
        if signature is None:
            signature = DecodeSignature(
                batch_size=self._config.lane_capacity,
                page_table_width=self._config.page_table_layout.decode_width,
                sampling_path=path,
                device_feedback=device_feedback,
                penalties_enabled=penalties,
                logprobs_enabled=logprobs,
            )
            self._signatures[facts] = signature
        return signature

    def _refuse_while_orphaned(self) -> None:
        if self._orphans:
            raise RuntimeError(
                f"{_ORPHAN_REFUSAL} ({len(self._orphans)} orphan(s); call cleanup_transients())"
            )

    def program_signature(self, prepared: PreparedDecode) -> DecodeSignature:
        """The eager program identity (lane capacity, normalised width, sampling facts): the
        signature `prepare` built for the step."""
        return require_prepared(prepared).signature

    def trace_signature(self, prepared: PreparedDecode) -> DecodeSignature:
        """The trace identity (same key material as the program)."""
        return DecodeSignature.for_program(self.program_signature(prepared))

    def note_submitted(self, prepared: PreparedDecode) -> None:
        """Remember the page table a step was submitted with (traced replay calls this).

        The normalised table is the runtime's own and never written after `prepare` made it,
        so it is kept, not copied.
        """
        self._last_submitted = require_prepared(prepared).page_table

    # -- eager execution ----------------------------------------------------------------------

    def invoke(
        self, prepared: PreparedDecode, *, device_feedback: bool = False
    ) -> DecodeInvocationResult:
        """Stage the inputs as owned transients, run decode (and sampling), return the output.

        On failure the staged values are released (failures kept as orphans and attached).
        """
        prepared = require_prepared(prepared)
        require_bool("device_feedback", device_feedback)
        if device_feedback and not prepared.device_feedback:
            raise ValueError(
                "device_feedback=True needs a request prepared with device feedback "
                "(sampling_params and a model with increment_positions)"
            )
        self._refuse_while_orphaned()
        created: list[DeviceTensor] = []
        try:
            inputs = stage_inputs(self._device, prepared, created)
            plan: SamplerPlan | None = None
            if prepared.prepared_sampling is not None:
                sampler = ready_sampler(self._config.model, self._device)
                plan = sampler.stage(prepared.prepared_sampling)
            with torch.inference_mode():
                value = run_decode_body(
                    self._config.model, inputs, plan, device_feedback=device_feedback, traced=False
                )
        except BaseException as error:
            attach_cleanup_failures(error, self._release_owned(created))
            raise
        self.note_submitted(prepared)
        return DecodeInvocationResult(
            value=value, owned=(value, inputs), is_tokens=prepared.sampling_path != "logits"
        )

    def consume(
        self, result: DecodeInvocationResult, *, read_from_device: bool = True
    ) -> DecodeHostOutput | object:
        """Blocking: read, release owned values, normalise. Otherwise lease the raw output.

        Normalised output: logits float32 `[lane, 1, vocab]`; tokens int64 `[lane]`; with
        log-probs a `(tokens, log_probs float32 [lane])` tuple.
        """
        if not isinstance(result, DecodeInvocationResult):
            raise TypeError(f"result must be a DecodeInvocationResult, got {type(result).__name__}")
        try:
            require_bool("read_from_device", read_from_device)
        except TypeError as error:  # the output is not handed out: release it, lose nothing
            attach_cleanup_failures(error, self._release_owned(result.owned))
            raise
        if not read_from_device:
            if result.owned is not None:
                self._register_lease(result)
            raw: object = result.value
            return raw
        # Eager logits are a fresh model output this call owns and releases below, so the
        # reader may hand them over without a copy; trace outputs (owned=None) are overwritten
        # by the next replay and sampled tokens may live in sampler buffers: those are copied.
        donate = result.owned is not None and not result.is_tokens
        try:
            host = self._config.output_reader.read(result.value, blocking=True, donate=donate)
        except BaseException as error:
            attach_cleanup_failures(error, self._release_owned(result.owned))
            raise
        failures = self._release_owned(result.owned)
        return self._normalize_then_raise(host, result.is_tokens, failures, "consume")

    # -- external (asynchronous) reads --------------------------------------------------------

    @overload
    def read_decode_output(
        self, raw: object, *, async_read: Literal[True]
    ) -> tuple[object, list[Event]]: ...
    @overload
    def read_decode_output(self, raw: object, *, async_read: Literal[False] = False) -> object: ...
    def read_decode_output(
        self, raw: object, *, async_read: bool = False
    ) -> object | tuple[object, list[Event]]:
        """Read a raw decode output: the host value now, or `(host_value, events)` to wait on."""
        require_bool("async_read", async_read)
        lease = self._lease_for(raw)
        if lease is not None and lease.state is not ReadState.IDLE:
            raise RuntimeError(
                f"this decode output was already read (lease is {lease.state.value}); pass its "
                "host value to process_decode_output_host()"
            )
        reader = self._config.output_reader
        if not async_read:
            host = reader.read(raw, blocking=True)
            if lease is not None:
                lease.move("complete")
                failures = self._release_lease(lease)
                if failures:
                    self._raise_release_failures(failures, "read_decode_output")
            return host
        pending = reader.submit(raw)
        if lease is not None:
            lease.pending = pending
            lease.host_value = pending.value
            lease.move("submit")
            self._leases_by_host[id(pending.value)] = lease
        return pending.value, list(pending.events)

    def process_decode_output_host(
        self, host_value: object, *, is_tokens: bool = False
    ) -> DecodeHostOutput:
        """Complete an asynchronous read, release its lease, normalise the host value.

        `is_tokens` may be left False for a leased output: the lease knows its kind.
        """
        require_bool("is_tokens", is_tokens)
        host = self._config.output_reader.complete(host_value)
        lease = self._leases_by_host.get(id(host_value))
        failures: list[BaseException] = []
        if lease is not None and lease.host_value is host_value:
            is_tokens = is_tokens or lease.is_tokens
            if lease.state is ReadState.PENDING:
                lease.move("complete")
            failures = self._release_lease(lease)
        return self._normalize_then_raise(host, is_tokens, failures, "process_decode_output_host")

    def drain_external_outputs(self) -> None:
        """Retire every outstanding lease: wait for its read (or the device), then release.

        A lease whose wait fails is kept for a retry; failures are raised together.
        """
        failures: list[BaseException] = []
        for lease in list(self._leases.values()):
            try:
                if lease.state is ReadState.PENDING and lease.pending is not None:
                    self._config.output_reader.complete(lease.pending)
                    lease.move("complete")
                elif lease.state is ReadState.IDLE:
                    self._device.synchronize()
            except BaseException as failure:
                failures.append(failure)
                continue
            failures.extend(self._release_lease(lease))
        if failures:
            error = RuntimeError(
                f"Failed to drain {len(failures)} decode output lease resource(s); call "
                "drain_external_outputs() or cleanup_transients() again"
            )
            error.__cause__ = failures[0]
            attach_cleanup_failures(error, failures)
            raise error

    def cleanup_transients(self) -> None:
        """Retry orphaned transients; raises while any still fails. Idempotent."""
        failures = release_orphans(self._orphans)
        if failures:
            error = RuntimeError(
                f"Failed to release {len(self._orphans)} decode transient resource(s); call "
                "cleanup_transients() again"
            )
            error.__cause__ = failures[0]
            attach_cleanup_failures(error, failures)
            raise error

    # -- trace parts --------------------------------------------------------------------------

    def capture_plan(self, prepared: PreparedDecode) -> DecodeCapturePlan:
        """Persistent inputs and the decode body for one trace of `prepared`'s signature."""
        prepared = require_prepared(prepared)
        if prepared.prepared_sampling is not None:
            # Fail now, not inside capture, when traced sampling is impossible.
            sampler_buffers(ready_sampler(self._config.model, self._device))

        def prepare_inputs() -> DecodePersistentInputs:
            return self._prepare_persistent(prepared)

        def capture(persistent: PersistentInputs | DecodePersistentInputs) -> TraceOutputs:
            values = unwrap_persistent(persistent)
            with torch.inference_mode():
                if values.sampling is not None and values.sampler_buffers is not None:
                    rows = self._config.lane_capacity
                    for name, copy in values.sampling.items():
                        values.sampler_buffers[name][:rows].copy_(copy)
                return run_decode_body(
                    self._config.model,
                    values.device_inputs,
                    values.sampler_plan,
                    device_feedback=values.device_feedback,
                    traced=True,
                )

        return DecodeCapturePlan(prepare_inputs=prepare_inputs, capture=capture)

    def refresh_trace(
        self,
        artifact: TraceArtifact | PersistentInputs | DecodePersistentInputs,
        prepared: PreparedDecode,
        decision: RefreshDecision,
    ) -> None:
        """Copy `prepared` into the persistent inputs in place, as far as `decision` says.

        full -> tokens, positions and page table; page_table -> only the page table. Sampling
        copies are restaged only when the prepared sampling value changed; penalty history is
        refreshed every replay. A change between the sampled and unsampled path (or of the
        compiled sampling features) raises `RuntimeError`.
        """
        values = unwrap_persistent(artifact)
        prepared = require_prepared(prepared)
        if not isinstance(decision, RefreshDecision):
            raise TypeError(f"decision must be a RefreshDecision, got {type(decision).__name__}")
        sampling = prepared.prepared_sampling
        check_trace_sampling(values, sampling)
        if values.device_feedback != prepared.device_feedback:
            raise RuntimeError(
                f"device feedback changed after capture: trace device_feedback="
                f"{values.device_feedback}, request device_feedback={prepared.device_feedback}"
            )
        inputs = values.device_inputs
        device = self._device
        if decision.full:
            device.from_host(prepared.tokens, into=inputs.tokens)
            device.from_host(prepared.start_pos, into=inputs.positions)
            device.from_host(prepared.page_table, into=inputs.page_table)
        elif decision.page_table:
            device.from_host(prepared.page_table, into=inputs.page_table)
        if sampling is None:
            return
        if values.sampling_signature != sampling:
            sampler = ready_sampler(self._config.model, device)
            snapshot_sampling(sampler, values, sampling, self._config.lane_capacity)
        if decision.full or "sampling" in decision.fields:
            refresh_history(device, inputs, sampling)

    # -- internals ----------------------------------------------------------------------------

    def _prepare_persistent(self, prepared: PreparedDecode) -> DecodePersistentInputs:
        created: list[DeviceTensor] = []
        try:
            inputs = stage_inputs(self._device, prepared, created)
            values = DecodePersistentInputs(inputs, device_feedback=prepared.device_feedback)
            sampling = prepared.prepared_sampling
            if sampling is not None:
                sampler = ready_sampler(self._config.model, self._device)
                buffers = sampler_buffers(sampler)
                rows = self._config.lane_capacity
                copies: dict[str, torch.Tensor] = {}
                for name, buffer in buffers.items():
                    copy = self._device.allocate((rows, *buffer.shape[1:]), buffer.dtype)
                    created.append(copy)
                    copies[name] = as_torch(copy, f"sampling copy {name!r}")
                values.sampling = copies
                values.sampler_buffers = buffers
                values.captured_sampling = sampling
                values.sampler_plan = snapshot_sampling(sampler, values, sampling, rows)
        except BaseException as error:
            attach_cleanup_failures(error, self._release_owned(created))
            raise
        logger.debug(
            "decode persistent inputs ready: lane %d, path %s, %d tensor(s)",
            prepared.lane_capacity,
            prepared.sampling_path,
            len(created),
        )
        return values

    def _register_lease(self, result: DecodeInvocationResult) -> None:
        existing = self._leases.get(id(result.value))
        if existing is not None and existing.raw_value is result.value:
            raise RuntimeError("this decode output is already leased; read it once")
        self._leases[id(result.value)] = DecodeOutputLease(
            raw_value=result.value, owned_values=result.owned, is_tokens=result.is_tokens
        )

    def _lease_for(self, raw: object) -> DecodeOutputLease | None:
        lease = self._leases.get(id(raw))
        return lease if lease is not None and lease.raw_value is raw else None

    def _release_lease(self, lease: DecodeOutputLease) -> list[BaseException]:
        self._leases.pop(id(lease.raw_value), None)
        if lease.host_value is not None:
            self._leases_by_host.pop(id(lease.host_value), None)
        lease.move("release")
        return self._release_owned(lease.owned_values)

    def _release_owned(self, owned: object) -> list[BaseException]:
        if owned is None:
            return []
        orphan, failures = release_or_orphan(owned, self._device)
        if orphan is not None:
            self._orphans.append(orphan)
        return failures

    def _raise_release_failures(self, failures: list[BaseException], operation: str) -> None:
        error = RuntimeError(
            f"{operation}: failed to release {len(failures)} decode transient resource(s); "
            "cleanup_transients() retries them (the owning executor's close() calls it)"
        )
        error.__cause__ = failures[0]
        attach_cleanup_failures(error, failures)
        raise error

    def _normalize_then_raise(
        self, host: object, is_tokens: bool, failures: list[BaseException], operation: str
    ) -> DecodeHostOutput:
        config = self._config
        try:
            if is_tokens:
                out: DecodeHostOutput = normalize_tokens(host, lane_capacity=config.lane_capacity)
            else:
                out = normalize_logits(
                    host, lane_capacity=config.lane_capacity, vocab_size=config.vocab_size
                )
        except BaseException as error:
            attach_cleanup_failures(error, failures)
            raise
        if failures:
            self._raise_release_failures(failures, operation)
        return out


def _check_of(config: DecodeRuntimeConfig) -> DecodeCheck:
    """The stamp of a step checked against this lane's geometry (`runtime.steps`)."""
    return DecodeCheck(
        lane_capacity=config.lane_capacity,
        vocab_size=config.vocab_size,
        page_table_layout=config.page_table_layout,
        num_blocks=config.page_table_layout.num_blocks,
        device_sampling_enabled=config.device_sampling_enabled,
    )

"""The decode runtime: validate, normalise, stage, run and read one decode step of a lane.

`DecodeRuntimeConfig.resolve` checks the collaborators once (model, device, output reader,
lane capacity, page-table layout, sampling capability) and fixes the construction-time
page-table ceilings. `DecodeRuntime` then serves the seed's decode call chains:

* eager: `prepare` -> `invoke` -> `consume` (blocking read, or an external lease);
* asynchronous reads: `consume(read_from_device=False)` -> `read_decode_output(async_read=True)`
  -> `process_decode_output_host`, with `drain_external_outputs` retiring what was not read;
* traced: `capture_plan` (persistent inputs + body) for the `TraceCompiler`, and
  `refresh_trace` to copy a prepared step into the persistent inputs before each replay.

The model contract is `model.decode(tokens [B], *, positions [B], page_table [B, W])` ->
logits `[B, vocab]`. Device sampling (`model.sampling`, e.g. a `LlamaSampler`) is used through
`stage(prepared) -> plan` and `run(logits, plan, ...)`. Device position feedback (sampled tokens
written back into the token input and `model.increment_positions(positions)` advancing the
positions in place) is used only by compile and traced replay, as in the reference.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, TypeGuard

import attrs
import torch

from lifecycle.errors import attach_cleanup_failures
from runtime.backends.base import Device
from runtime.config import PageTableLayout, RuntimePolicy
from runtime.decode_signatures import DecodeProgramSignature, DecodeTraceSignature
from runtime.decode_staging import (
    DecodeCapturePlan,
    DecodeDeviceInputs,
    DecodeInvocationResult,
    DecodeOutputLease,
    DecodePersistentInputs,
    PageTableNormalizer,
    PreparedDecode,
    check_host_tensor,
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
from runtime.output_reader import OutputReader, ReadState
from runtime.sampling import (
    PreparedSamplingParams,
    SamplingParams,
    SamplingPath,
    prepare_sampling_params,
    slice_prepared_sampling_params,
)
from runtime.tensor_resources import TensorResourceOrphan, release_or_orphan, release_orphans
from runtime.trace_compiler import PersistentInputs, RefreshDecision, TraceArtifact

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


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _require_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {value!r}")
    return value


@attrs.frozen
class _SamplerFacts:
    """What the runtime reads from `model.sampling.config` once."""

    allow_force_argmax: bool
    max_device_top_k: int
    sampling_batch_size: int
    vocab_size: int


def _sampler_facts(model: Any) -> _SamplerFacts:
    """Check that `model.sampling` is a usable device sampler and read its static facts."""
    sampler = getattr(model, "sampling", None)
    if not (callable(getattr(sampler, "stage", None)) and callable(getattr(sampler, "run", None))):
        raise TypeError(
            "device_sampling_enabled=True requires model.sampling with callable stage() and "
            f"run() (e.g. model.sampling = LlamaSampler(...)); got {type(sampler).__name__}"
        )
    config = getattr(sampler, "config", None)
    allow = getattr(config, "allow_force_argmax", None)
    if not isinstance(allow, bool):
        raise TypeError(f"model.sampling.config.allow_force_argmax must be a bool, got {allow!r}")
    facts: dict[str, int] = {}
    for name in ("max_top_k", "max_batch_size", "vocab_size"):
        value = getattr(config, name, None)
        if not _is_int(value) or value <= 0:
            raise ValueError(
                f"model.sampling.config.{name} must be a positive integer, got {value!r}"
            )
        facts[name] = value
    return _SamplerFacts(
        allow_force_argmax=allow,
        max_device_top_k=facts["max_top_k"],
        sampling_batch_size=facts["max_batch_size"],
        vocab_size=facts["vocab_size"],
    )


def _validate_config(config: DecodeRuntimeConfig) -> None:
    """Every rule of `DecodeRuntimeConfig`, run by `resolve` and on direct construction."""
    if not isinstance(config.output_reader, OutputReader):
        raise TypeError(
            f"output_reader must be an OutputReader, got {type(config.output_reader).__name__}"
        )
    if not isinstance(config.device, Device):
        raise TypeError(
            f"device must implement the Device protocol, got {type(config.device).__name__}"
        )
    if config.output_reader.device is not config.device:
        raise ValueError(
            f"device {config.device.name!r} must be the same device as the output reader's "
            f"({config.output_reader.device.name!r}); construct the OutputReader with this device"
        )
    if not isinstance(config.policy, RuntimePolicy):
        raise TypeError(f"policy must be a RuntimePolicy, got {type(config.policy).__name__}")
    lane = config.lane_capacity
    if not _is_int(lane) or lane <= 0:
        raise ValueError(f"lane_capacity must be a positive integer, got {lane!r}")
    limit = config.policy.decode_lane_capacity_limit
    if lane > limit:
        raise ValueError(
            f"lane_capacity {lane} exceeds the decode lane capacity limit {limit} "
            f"(RuntimePolicy.decode_lane_capacity_limit); allowed: 1..{limit}"
        )
    for name in (
        "device_sampling_enabled",
        "force_greedy_top_k",
        "allow_force_argmax",
        "position_feedback_capable",
    ):
        _require_bool(name, getattr(config, name))
    layout = config.page_table_layout
    if not isinstance(layout, PageTableLayout):
        raise TypeError(f"page_table_layout must be a PageTableLayout, got {type(layout).__name__}")
    _check_layout_within_ceilings(
        layout,
        block_size=layout.block_size,
        max_raw_capacity_width=config.max_raw_capacity_width,
        max_decode_page_table_width=config.max_decode_page_table_width,
    )
    model = config.model
    if not callable(getattr(model, "decode", None)):
        raise TypeError(
            f"model must provide decode(tokens, *, positions, page_table) (see "
            f"runtime.model_contract.PagedModel), got {type(model).__name__}"
        )
    vocab = getattr(model, "vocab_size", None)
    if not _is_int(vocab) or vocab <= 0:
        raise ValueError(f"model.vocab_size must be a positive integer, got {vocab!r}")
    if config.vocab_size != vocab:
        raise ValueError(
            f"vocab_size {config.vocab_size!r} does not match model.vocab_size {vocab}"
        )
    capable = callable(getattr(model, "increment_positions", None))
    if config.position_feedback_capable != capable:
        raise ValueError(
            f"position_feedback_capable={config.position_feedback_capable} does not match the "
            f"model (callable increment_positions: {capable})"
        )
    _validate_sampling_facts(config)


def _validate_sampling_facts(config: DecodeRuntimeConfig) -> None:
    if not config.device_sampling_enabled:
        if config.allow_force_argmax or config.max_device_top_k is not None:
            raise ValueError(
                "allow_force_argmax and max_device_top_k come from model.sampling and must be "
                "False/None while device sampling is disabled"
            )
        if config.sampling_batch_size is not None:
            raise ValueError("sampling_batch_size must be None while device sampling is disabled")
        return
    facts = _sampler_facts(config.model)
    derived = (facts.allow_force_argmax, facts.max_device_top_k, facts.sampling_batch_size)
    given = (config.allow_force_argmax, config.max_device_top_k, config.sampling_batch_size)
    if derived != given:
        raise ValueError(
            f"(allow_force_argmax, max_device_top_k, sampling_batch_size) {given} do not match "
            f"model.sampling.config {derived}"
        )
    if facts.sampling_batch_size < config.lane_capacity:
        raise ValueError(
            f"model.sampling.config.max_batch_size {facts.sampling_batch_size} is smaller than "
            f"lane_capacity {config.lane_capacity}; the sampler must hold every lane row"
        )
    if facts.vocab_size != config.vocab_size:
        raise ValueError(
            f"model.sampling.config.vocab_size {facts.vocab_size} does not match "
            f"model.vocab_size {config.vocab_size}"
        )


def _check_layout_within_ceilings(
    layout: PageTableLayout,
    *,
    block_size: int,
    max_raw_capacity_width: int,
    max_decode_page_table_width: int,
) -> None:
    if layout.block_size != block_size:
        raise ValueError(
            f"page-table layout block_size {layout.block_size} differs from the configured "
            f"block_size {block_size}; late capacity may not change the block size"
        )
    if layout.raw_capacity_width > max_raw_capacity_width:
        raise ValueError(
            f"page-table layout raw_capacity_width {layout.raw_capacity_width} exceeds the "
            f"construction-time ceiling {max_raw_capacity_width}; late capacity may only shrink"
        )
    if layout.decode_width > max_decode_page_table_width:
        raise ValueError(
            f"page-table layout decode width {layout.decode_width} exceeds the construction-time "
            f"decode width ceiling {max_decode_page_table_width}; late capacity may only shrink"
        )


@attrs.frozen
class DecodeRuntimeConfig:
    """Static decode policy of one lane, resolved once (use `resolve`).

    The ceilings are the layout widths at construction; `with_page_table_layout` may replace
    the layout later only within them and with the same block size.
    """

    model: Any
    device: Device
    output_reader: OutputReader
    lane_capacity: int
    page_table_layout: PageTableLayout
    policy: RuntimePolicy
    vocab_size: int
    device_sampling_enabled: bool
    force_greedy_top_k: bool
    allow_force_argmax: bool
    position_feedback_capable: bool
    max_raw_capacity_width: int
    max_decode_page_table_width: int
    max_device_top_k: int | None = None
    sampling_batch_size: int | None = None

    def __attrs_post_init__(self) -> None:
        _validate_config(self)

    @classmethod
    def resolve(
        cls,
        *,
        model: Any,
        device: Device,
        output_reader: OutputReader,
        lane_capacity: int,
        page_table_layout: PageTableLayout,
        device_sampling_enabled: bool,
        force_greedy_top_k: bool = False,
        policy: RuntimePolicy,
    ) -> DecodeRuntimeConfig:
        """Validate the collaborators and derive the model/sampler facts decode depends on."""
        if not isinstance(output_reader, OutputReader):
            raise TypeError(
                f"output_reader must be an OutputReader, got {type(output_reader).__name__}"
            )
        _require_bool("device_sampling_enabled", device_sampling_enabled)
        _require_bool("force_greedy_top_k", force_greedy_top_k)
        if not isinstance(page_table_layout, PageTableLayout):
            raise TypeError(
                f"page_table_layout must be a PageTableLayout, got "
                f"{type(page_table_layout).__name__}"
            )
        facts = _sampler_facts(model) if device_sampling_enabled else None
        vocab_size: Any = getattr(model, "vocab_size", None)  # checked by __attrs_post_init__
        return cls(
            model=model,
            device=device,
            output_reader=output_reader,
            lane_capacity=lane_capacity,
            page_table_layout=page_table_layout,
            policy=policy,
            vocab_size=vocab_size,
            device_sampling_enabled=device_sampling_enabled,
            force_greedy_top_k=force_greedy_top_k,
            allow_force_argmax=facts.allow_force_argmax if facts is not None else False,
            position_feedback_capable=callable(getattr(model, "increment_positions", None)),
            max_raw_capacity_width=page_table_layout.raw_capacity_width,
            max_decode_page_table_width=page_table_layout.decode_width,
            max_device_top_k=facts.max_device_top_k if facts is not None else None,
            sampling_batch_size=facts.sampling_batch_size if facts is not None else None,
        )

    def with_page_table_layout(self, layout: PageTableLayout) -> DecodeRuntimeConfig:
        """A copy with a late layout: same block size, widths within the original ceilings."""
        if not isinstance(layout, PageTableLayout):
            raise TypeError(f"layout must be a PageTableLayout, got {type(layout).__name__}")
        _check_layout_within_ceilings(
            layout,
            block_size=self.page_table_layout.block_size,
            max_raw_capacity_width=self.max_raw_capacity_width,
            max_decode_page_table_width=self.max_decode_page_table_width,
        )
        return attrs.evolve(self, page_table_layout=layout)


# --------------------------------------------------------------------------------------------
# Input validation helpers
# --------------------------------------------------------------------------------------------


def _pad_history(value: torch.Tensor | None, lane: int, rows: int) -> torch.Tensor | None:
    """Lane-row history extended with empty (-1) rows to the sampler batch."""
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.shape[0] != lane:
        return value  # broadcast, full-width or malformed: the sampler validates it
    if rows == lane:
        return value
    filler = torch.full((rows - lane, value.shape[1]), -1, dtype=value.dtype, device=value.device)
    return torch.cat([value, filler])


def _pad_slot_remap(
    value: Sequence[int] | torch.Tensor | None, lane: int, rows: int
) -> Sequence[int] | torch.Tensor | None:
    """A lane-wide slot remap extended with "no source" (-1) entries to the sampler batch."""
    if value is None or rows == lane:
        return value
    items = value.reshape(-1).tolist() if isinstance(value, torch.Tensor) else list(value)
    return items + [-1] * (rows - lane) if len(items) == lane else value


def _require_prepared(value: object) -> PreparedDecode:
    if not isinstance(value, PreparedDecode):
        raise TypeError(f"prepared must be a PreparedDecode, got {type(value).__name__}")
    return value


# --------------------------------------------------------------------------------------------
# The runtime
# --------------------------------------------------------------------------------------------


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
        self._normalizer = PageTableNormalizer(config.page_table_layout)
        self._last_submitted: torch.Tensor | None = None
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
        self._normalizer = PageTableNormalizer(config.page_table_layout)
        self._last_submitted = None

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
        *,
        sampling_params: SamplingParams | None = None,
        prompt_tokens: torch.Tensor | None = None,
        output_tokens: torch.Tensor | None = None,
        slot_remap: Sequence[int] | torch.Tensor | None = None,
        reset_batch: bool = False,
    ) -> PreparedDecode:
        """Validate one lane step, normalise its page table and classify its sampling path.

        A row is active iff `start_pos >= 0`; sampling parameters are slot-indexed over the
        lane and inactive rows are neutral. Nothing touches the device.
        """
        if self._orphans:
            raise RuntimeError(
                f"{_ORPHAN_REFUSAL} ({len(self._orphans)} orphan(s); call cleanup_transients())"
            )
        config = self._config
        lane = config.lane_capacity
        check_host_tensor("tokens", tokens, 1, "[lane]")
        check_host_tensor("start_pos", start_pos, 1, "[lane]")
        check_host_tensor("page_table", page_table, 2, "[lane, width]")
        batch = int(tokens.shape[0])
        if batch != lane:
            raise ValueError(f"decode batch {batch} must equal lane capacity {lane}")
        if int(start_pos.shape[0]) != batch or int(page_table.shape[0]) != batch:
            raise ValueError(
                f"decode tokens, start_pos and page_table batches must match: tokens {batch}, "
                f"start_pos {int(start_pos.shape[0])}, page_table {int(page_table.shape[0])}"
            )
        _require_bool("reset_batch", reset_batch)
        if sampling_params is not None:
            if not config.device_sampling_enabled:
                raise ValueError(
                    "sampling_params were supplied but device sampling is disabled; resolve "
                    "DecodeRuntimeConfig with device_sampling_enabled=True"
                )
            if not isinstance(sampling_params, SamplingParams):
                raise TypeError(
                    f"sampling_params must be SamplingParams, got {type(sampling_params).__name__}"
                )
        else:
            for name, value in (
                ("prompt_tokens", prompt_tokens),
                ("output_tokens", output_tokens),
                ("slot_remap", slot_remap),
            ):
                if value is not None:
                    raise ValueError(
                        f"{name} is request-owned sampling state and needs sampling_params; "
                        "pass sampling_params or leave it None"
                    )
        host_tokens = tokens.detach().to(device="cpu", dtype=torch.int64, copy=True)
        positions = start_pos.detach().to(device="cpu", dtype=torch.int64, copy=True)
        active = positions >= 0
        bad = (active & ((host_tokens < 0) | (host_tokens >= config.vocab_size))).nonzero()
        if bad.numel():
            row = int(bad[0, 0])
            raise ValueError(
                f"tokens row {row} is {int(host_tokens[row])}; allowed token ids of an active row "
                f"are [0, {config.vocab_size})"
            )
        device_feedback = sampling_params is not None and config.position_feedback_capable
        prepared_sampling: PreparedSamplingParams | None = None
        sampling_path: SamplingPath = "logits"
        if sampling_params is not None:
            if not bool(active.any()):
                raise ValueError(
                    "sampling_params need at least one active decode row (start_pos >= 0); "
                    "every row is inactive"
                )
            prepared_sampling = self._prepare_sampling(
                sampling_params,
                [bool(flag) for flag in active.tolist()],
                prompt_tokens=prompt_tokens,
                output_tokens=output_tokens,
                slot_remap=slot_remap,
            )
            sampling_path = prepared_sampling.sampling_path
        normalized = self._normalizer.normalize(
            page_table, positions, device_feedback=device_feedback
        )
        last = self._last_submitted
        changed = last is None or not torch.equal(normalized, last)
        return PreparedDecode(
            tokens=host_tokens,
            start_pos=positions,
            page_table=normalized,
            sampling_params=sampling_params,
            prepared_sampling=prepared_sampling,
            sampling_path=sampling_path,
            reset_batch=reset_batch,
            device_feedback=device_feedback,
            page_table_changed=changed,
        )

    def _prepare_sampling(
        self,
        sampling_params: SamplingParams,
        active: list[bool],
        *,
        prompt_tokens: torch.Tensor | None,
        output_tokens: torch.Tensor | None,
        slot_remap: Sequence[int] | torch.Tensor | None,
    ) -> PreparedSamplingParams:
        """Normalise over the sampler batch (reference 2.15), then keep the lane's rows.

        Slot-indexed values may cover the whole sampler batch (e.g. 32 rows for a lane of 1);
        rows past the lane are inactive, hence neutral, and never change the sampling path.
        """
        config = self._config
        lane = config.lane_capacity
        rows = config.sampling_batch_size or lane
        assert config.max_device_top_k is not None
        full = prepare_sampling_params(
            sampling_params,
            rows,
            max_device_top_k=config.max_device_top_k,
            allow_force_argmax=config.allow_force_argmax and not config.force_greedy_top_k,
            prompt_tokens=_pad_history(prompt_tokens, lane, rows),
            output_tokens=_pad_history(output_tokens, lane, rows),
            slot_remap=_pad_slot_remap(slot_remap, lane, rows),
            active_mask=active + [False] * (rows - lane),
        )
        if rows == lane:
            return full
        lane_rows = slice_prepared_sampling_params(full, range(lane))
        remap = None if full.slot_remap is None else full.slot_remap[:lane]
        return attrs.evolve(lane_rows, slot_remap=remap)

    def program_signature(self, prepared: PreparedDecode) -> DecodeProgramSignature:
        """The eager program identity: lane capacity, normalised width, sampling facts."""
        prepared = _require_prepared(prepared)
        return DecodeProgramSignature(
            batch_size=prepared.lane_capacity,
            page_table_width=int(prepared.page_table.shape[1]),
            sampling_path=prepared.sampling_path,
            device_feedback=prepared.device_feedback,
            penalties_enabled=prepared.penalties_enabled,
            logprobs_enabled=prepared.logprobs_enabled,
        )

    def trace_signature(self, prepared: PreparedDecode) -> DecodeTraceSignature:
        """The trace identity (same key material as the program)."""
        return DecodeTraceSignature.for_program(self.program_signature(prepared))

    def note_submitted(self, prepared: PreparedDecode) -> None:
        """Remember the page table a step was submitted with (traced replay calls this)."""
        prepared = _require_prepared(prepared)
        self._last_submitted = prepared.page_table.clone()

    # -- eager execution ----------------------------------------------------------------------

    def invoke(
        self, prepared: PreparedDecode, *, device_feedback: bool = False
    ) -> DecodeInvocationResult:
        """Stage the inputs as owned transients, run decode (and sampling), return the output.

        On failure the staged values are released (failures kept as orphans and attached).
        """
        prepared = _require_prepared(prepared)
        _require_bool("device_feedback", device_feedback)
        if device_feedback and not prepared.device_feedback:
            raise ValueError(
                "device_feedback=True needs a request prepared with device feedback "
                "(sampling_params and a model with increment_positions)"
            )
        if self._orphans:
            raise RuntimeError(
                f"{_ORPHAN_REFUSAL} ({len(self._orphans)} orphan(s); call cleanup_transients())"
            )
        created: list[Any] = []
        try:
            inputs = stage_inputs(self._device, prepared, created)
            plan = None
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

    def consume(self, result: DecodeInvocationResult, *, read_from_device: bool = True) -> Any:
        """Blocking: read, release owned values, normalise. Otherwise lease the raw output.

        Normalised output: logits float32 `[lane, 1, vocab]`; tokens int64 `[lane]`; with
        log-probs a `(tokens, log_probs float32 [lane])` tuple.
        """
        if not isinstance(result, DecodeInvocationResult):
            raise TypeError(f"result must be a DecodeInvocationResult, got {type(result).__name__}")
        _require_bool("read_from_device", read_from_device)
        if not read_from_device:
            if result.owned is not None:
                self._register_lease(result)
            return result.value
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

    def read_decode_output(self, raw: Any, *, async_read: bool = False) -> Any:
        """Read a raw decode output: the host value now, or `(host_value, events)` to wait on."""
        _require_bool("async_read", async_read)
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

    def process_decode_output_host(self, host_value: Any, *, is_tokens: bool = False) -> Any:
        """Complete an asynchronous read, release its lease, normalise the host value.

        `is_tokens` may be left False for a leased output: the lease knows its kind.
        """
        _require_bool("is_tokens", is_tokens)
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
        prepared = _require_prepared(prepared)
        if prepared.prepared_sampling is not None:
            # Fail now, not inside capture, when traced sampling is impossible.
            sampler_buffers(ready_sampler(self._config.model, self._device))

        def prepare_inputs() -> DecodePersistentInputs:
            return self._prepare_persistent(prepared)

        def capture(persistent: PersistentInputs | DecodePersistentInputs) -> Any:
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
        prepared = _require_prepared(prepared)
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
        created: list[Any] = []
        try:
            inputs = stage_inputs(self._device, prepared, created)
            values = DecodePersistentInputs(inputs, device_feedback=prepared.device_feedback)
            sampling = prepared.prepared_sampling
            if sampling is not None:
                sampler = ready_sampler(self._config.model, self._device)
                buffers = sampler_buffers(sampler)
                rows = self._config.lane_capacity
                copies: dict[str, Any] = {}
                for name, buffer in buffers.items():
                    copy = self._device.allocate((rows, *buffer.shape[1:]), buffer.dtype)
                    created.append(copy)
                    copies[name] = copy
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

    def _lease_for(self, raw: Any) -> DecodeOutputLease | None:
        lease = self._leases.get(id(raw))
        return lease if lease is not None and lease.raw_value is raw else None

    def _release_lease(self, lease: DecodeOutputLease) -> list[BaseException]:
        self._leases.pop(id(lease.raw_value), None)
        if lease.host_value is not None:
            self._leases_by_host.pop(id(lease.host_value), None)
        lease.move("release")
        return self._release_owned(lease.owned_values)

    def _release_owned(self, owned: Any) -> list[BaseException]:
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
        self, host: Any, is_tokens: bool, failures: list[BaseException], operation: str
    ) -> Any:
        config = self._config
        try:
            if is_tokens:
                out: Any = normalize_tokens(host, lane_capacity=config.lane_capacity)
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

"""`ModelExecutor`: one execution lane composed in the seed's order, as a lifecycle host.

The executor owns every runtime component of a lane (paged KV cache, output reader, prefill
and decode runtimes, program and trace compilers, warmup coordinator; built by
`models.lane_components`) and is the cleanup root. Its phase machine guards the public
surface: a call in the wrong phase is refused before any device work with the next legal
calls. Completing warmup moves ALLOCATED -> COMPILED, `capture()` COMPILED -> CAPTURED,
`serve()` -> SERVING.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Literal, Unpack, overload

import attrs
import torch

from lifecycle import Phase, guarded, host_table
from lifecycle.journal import Journal
from lifecycle.phases import NOT_SERVING
from models.executor_config import ModelExecutorConfig as ModelExecutorConfig
from models.executor_config import require_exact_type
from models.executor_sleep import ExecutorSleep
from models.lane_capacity import KVCapacityError as KVCapacityError
from models.lane_capacity import (
    check_kv_memory,
    check_server_cache_shape,
    check_warmup_extent,
    server_cache_blocks,
)
from models.lane_components import LaneCallbacks, LaneComponents, build_lane_components
from models.progress import ProgressSink, as_progress
from runtime.backends.base import Device, Event
from runtime.backends.memory import format_bytes
from runtime.config import (
    PagedKVCacheConfig,
)
from runtime.decode_batch import DecodeArguments
from runtime.decode_staging import DecodeHostOutput
from runtime.execution import EagerExecutor, TracedExecutor
from runtime.json_types import JSONValue
from runtime.model_contract import PagedModel
from runtime.paged_kv_cache import KVCacheHandle
from runtime.prefill.batch import IntVector, PrefillArguments
from runtime.prefill.result_collector import PrefillOutput
from runtime.prefill.signatures import PreparedPrefill
from runtime.program_compiler import CompiledProgram
from runtime.sampling import BufferedSampler, SamplingParams
from runtime.steps import DecodeStep
from runtime.validation import require_bool
from runtime.warmup_manifest import CoverageManifest
from runtime.weight_residency import WeightResidency

logger = logging.getLogger(__name__)

P = Phase
_SETUP = (P.ALLOCATED, P.COMPILED)

_NEXT_CALLS = {
    P.CONSTRUCTED: ("start", "configure_paged_kv_cache", "allocate_kv_cache"),
    P.CAPACITY_RESOLVED: ("start", "allocate_kv_cache"),
    P.SEALED: ("start", "allocate_kv_cache"),
    P.ALLOCATED: ("start", "warmup_prefill", "warmup_decode"),
    P.CAPTURED: ("start", "serve"),
    P.SERVING: ("prefill_forward", "decode_forward", "drain", "close"),
}
_NOT_SERVING = NOT_SERVING

_ASLEEP: dict[Enum, str] = {phase: _NOT_SERVING[phase] for phase in (P.SLEEPING, P.WEIGHTS_AWAKE)}
# The onward calls from COMPILED depend on the trace mode: only one of capture()/serve() can
# succeed there, and errors and `bringup` list exactly the calls that can.
EAGER_EXECUTOR_TABLE = host_table(
    name="model-executor", next_calls={**_NEXT_CALLS, P.COMPILED: ("start", "serve")}
)
TRACED_EXECUTOR_TABLE = host_table(
    name="model-executor", next_calls={**_NEXT_CALLS, P.COMPILED: ("start", "capture")}
)
EXECUTOR_TABLE = EAGER_EXECUTOR_TABLE


@attrs.frozen
class PreflightedPrefill:
    """A traced prefill whose traces are all captured; run by execute_preflighted_prefill."""

    prepared: tuple[PreparedPrefill, ...]
    batch_size: int
    sampling_params: SamplingParams | None
    lane: int


class ModelExecutor(ExecutorSleep):
    """One lane: composition, phase-guarded calls, and cleanup in the seed's order."""

    PHASE_TABLE = EXECUTOR_TABLE

    def __init__(
        self,
        model: PagedModel,
        config: ModelExecutorConfig,
        *,
        device: Device,
        owner_name: str = "ModelExecutor",
        journal: Journal | None = None,
        progress: ProgressSink | Callable[[str, int, int], None] | None = None,
    ) -> None:
        require_exact_type("config", config, ModelExecutorConfig)
        if not callable(getattr(model, "iter_executor_named_modules", None)):
            raise TypeError(
                f"model {type(model).__name__} must provide iter_executor_named_modules() "
                "(see runtime.model_contract.PagedModel)"
            )
        if config.device_sampling_enabled and getattr(model, "sampling", None) is None:
            raise TypeError("device sampling requires model.sampling (a resolved sampler)")
        super().__init__(
            owner_name=owner_name,
            journal=journal,
            table=TRACED_EXECUTOR_TABLE if config.traced else EAGER_EXECUTOR_TABLE,
        )
        self.model = model
        self.config = config
        self.device = device
        self.progress: ProgressSink = as_progress(progress)
        kv = config.paged_kv_cache
        self.page_table_layout = config.page_table_layout(kv.num_blocks or kv.max_num_blocks)
        self._lane_callbacks = LaneCallbacks(
            ensure_sampling_buffers=self.ensure_sampling_buffers,
            validate_bound_cache=self._validate_cache_argument,
            progress=self.progress,
        )
        self._kv_handle: KVCacheHandle | None = None
        self.kv_generation = 0
        """Counts KV allocations: block tables of an older generation describe lost contents."""
        resident = callable(getattr(model, "resident_weights", None))
        self.residency = WeightResidency(model) if resident else None  # type: ignore[arg-type]
        self._install_components(self._build_components())

    def _build_components(self) -> LaneComponents:
        """Fresh runtime components of this lane (start-up, and each wake of the KV cache)."""
        return build_lane_components(
            self.model,
            self.config,
            layout=self.page_table_layout,
            device=self.device,
            journal=self.journal,
            owner_name=self.owner_name,
            callbacks=self._lane_callbacks,
        )

    def _install_components(self, components: LaneComponents) -> None:
        """Make `components` the lane's own (the executor releases them)."""
        self.components = components
        self.kv_cache_manager = components.kv_cache_manager
        self.output_reader = components.output_reader
        self.prefill_runtime = components.prefill_runtime
        self.decode_runtime = components.decode_runtime
        self.program_compiler = components.program_compiler
        self.eager_executor = components.eager_executor
        self.trace_compiler = components.trace_compiler
        self.traced_executor = components.traced_executor
        self.warmup = components.warmup
        traced = self.traced_executor if self.config.trace.decode_enabled else None
        self._decode_target: EagerExecutor | TracedExecutor = traced or self.eager_executor

    def _release_sampling(self) -> Callable[[], object] | None:
        """The sampler's release, when this lane samples on the device."""
        return self._sampler().release if self.config.device_sampling_enabled else None

    def _warm_and_capture(self) -> None:
        """Every configured warmup, then capture when traced (the KV stage of a wake)."""
        self._prefill_warmup(None, None, None)
        self._decode_warmup(None, None, None)
        if self.config.traced:
            with self.progress.step("capture traces"):
                self.warmup.capture_pending_traces()

    # -- geometry ---------------------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        return self.kv_cache_manager.config.block_size

    @property
    def num_blocks(self) -> int | None:
        """Physical KV blocks (None until capacity is resolved)."""
        return self.kv_cache_manager.config.num_blocks

    @property
    def max_batch_size(self) -> int:
        """Lane capacity: decode rows per step."""
        return self.config.max_batch_size

    @property
    def kv_cache(self) -> KVCacheHandle | None:
        """The borrowed KV handle once allocated."""
        return self._kv_handle

    @property
    def trace_mode(self) -> str:
        """none, decode_only or all."""
        return self.config.trace.mode

    @property
    def coverage_manifest(self) -> CoverageManifest | None:
        """Traced coverage after capture, else the eager coverage warmup compiled."""
        if self.warmup.coverage_manifest is not None:
            return self.warmup.coverage_manifest
        if self.phase in (P.COMPILED, P.CAPTURED, P.SERVING, P.DRAINING, P.DRAINED):
            return self.warmup.eager_manifest()
        return None

    # -- capacity, seal, allocate ----------------------------------------------------------------

    @guarded(P.CONSTRUCTED)
    def configure_paged_kv_cache(self, config: PagedKVCacheConfig) -> None:
        """Resolve physical capacity late (may shrink, never grow); CONSTRUCTED -> RESOLVED."""
        if not isinstance(config, PagedKVCacheConfig):
            raise TypeError(f"config must be a PagedKVCacheConfig, got {type(config).__name__}")
        self._lifecycle.transact(
            "resolve_capacity", lambda: self._install_capacity(config), detail=_same
        )

    def _install_capacity(self, config: PagedKVCacheConfig) -> str:
        if not config.is_resolved():
            raise ValueError("configure_paged_kv_cache needs a resolved config (num_blocks set)")
        assert config.num_blocks is not None
        layout = self.config.page_table_layout(config.num_blocks)
        self.components.install_capacity(config, layout, self.device)
        self.page_table_layout = layout
        return f"{config.num_blocks} blocks of {config.block_size} tokens"

    def kv_cache_bytes(self, num_blocks: int) -> int:
        """Bytes a paged KV cache of `num_blocks` blocks takes (every layer's K and V)."""
        return self.kv_cache_manager.bytes_per_block * num_blocks

    def check_kv_memory(self, num_blocks: int) -> None:
        """Refuse, before allocating, a KV cache larger than the memory the device has left."""
        check_kv_memory(self.kv_cache_manager, self.device, num_blocks)

    def _do_resolve_capacity(self, num_blocks: int | None) -> str:
        current = self.kv_cache_manager.config
        if num_blocks is None:
            num_blocks = current.num_blocks or current.max_num_blocks
        return self._install_capacity(current.with_num_blocks(num_blocks))

    def _do_seal(self) -> str:
        self.warmup.seal_configuration()
        layout = self.page_table_layout
        return (
            f"layout: block {layout.block_size}, prefill width {layout.prefill_width}, "
            f"decode width {layout.decode_width}"
        )

    def _do_allocate(self) -> str:
        num_blocks = self.kv_cache_manager.config.num_blocks
        assert num_blocks is not None
        self.check_kv_memory(num_blocks)
        manager = self.kv_cache_manager
        with self.progress.step("allocate KV cache") as step:
            self._kv_handle = manager.allocate()
            self.kv_generation += 1
            step.advance(0, f"{format_bytes(manager.nbytes)} in {num_blocks} blocks")
        return (
            f"KV {manager.nbytes} bytes in {manager.config.num_blocks} blocks x "
            f"{2 * manager.num_layers} tensors"
        )

    @guarded(P.CONSTRUCTED, P.CAPACITY_RESOLVED, P.SEALED)
    def allocate_kv_cache(
        self,
        kv_cache_shape: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
        num_layers: int | None = None,
    ) -> KVCacheHandle:
        """Resolve (if needed), seal and allocate: three journaled transitions.

        A server may pass its physical cache spec (all three arguments or none).
        """
        num_blocks = server_cache_blocks(self.kv_cache_manager, kv_cache_shape, dtype, num_layers)
        if self.phase is P.CONSTRUCTED:
            self.resolve_capacity(num_blocks)
        if kv_cache_shape is not None:
            check_server_cache_shape(self.kv_cache_manager, kv_cache_shape)
        if self.phase is P.CAPACITY_RESOLVED:
            self.seal()
        self.allocate()
        assert self._kv_handle is not None
        return self._kv_handle

    # -- compile and warm ------------------------------------------------------------------------

    def _validate_cache_argument(self, kv_cache: object) -> None:
        if kv_cache is not None:
            self.kv_cache_manager.validate_borrowed_handle(kv_cache)
        elif self.kv_cache_manager.bound_context is None:
            raise RuntimeError(
                "Paged KV cache must be allocated and bound before execution; call "
                "allocate_kv_cache()"
            )

    def _sampler(self) -> BufferedSampler:
        """`model.sampling`, which construction required when device sampling is enabled."""
        sampler: BufferedSampler = getattr(self.model, "sampling")  # noqa: B009
        return sampler

    def ensure_sampling_buffers(self) -> None:
        """Materialise device-sampling buffers; refused once traces are active."""
        if not self.config.device_sampling_enabled:
            return
        sampler = self._sampler()
        if getattr(sampler, "materialized", False):
            return
        if self.program_compiler.gate_closed:
            raise RuntimeError(
                "device sampling buffers would be allocated after trace activation; warm up "
                "with sampling before capture()"
            )
        sampler.materialize(self.device)

    @guarded(*_SETUP, reasons=_ASLEEP)
    def compile_prefill(
        self, *, kv_cache: object = None, **arguments: Unpack[PrefillArguments]
    ) -> tuple[CompiledProgram, ...]:
        """Compile the programs of one prefill call (eager; traced lanes also register)."""
        self._validate_cache_argument(kv_cache)
        target = self.traced_executor if self.config.trace.prefill_enabled else None
        with self._faulting("compile_prefill"):
            batch = self.eager_executor.prefill_batch("compile_prefill", arguments)
            return (target or self.eager_executor).compile_prefill_batch(batch)

    @guarded(*_SETUP, reasons=_ASLEEP)
    def compile_decode(
        self, *, kv_cache: object = None, **arguments: Unpack[DecodeArguments]
    ) -> CompiledProgram:
        """Compile the decode program of one call (traced lanes also register a plan).

        The step is checked by `DecodeRuntime.prepare`, as in `decode_forward`.
        """
        self._validate_cache_argument(kv_cache)
        target = self.traced_executor if self.config.trace.decode_enabled else None
        with self._faulting("compile_decode"):
            prepared = self.decode_runtime.prepare(**arguments)
            return (target or self.eager_executor).compile_decode_batch(prepared)

    def _sampling_choice(self, sampling: bool | None) -> bool:
        """A warmup's `can_sample_on_device`: the caller's choice, else the lane's policy."""
        return self.config.device_sampling_enabled if sampling is None else sampling

    def _prefill_warmup(self, kv_cache: object, sampling: bool | None, trace: bool | None) -> None:
        try:
            self.warmup.warmup_prefill(
                kv_cache=kv_cache,
                can_sample_on_device=self._sampling_choice(sampling),
                enable_trace=self.config.trace.prefill_enabled if trace is None else trace,
            )
        finally:
            self.progress.cases_done()

    def _decode_warmup(
        self,
        kv_cache: object,
        sampling: bool | None,
        trace: bool | None,
        max_batch_size: int | None = None,
        num_blocks: int | None = None,
    ) -> None:
        try:
            physical = self.kv_cache_manager.config.num_blocks
            assert physical is not None
            lane = self.config.max_batch_size
            check_warmup_extent(lane, physical, max_batch_size, num_blocks)
            self.warmup.warmup_decode(
                kv_cache=kv_cache,
                max_batch_size=lane if max_batch_size is None else max_batch_size,
                num_blocks=physical if num_blocks is None else num_blocks,
                can_sample_on_device=self._sampling_choice(sampling),
                enable_trace=self.config.trace.decode_enabled if trace is None else trace,
            )
        finally:
            self.progress.cases_done()

    def _warmup_ready(self) -> bool:
        return self.warmup.operation_complete("prefill") and self.warmup.operation_complete(
            "decode"
        )

    def _after_warmup(self) -> None:
        if self.phase is P.ALLOCATED and self._warmup_ready():
            self._fire_compiled()

    def _fire_compiled(self) -> None:
        """ALLOCATED -> COMPILED, journaled with the time warmup spent compiling."""
        seconds = sum(self.warmup.case_seconds.values())
        self._lifecycle.fire("compile", detail=self._compile_detail(), duration_s=seconds)

    def _compile_detail(self) -> str:
        programs = len(self.program_compiler.compiled_programs)
        seconds = sum(self.warmup.case_seconds.values())
        kernels = self.warmup.kernel_choice
        chosen = f"; {kernels['summary']}" if isinstance(kernels, dict) else ""
        return f"{programs} programs compiled in {seconds:.2f} s{chosen}"

    @guarded(*_SETUP, reasons=_ASLEEP)
    def warmup_prefill(
        self,
        *,
        kv_cache: object = None,
        can_sample_on_device: bool | None = None,
        enable_trace: bool | None = None,
    ) -> None:
        """Compile every declared prefill shape; with decode done, ALLOCATED -> COMPILED."""
        with self._faulting("warmup_prefill"):
            self._prefill_warmup(kv_cache, can_sample_on_device, enable_trace)
        self._after_warmup()

    @guarded(*_SETUP, reasons=_ASLEEP)
    def warmup_decode(
        self,
        *,
        kv_cache: object = None,
        max_batch_size: int | None = None,
        num_blocks: int | None = None,
        can_sample_on_device: bool | None = None,
        enable_trace: bool | None = None,
    ) -> None:
        """Compile every declared decode shape; with prefill done, ALLOCATED -> COMPILED.

        `max_batch_size` (1..lane capacity) and `num_blocks` (1..allocated blocks) are what a
        serving engine warms for; None means the lane's own values.
        """
        with self._faulting("warmup_decode"):
            self._decode_warmup(
                kv_cache, can_sample_on_device, enable_trace, max_batch_size, num_blocks
            )
        self._after_warmup()

    @guarded(P.CONSTRUCTED, P.CAPACITY_RESOLVED, P.SEALED, *_SETUP)
    def choose_kernels(self) -> JSONValue:
        """Choose this lane's kernels now (measured or replayed); their JSON, or None.

        A lane group asks one lane and hands the answer to the others (`adopt_kernels`), so
        a request computes with the same forms whichever lane serves it.
        """
        return self.warmup.choose_kernels()

    @guarded(P.CONSTRUCTED, P.CAPACITY_RESOLVED, P.SEALED, *_SETUP)
    def adopt_kernels(self, plan: JSONValue) -> None:
        """Use `plan` (another lane's `choose_kernels` JSON) at warmup instead of choosing."""
        adopt = getattr(self.model, "adopt_kernels", None)
        if plan is not None and callable(adopt) and self.warmup.kernel_choice is None:
            adopt(plan)

    warmup_model_prefill = warmup_prefill
    """The seed's name for `warmup_prefill` (every argument honoured)."""
    warmup_model_decode = warmup_decode
    """The seed's name for `warmup_decode` (every argument honoured and validated)."""

    def _do_compile(self) -> str:
        self._prefill_warmup(None, None, None)
        self._decode_warmup(None, None, None)
        return self._compile_detail()

    def compile(self) -> None:
        """ALLOCATED -> COMPILED by running every configured warmup."""
        if self.phase is P.ALLOCATED and self._warmup_ready():
            self._fire_compiled()
            return
        super().compile()

    # -- capture and serve -----------------------------------------------------------------------

    def _requires_capture(self) -> bool:
        return self.config.traced

    def _do_capture(self) -> str:
        with self.progress.step("capture traces"):
            manifest = self.warmup.capture_pending_traces()
        assert self.trace_compiler is not None
        tracer = self.trace_compiler
        return (
            f"{tracer.capture_count} captures for {tracer.trace_count} traces and "
            f"{len(manifest.aliases)} programs"
        )

    def _do_serve(self) -> str:
        self._validate_cache_argument(None)
        return f"trace mode {self.config.trace.mode}"

    # -- requests --------------------------------------------------------------------------------

    def _check_sampling(self, sampling_params: object) -> None:
        if sampling_params is not None:
            if not self.config.device_sampling_enabled:
                raise ValueError(
                    "sampling_params were given but device sampling is disabled for this "
                    "executor; construct it with device_sampling_enabled=True"
                )
            self.ensure_sampling_buffers()

    def _traced_target(self, operation: str) -> TracedExecutor:
        """The traced executor for `operation` (ValueError when the trace mode skips it)."""
        target = self._target(operation, "traced")
        assert isinstance(target, TracedExecutor), "_target('traced') returns the traced one"
        return target

    def _target(self, operation: str, execution: str | None) -> EagerExecutor | TracedExecutor:
        if execution is None and operation == "decode":
            return self._decode_target  # the per-step case: decided once, at construction
        if execution not in (None, "eager", "traced"):
            raise ValueError(f"execution must be None, 'eager' or 'traced', got {execution!r}")
        traced = (
            self.config.trace.prefill_enabled
            if operation == "prefill"
            else self.config.trace.decode_enabled
        )
        if execution == "eager" or (execution is None and not traced):
            return self.eager_executor
        if self.traced_executor is None or not traced:
            raise ValueError(
                f"execution='traced' asked for {operation}, which trace mode "
                f"{self.config.trace.mode!r} does not trace"
            )
        return self.traced_executor

    @guarded(P.SERVING, reasons=_NOT_SERVING)
    def prefill_forward(
        self,
        *,
        kv_cache: object = None,
        execution: str | None = None,
        **arguments: Unpack[PrefillArguments],
    ) -> PrefillOutput:
        """Prefill a batch of prompts; rows come back in source order.

        The keywords are `PrefillArguments` (tokens, page_table, prompt_lens, start_pos,
        empty_slots, sampling_params, prompt_tokens, output_tokens, slot_remap).
        """
        self._validate_cache_argument(kv_cache)
        self._check_sampling(arguments.get("sampling_params"))
        target = self._target("prefill", execution)
        try:
            batch = self.eager_executor.prefill_batch("prefill_forward", arguments)
            return target.prefill_forward_batch(batch)
        except BaseException as error:  # inline: this is the per-step path
            self._fault_if_holding("prefill_forward", error)
            raise

    @guarded(P.SERVING, reasons=_NOT_SERVING)
    def decode_forward(
        self,
        *,
        kv_cache: object = None,
        read_from_device: bool = True,
        execution: str | None = None,
        **arguments: Unpack[DecodeArguments],
    ) -> DecodeHostOutput | object:
        """One decode step over the whole lane (negative positions are inactive rows).

        The step is checked once, by `DecodeRuntime.prepare`, before any device work; the
        eager or traced executor runs the checked `PreparedDecode`.
        """
        self._validate_cache_argument(kv_cache)
        self._check_sampling(arguments.get("sampling_params"))
        require_bool("read_from_device", read_from_device)
        target = self._target("decode", execution)
        try:
            prepared = self.decode_runtime.prepare(**arguments)
            return target.decode_forward(prepared, read_from_device=read_from_device)
        except BaseException as error:  # inline: this is the per-step path
            self._fault_if_holding("decode_forward", error)
            raise

    @guarded(P.SERVING, reasons=_NOT_SERVING)
    def decode_step(self, step: DecodeStep) -> object:
        """`decode_forward` of a typed step (what a lane group sends its lanes).

        A step whose `checked` stamp is this lane's own geometry was checked by the group's
        boundary and is not checked again; any other step is checked as `decode_forward`
        checks its keywords (`DecodeRuntime.prepare_step`).
        """
        if not isinstance(step, DecodeStep):
            raise TypeError(f"step must be a DecodeStep, got {type(step).__name__}")
        self._validate_cache_argument(step.kv_cache)
        self._check_sampling(step.sampling_params)
        require_bool("read_from_device", step.read_from_device)
        target = self._target("decode", step.execution)
        try:
            prepared = self.decode_runtime.prepare_step(step)
            return target.decode_forward(prepared, read_from_device=step.read_from_device)
        except BaseException as error:  # inline: this is the per-step path
            self._fault_if_holding("decode_forward", error)
            raise

    @guarded(P.SERVING, reasons=_NOT_SERVING)
    @overload
    def read_decode_output(
        self, raw: object, *, async_read: Literal[True]
    ) -> tuple[object, list[Event]]: ...
    @overload
    def read_decode_output(self, raw: object, *, async_read: Literal[False] = False) -> object: ...
    def read_decode_output(
        self, raw: object, *, async_read: bool = False
    ) -> object | tuple[object, list[Event]]:
        """Read a raw decode output (async: `(host_value, events)` to complete later)."""
        try:
            if async_read:
                return self.decode_runtime.read_decode_output(raw, async_read=True)
            return self.decode_runtime.read_decode_output(raw, async_read=False)
        except BaseException as error:  # inline: this is the per-step path
            self._fault_if_holding("read_decode_output", error)
            raise

    @guarded(P.SERVING, reasons=_NOT_SERVING)
    def process_decode_output_host(
        self, host_value: object, *, is_tokens: bool = False
    ) -> DecodeHostOutput:
        """Complete an asynchronous read and normalise it."""
        try:
            return self.decode_runtime.process_decode_output_host(host_value, is_tokens=is_tokens)
        except BaseException as error:  # inline: this is the per-step path
            self._fault_if_holding("process_decode_output_host", error)
            raise

    @guarded(P.SERVING, reasons=_NOT_SERVING)
    def preflight_prefill(
        self, *, lane: int = 0, kv_cache: object = None, **arguments: Unpack[PrefillArguments]
    ) -> PreflightedPrefill:
        """Prepare a traced prefill and check its traces; nothing runs (lane-group preflight)."""
        self._validate_cache_argument(kv_cache)
        self._check_sampling(arguments.get("sampling_params"))
        traced = self._traced_target("prefill")
        batch = self.eager_executor.prefill_batch("preflight_prefill", arguments)
        prepared = traced.preflight_prefill(self.eager_executor.prepare_prefill(batch))
        return PreflightedPrefill(prepared, batch.batch_size, batch.sampling_params, lane)

    @guarded(P.SERVING, reasons=_NOT_SERVING)
    def execute_preflighted_prefill(self, *, preflighted: PreflightedPrefill) -> PrefillOutput:
        """Replay a request `preflight_prefill` accepted (rows in source order)."""
        if not isinstance(preflighted, PreflightedPrefill):
            raise TypeError(
                f"preflighted must come from preflight_prefill(), got {type(preflighted).__name__}"
            )
        traced = self._traced_target("prefill")
        return traced.execute_prepared_prefill(
            preflighted.prepared,
            batch_size=preflighted.batch_size,
            sampling_params=preflighted.sampling_params,
            lane=preflighted.lane,
        )

    def can_trace_prefill(
        self, *, tokens: object, prompt_lens: IntVector = None, start_pos: IntVector = None
    ) -> bool:
        """Whether prefill of this geometry could replay a trace (a capability query)."""
        if self.traced_executor is None or not self.config.trace.prefill_enabled:
            return False
        return self.prefill_runtime.can_trace(
            tokens=tokens, prompt_lens=prompt_lens, start_pos=start_pos
        )

    def runtime_summary(self) -> dict[str, JSONValue]:
        """Counters from the execution objects."""
        target = self.traced_executor or self.eager_executor
        return target.runtime_summary()

    # -- cleanup ---------------------------------------------------------------------------------

    def _held_resources(self) -> tuple[str, ...]:
        """Components holding what a failed release left (each refuses work until cleaned)."""
        return self.components.held_resources()

    def _do_close(self) -> Sequence[BaseException]:
        failures = self._release_components()
        return failures or self._return_weights()


def _same(detail: str) -> str:
    return detail

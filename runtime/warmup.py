"""Warmup coverage and the prefill/decode capture barrier.

The coverage plan is derived from the identity rules serving uses (`runtime.warmup_coverage`):
every program a request the lane admits can need, trimmed only where the user asked
(`WarmupConfig`). `warmup_prefill` and
`warmup_decode` may run in either order and repeatedly: each compiles (and, when tracing,
registers) only what is not yet covered. Capture happens exactly once, only after every
configured operation registered its complete case set; a lane group can defer it and
activate all lanes together.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

import attrs
import torch

from lifecycle.journal import Journal, Outcome
from runtime.config import PageTableLayout, TraceConfig, WarmupConfig
from runtime.decode import DecodeRuntime
from runtime.decode_config import DecodeRuntimeConfig
from runtime.execution import EagerExecutor, TracedExecutor
from runtime.json_types import JSONValue
from runtime.prefill.config import PrefillRuntimeConfig
from runtime.prefill.runtime import STATIC_Q128_TOPK_SUPPORTED, PrefillRuntime
from runtime.program_compiler import CompiledProgram
from runtime.validation import is_int, positive_int
from runtime.warmup_coverage import (
    CoverageFilter,
    Operation,
    Recipe,
    WarmupCase,
    derive_decode_cases,
    derive_prefill_cases,
    recipe_params,
)
from runtime.warmup_manifest import CoverageManifest, eager_manifest, traced_manifest

logger = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]


def progress_step(progress: object, name: str) -> contextlib.AbstractContextManager[object]:
    """`progress.step(name)` where the sink has steps (`models.progress`), else nothing.

    A bare `(label, index, total)` callback sees warmup cases only; a sink with steps also
    sees the slow phases before them (coverage derivation), so a large lane is never silent.
    """
    step = getattr(progress, "step", None)
    if callable(step):
        context: contextlib.AbstractContextManager[object] = step(name)
        return context
    return contextlib.nullcontext()


@attrs.frozen
class WarmupPlan:
    """Every case warmup covers, prefill then decode."""

    prefill: tuple[WarmupCase, ...]
    decode: tuple[WarmupCase, ...]


def _unique_positive(name: str, values: object) -> tuple[int, ...]:
    if not isinstance(values, tuple) or not values:
        raise ValueError(f"{name} must be a non-empty tuple of positive integers, got {values!r}")
    for value in values:
        if not is_int(value) or value <= 0:
            raise ValueError(f"{name} must contain positive integers, got {value!r}")
    if len(set(values)) != len(values):
        raise ValueError(f"{name} must be unique, got {values!r}")
    return values


def _check_runtimes_agree(prefill: PrefillRuntimeConfig, decode: DecodeRuntimeConfig) -> None:
    """Prefill and decode of one lane share model, layout, capacity and sampling policy."""
    if prefill.model is not decode.model:
        raise ValueError("prefill and decode runtimes must share one model")
    if prefill.page_table_layout is not decode.page_table_layout:
        raise ValueError("prefill and decode runtimes must share one page-table layout")
    if prefill.max_batch_size != decode.lane_capacity:
        raise ValueError(
            f"prefill and decode runtimes must share one lane capacity: "
            f"{prefill.max_batch_size} != {decode.lane_capacity}"
        )
    if prefill.device_sampling_enabled != decode.device_sampling_enabled:
        raise ValueError("prefill and decode runtimes must share device-sampling policy")


@attrs.frozen
class WarmupCoordinatorConfig:
    """Resolved warmup policy shared by prefill and decode of one lane.

    Coverage is derived (`runtime.warmup_coverage`): every prompt length up to
    `max_prompt_length`, every wave the planner forms within the lane, each sampling recipe.
    `coverage` holds the user's trims (`WarmupConfig`); `prime_q128_tile_ends` reports whether
    Q128 top-k programs also bake the last-token tile (reference 2.19: the static Q128 top-k
    sampler); argmax programs always do, and each of their tile ends is a derived case.
    """

    warmup: WarmupConfig
    trace: TraceConfig
    model: object
    """The lane's model (compared by identity; its optional `choose_kernels` is read)."""
    page_table_layout: PageTableLayout
    prefill_sequence_lengths: tuple[int, ...]
    batched_sequence_lengths: tuple[int, ...] | None
    lane_batch_size: int
    max_prefill_batch_size: int
    max_batched_prefill_tokens: int
    device_sampling_enabled: bool
    allow_force_argmax: bool
    max_prompt_length: int | None = None
    max_device_top_k: int = 1
    prime_q128_tile_ends: bool = False

    @classmethod
    def resolve(
        cls,
        *,
        warmup: WarmupConfig,
        trace: TraceConfig,
        prefill: PrefillRuntime,
        decode: DecodeRuntime,
        prefill_sequence_lengths: tuple[int, ...],
        batched_sequence_lengths: tuple[int, ...] | None = None,
        max_seq_len: int | None = None,
    ) -> WarmupCoordinatorConfig:
        """Validate that prefill and decode agree, and fix the coverage trims.

        `batched_sequence_lengths=None` keeps the reference's eager default (waves at the
        first length only); a traced lane passes every length. `max_seq_len` bounds the
        probed prompt lengths (`1..max_seq_len-1`; default: the KV capacity).
        """
        if not isinstance(warmup, WarmupConfig):
            raise TypeError(f"warmup must be a WarmupConfig, got {type(warmup).__name__}")
        if not isinstance(trace, TraceConfig):
            raise TypeError(f"trace must be a TraceConfig, got {type(trace).__name__}")
        p, d = prefill.config, decode.config
        _check_runtimes_agree(p, d)
        if max_seq_len is not None and (not is_int(max_seq_len) or max_seq_len < 2):
            raise ValueError(f"max_seq_len must be an integer >= 2, got {max_seq_len!r}")
        lengths = _unique_positive(
            "prefill_sequence_lengths",
            warmup.prefill_seq_lens
            if warmup.prefill_seq_lens is not None
            else prefill_sequence_lengths,
        )
        batched = lengths[:1] if batched_sequence_lengths is None else batched_sequence_lengths
        sampling = d.device_sampling_enabled
        return cls(
            warmup=warmup,
            trace=trace,
            model=p.model,
            page_table_layout=p.page_table_layout,
            prefill_sequence_lengths=lengths,
            batched_sequence_lengths=tuple(batched),
            lane_batch_size=d.lane_capacity,
            max_prefill_batch_size=p.max_prefill_batch_size,
            max_batched_prefill_tokens=p.policy.max_batched_prefill_tokens,
            device_sampling_enabled=sampling,
            allow_force_argmax=d.allow_force_argmax,
            max_prompt_length=None if max_seq_len is None else max_seq_len - 1,
            max_device_top_k=(d.max_device_top_k or 1) if sampling else 1,
            prime_q128_tile_ends=sampling and STATIC_Q128_TOPK_SUPPORTED,
        )

    def with_page_table_layout(self, layout: PageTableLayout) -> WarmupCoordinatorConfig:
        """The same policy over a (late, smaller) layout."""
        if not isinstance(layout, PageTableLayout):
            raise TypeError(f"layout must be a PageTableLayout, got {type(layout).__name__}")
        return attrs.evolve(self, page_table_layout=layout)

    @property
    def coverage(self) -> CoverageFilter:
        """The user's trims: configured lengths only when set, waves per lane policy."""
        warmup = self.warmup
        return CoverageFilter(
            sequence_lengths=warmup.prefill_seq_lens,
            batch_sizes=warmup.prefill_batch_sizes,
            batched_lengths=self.batched_sequence_lengths,
        )

    def recipes(self, can_sample_on_device: bool) -> tuple[Recipe, ...]:
        """Sampling recipes probed: none, plus greedy and sampled when sampling on device."""
        if can_sample_on_device and self.device_sampling_enabled:
            return ("none", "greedy", "sampled")
        return ("none",)

    def prompt_length_limit(self) -> int:
        """The longest prompt probed: max_seq_len - 1, within the KV capacity."""
        layout = self.page_table_layout
        capacity = layout.raw_capacity_width * layout.block_size
        if self.max_prompt_length is None:
            return capacity
        return min(self.max_prompt_length, capacity)

    def plan(
        self, *, can_sample_on_device: bool, prefill: PrefillRuntime, decode: DecodeRuntime
    ) -> WarmupPlan:
        """The derived coverage for one sampling decision (see `runtime.warmup_coverage`)."""
        recipes = self.recipes(can_sample_on_device)
        prefill_cases = derive_prefill_cases(
            prefill,
            max_prompt_length=self.prompt_length_limit(),
            lane_batch_size=self.lane_batch_size,
            recipes=recipes,
            max_top_k=self.max_device_top_k,
            coverage=self.coverage,
        )
        decode_cases = derive_decode_cases(
            decode,
            lane_batch_size=self.lane_batch_size,
            page_table_width=self.page_table_layout.decode_width,
            recipes=recipes,
            max_top_k=self.max_device_top_k,
        )
        return WarmupPlan(prefill=prefill_cases, decode=decode_cases)


class WarmupCoordinator:
    """Compiles declared coverage in any order and captures traces exactly once."""

    def __init__(
        self,
        *,
        config: WarmupCoordinatorConfig,
        execution: EagerExecutor | TracedExecutor,
        ensure_sampling_buffers: Callable[[], None],
        validate_bound_cache: Callable[[object], None],
        progress: Progress | None = None,
        auto_capture: bool = True,
        journal: Journal | None = None,
        owner_name: str = "WarmupCoordinator",
    ) -> None:
        if not isinstance(config, WarmupCoordinatorConfig):
            raise TypeError(f"config must be a WarmupCoordinatorConfig, got {config!r}")
        if isinstance(execution, TracedExecutor):
            self._eager = execution.eager_executor
            self._traced: TracedExecutor | None = execution
        elif isinstance(execution, EagerExecutor):
            self._eager = execution
            self._traced = None
        else:
            raise TypeError(
                f"execution must be an EagerExecutor or TracedExecutor, got {execution!r}"
            )
        for name, callback in (
            ("ensure_sampling_buffers", ensure_sampling_buffers),
            ("validate_bound_cache", validate_bound_cache),
        ):
            if not callable(callback):
                raise TypeError(f"{name} must be callable, got {callback!r}")
        if self._eager.prefill.config.model is not config.model:
            raise ValueError("the warmup config and the executor must share one model")
        self.config = config
        self._ensure_sampling_buffers = ensure_sampling_buffers
        self._validate_bound_cache = validate_bound_cache
        self._progress = progress
        self._auto_capture = auto_capture
        self._compiled: set[WarmupCase] = set()
        self._registered: set[WarmupCase] = set()
        self._decisions: dict[Operation, tuple[bool, bool]] = {}
        self._required: list[CompiledProgram] = []
        self._required_traced: list[CompiledProgram] = []
        self._deferring = False
        self._capture_pending = False
        self._trace_activated = False
        self._sealed = False
        self.coverage_manifest: CoverageManifest | None = None
        self.case_seconds: dict[WarmupCase, float] = {}
        self._journal = journal
        self._owner_name = owner_name
        self._plans: dict[tuple[bool, PageTableLayout], WarmupPlan] = {}
        self.derivation_seconds = 0.0
        """Seconds spent deriving coverage from the planner (not compiling)."""
        self.kernel_choice: JSONValue = None

    def choose_kernels(self) -> JSONValue:
        """The model's kernel choice for this lane (made once, before anything compiles)."""
        if self.kernel_choice is None:
            self.kernel_choice = choose_model_kernels(self.config, self._progress)
        return self.kernel_choice

    def adopt_derivation(self, previous: WarmupCoordinator) -> None:
        """Reuse `previous`'s kernel choice and derived coverage (a wake re-warms the same
        lane, so neither is measured or derived again)."""
        self.kernel_choice = previous.kernel_choice
        self._plans.update(previous._plans)

    # -- state ----------------------------------------------------------------------------------

    @property
    def trace_activated(self) -> bool:
        """Whether capture ran (exactly once)."""
        return self._trace_activated

    @property
    def capture_pending(self) -> bool:
        """Whether capture is ready but deferred (lane-group barrier)."""
        return self._capture_pending

    def seal_configuration(self) -> None:
        """Freeze the layout: warmup shapes are about to be compiled against it."""
        self._sealed = True

    def configure_page_table_layout(self, layout: PageTableLayout) -> None:
        """Adopt a late (smaller) layout before warmup starts."""
        if not isinstance(layout, PageTableLayout):
            raise TypeError(f"layout must be a PageTableLayout, got {type(layout).__name__}")
        if self._sealed:
            raise RuntimeError("warmup configuration is sealed; configure capacity before warmup")
        self.config = self.config.with_page_table_layout(layout)

    def operation_complete(self, operation: Operation) -> bool:
        """Whether the latest decision's cases of `operation` are all covered."""
        decision = self._decisions.get(operation)
        if decision is None:
            return False
        sampling, trace = decision
        cases = self._cases(operation, sampling)
        done = self._registered if trace else self._compiled
        return all(case in done for case in cases)

    @property
    def complete(self) -> bool:
        """Whether prefill and decode are both covered (and captured when traced)."""
        covered = self.operation_complete("prefill") and self.operation_complete("decode")
        return covered and (
            self._traced is None or not self._trace_required() or self._trace_activated
        )

    def plan(self, *, can_sample_on_device: bool) -> WarmupPlan:
        """The derived coverage for one sampling decision (memoised per layout)."""
        key = (can_sample_on_device, self.config.page_table_layout)
        plan = self._plans.get(key)
        if plan is None:
            started = time.perf_counter()
            with progress_step(self._progress, "derive warmup coverage"):
                plan = self.config.plan(
                    can_sample_on_device=can_sample_on_device,
                    prefill=self._eager.prefill,
                    decode=self._eager.decode,
                )
            self._plans[key] = plan
            self.derivation_seconds += time.perf_counter() - started
            logger.info(
                "derived %d prefill and %d decode warmup case(s) in %.2f s",
                len(plan.prefill),
                len(plan.decode),
                time.perf_counter() - started,
            )
        return plan

    def _cases(self, operation: Operation, sampling: bool) -> tuple[WarmupCase, ...]:
        plan = self.plan(can_sample_on_device=sampling)
        return plan.prefill if operation == "prefill" else plan.decode

    # -- warmup calls ---------------------------------------------------------------------------

    def warmup_prefill(
        self, *, kv_cache: object, can_sample_on_device: bool, enable_trace: bool
    ) -> None:
        """Compile (and register for capture) every declared prefill case not yet covered."""
        self._check_hints("prefill", can_sample_on_device, enable_trace)
        self._validate_bound_cache(kv_cache)
        self._run("prefill", can_sample_on_device, enable_trace, num_blocks=None)

    def warmup_decode(
        self,
        *,
        kv_cache: object,
        max_batch_size: int,
        num_blocks: int,
        can_sample_on_device: bool,
        enable_trace: bool,
    ) -> None:
        """Compile (and register for capture) every declared decode case not yet covered."""
        self._check_hints("decode", can_sample_on_device, enable_trace)
        self._validate_bound_cache(kv_cache)
        lane = self.config.lane_batch_size
        if not is_int(max_batch_size) or not 1 <= max_batch_size <= lane:
            raise ValueError(
                f"max_batch_size must be an int in 1..{lane} (the lane capacity; decode runs "
                f"the whole lane), got {max_batch_size!r}"
            )
        positive_int("num_blocks", num_blocks)
        self._run("decode", can_sample_on_device, enable_trace, num_blocks=num_blocks)

    def _check_hints(self, operation: Operation, sampling: bool, trace: bool) -> None:
        for name, value in (("can_sample_on_device", sampling), ("enable_trace", trace)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be bool, got {value!r}")
        configured = (
            self.config.trace.prefill_enabled
            if operation == "prefill"
            else self.config.trace.decode_enabled
        )
        if trace and (not configured or self._traced is None):
            raise ValueError(
                f"{operation} trace warmup exceeds the configured trace policy "
                f"(trace mode {self.config.trace.mode!r})"
            )
        if sampling and not self.config.device_sampling_enabled:
            raise ValueError(
                f"{operation} warmup asked for device sampling, which is statically disabled"
            )

    def _run(
        self, operation: Operation, sampling: bool, trace: bool, *, num_blocks: int | None
    ) -> None:
        self._decisions[operation] = (sampling, trace)
        self._sealed = True
        if self._trace_activated and trace:
            return  # capture already happened; coverage is fixed
        if sampling:
            self._ensure_sampling_buffers()
        self.choose_kernels()
        cases = list(self._cases(operation, sampling))
        if trace and sampling:
            # Top-k registers first, within each probe, so siblings still share a forward.
            cases.sort(key=lambda case: (case.probe_key, case.sampling_path != "topk"))
        done = self._registered if trace else self._compiled
        todo = [case for case in cases if case not in done]
        for index, case in enumerate(todo, start=1):
            if self._progress is not None:
                self._progress(case.describe(), index, len(todo))
            started = time.perf_counter()
            wall = time.time()
            programs = self._compile_case(case, trace=trace, num_blocks=num_blocks)
            seconds = self.case_seconds[case] = time.perf_counter() - started
            if self._journal is not None:
                self._journal.record(
                    machine=self._owner_name,
                    trigger=f"warmup_{operation}",
                    source="pending",
                    dest="traced" if trace else "compiled",
                    started=wall,
                    duration_s=seconds,
                    outcome=Outcome.OK,
                    detail=f"{case.describe()}: {len(programs)} program(s)",
                )
            self._required.extend(programs)
            self._compiled.add(case)
            if trace:
                self._required_traced.extend(programs)
                self._registered.add(case)
        self._maybe_capture()

    def _compile_case(
        self, case: WarmupCase, *, trace: bool, num_blocks: int | None
    ) -> tuple[CompiledProgram, ...]:
        target = self._traced if trace else self._eager
        if target is None:
            raise RuntimeError(
                f"cannot compile traced {case.operation} warmup: this coordinator was built "
                "with an EagerExecutor; pass a TracedExecutor"
            )
        top_k = self.config.max_device_top_k
        if case.operation == "prefill":
            request = case.prefill_request(
                block_size=self.config.page_table_layout.block_size, max_top_k=top_k
            )
            return tuple(target.compile_prefill(**request))
        assert num_blocks is not None
        lane = case.batch_size
        program = target.compile_decode(
            tokens=torch.zeros(lane, dtype=torch.long),
            start_pos=torch.zeros(lane, dtype=torch.long),
            page_table=torch.zeros(
                lane, min(num_blocks, self.config.page_table_layout.decode_width), dtype=torch.int32
            ),
            sampling_params=recipe_params(case.recipe, lane, max_top_k=top_k),
        )
        return (program,)

    # -- capture barrier ------------------------------------------------------------------------

    def _trace_required(self) -> bool:
        trace = self.config.trace
        return trace.prefill_enabled or trace.decode_enabled

    def _maybe_capture(self) -> None:
        if self._traced is None or self._trace_activated or self._capture_pending:
            return
        wanted = False
        for operation, enabled in (
            ("prefill", self.config.trace.prefill_enabled),
            ("decode", self.config.trace.decode_enabled),
        ):
            if not enabled:
                continue
            decision = self._decisions.get(operation)  # type: ignore[call-overload]
            if decision is None:
                return  # wait for the other operation's warmup
            if decision[1]:
                if not self.operation_complete(operation):  # type: ignore[arg-type]
                    return
                wanted = True
        if not wanted:
            return
        manifest = self._resolve_manifest()
        if self._deferring or not self._auto_capture:
            self._capture_pending = True
            self.coverage_manifest = manifest
            return
        self._capture(manifest)

    def _capture(self, manifest: CoverageManifest) -> None:
        assert self._traced is not None
        self._traced.trace_compiler.capture_all()
        self._trace_activated = True
        self._capture_pending = False
        self.coverage_manifest = manifest
        logger.info(
            "captured %d trace(s) for %d program(s)",
            len(manifest.trace_signatures),
            len(manifest.aliases),
        )

    def _resolve_manifest(self) -> CoverageManifest:
        return traced_manifest(
            required=self._required,
            required_traced=self._required_traced,
            program_compiler=self._eager.program_compiler,
            trace_compiler=None if self._traced is None else self._traced.trace_compiler,
            kernels=self.kernel_choice,
        )

    def eager_manifest(self) -> CoverageManifest:
        """The manifest of an untraced warmup (no traces, no aliases)."""
        return eager_manifest(self._required, kernels=self.kernel_choice)

    @contextlib.contextmanager
    def defer_capture(self) -> Iterator[None]:
        """Stage capture instead of running it (a lane group activates every lane together)."""
        if self._deferring or self._capture_pending:
            raise RuntimeError("capture is already deferred or pending")
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
            if self._capture_pending:
                self._capture_pending = False
                self.coverage_manifest = None

    def capture_pending_traces(self) -> CoverageManifest:
        """Capture a staged manifest now (hosts that make capture an explicit phase)."""
        if self._deferring or not self._capture_pending or self.coverage_manifest is None:
            raise RuntimeError(
                "no capture is pending: warm up every traced operation first "
                "(warmup_prefill() and warmup_decode())"
            )
        manifest = self.coverage_manifest
        self._capture(manifest)
        return manifest


def choose_model_kernels(config: WarmupCoordinatorConfig, progress: object = None) -> JSONValue:
    """Let the model pick its kernels for this lane's row counts before anything compiles.

    A model may offer `choose_kernels(decode_rows=, prefill_rows=, progress=)` returning a
    JSON-ready record with a "summary" line (the Llama family times its projection forms and
    reports each measurement to `progress`, a sink with steps, when given); models without
    it get None.
    """
    choose = getattr(config.model, "choose_kernels", None)
    if not callable(choose):
        return None
    rows = {
        "decode_rows": config.lane_batch_size,
        "prefill_rows": max(config.prefill_sequence_lengths),
    }
    chosen: JSONValue = (
        choose(**rows, progress=progress)
        if callable(getattr(progress, "step", None))
        else choose(**rows)
    )
    return chosen

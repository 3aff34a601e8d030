"""`LaneGroupExecutor`: one execution target over several data-parallel lanes.

The group is a lifecycle host with the same phase table as one lane and presents the same
execution-target API as one `ModelExecutor`; slots are global and a slot's lane is
`slot // per_lane`. Every phase call fans out to every lane (issued to all before waiting on
any), capture is one barrier across lanes, and every operation is guarded: once any lane
call fails, the group cleans up every lane and ends terminal, with cleanup failures attached
to the primary error. See docs/lanes.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TypeVar, Unpack

import attrs
import torch

from lifecycle import Phase, PhaseError, guarded
from lifecycle.errors import attach_cleanup_failures
from lifecycle.journal import Journal
from lifecycle.phases import NOT_SERVING
from runtime.config import TraceConfig
from runtime.decode_batch import DecodeArguments
from runtime.lane_routing import (
    LaneOutput,
    LaneRows,
    concat_decode,
    join_async_reads,
    lane_executions,
    one_per_lane,
    per_lane_argument,
    scatter_prefill,
    split_decode,
    split_prefill,
    trace_probes,
)
from runtime.lanes.barrier import (
    agreed_phase_after_warmup,
    check_capture_barrier,
    check_same_readiness,
)
from runtime.lanes.boundary import (
    GroupBoundary,
    check_cache_spec_given,
    check_group_cache_shape,
    check_traced_executions,
)
from runtime.lanes.fanout import LaneFanOut, close_all
from runtime.lanes.group_sleep import GroupSleep
from runtime.lanes.group_table import (
    BEFORE_ALLOCATED,
    GROUP_TABLE,
    SETUP,
    clone_config,
    warmup_call,
)
from runtime.lanes.group_view import LaneGroupView
from runtime.lanes.protocol import Lane, LaneFailure
from runtime.prefill.batch import IntVector, PrefillArguments
from runtime.steps import DecodeStep, PrefillStep
from runtime.validation import positive_int, require_bool

logger = logging.getLogger(__name__)

T = TypeVar("T")
P = Phase


class LaneGroupExecutor(LaneGroupView, GroupSleep):
    """Data-parallel lanes behind one lane's API; global slots, per-lane KV caches."""

    PHASE_TABLE = GROUP_TABLE

    def __init__(
        self,
        lanes: Sequence[Lane],
        *,
        mesh_device: object = None,
        owner_name: str = "LaneGroupExecutor",
        journal: Journal | None = None,
        call_timeout_s: float | None = None,
    ) -> None:
        lanes = tuple(lanes)
        if not lanes:
            raise ValueError("LaneGroupExecutor needs at least one lane, got none")
        try:
            capacities = [int(lane.facts.max_batch_size) for lane in lanes]
            if any(c <= 0 for c in capacities) or len(set(capacities)) != 1:
                raise ValueError(
                    "DP lanes must share the same fixed capacity (a positive max_batch_size); "
                    f"got {capacities}"
                )
        except BaseException as error:
            failures = close_all(lanes)
            attach_cleanup_failures(error, failures, note="cleaning up the supplied lanes")
            raise
        super().__init__(owner_name=owner_name, journal=journal)
        self.lanes = lanes
        self.tt_data_parallel = len(lanes)
        self.per_lane_max_batch_size = capacities[0]
        self.max_batch_size = self.tt_data_parallel * self.per_lane_max_batch_size
        self._explicit_mesh = mesh_device
        self._lanes = LaneFanOut(lanes, self.journal, call_timeout_s)
        self._boundary = GroupBoundary(owner_name, self.per_lane_max_batch_size)
        self._reset_owed = [False] * len(lanes)
        self._kv_handles: list[object] | None = None
        self.kv_generation = 0
        """Counts KV allocations (start-up and every wake): a generator's block tables of an
        older generation describe contents that are gone."""
        self._kernels_shared = False
        self.requires_prefill_trace_warmup = True
        self.step_host_seconds = 0.0
        self.step_lane_seconds = 0.0
        self.step_transport_seconds = 0.0
        self.decode_steps = 0
        self._lanes.drain_journals()

    @property
    def terminal(self) -> bool:
        return self.is_terminal

    @property
    def call_timeout_s(self) -> float | None:
        """The bound on every wait for a lane's answer (None: the lanes' own bounds)."""
        return self._lanes.call_timeout_s

    # -- the guard ------------------------------------------------------------------------------

    def _guard(self, operation: str, work: Callable[[], T]) -> T:
        """Run `work`; on any failure clean up every lane, end terminal, re-raise."""
        try:
            return work()
        except PhaseError as error:
            if error.owner == self.owner_name:
                raise  # the group's own refusal: nothing ran
            self._fail(operation, error)
            raise
        except BaseException as error:
            self._fail(operation, error)
            raise

    def _fail(self, operation: str, error: BaseException) -> None:
        if self._lifecycle.can("fault"):
            self._lifecycle.fire("fault", detail=f"{operation}() failed: {error}")
        logger.error(
            "%s: %s() failed, cleaning up every lane: %s", self.owner_name, operation, error
        )
        clock = time.perf_counter()
        failures = list(self._do_close())
        elapsed = time.perf_counter() - clock
        if failures:
            self._lifecycle.fire(
                "close_incomplete",
                detail=f"{len(failures)} cleanup failure(s); close() again retries",
                duration_s=elapsed,
            )
            attach_cleanup_failures(error, failures, note=f"cleaning up after {operation}()")
        else:
            self._lifecycle.fire("close", detail="every lane released", duration_s=elapsed)

    def _refresh(self) -> None:
        self._lanes.each("describe")

    def _placement(
        self, operation: str, kv_cache: object, execution: object
    ) -> tuple[list[object], list[str | None]]:
        """Each lane's KV handle and execution name, checked against the lanes' tracing."""
        lanes = len(self.lanes)
        caches = per_lane_argument("kv_cache", kv_cache, lanes)
        executions = lane_executions(execution, lanes)
        check_traced_executions(executions, operation, self.facts)
        return caches, executions

    def _prefill_step(
        self, arguments: PrefillArguments, kv_cache: object, execution: object
    ) -> tuple[dict[int, PrefillStep], dict[int, LaneRows]]:
        """The boundary: check one global prefill, then split it into per-lane steps.

        Every caller error raises here, before any lane is called, so a refusal leaves the
        group and every lane as they were.
        """
        caches, executions = self._placement("prefill", kv_cache, execution)
        self._boundary.check_prefill(arguments, self.facts)
        return split_prefill(
            PrefillStep.of(arguments),
            per_lane=self.per_lane_max_batch_size,
            lanes=len(self.lanes),
            kv_caches=caches,
            executions=executions,
        )

    def _decode_steps(
        self, arguments: DecodeArguments, kv_cache: object, execution: object, read: bool
    ) -> list[DecodeStep]:
        """The boundary: check one global decode step, then split it into lane steps."""
        caches, executions = self._placement("decode", kv_cache, execution)
        checked = self._boundary.check_decode(arguments, self.facts)
        return split_decode(
            DecodeStep.of(arguments, read_from_device=read, checked=checked),
            per_lane=self.per_lane_max_batch_size,
            lanes=len(self.lanes),
            kv_caches=caches,
            executions=executions,
        )

    def held_resources(self) -> tuple[str, ...]:
        """What every lane still holds that a finished call should have released, each
        named with its lane (asks every lane: refreshes the facts)."""
        self._lanes.each("describe")
        return tuple(
            f"DP lane {index}: {held}"
            for index, fact in enumerate(self.facts)
            for held in fact.held_resources
        )

    def _lane_phases(self) -> list[str]:
        return [lane.facts.phase for lane in self.lanes]

    # -- capacity, seal, allocate ---------------------------------------------------------------

    @guarded(P.CONSTRUCTED)
    def configure_paged_kv_cache(self, config: object) -> None:
        """Late KV capacity for every lane: one config (cloned per lane) or one per lane."""
        if isinstance(config, Sequence) and not isinstance(config, str | bytes):
            configs = per_lane_argument("config", config, len(self.lanes))
        else:
            configs = [clone_config(config) for _ in self.lanes]

        def work() -> str:
            self._lanes.each("configure_paged_kv_cache", lambda i: {"config": configs[i]})
            self._lanes.each("describe")
            return f"{len(self.lanes)} lanes x {self.num_blocks} blocks"

        self._guard(
            "configure_paged_kv_cache",
            lambda: self._lifecycle.transact(
                "resolve_capacity", work, detail=lambda detail: detail
            ),
        )

    def check_kv_memory(self, num_blocks: int) -> None:
        """Refuse, before allocating, `num_blocks` KV blocks per lane where a lane's device has
        not that much memory left (each lane checks its own device; nothing changes)."""
        positive_int("num_blocks", num_blocks)
        try:
            self._lanes.each("check_kv_memory", lambda index: {"num_blocks": num_blocks})
        except LaneFailure as failure:
            refusal = failure.__cause__
            if not isinstance(refusal, ValueError):
                raise
            refusal.add_note(f"(DP lane {failure.lane} of {len(self.lanes)})")
            raise refusal from None

    def _do_resolve_capacity(self, num_blocks: int | None) -> str:
        self._lanes.each("resolve_capacity", lambda i: {"num_blocks": num_blocks})
        self._refresh()
        return f"{len(self.lanes)} lanes x {self.num_blocks} blocks"

    def _do_seal(self) -> str:
        self._lanes.each("seal")
        self._refresh()
        return f"{len(self.lanes)} lanes sealed"

    def _do_allocate(self) -> str:
        self._kv_handles = self._lanes.each("allocate_kv_cache")
        self.kv_generation += 1
        self._refresh()
        return f"{len(self.lanes)} lanes allocated, {self.live_allocations} device tensors"

    @guarded(P.CONSTRUCTED)
    def resolve_capacity(self, num_blocks: int | None = None) -> None:
        """CONSTRUCTED -> CAPACITY_RESOLVED on every lane."""
        self._guard(
            "resolve_capacity", lambda: super(LaneGroupExecutor, self).resolve_capacity(num_blocks)
        )

    @guarded(P.CAPACITY_RESOLVED)
    def seal(self) -> None:
        """CAPACITY_RESOLVED -> SEALED on every lane."""
        self._guard("seal", lambda: super(LaneGroupExecutor, self).seal())

    @guarded(P.SEALED)
    def allocate(self) -> None:
        """SEALED -> ALLOCATED on every lane."""
        self._guard("allocate", lambda: super(LaneGroupExecutor, self).allocate())

    @guarded(*BEFORE_ALLOCATED)
    def allocate_kv_cache(
        self,
        kv_cache_shape: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
        num_layers: int | None = None,
    ) -> list[object]:
        """Resolve, seal and allocate every lane. A server's spec (all three or none) goes to
        every lane in CONSTRUCTED; once capacity is resolved it must match every lane's
        model-derived shapes, checked before any lane allocates (a mismatch changes nothing).
        """
        check_cache_spec_given(kv_cache_shape, dtype, num_layers)
        if self.phase is not P.CONSTRUCTED and kv_cache_shape is not None:
            check_group_cache_shape(self.facts, kv_cache_shape, num_layers)

        def work() -> list[object]:
            if self.phase is P.CONSTRUCTED and kv_cache_shape is not None:
                # The server's physical spec: every lane resolves it in its own call.
                handles = self._lanes.each(
                    "allocate_kv_cache",
                    lambda i: {
                        "kv_cache_shape": kv_cache_shape,
                        "dtype": dtype,
                        "num_layers": num_layers,
                    },
                )
                self._refresh()
                for trigger in ("resolve_capacity", "seal", "allocate"):
                    self._lifecycle.fire(trigger, detail=f"{len(self.lanes)} lanes")
                self._kv_handles = handles
                self.kv_generation += 1
                return handles
            if self.phase is P.CONSTRUCTED:
                super(LaneGroupExecutor, self).resolve_capacity(None)
            if self.phase is P.CAPACITY_RESOLVED:
                super(LaneGroupExecutor, self).seal()
            super(LaneGroupExecutor, self).allocate()
            assert self._kv_handles is not None
            return self._kv_handles

        return self._guard("allocate_kv_cache", work)

    # -- compile, warm, capture -----------------------------------------------------------------

    @guarded(*SETUP)
    def compile_prefill(
        self, *, kv_cache: object = None, **arguments: Unpack[PrefillArguments]
    ) -> None:
        """Compile one slot-routed prefill on the lanes it reaches (returns None)."""
        routed, _ = self._prefill_step(arguments, kv_cache, None)
        self._guard(
            "compile_prefill",
            lambda: self._lanes.each(
                "compile_prefill", lambda i: {"step": routed[i]}, lanes=sorted(routed)
            ),
        )

    @guarded(*SETUP)
    def compile_decode(
        self, *, kv_cache: object = None, **arguments: Unpack[DecodeArguments]
    ) -> None:
        """Compile one decode call on every fixed-capacity lane (returns None)."""
        split = self._decode_steps(arguments, kv_cache, None, True)
        self._guard(
            "compile_decode",
            lambda: self._lanes.each("compile_decode", lambda i: {"step": split[i]}),
        )

    def _after_warmup(self, operation: str, enable_trace: bool | None) -> None:
        self._refresh()
        phase = agreed_phase_after_warmup(self.facts, operation, enable_trace)
        if self.phase is P.ALLOCATED and phase == P.COMPILED.value:
            self._lifecycle.fire("compile", detail=f"every lane compiled ({len(self.lanes)} lanes)")

    def _share_kernels(self) -> None:
        """Lane 0 chooses the kernels; every other lane replays its plan before it warms up.

        Timing once keeps the lanes from timing against each other on shared cores, and a
        request computes the same numbers whichever lane serves it.
        """
        if self._kernels_shared:
            return
        plan = self._lanes.each("choose_kernels", lanes=[0])[0]
        if plan is not None and len(self.lanes) > 1:
            others = range(1, len(self.lanes))
            self._lanes.each("adopt_kernels", lambda index: {"plan": plan}, lanes=others)
        self._kernels_shared = True

    def _warm(self, operation: str, kv_cache: object, hints: dict[str, bool | None]) -> None:
        caches = per_lane_argument("kv_cache", kv_cache, len(self.lanes))

        def work() -> None:
            self._share_kernels()
            self._lanes.each(operation, lambda i: {"kv_cache": caches[i], **hints})
            self._after_warmup(operation, hints["enable_trace"])

        self._guard(operation, work)

    warmup_prefill = warmup_call(
        "warmup_prefill",
        "Warm prefill on every lane with its own cache; all COMPILED -> group COMPILED.",
    )
    warmup_decode = warmup_call(
        "warmup_decode", "Warm decode on every lane (at the lane capacity) with its own cache."
    )

    warmup_model_prefill = warmup_prefill
    """The seed's name for `warmup_prefill`."""

    def warmup_model_decode(
        self,
        *,
        kv_cache: object = None,
        can_sample_on_device: bool | None = None,
        enable_trace: bool | None = None,
        max_batch_size: object = None,
        num_blocks: object = None,
    ) -> None:
        """The seed's name; decode always warms `per_lane_max_batch_size` rows per lane
        (`max_batch_size` and `num_blocks` are accepted and ignored)."""
        self.warmup_decode(
            kv_cache=kv_cache, can_sample_on_device=can_sample_on_device, enable_trace=enable_trace
        )

    def _do_compile(self) -> str:
        self._share_kernels()
        self._lanes.each("compile")
        self._refresh()
        check_same_readiness(self.facts, "after compile")
        return f"every lane compiled ({len(self.lanes)} lanes)"

    @guarded(P.ALLOCATED)
    def compile(self) -> None:
        """ALLOCATED -> COMPILED: every lane runs its configured warmup."""
        if all(phase == P.COMPILED.value for phase in self._lane_phases()):
            self._lifecycle.fire("compile", detail="every lane already compiled")
            return
        self._guard("compile", lambda: super(LaneGroupExecutor, self).compile())

    def _requires_capture(self) -> bool:
        return TraceConfig.of(self.trace_mode).enabled

    def _do_capture(self) -> str:
        """The lane barrier: every lane must be pending, then all capture together."""
        self._refresh()
        check_capture_barrier(self.facts)
        self._lanes.each("capture")
        self._refresh()
        return f"barrier: {len(self.lanes)} lanes pending -> captured together"

    @guarded(P.COMPILED)
    def capture(self) -> None:
        """COMPILED -> CAPTURED through the lane barrier."""
        self._guard("capture", lambda: super(LaneGroupExecutor, self).capture())

    def _do_serve(self) -> str:
        waiting = [i for i, fact in enumerate(self.facts) if fact.phase != P.SERVING.value]
        self._lanes.each("serve", lanes=waiting)
        self._refresh()
        return f"{len(self.lanes)} lanes serving, {self.max_batch_size} global slots"

    @guarded(P.COMPILED, P.CAPTURED, P.DRAINED)
    def serve(self) -> None:
        """COMPILED/CAPTURED -> SERVING on every lane; DRAINED -> SERVING resumes."""
        self._guard("serve", lambda: super(LaneGroupExecutor, self).serve())

    # -- prefill --------------------------------------------------------------------------------

    @guarded(P.SERVING, reasons=NOT_SERVING)
    def prefill_forward(
        self,
        *,
        kv_cache: object = None,
        execution: object = None,
        **arguments: Unpack[PrefillArguments],
    ) -> LaneOutput:
        """Prefill global rows: check, route by slot, preflight traced lanes, run, restore order.

        `kv_cache` and `execution`: one value, or one per lane (None: each lane's own)."""
        routed, routes = self._prefill_step(arguments, kv_cache, execution)
        batch = int(arguments["tokens"].shape[0])

        def work() -> LaneOutput:
            tickets = self._lanes.preflight_traced(routed)

            def lane_call(index: int) -> dict[str, object]:
                if index in tickets:
                    return {"preflighted": tickets[index]}
                return {"step": routed[index]}

            method_of = {
                i: "execute_preflighted_prefill" if i in tickets else "prefill_forward"
                for i in routed
            }
            outputs = self._lanes.methods(method_of, lane_call)
            return scatter_prefill([(routes[i], outputs[i]) for i in sorted(routed)], batch)

        return self._guard("prefill_forward", work)

    def can_trace_prefill(
        self,
        *,
        tokens: torch.Tensor,
        prompt_lens: IntVector = None,
        start_pos: IntVector = None,
        empty_slots: IntVector = None,
    ) -> bool:
        """True only if every participating lane can replay a trace for its rows."""
        probes = trace_probes(
            tokens,
            prompt_lens,
            start_pos,
            empty_slots,
            per_lane=self.per_lane_max_batch_size,
            lanes=len(self.lanes),
        )
        answers = self._guard(
            "can_trace_prefill",
            lambda: self._lanes.methods(
                dict.fromkeys(probes, "can_trace_prefill"), lambda i: probes[i]
            ),
        )
        return all(bool(a) for a in answers.values())

    # -- decode ---------------------------------------------------------------------------------

    @guarded(P.SERVING, reasons=NOT_SERVING)
    def decode_forward(
        self,
        *,
        kv_cache: object = None,
        execution: object = None,
        read_from_device: bool = True,
        **arguments: Unpack[DecodeArguments],
    ) -> LaneOutput | list[object]:
        """One decode step over the global batch; every lane is issued before any is waited.

        `kv_cache` and `execution`: one value, or one per lane (None: each lane's own)."""
        clock = time.perf_counter()
        read = require_bool("read_from_device", read_from_device)
        split = self._decode_steps(arguments, kv_cache, execution, read)
        active = self._active_lanes(split)

        def step_for(index: int) -> dict[str, object]:
            step = split[index]
            if self._reset_owed[index]:
                step = attrs.evolve(step, reset_batch=True)
                self._reset_owed[index] = False
            return {"step": step}

        def work() -> LaneOutput | list[object]:
            lane_clock = time.perf_counter()
            ran = self._lanes.methods(dict.fromkeys(active, "decode_forward"), step_for)
            lane_seconds = time.perf_counter() - lane_clock
            slowest = max(self.lanes[i].last_call_seconds for i in active)
            outputs = [ran.get(i) for i in range(len(self.lanes))]
            result = concat_decode(outputs) if read else outputs
            total = time.perf_counter() - clock
            self.decode_steps += 1
            self.step_lane_seconds += slowest
            self.step_transport_seconds += max(0.0, lane_seconds - slowest)
            self.step_host_seconds += total - lane_seconds
            return result

        return self._guard("decode_forward", work)

    def _active_lanes(self, split: Sequence[DecodeStep]) -> list[int]:
        """Lanes with an active row; a sampled lane with none is skipped (its rows read 0).

        A lane's sampler refuses a batch without an active row, and nothing of an inactive
        row is read, so the group skips it; a `reset_batch` it missed is owed to its next call.
        The boundary refused a sampled step without any active row.
        """
        lanes = list(range(len(self.lanes)))
        if split[0].sampling_params is None:
            return lanes
        active = [i for i in lanes if bool((split[i].start_pos >= 0).any())]
        for index in set(lanes) - set(active):
            if split[index].reset_batch:
                self._reset_owed[index] = True
        return active

    @guarded(P.SERVING, reasons=NOT_SERVING)
    def read_decode_output(
        self, tt_out: object, *, async_read: bool = False
    ) -> list[object] | tuple[list[object], list[object]]:
        """Read every lane's raw output concurrently (async: hosts and flattened events)."""
        raws = one_per_lane("tt_out", tt_out, len(self.lanes))

        def work() -> list[object] | tuple[list[object], list[object]]:
            outputs = self._lanes.concurrently(
                "read_decode_output",
                lambda i: {"raw": raws[i], "async_read": async_read},
                skip=[i for i, raw in enumerate(raws) if raw is None],
                skipped=(None, []) if async_read else None,
            )
            return join_async_reads(outputs) if async_read else outputs

        return self._guard("read_decode_output", work)

    @guarded(P.SERVING, reasons=NOT_SERVING)
    def process_decode_output_host(self, tt_out: object, *, is_tokens: bool = False) -> LaneOutput:
        """Complete every lane's read concurrently and concatenate (int64 when tokens)."""
        hosts = one_per_lane("tt_out", tt_out, len(self.lanes))

        def work() -> LaneOutput:
            outputs = self._lanes.concurrently(
                "process_decode_output_host",
                lambda i: {"host_value": hosts[i], "is_tokens": is_tokens},
                skip=[i for i, host in enumerate(hosts) if host is None],
            )
            return concat_decode(outputs, force_int64=is_tokens)

        return self._guard("process_decode_output_host", work)

    # -- cleanup --------------------------------------------------------------------------------

    def _do_close(self) -> Sequence[BaseException]:
        """Wait for in-flight reads, close every lane not yet closed, stop the pool."""
        failures = self._lanes.close()
        if not failures:
            self._kv_handles = None
        return failures

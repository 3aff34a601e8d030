"""`LaneGroupExecutor`: one execution target over several data-parallel lanes.

The group is a lifecycle host with the same phase table as one lane and presents the same
execution-target API as one `ModelExecutor`; slots are global and a slot's lane is
`slot // per_lane`. Every phase call fans out to every lane (issued to all before waiting on
any), capture is one barrier across lanes, and every operation is guarded: once any lane
call fails, the group cleans up every lane and ends terminal, with cleanup failures attached
to the primary error. See docs/lanes.md.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import attrs

from lifecycle import LifecycleHost, Phase, PhaseError, guarded, host_table
from lifecycle.errors import attach_cleanup_failures
from lifecycle.journal import Journal, Outcome
from runtime.lane_routing import (
    LaneRows,
    concat_decode,
    history_for_lane,
    per_lane_argument,
    remap_for_lane,
    route_prefill_rows,
    scatter_prefill,
    select_rows,
    slice_sampling,
)
from runtime.lanes.protocol import NO_BARRIER, PENDING, Lane, LaneCall, LaneFacts, LaneFailure

logger = logging.getLogger(__name__)

P = Phase
_SETUP = (P.ALLOCATED, P.COMPILED)
OUTPUT_THREAD_PREFIX = "llm-runtime-dp-output"
TERMINAL_TEXT = "LaneGroupExecutor is terminal; construct a new group"


def _group_table() -> Any:
    table = host_table(
        name="lane-group",
        next_calls={
            P.CONSTRUCTED: ("configure_paged_kv_cache", "allocate_kv_cache"),
            P.CAPACITY_RESOLVED: ("allocate_kv_cache",),
            P.SEALED: ("allocate_kv_cache",),
            P.ALLOCATED: ("warmup_prefill", "warmup_decode"),
            P.COMPILED: ("capture", "serve"),
            P.CAPTURED: ("serve",),
            P.SERVING: ("prefill_forward", "decode_forward", "close"),
        },
    )
    states = tuple(
        attrs.evolve(spec, refusal=TERMINAL_TEXT) if spec.state is P.TERMINAL else spec
        for spec in table.states
    )
    return attrs.evolve(table, states=states)


GROUP_TABLE = _group_table()


@attrs.frozen
class LaneModelFacts:
    """The model facts a caller (the Generator) reads, identical on every lane."""

    vocab_size: int | None
    max_seq_len: int | None
    eos_token_ids: tuple[int, ...]
    max_top_k: int | None


@attrs.frozen
class LaneGroupConfig:
    """The group's static shape, in the fields a single lane's config offers."""

    lanes: int
    per_lane_max_batch_size: int
    max_batch_size: int
    device_sampling_enabled: bool
    max_seq_len: int | None
    trace_mode: str
    max_prefill_chunk_size: int | None


class LaneGroupExecutor(LifecycleHost):
    """Data-parallel lanes behind one lane's API; global slots, per-lane KV caches."""

    PHASE_TABLE = GROUP_TABLE

    def __init__(
        self,
        lanes: Sequence[Lane],
        *,
        mesh_device: Any = None,
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
            failures = _close_all(lanes)
            attach_cleanup_failures(error, failures, note="cleaning up the supplied lanes")
            raise
        super().__init__(owner_name=owner_name, journal=journal)
        self.lanes = lanes
        self.tt_data_parallel = len(lanes)
        self.per_lane_max_batch_size = capacities[0]
        self.max_batch_size = self.tt_data_parallel * self.per_lane_max_batch_size
        self.call_timeout_s = call_timeout_s
        self._explicit_mesh = mesh_device
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max_workers=len(lanes), thread_name_prefix=OUTPUT_THREAD_PREFIX
        )
        self._in_flight: list[Future[Any]] = []
        self._cleaned = [False] * len(lanes)
        self._reset_owed = [False] * len(lanes)
        self._kv_handles: list[Any] | None = None
        self._kernels_shared = False
        self.requires_prefill_trace_warmup = True
        self.step_host_seconds = 0.0
        self.step_lane_seconds = 0.0
        self.step_transport_seconds = 0.0
        self.decode_steps = 0
        self._drain_journals()

    # -- facts ----------------------------------------------------------------------------------

    @property
    def facts(self) -> tuple[LaneFacts, ...]:
        return tuple(lane.facts for lane in self.lanes)

    @property
    def executors(self) -> tuple[Any, ...]:
        """Each lane's executor where it lives in this process, else the lane itself."""
        return tuple(getattr(lane, "executor", lane) for lane in self.lanes)

    @property
    def lane_models(self) -> tuple[Any, ...]:
        """Each in-process lane's model (None for a process lane)."""
        return tuple(getattr(getattr(lane, "executor", None), "model", None) for lane in self.lanes)

    @property
    def model(self) -> LaneModelFacts:
        first = self.lanes[0].facts
        return LaneModelFacts(
            vocab_size=first.vocab_size,
            max_seq_len=first.max_seq_len,
            eos_token_ids=first.eos_token_ids,
            max_top_k=first.max_top_k,
        )

    @property
    def config(self) -> LaneGroupConfig:
        first = self.lanes[0].facts
        return LaneGroupConfig(
            lanes=self.tt_data_parallel,
            per_lane_max_batch_size=self.per_lane_max_batch_size,
            max_batch_size=self.max_batch_size,
            device_sampling_enabled=first.device_sampling_enabled,
            max_seq_len=first.max_seq_len,
            trace_mode=first.trace_mode,
            max_prefill_chunk_size=first.max_prefill_chunk_size,
        )

    @property
    def coverage_manifest(self) -> Any:
        """Lane 0's coverage manifest (every lane warms the same declared coverage)."""
        return self.lanes[0].facts.coverage_manifest

    @property
    def mesh_devices(self) -> tuple[str, ...]:
        return tuple(lane.facts.device_name for lane in self.lanes)

    @property
    def mesh_device(self) -> Any:
        """The explicit mesh given at construction (by identity), else the lanes' devices."""
        return self._explicit_mesh if self._explicit_mesh is not None else self.mesh_devices

    @property
    def eager_execution(self) -> tuple[str, ...]:
        return tuple("eager" for _ in self.lanes)

    @property
    def traced_prefill_execution(self) -> tuple[str, ...] | None:
        facts = self.facts
        return tuple("traced" for _ in facts) if all(f.prefill_traced for f in facts) else None

    @property
    def traced_decode_execution(self) -> tuple[str, ...] | None:
        facts = self.facts
        return tuple("traced" for _ in facts) if all(f.decode_traced for f in facts) else None

    @property
    def already_warmed_up_prefill(self) -> bool:
        return all(f.prefill_warmed for f in self.facts)

    @property
    def paged_kv_cache_config(self) -> tuple[Any, ...]:
        return tuple(f.paged_kv_cache_config for f in self.facts)

    @property
    def cache_path(self) -> Any:
        return getattr(self.executors[0], "cache_path", None)

    @property
    def terminal(self) -> bool:
        return self.is_terminal

    @property
    def trace_mode(self) -> str:
        return self.lanes[0].facts.trace_mode

    @property
    def block_size(self) -> int | None:
        return self.lanes[0].facts.block_size

    @property
    def num_blocks(self) -> int | None:
        """Physical KV blocks of each lane (block ids in page tables are lane-local)."""
        return self.lanes[0].facts.num_blocks

    @property
    def page_table_layout(self) -> Any:
        return self.lanes[0].facts.page_table_layout

    @property
    def tokenizer(self) -> Any:
        return self.lanes[0].facts.tokenizer

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.lanes[0].facts.eos_token_ids

    @property
    def kv_cache(self) -> list[Any] | None:
        return self._kv_handles

    @property
    def live_allocations(self) -> int:
        """Device allocations every lane still holds (the final count after close)."""
        return sum(int(getattr(lane, "live_allocations", 0)) for lane in self.lanes)

    def lane_of_slot(self, slot: int) -> int:
        """The lane a global slot belongs to."""
        return slot // self.per_lane_max_batch_size

    # -- fan-out and the guard ------------------------------------------------------------------

    def _wait(self, index: int, call: LaneCall, method: str) -> Any:
        try:
            return call.wait(self.call_timeout_s)
        except LaneFailure:
            raise
        except BaseException as error:
            raise LaneFailure(
                index, f"{method}() failed: {type(error).__name__}: {error}"
            ) from error

    def _fan_out(
        self,
        method: str,
        kwargs_for: Callable[[int], dict[str, Any]] | None = None,
        *,
        lanes: Sequence[int] | None = None,
    ) -> list[Any]:
        """Issue `method` to every chosen lane, then wait on each; first failure wins."""
        chosen = list(range(len(self.lanes))) if lanes is None else list(lanes)
        results = self._fan_out_methods(
            dict.fromkeys(chosen, method), kwargs_for or (lambda index: {})
        )
        return [results[index] for index in chosen]

    def _concurrently(
        self,
        method: str,
        kwargs_for: Callable[[int], dict[str, Any]],
        *,
        skip: Sequence[int] = (),
        skipped: Any = None,
    ) -> list[Any]:
        """Run one call per lane on the output pool (reads overlap across lanes)."""
        pool = self._pool
        if pool is None:
            raise RuntimeError(TERMINAL_TEXT)

        def one(index: int) -> Any:
            call = self.lanes[index].submit(method, **kwargs_for(index))
            return self._wait(index, call, method)

        futures = [
            None if index in skip else pool.submit(one, index) for index in range(len(self.lanes))
        ]
        self._in_flight = [f for f in futures if f is not None]
        results: list[Any] = []
        failures: list[BaseException] = []
        for index, future in enumerate(futures):
            if future is None:
                results.append(skipped)
                continue
            try:
                results.append(future.result())
            except LaneFailure as failure:
                failures.append(failure)
            except BaseException as error:
                failures.append(LaneFailure(index, f"{method}() failed: {error}"))
        self._in_flight = []
        self._drain_journals()
        if failures:
            _raise_with_lane_failures(failures)
        return results

    def _guard(self, operation: str, work: Callable[[], Any]) -> Any:
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

    def _drain_journals(self) -> None:
        for index, lane in enumerate(self.lanes):
            for row in lane.drain_journal():
                detail = row.get("detail") or ""
                if row.get("error"):
                    detail = f"{detail} {row['error']}".strip()
                self.journal.record(
                    machine=f"lane{index}.{row['machine']}",
                    trigger=row["trigger"],
                    source=row["source"],
                    dest=row["dest"],
                    started=row["wall_time"],
                    duration_s=row["duration_s"],
                    outcome=Outcome(row["outcome"]),
                    detail=detail,
                )

    def _refresh(self) -> None:
        self._fan_out("describe")

    def _lane_phases(self) -> list[str]:
        return [lane.facts.phase for lane in self.lanes]

    # -- capacity, seal, allocate ---------------------------------------------------------------

    @guarded(P.CONSTRUCTED)
    def configure_paged_kv_cache(self, config: Any) -> None:
        """Late KV capacity for every lane: one config (cloned per lane) or one per lane."""
        if isinstance(config, Sequence) and not isinstance(config, str | bytes):
            configs = per_lane_argument("config", config, len(self.lanes))
        else:
            configs = [_clone(config) for _ in self.lanes]

        def work() -> str:
            self._fan_out("configure_paged_kv_cache", lambda i: {"config": configs[i]})
            self._fan_out("describe")
            return f"{len(self.lanes)} lanes x {self.num_blocks} blocks"

        self._guard(
            "configure_paged_kv_cache",
            lambda: self._lifecycle.transact("resolve_capacity", work, detail=_same),
        )

    def _do_resolve_capacity(self, num_blocks: int | None) -> str:
        self._fan_out("resolve_capacity", lambda i: {"num_blocks": num_blocks})
        self._refresh()
        return f"{len(self.lanes)} lanes x {self.num_blocks} blocks"

    def _do_seal(self) -> str:
        self._fan_out("seal")
        self._refresh()
        return f"{len(self.lanes)} lanes sealed"

    def _do_allocate(self) -> str:
        self._kv_handles = self._fan_out("allocate_kv_cache")
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

    @guarded(P.CONSTRUCTED, P.CAPACITY_RESOLVED, P.SEALED)
    def allocate_kv_cache(
        self, kv_cache_shape: Any = None, dtype: Any = None, num_layers: int | None = None
    ) -> list[Any]:
        """Resolve, seal and allocate every lane (arguments forwarded unchanged)."""

        def work() -> list[Any]:
            if self.phase is P.CONSTRUCTED and kv_cache_shape is not None:
                # The server's physical spec: every lane resolves it in its own call.
                handles = self._fan_out(
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
                return handles
            if self.phase is P.CONSTRUCTED:
                super(LaneGroupExecutor, self).resolve_capacity(None)
            if self.phase is P.CAPACITY_RESOLVED:
                super(LaneGroupExecutor, self).seal()
            super(LaneGroupExecutor, self).allocate()
            assert self._kv_handles is not None
            return self._kv_handles

        return self._guard("allocate_kv_cache", work)  # type: ignore[no-any-return]

    # -- compile, warm, capture -----------------------------------------------------------------

    def _per_lane_cache(self, kv_cache: Any) -> list[Any]:
        return per_lane_argument("kv_cache", kv_cache, len(self.lanes))

    @guarded(*_SETUP)
    def compile_prefill(self, **request: Any) -> None:
        """Compile one slot-routed prefill on the lanes it reaches (returns None)."""
        routed, _ = self._route_prefill(request)
        self._guard(
            "compile_prefill",
            lambda: self._fan_out(
                "compile_prefill",
                lambda i: routed[i],
                lanes=sorted(routed),
            ),
        )

    @guarded(*_SETUP)
    def compile_decode(self, **request: Any) -> None:
        """Compile one decode call on every fixed-capacity lane (returns None)."""
        split = self._split_decode(request, compile_only=True)
        self._guard("compile_decode", lambda: self._fan_out("compile_decode", lambda i: split[i]))

    def _after_warmup(self, operation: str, enable_trace: bool | None) -> None:
        self._refresh()
        facts = self.facts
        if enable_trace and any(f.readiness == NO_BARRIER for f in facts):
            raise RuntimeError("Every DP lane must expose the trace activation barrier")
        self._check_same_readiness(facts, f"after {operation}")
        phases = {f.phase for f in facts}
        if len(phases) != 1:
            raise RuntimeError(
                f"DP lanes disagree on their phase after {operation}: "
                + ", ".join(f"lane {i}={f.phase}" for i, f in enumerate(facts))
            )
        if self.phase is P.ALLOCATED and phases == {P.COMPILED.value}:
            self._lifecycle.fire("compile", detail=f"every lane compiled ({len(self.lanes)} lanes)")

    def _check_same_readiness(self, facts: Sequence[LaneFacts], where: str) -> None:
        states = {f.readiness for f in facts}
        if len(states) > 1:
            listed = ", ".join(f"lane {i}={f.readiness}" for i, f in enumerate(facts))
            raise RuntimeError(
                f"DP lanes have mixed trace activation readiness {where}: {listed}; "
                "nothing was captured"
            )

    def _share_kernels(self) -> None:
        """Lane 0 chooses the kernels; every other lane replays its plan before it warms up.

        Timing once keeps the lanes from timing against each other on shared cores, and a
        request computes the same numbers whichever lane serves it.
        """
        if self._kernels_shared:
            return
        plan = self._fan_out("choose_kernels", lanes=[0])[0]
        if plan is not None and len(self.lanes) > 1:
            others = range(1, len(self.lanes))
            self._fan_out("adopt_kernels", lambda index: {"plan": plan}, lanes=others)
        self._kernels_shared = True

    def _warm(self, operation: str, kwargs: dict[str, Any]) -> None:
        caches = self._per_lane_cache(kwargs.pop("kv_cache", None))
        enable_trace = kwargs.get("enable_trace")

        def work() -> None:
            self._share_kernels()
            self._fan_out(operation, lambda i: {**kwargs, "kv_cache": caches[i]})
            self._after_warmup(operation, enable_trace)

        self._guard(operation, work)

    @guarded(*_SETUP)
    def warmup_prefill(
        self,
        *,
        kv_cache: Any = None,
        can_sample_on_device: bool | None = None,
        enable_trace: bool | None = None,
    ) -> None:
        """Warm prefill on every lane with its own cache; all COMPILED -> group COMPILED."""
        self._warm(
            "warmup_prefill",
            {
                "kv_cache": kv_cache,
                "can_sample_on_device": can_sample_on_device,
                "enable_trace": enable_trace,
            },
        )

    @guarded(*_SETUP)
    def warmup_decode(
        self,
        *,
        kv_cache: Any = None,
        can_sample_on_device: bool | None = None,
        enable_trace: bool | None = None,
    ) -> None:
        """Warm decode on every lane (at the lane capacity) with its own cache."""
        self._warm(
            "warmup_decode",
            {
                "kv_cache": kv_cache,
                "can_sample_on_device": can_sample_on_device,
                "enable_trace": enable_trace,
            },
        )

    def warmup_model_prefill(self, **kwargs: Any) -> None:
        """The seed's name for `warmup_prefill`."""
        self.warmup_prefill(**kwargs)

    def warmup_model_decode(self, **kwargs: Any) -> None:
        """The seed's name; decode always warms `per_lane_max_batch_size` rows per lane."""
        kwargs.pop("max_batch_size", None)
        kwargs.pop("num_blocks", None)
        self.warmup_decode(**kwargs)

    def _do_compile(self) -> str:
        self._share_kernels()
        self._fan_out("compile")
        self._refresh()
        self._check_same_readiness(self.facts, "after compile")
        return f"every lane compiled ({len(self.lanes)} lanes)"

    @guarded(P.ALLOCATED)
    def compile(self) -> None:
        """ALLOCATED -> COMPILED: every lane runs its configured warmup."""
        if all(phase == P.COMPILED.value for phase in self._lane_phases()):
            self._lifecycle.fire("compile", detail="every lane already compiled")
            return
        self._guard("compile", lambda: super(LaneGroupExecutor, self).compile())

    def _requires_capture(self) -> bool:
        return self.trace_mode != "none"

    def _do_capture(self) -> str:
        """The lane barrier: every lane must be pending, then all capture together."""
        self._refresh()
        facts = self.facts
        self._check_same_readiness(facts, "at the capture barrier")
        if facts[0].readiness != PENDING:
            raise RuntimeError(
                f"DP lanes are {facts[0].readiness} at the capture barrier; warm up every traced "
                "operation on every lane first (warmup_prefill() and warmup_decode())"
            )
        self._fan_out("capture")
        self._refresh()
        return f"barrier: {len(self.lanes)} lanes pending -> captured together"

    @guarded(P.COMPILED)
    def capture(self) -> None:
        """COMPILED -> CAPTURED through the lane barrier."""
        self._guard("capture", lambda: super(LaneGroupExecutor, self).capture())

    def _do_serve(self) -> str:
        self._fan_out("serve")
        self._refresh()
        return f"{len(self.lanes)} lanes serving, {self.max_batch_size} global slots"

    @guarded(P.COMPILED, P.CAPTURED)
    def serve(self) -> None:
        """COMPILED/CAPTURED -> SERVING on every lane."""
        self._guard("serve", lambda: super(LaneGroupExecutor, self).serve())

    # -- prefill --------------------------------------------------------------------------------

    def _route_prefill(
        self, request: dict[str, Any]
    ) -> tuple[dict[int, dict[str, Any]], dict[int, LaneRows]]:
        """Validate and split one global prefill into per-lane requests (no lane work)."""
        request = dict(request)
        tokens = request.pop("tokens")
        batch = int(tokens.shape[0])
        empty_slots = request.pop("empty_slots", None)
        routes = route_prefill_rows(
            batch, empty_slots, per_lane=self.per_lane_max_batch_size, lanes=len(self.lanes)
        )
        caches = self._per_lane_cache(request.pop("kv_cache", None))
        executions = per_lane_argument("execution", request.pop("execution", None), len(self.lanes))
        per_lane: dict[int, dict[str, Any]] = {}
        for lane_rows in routes:
            per_lane[lane_rows.lane] = self._lane_prefill(
                lane_rows, tokens, request, caches[lane_rows.lane], executions[lane_rows.lane]
            )
        return per_lane, {r.lane: r for r in routes}

    def _lane_prefill(
        self,
        lane_rows: LaneRows,
        tokens: Any,
        request: dict[str, Any],
        kv_cache: Any,
        execution: Any,
    ) -> dict[str, Any]:
        rows = lane_rows.rows
        out: dict[str, Any] = {"tokens": select_rows(tokens, rows)}
        for name, value in request.items():
            if name in ("page_table", "prompt_lens", "start_pos"):
                out[name] = select_rows(value, rows)
            elif name == "sampling_params":
                out[name] = slice_sampling(value, rows)
            elif name in ("prompt_tokens", "output_tokens"):
                out[name] = history_for_lane(
                    name,
                    value,
                    lane_rows,
                    per_lane=self.per_lane_max_batch_size,
                    capacity=self.max_batch_size,
                )
            elif name == "slot_remap":
                out[name] = remap_for_lane(
                    value,
                    lane_rows.lane,
                    per_lane=self.per_lane_max_batch_size,
                    lanes=len(self.lanes),
                )
            else:
                out[name] = value
        out["empty_slots"] = list(lane_rows.local_slots)
        if kv_cache is not None:
            out["kv_cache"] = kv_cache
        if execution is not None:
            out["execution"] = execution
        return out

    def _traced(self, lane: int, execution: Any) -> bool:
        if execution == "eager":
            return False
        return execution == "traced" or self.lanes[lane].facts.prefill_traced

    def _preflight(self, routed: dict[int, dict[str, Any]]) -> dict[int, Any]:
        """Check every traced participating lane before any lane runs."""
        tickets: dict[int, Any] = {}
        for lane, request in routed.items():
            if not self._traced(lane, request.get("execution")):
                continue
            try:
                call = self.lanes[lane].submit(
                    "preflight_prefill", **{k: v for k, v in request.items() if k != "execution"}
                )
                tickets[lane] = call.wait(self.call_timeout_s)
            except BaseException as error:
                self._drain_journals()
                raise RuntimeError(
                    f"Required traced prefill is unavailable for DP lane {lane}; no DP lane "
                    f"executed: {type(error).__name__}: {error}"
                ) from error
        self._drain_journals()
        return tickets

    @guarded(P.SERVING)
    def prefill_forward(self, *, tokens: Any, page_table: Any, **request: Any) -> Any:
        """Prefill global rows: route by slot, preflight traced lanes, run, restore order."""
        routed, routes = self._route_prefill(
            {"tokens": tokens, "page_table": page_table, **request}
        )
        batch = int(tokens.shape[0])

        def work() -> Any:
            tickets = self._preflight(routed)

            def lane_call(index: int) -> dict[str, Any]:
                return {"preflighted": tickets[index]} if index in tickets else routed[index]

            method_of = {
                i: "execute_preflighted_prefill" if i in tickets else "prefill_forward"
                for i in routed
            }
            outputs = self._fan_out_methods(method_of, lane_call)
            return scatter_prefill([(routes[i], outputs[i]) for i in sorted(routed)], batch)

        return self._guard("prefill_forward", work)

    def _fan_out_methods(
        self, method_of: dict[int, str], kwargs_for: Callable[[int], dict[str, Any]]
    ) -> dict[int, Any]:
        calls: list[tuple[int, LaneCall]] = []
        failures: list[BaseException] = []
        for index in sorted(method_of):
            try:
                calls.append(
                    (index, self.lanes[index].submit(method_of[index], **kwargs_for(index)))
                )
            except BaseException as error:
                failures.append(
                    error
                    if isinstance(error, LaneFailure)
                    else LaneFailure(index, f"{method_of[index]}(): {error}")
                )
        results: dict[int, Any] = {}
        for index, call in calls:
            try:
                results[index] = self._wait(index, call, method_of[index])
            except BaseException as failure:
                failures.append(failure)
        self._drain_journals()
        if failures:
            _raise_with_lane_failures(failures)
        return results

    def can_trace_prefill(
        self,
        *,
        tokens: Any,
        prompt_lens: Any = None,
        start_pos: Any = None,
        empty_slots: Any = None,
    ) -> bool:
        """True only if every participating lane can replay a trace for its rows."""
        routes = route_prefill_rows(
            int(tokens.shape[0]),
            empty_slots,
            per_lane=self.per_lane_max_batch_size,
            lanes=len(self.lanes),
        )

        def kwargs_for(lane_rows: LaneRows) -> dict[str, Any]:
            return {
                "tokens": select_rows(tokens, lane_rows.rows),
                "prompt_lens": select_rows(prompt_lens, lane_rows.rows),
                "start_pos": select_rows(start_pos, lane_rows.rows),
            }

        by_lane = {r.lane: r for r in routes}
        answers = self._guard(
            "can_trace_prefill",
            lambda: self._fan_out_methods(
                dict.fromkeys(by_lane, "can_trace_prefill"), lambda i: kwargs_for(by_lane[i])
            ),
        )
        return all(bool(a) for a in answers.values())

    # -- decode ---------------------------------------------------------------------------------

    def _split_decode(
        self, request: dict[str, Any], *, compile_only: bool = False
    ) -> list[dict[str, Any]]:
        """Validate one global decode and split it into contiguous lane batches."""
        request = dict(request)
        per_lane = self.per_lane_max_batch_size
        global_batch = self.max_batch_size
        for name in ("tokens", "start_pos", "page_table"):
            value = request.get(name)
            if value is None:
                if compile_only:
                    continue
                raise TypeError(f"decode_forward() needs {name}")
            if int(value.shape[0]) != global_batch:
                raise ValueError(
                    f"DP decode expects fixed global batch {global_batch}; {name} has "
                    f"{int(value.shape[0])} rows ({len(self.lanes)} lanes x {per_lane})"
                )
        caches = self._per_lane_cache(request.pop("kv_cache", None))
        executions = per_lane_argument("execution", request.pop("execution", None), len(self.lanes))
        split: list[dict[str, Any]] = []
        for lane in range(len(self.lanes)):
            rows = range(lane * per_lane, (lane + 1) * per_lane)
            out: dict[str, Any] = {}
            for name, value in request.items():
                if name in ("tokens", "start_pos", "page_table"):
                    out[name] = value[lane * per_lane : (lane + 1) * per_lane]
                elif name == "sampling_params":
                    out[name] = slice_sampling(value, rows)
                elif name in ("prompt_tokens", "output_tokens"):
                    out[name] = (
                        value[lane * per_lane : (lane + 1) * per_lane]
                        if value is not None and int(value.shape[0]) == global_batch
                        else value
                    )
                elif name == "slot_remap":
                    out[name] = remap_for_lane(
                        value, lane, per_lane=per_lane, lanes=len(self.lanes)
                    )
                else:
                    out[name] = value
            if caches[lane] is not None:
                out["kv_cache"] = caches[lane]
            if executions[lane] is not None:
                out["execution"] = executions[lane]
            split.append(out)
        return split

    @guarded(P.SERVING)
    def decode_forward(self, *, read_from_device: bool = True, **request: Any) -> Any:
        """One decode step over the global batch; every lane is issued before any is waited."""
        clock = time.perf_counter()
        split = self._split_decode(request)
        read = bool(read_from_device)
        active = self._active_lanes(split)

        def kwargs_for(index: int) -> dict[str, Any]:
            lane_request = {**split[index], "read_from_device": read}
            if self._reset_owed[index]:
                lane_request["reset_batch"] = True
                self._reset_owed[index] = False
            return lane_request

        def work() -> Any:
            lane_clock = time.perf_counter()
            ran = self._fan_out_methods(dict.fromkeys(active, "decode_forward"), kwargs_for)
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

    def _active_lanes(self, split: Sequence[dict[str, Any]]) -> list[int]:
        """Lanes with an active row; a sampled lane with none is skipped (its rows read 0).

        A lane's sampler refuses a batch without an active row, and nothing of an inactive
        row is read, so the group skips it; a `reset_batch` it missed is owed to its next call.
        """
        lanes = list(range(len(self.lanes)))
        if split[0].get("sampling_params") is None:
            return lanes
        active = [i for i in lanes if bool((split[i]["start_pos"] >= 0).any())]
        if not active:
            return lanes  # let the lanes explain the empty batch
        for index in set(lanes) - set(active):
            if split[index].get("reset_batch"):
                self._reset_owed[index] = True
        return active

    def _per_lane_values(self, name: str, values: Any) -> list[Any]:
        if not isinstance(values, list | tuple) or len(values) != len(self.lanes):
            raise ValueError(
                f"{name} needs one value per DP lane ({len(self.lanes)}), got "
                f"{type(values).__name__}"
                + (f" of length {len(values)}" if isinstance(values, list | tuple) else "")
            )
        return list(values)

    @guarded(P.SERVING)
    def read_decode_output(self, tt_out: Any, *, async_read: bool = False) -> Any:
        """Read every lane's raw output concurrently (async: hosts and flattened events)."""
        raws = self._per_lane_values("tt_out", tt_out)

        def work() -> Any:
            outputs = self._concurrently(
                "read_decode_output",
                lambda i: {"raw": raws[i], "async_read": async_read},
                skip=[i for i, raw in enumerate(raws) if raw is None],
                skipped=(None, []) if async_read else None,
            )
            if not async_read:
                return outputs
            hosts: list[Any] = []
            events: list[Any] = []
            for index, output in enumerate(outputs):
                if not isinstance(output, tuple) or len(output) != 2:
                    raise TypeError(
                        f"DP lane {index} async read returned {type(output).__name__}; "
                        "expected (host_value, events)"
                    )
                hosts.append(output[0])
                events.extend(output[1])
            return hosts, events

        return self._guard("read_decode_output", work)

    @guarded(P.SERVING)
    def process_decode_output_host(self, tt_out: Any, *, is_tokens: bool = False) -> Any:
        """Complete every lane's read concurrently and concatenate (int64 when tokens)."""
        hosts = self._per_lane_values("tt_out", tt_out)

        def work() -> Any:
            outputs = self._concurrently(
                "process_decode_output_host",
                lambda i: {"host_value": hosts[i], "is_tokens": is_tokens},
                skip=[i for i, host in enumerate(hosts) if host is None],
            )
            return concat_decode(outputs, force_int64=is_tokens)

        return self._guard("process_decode_output_host", work)

    def runtime_summary(self) -> dict[str, Any]:
        """The group's host bookkeeping per decode step."""
        steps = max(self.decode_steps, 1)
        return {
            "lanes": len(self.lanes),
            "decode_steps": self.decode_steps,
            "host_overhead_us_per_step": 1e6 * self.step_host_seconds / steps,
            "transport_us_per_step": 1e6 * self.step_transport_seconds / steps,
            "slowest_lane_us_per_step": 1e6 * self.step_lane_seconds / steps,
        }

    def reset_step_counters(self) -> None:
        """Start a new measurement of the per-step counters."""
        self.decode_steps = 0
        self.step_host_seconds = self.step_transport_seconds = self.step_lane_seconds = 0.0

    # -- cleanup --------------------------------------------------------------------------------

    def _do_close(self) -> Sequence[BaseException]:
        """Wait for in-flight reads, close every lane not yet closed, stop the pool."""
        failures: list[BaseException] = []
        for future in self._in_flight:
            try:
                future.result(timeout=self.call_timeout_s or 600.0)
            except BaseException as error:  # already reported by the call that started it
                logger.debug("in-flight lane read ended with %s", error)
        self._in_flight = []
        for index, lane in enumerate(self.lanes):
            if self._cleaned[index]:
                continue
            try:
                lane.close()
                self._cleaned[index] = True
            except BaseException as error:
                failures.append(
                    error
                    if isinstance(error, LaneFailure)
                    else LaneFailure(index, f"cleanup failed: {type(error).__name__}: {error}")
                )
        self._drain_journals()
        if self._pool is not None:
            try:
                self._pool.shutdown(wait=True)
                self._pool = None
            except BaseException as error:
                failures.append(error)
        if not failures:
            self._kv_handles = None
        return failures


def _clone(config: Any) -> Any:
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.replace(config)
    if attrs.has(type(config)):
        return attrs.evolve(config)
    return copy.copy(config)


def _close_all(lanes: Sequence[Lane]) -> list[BaseException]:
    failures: list[BaseException] = []
    for lane in lanes:
        try:
            lane.close()
        except BaseException as error:
            failures.append(error)
    return failures


def _raise_with_lane_failures(failures: Sequence[BaseException]) -> None:
    primary = failures[0]
    if len(failures) > 1:
        primary.lane_failures = tuple(failures[1:])  # type: ignore[attr-defined]
        primary.add_note(
            f"{len(failures) - 1} other DP lane(s) failed too: "
            + "; ".join(str(f) for f in failures[1:])
        )
    raise primary


def _same(detail: str) -> str:
    return detail

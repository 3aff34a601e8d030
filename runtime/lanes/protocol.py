"""The small `Lane` protocol a `LaneGroupExecutor` drives, and what both transports share.

A lane is one execution target (a lane executor) behind a transport. The group only ever
*submits* a named call and later *waits* on it with a bound, so a transport can run the call
right away (in-process lanes: device launches are asynchronous) or in another process
(process lanes). `invoke` is the one dispatcher both transports use on the executing side.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Protocol, TypedDict, runtime_checkable

import attrs
import torch

from lifecycle.journal import Journal
from runtime.config import PagedKVCacheConfig, PageTableLayout
from runtime.prefill.batch import PlanLimits
from runtime.steps import DecodeStep, LaneStep, PrefillStep
from runtime.warmup_manifest import CoverageManifest

logger = logging.getLogger(__name__)

# Readiness of a lane's trace-activation barrier (the group's capture barrier compares them).
NO_BARRIER = "no-barrier"
NOT_READY = "not-ready"
PENDING = "pending"
ACTIVATED = "activated"

LANE_CALLS = frozenset(
    {
        "describe",
        "choose_kernels",
        "adopt_kernels",
        "configure_paged_kv_cache",
        "resolve_capacity",
        "seal",
        "allocate",
        "allocate_kv_cache",
        "check_kv_memory",
        "compile",
        "compile_prefill",
        "compile_decode",
        "warmup_prefill",
        "warmup_decode",
        "capture",
        "serve",
        "prefill_forward",
        "preflight_prefill",
        "execute_preflighted_prefill",
        "can_trace_prefill",
        "decode_forward",
        "read_decode_output",
        "process_decode_output_host",
        "drain",
        "sleep",
        "wake",
        "check_reload_source",
        "reload_weights",
    }
)

_OPTIONAL_CALLS = frozenset({"choose_kernels", "adopt_kernels", "check_kv_memory"})
"""Lane calls an executor may lack (then they do nothing)."""


class JournalRow(TypedDict):
    """One lane journal entry as plain values (picklable; forwarded into the group's journal)."""

    machine: str
    trigger: str
    source: str
    dest: str
    wall_time: float
    duration_s: float
    outcome: str
    error: str | None
    detail: str


class LaneFailure(RuntimeError):
    """A lane's call failed, its worker died, or it did not answer within its bound."""

    def __init__(self, lane: int, message: str) -> None:
        super().__init__(f"DP lane {lane}: {message}")
        self.lane = lane


class RemoteLaneError(RuntimeError):
    """An exception raised inside a lane worker, carried back as text (type, message, trace)."""

    def __init__(self, lane: int, type_name: str, message: str, remote_traceback: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.lane = lane
        self.type_name = type_name
        self.remote_message = message
        self.remote_traceback = remote_traceback

    def __reduce__(self) -> tuple[type[RemoteLaneError], tuple[int, str, str, str]]:
        return (
            RemoteLaneError,
            (self.lane, self.type_name, self.remote_message, self.remote_traceback),
        )


@attrs.frozen
class LaneFacts:
    """What the group knows about a lane without reaching into it (refreshed by `describe`)."""

    max_batch_size: int
    phase: str
    readiness: str
    block_size: int | None = None
    num_blocks: int | None = None
    trace_mode: str = "none"
    prefill_traced: bool = False
    decode_traced: bool = False
    device_sampling_enabled: bool = False
    page_table_layout: PageTableLayout | None = None
    paged_kv_cache_config: PagedKVCacheConfig | None = None
    live_allocations: int = 0
    vocab_size: int | None = None
    max_seq_len: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    max_top_k: int | None = None
    device_name: str = "?"
    tokenizer: object = None
    prefill_warmed: bool = False
    max_prefill_chunk_size: int | None = None
    coverage_manifest: CoverageManifest | None = None
    torch_threads: int = 0
    kv_bytes_per_block: int | None = None
    kv_cache_shapes: tuple[tuple[int, ...], ...] = ()
    plan_limits: PlanLimits | None = None
    """The lane's prefill geometry (`PrefillRuntime.plan_limits`): the group's boundary checks."""
    max_device_top_k: int | None = None
    held_resources: tuple[str, ...] = ()
    """What the lane holds that a finished call should have released (its components')."""
    """Each layer's K (and V) shape once capacity is resolved (empty before, or unknown)."""
    serving_blocked: str | None = None
    """Why the lane may not resume serving after a wake (level-2 weights not reloaded)."""
    fault_attempts: tuple[tuple[str, int], ...] = ()
    faults_injected: int = 0


def _readiness(target: object) -> str:
    warmup = getattr(target, "warmup", None)
    if warmup is None or not all(
        hasattr(warmup, name) for name in ("defer_capture", "capture_pending", "trace_activated")
    ):
        return NO_BARRIER
    if warmup.trace_activated:
        return ACTIVATED
    if warmup.capture_pending:
        return PENDING
    return NOT_READY


def _held_resources(target: object) -> tuple[str, ...]:
    held = getattr(getattr(target, "components", None), "held_resources", None)
    return tuple(str(item) for item in held()) if callable(held) else ()


def describe(target: object, *, with_tokenizer: bool = False) -> LaneFacts:
    """The facts of a lane executor (duck-typed, so fake lanes may be small), with what the
    group's boundary checks a call against and what the lane still holds."""
    facts = _served_facts(target, with_tokenizer=with_tokenizer)
    kv_manager = getattr(target, "kv_cache_manager", None)
    decode_config = getattr(getattr(target, "decode_runtime", None), "config", None)
    return attrs.evolve(
        facts,
        plan_limits=getattr(getattr(target, "prefill_runtime", None), "plan_limits", None),
        max_device_top_k=getattr(decode_config, "max_device_top_k", None),
        held_resources=_held_resources(target),
        kv_cache_shapes=tuple(tuple(shape) for shape in getattr(kv_manager, "cache_shapes", ())),
    )


def _served_facts(target: object, *, with_tokenizer: bool) -> LaneFacts:
    config = getattr(target, "config", None)
    trace = getattr(config, "trace", None)
    model = getattr(target, "model", None)
    device = getattr(target, "device", None)
    sampler_config = getattr(getattr(model, "sampling", None), "config", None)
    warmup = getattr(target, "warmup", None)
    complete = getattr(warmup, "operation_complete", None)
    kv_manager = getattr(target, "kv_cache_manager", None)
    return LaneFacts(
        max_batch_size=int(getattr(target, "max_batch_size", 0)),
        phase=str(getattr(target, "phase", "SERVING")),
        readiness=_readiness(target),
        block_size=getattr(target, "block_size", None),
        num_blocks=getattr(target, "num_blocks", None),
        trace_mode=str(getattr(trace, "mode", "none")),
        prefill_traced=bool(getattr(trace, "prefill_enabled", False)),
        decode_traced=bool(getattr(trace, "decode_enabled", False)),
        device_sampling_enabled=bool(getattr(config, "device_sampling_enabled", False)),
        page_table_layout=getattr(target, "page_table_layout", None),
        paged_kv_cache_config=getattr(kv_manager, "config", None),
        live_allocations=int(getattr(device, "live_allocations", 0)),
        vocab_size=getattr(model, "vocab_size", None),
        max_seq_len=getattr(config, "max_seq_len", None) or getattr(model, "max_seq_len", None),
        eos_token_ids=tuple(
            getattr(target, "eos_token_ids", None) or getattr(model, "eos_token_ids", None) or ()
        ),
        max_top_k=getattr(sampler_config, "max_top_k", None),
        device_name=str(getattr(device, "name", "?")),
        tokenizer=getattr(target, "tokenizer", None) if with_tokenizer else None,
        prefill_warmed=bool(complete("prefill")) if callable(complete) else False,
        max_prefill_chunk_size=getattr(config, "max_prefill_chunk_size", None),
        coverage_manifest=getattr(target, "coverage_manifest", None),
        torch_threads=torch.get_num_threads(),
        kv_bytes_per_block=getattr(kv_manager, "bytes_per_block", None),
        serving_blocked=getattr(target, "serving_blocked", None),
        fault_attempts=tuple((getattr(device, "attempts", None) or {}).items()),
        faults_injected=int(getattr(device, "injected_total", 0)),
    )


def keep_tokenizer(fresh: LaneFacts, previous: LaneFacts | None) -> LaneFacts:
    """Refreshed facts keep the tokenizer sent once at start-up (it never changes)."""
    if fresh.tokenizer is None and previous is not None and previous.tokenizer is not None:
        return attrs.evolve(fresh, tokenizer=previous.tokenizer)
    return fresh


_STEP_EXECUTION = frozenset({"prefill_forward", "decode_forward"})
"""Lane calls that take the step's `execution` (the others run where the lane decides)."""


def step_keywords(method: str, step: LaneStep) -> dict[str, object]:
    """The executor keywords of `step` for lane call `method`."""
    if isinstance(step, DecodeStep):
        keywords = step.keywords(with_read=method == "decode_forward")
    else:
        keywords = step.keywords()
    if method not in _STEP_EXECUTION:
        keywords.pop("execution", None)
    return keywords


def invoke(target: object, method: str, kwargs: Mapping[str, object]) -> object:
    """Run one lane call on the executing side (the same for every transport).

    A prefill or decode call carries one typed `step` (a `PrefillStep` / `DecodeStep`); its
    keywords go to the lane executor unchanged, `page_table` included.
    """
    if method not in LANE_CALLS:
        raise ValueError(f"{method!r} is not a lane call; lane calls are {sorted(LANE_CALLS)}")
    if method == "describe":
        return describe(target, with_tokenizer=bool(kwargs.get("with_tokenizer", False)))
    if method in _OPTIONAL_CALLS and not hasattr(target, method):
        return None  # e.g. an executor without kernel choices shares nothing
    function: Callable[..., object] = getattr(target, method)
    step = kwargs.get("step")
    if method == "decode_forward" and isinstance(step, DecodeStep) and len(kwargs) == 1:
        # A lane executor that takes the typed step gets it whole, with the group's stamp.
        decode_step: Callable[[DecodeStep], object] | None = getattr(target, "decode_step", None)
        if callable(decode_step):
            return decode_step(step)
    if isinstance(step, PrefillStep | DecodeStep):
        rest = {name: value for name, value in kwargs.items() if name != "step"}
        return function(**step_keywords(method, step), **rest)
    return function(**kwargs)


class LaneCall(Protocol):
    """One submitted call: `wait` returns its value or raises, within `timeout_s`."""

    def wait(self, timeout_s: float | None = None) -> object: ...


@runtime_checkable
class Lane(Protocol):
    """One execution lane behind a transport."""

    index: int

    @property
    def facts(self) -> LaneFacts:
        """The latest facts (refresh with `submit("describe")`)."""
        ...

    @property
    def closed(self) -> bool:
        """Whether `close()` succeeded (then it is a no-op)."""
        ...

    def submit(self, method: str, /, **kwargs: object) -> LaneCall:
        """Issue `method` to the lane; never blocks on the lane's result."""
        ...

    def drain_journal(self) -> list[JournalRow]:
        """Journal entries the lane recorded since the last drain (for the group's journal)."""
        ...

    @property
    def last_call_seconds(self) -> float:
        """Seconds the lane itself spent on its last finished call (not the transport)."""
        ...

    def close(self) -> None:
        """Release everything the lane owns; retryable when it raised, a no-op once done."""
        ...


class LaneBase:
    """What every transport's lane keeps: its index and whether `close()` succeeded."""

    def __init__(self, index: int) -> None:
        self.index = index
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed


class LaneTarget:
    """The executing side of a lane, the same for both transports: one lane executor, driven
    by call name, whose journal is forwarded in increments and whose close is retryable."""

    def __init__(self, executor: object) -> None:
        self.executor = executor
        self._journal_seen = 0

    def run(self, method: str, kwargs: Mapping[str, object]) -> object:
        return invoke(self.executor, method, kwargs)

    def new_journal_rows(self) -> list[JournalRow]:
        """The executor's journal entries recorded since the last call (picklable rows)."""
        rows, self._journal_seen = journal_rows(
            getattr(self.executor, "journal", None), self._journal_seen
        )
        return rows

    @property
    def live_allocations(self) -> int:
        return int(getattr(getattr(self.executor, "device", None), "live_allocations", 0))

    def close(self) -> None:
        close: Callable[[], object] | None = getattr(self.executor, "close", None) or getattr(
            self.executor, "cleanup", None
        )
        if close is None:
            raise TypeError(f"lane executor {self.executor!r} has neither close() nor cleanup()")
        close()


@attrs.define
class CompletedCall:
    """A call that already ran (value or error): what an in-process lane returns."""

    value: object = None
    error: BaseException | None = None
    finish: Callable[[], object] | None = None
    seconds: float = 0.0

    def wait(self, timeout_s: float | None = None) -> object:
        if self.error is not None:
            raise self.error
        if self.finish is not None:
            finish, self.finish = self.finish, None
            clock = time.perf_counter()
            self.value = finish()
            self.seconds += time.perf_counter() - clock
        return self.value


def journal_rows(journal: Journal | None, seen: int) -> tuple[list[JournalRow], int]:
    """Entries of `journal` after the first `seen`, as plain dicts (picklable)."""
    if journal is None or len(journal) == seen:
        return [], seen  # nothing new: no snapshot of the whole journal (the per-step case)
    entries = journal.entries
    rows = [
        JournalRow(
            machine=e.machine,
            trigger=e.trigger,
            source=e.source,
            dest=e.dest,
            wall_time=e.wall_time,
            duration_s=e.duration_s,
            outcome=str(e.outcome.value),
            error=e.error,
            detail=e.detail,
        )
        for e in entries[seen:]
    ]
    return rows, len(entries)

"""Process lanes: one spawned worker process per lane, calls and results over a pipe.

Each worker builds its own lane executor from a picklable factory, sets its own torch thread
count (and optionally environment such as `CUDA_VISIBLE_DEVICES`) first, then answers calls
one at a time. Tensors travel through shared memory (torch.multiprocessing's reductions on
the pipe), never as pickled copies of large buffers; objects whose identity matters inside
the lane (raw decode outputs, pending reads, preflighted requests, the KV handle) stay in the
worker and cross as `RemoteRef` tokens. Every wait is bounded, and a worker that died or did
not answer in time is a `LaneFailure` naming the lane.

A decode step arrives as a pickled `DecodeStep`. The worker answers only its parent group
over a private pipe, so it trusts the group boundary's `DecodeCheck` stamp as an in-process
lane does: a step stamped with the worker lane's own geometry is not checked again, and any
other step (no stamp, or one checked against another geometry, e.g. facts gone stale) is
checked in full by the lane's boundary (`DecodeRuntime.prepare_step`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection

import attrs
import torch
import torch.multiprocessing as torch_mp

from runtime.lanes.protocol import (
    JournalRow,
    LaneBase,
    LaneFacts,
    LaneFailure,
    LaneTarget,
    RemoteLaneError,
    keep_tokenizer,
)
from runtime.steps import DecodeStep, PrefillStep
from runtime.validation import positive_int

logger = logging.getLogger(__name__)

DEFAULT_STARTUP_TIMEOUT_S = 600.0
DEFAULT_CALL_TIMEOUT_S = 600.0
DEFAULT_CLOSE_TIMEOUT_S = 60.0
JOIN_TIMEOUT_S = 10.0
_POLL_S = 0.05
_CLOSE = "__close__"


@attrs.frozen
class RemoteRef:
    """An object that stays inside lane `lane`'s worker (consumed by the next call using it)."""

    lane: int
    key: int


@attrs.frozen
class RemoteKVCache:
    """The KV handle of a process lane: the worker's executor uses its own bound cache."""

    lane: int


def _plain(value: object) -> bool:
    if value is None or isinstance(value, bool | int | float | str):
        return True
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, tuple | list):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return isinstance(value, LaneFacts) or attrs.has(type(value))


def _export(value: object) -> object:
    """Clone tensors so the parent never shares a buffer the lane keeps writing."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple):
        return tuple(_export(v) for v in value)
    if isinstance(value, list):
        return [_export(v) for v in value]
    return value


class _WorkerState:
    def __init__(self, index: int, target: LaneTarget) -> None:
        self.index = index
        self.target = target
        self.store: dict[int, object] = {}
        self.next_key = 1

    def keep(self, value: object) -> RemoteRef:
        key = self.next_key
        self.next_key += 1
        self.store[key] = value
        return RemoteRef(self.index, key)

    def resolve(self, value: object) -> object:
        if isinstance(value, RemoteRef):
            if value.lane != self.index or value.key not in self.store:
                raise ValueError(f"{value} does not belong to lane {self.index} (or was consumed)")
            return self.store.pop(value.key)
        if isinstance(value, RemoteKVCache):
            if value.lane != self.index:
                raise ValueError(f"KV handle of lane {value.lane} given to lane {self.index}")
            return None
        if isinstance(value, PrefillStep | DecodeStep):
            return attrs.evolve(value, kv_cache=self.resolve(value.kv_cache))
        if isinstance(value, list):
            return [self.resolve(v) for v in value]
        return value

    def run(self, method: str, kwargs: dict[str, object]) -> object:
        kwargs = {name: self.resolve(value) for name, value in kwargs.items()}
        value = self.target.run(method, kwargs)
        if method == "allocate_kv_cache":
            return RemoteKVCache(self.index)
        if method == "read_decode_output" and kwargs.get("async_read"):
            assert isinstance(value, tuple)
            host = value[0]
            return (self.keep(host), [])
        if _plain(value):
            return _export(value)
        return self.keep(value)


def _worker_main(
    index: int,
    factory: Callable[[], object],
    threads: int,
    env: dict[str, str],
    conn: Connection,
) -> None:
    """The worker loop: build the lane, then answer calls until told to close."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    os.environ.update(env)
    torch.set_num_threads(threads)
    parent = os.getppid()
    try:
        state = _WorkerState(index, LaneTarget(factory()))
        conn.send(("ready", state.target.run("describe", {"with_tokenizer": True}), []))
    except BaseException as error:
        conn.send(("error", _remote(index, error), []))
        return
    while True:
        if not conn.poll(1.0):
            if os.getppid() != parent:
                return  # the group's process is gone: nobody will close us
            continue
        try:
            method, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if method == _CLOSE:
                state.store.clear()
                state.target.close()
                rows = state.target.new_journal_rows()
                conn.send(("closed", state.target.live_allocations, rows))
                return
            clock = time.perf_counter()
            value = state.run(method, kwargs)
            seconds = time.perf_counter() - clock
            conn.send(("ok", value, state.target.new_journal_rows(), seconds))
        except BaseException as error:
            conn.send(("error", _remote(index, error), state.target.new_journal_rows()))


def _remote(index: int, error: BaseException) -> RemoteLaneError:
    return RemoteLaneError(
        index,
        type(error).__name__,
        str(error),
        "".join(traceback.format_exception(error)),
    )


@attrs.frozen
class _Reply:
    """One message from a worker: its kind, payload, journal rows and the call's seconds."""

    kind: str
    payload: object
    rows: list[JournalRow]
    seconds: float = 0.0

    @classmethod
    def of(cls, message: object) -> _Reply:
        assert isinstance(message, tuple) and len(message) in (3, 4)
        kind, payload, rows, *timing = message
        return cls(str(kind), payload, list(rows), float(timing[0]) if timing else 0.0)

    def error(self) -> BaseException | None:
        """The worker's exception when the call failed (else None)."""
        if self.kind == "error" and isinstance(self.payload, BaseException):
            return self.payload
        return None


@attrs.define
class _ProcessCall:
    lane: ProcessLane
    method: str

    def wait(self, timeout_s: float | None = None) -> object:
        return self.lane._finish(self.method, timeout_s)


@contextlib.contextmanager
def _interrupts_ignored() -> Iterator[None]:
    """Start a worker with SIGINT ignored (an ignored signal stays ignored across exec, and
    Python keeps it so): Ctrl-C reaches the parent, which closes its workers in order, and no
    worker prints a KeyboardInterrupt traceback of its own. Main thread only (signals).

    The parent's own Ctrl-C must not be lost meanwhile: SIGINT is blocked first (a blocked
    signal is never discarded as ignored, it stays pending), and one already pending stops
    the start before the disposition changes; whatever arrives in the window is delivered
    when the handler is back and the mask lifted."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    blocking = hasattr(signal, "pthread_sigmask")
    if blocking:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        if signal.SIGINT in signal.sigpending():
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # raises here
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if blocking:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


class ProcessLane(LaneBase):
    """A lane executor in its own spawned worker process."""

    def __init__(
        self,
        index: int,
        factory: Callable[[], object],
        *,
        threads: int = 1,
        env: dict[str, str] | None = None,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        close_timeout_s: float = DEFAULT_CLOSE_TIMEOUT_S,
    ) -> None:
        super().__init__(index)
        self.threads = positive_int("threads", threads)
        self.call_timeout_s = call_timeout_s
        self.close_timeout_s = close_timeout_s
        context = torch_mp.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(
            target=_worker_main,
            args=(index, factory, threads, dict(env or {}), child),
            name=f"llm-runtime-lane{index}",
            daemon=True,
        )
        with _interrupts_ignored():
            self.process.start()
        child.close()
        self._facts: LaneFacts | None = None
        self._outstanding: str | None = None
        self._broken: str | None = None
        self._journal: list[JournalRow] = []
        self.final_live_allocations: int | None = None
        self.last_call_seconds = 0.0

    def __repr__(self) -> str:
        return f"ProcessLane({self.index}, pid={self.process.pid})"

    # -- startup --------------------------------------------------------------------------------

    def wait_ready(self, timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S) -> LaneFacts:
        """Wait for the worker to build its lane (bounded)."""
        if self._facts is None:
            reply = self._receive("startup", timeout_s)
            self._journal.extend(reply.rows)
            if reply.kind != "ready" or not isinstance(reply.payload, LaneFacts):
                self._broken = f"its lane could not be built: {reply.payload}"
                raise LaneFailure(self.index, self._broken) from reply.error()
            self._facts = reply.payload
        return self._facts

    @property
    def facts(self) -> LaneFacts:
        if self._facts is None:
            return self.wait_ready()
        return self._facts

    @property
    def live_allocations(self) -> int:
        if self.final_live_allocations is not None:
            return self.final_live_allocations
        return self.facts.live_allocations

    # -- calls ----------------------------------------------------------------------------------

    def submit(self, method: str, /, **kwargs: object) -> _ProcessCall:
        self._check_usable(method)
        if self._outstanding is not None:
            raise RuntimeError(
                f"DP lane {self.index} is still running {self._outstanding}(); wait on it first"
            )
        try:
            self._conn.send((method, kwargs))
        except (OSError, ValueError) as error:
            self.process.join(1.0)  # a killed worker closes its pipe before it is reaped
            self._broken = (
                self._death_text(method) or f"its pipe failed while sending {method}(): {error}"
            )
            raise LaneFailure(self.index, self._broken) from error
        self._outstanding = method
        return _ProcessCall(self, method)

    def _check_usable(self, method: str) -> None:
        if self._closed:
            raise LaneFailure(self.index, f"{method}() after the lane was closed")
        if self._broken is not None:
            raise LaneFailure(self.index, self._broken)

    def _finish(self, method: str, timeout_s: float | None) -> object:
        if self._outstanding != method:
            raise RuntimeError(f"DP lane {self.index}: no {method}() call is outstanding")
        try:
            reply = self._receive(method, timeout_s or self.call_timeout_s)
        finally:
            self._outstanding = None
        self.last_call_seconds = reply.seconds
        self._journal.extend(reply.rows)
        error = reply.error()
        if error is not None:
            raise error
        payload = reply.payload
        if method == "describe":
            assert isinstance(payload, LaneFacts)
            payload = keep_tokenizer(payload, self._facts)
            self._facts = payload
        return payload

    def _receive(self, what: str, timeout_s: float) -> _Reply:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self._conn.poll(_POLL_S):
                    return _Reply.of(self._conn.recv())
            except (EOFError, OSError) as error:
                self.process.join(1.0)  # a killed worker closes its pipe before it is reaped
                self._broken = self._death_text(what) or f"its pipe broke during {what}()"
                raise LaneFailure(self.index, self._broken) from error
            death = self._death_text(what)
            if death is not None:
                self._broken = death
                raise LaneFailure(self.index, death)
            if time.monotonic() > deadline:
                self._broken = (
                    f"worker pid {self.process.pid} did not answer {what}() within "
                    f"{timeout_s:g} s (raise call_timeout_s if the lane is just slow)"
                )
                raise LaneFailure(self.index, self._broken)

    def _death_text(self, what: str) -> str | None:
        if self.process.is_alive():
            return None
        code = self.process.exitcode
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return f"worker pid {self.process.pid} died ({how}) during {what}()"

    def drain_journal(self) -> list[JournalRow]:
        rows, self._journal = self._journal, []
        return rows

    # -- cleanup --------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the worker's lane, then join it (killing it after a bound)."""
        if self._closed:
            return
        failure: BaseException | None = None
        answered = False
        # A worker still building its lane (start-up interrupted) has nothing to close in
        # order: its next message would be its start-up reply, so it is stopped instead.
        started = self._facts is not None
        if started and self._broken is None and self.process.is_alive() and not self._outstanding:
            try:
                self._conn.send((_CLOSE, {}))
                reply = self._receive("close", self.close_timeout_s)
                self._journal.extend(reply.rows)
                error = reply.error()
                if error is not None:
                    raise error  # the worker stays up, so close() again retries
                assert isinstance(reply.payload, int)
                self.final_live_allocations = reply.payload
                answered = True
            except LaneFailure as error:
                failure = error
        if not started and self.process.is_alive():
            self.process.terminate()  # still importing or loading: nothing of it to keep
        self._stop_process(JOIN_TIMEOUT_S if answered else 0.5)
        if not answered:
            self.final_live_allocations = 0  # the worker's device memory ended with it
        self._closed = True
        if failure is not None:
            raise failure

    def _stop_process(self, join_s: float) -> None:
        self.process.join(join_s)
        if self.process.is_alive():
            logger.warning(
                "DP lane %d: worker pid %s did not exit; killing it", self.index, self.process.pid
            )
            self.process.kill()
            self.process.join(JOIN_TIMEOUT_S)
        self._conn.close()


def spawn_process_lanes(
    factories: Sequence[Callable[[], object]],
    *,
    threads: int = 1,
    envs: Sequence[dict[str, str]] | None = None,
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
    ready: Callable[[int], None] | None = None,
) -> list[ProcessLane]:
    """Start every worker first, then wait for all (startup overlaps); all or nothing.

    `ready(index)` is called as each lane reports ready, in lane order (progress).
    """
    lanes: list[ProcessLane] = []
    try:
        for index, factory in enumerate(factories):
            env = envs[index] if envs is not None else None
            lanes.append(
                ProcessLane(index, factory, threads=threads, env=env, call_timeout_s=call_timeout_s)
            )
        for lane in lanes:
            lane.wait_ready(startup_timeout_s)
            if ready is not None:
                ready(lane.index)
    except BaseException as error:
        for lane in lanes:
            try:
                lane.close()
            except BaseException as failure:  # already reported through `error`
                logger.warning("DP lane %d: cleanup after a failed start: %r", lane.index, failure)
        raise error
    return lanes

"""`GenerationStream`: the step loop of one generation call, driven by iterating it.

Every step admits waiting requests (one `prefill_forward` call for all of them, with prefix-cache
hits skipped through `start_pos`), then decodes every running slot with one `decode_forward`
over the whole lane. Decode reads asynchronously: while the step's output is in flight, the host
detokenizes the previous step's tokens and checks stop strings; a request that a stop string
ended in flight has its extra token dropped. Token-id checks (EOS, max tokens) happen as soon
as a token is read, so no decode is spent on a request that is known to be done.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Generator as PyGenerator
from collections.abc import Iterator, Sequence
from typing import NamedTuple, Protocol

import attrs
import torch

from models.generation.block_manager import BlockManager
from models.generation.params import GenerationParams, rows_sampling
from models.generation.results import (
    Completion,
    CompletionReason,
    GenerationStats,
    StreamEvent,
)
from models.generation.scheduler import Admission, Scheduler, SequenceState
from models.generation.text import TextTracker
from runtime.config import PageTableLayout
from runtime.sampling import SamplingParams


class StreamExecutor(Protocol):
    """What a stream calls on the executor (a `ModelExecutor` or a `LaneGroupExecutor`).

    Outputs are read through `_token_list` and `_async_read`, which check what came back.
    """

    @property
    def max_batch_size(self) -> int: ...

    @property
    def page_table_layout(self) -> PageTableLayout | None: ...

    def prefill_forward(
        self,
        *,
        tokens: torch.Tensor,
        page_table: torch.Tensor,
        prompt_lens: torch.Tensor,
        start_pos: torch.Tensor,
        empty_slots: list[int],
        sampling_params: SamplingParams,
    ) -> object: ...

    def decode_forward(
        self,
        *,
        tokens: torch.Tensor,
        start_pos: torch.Tensor,
        page_table: torch.Tensor,
        sampling_params: SamplingParams,
        reset_batch: bool,
        read_from_device: bool,
    ) -> object: ...

    def read_decode_output(self, raw: object, *, async_read: bool) -> object: ...

    def process_decode_output_host(self, host_value: object, *, is_tokens: bool) -> object: ...


class StreamHost(Protocol):
    """What a stream reads of the `Generator` that started it (the generator imports the
    stream; the stream names only this)."""

    @property
    def executor(self) -> StreamExecutor: ...

    last_stats: GenerationStats

    @property
    def block_managers(self) -> tuple[BlockManager, ...]: ...

    def reset_after_failure(self) -> None: ...


@attrs.define(eq=False)
class TrackedRequest:
    """Everything the generator keeps about one request besides the scheduler state."""

    sequence: SequenceState
    prompt: str | tuple[int, ...]
    params: GenerationParams
    text: TextTracker
    eos: frozenset[int]
    completion: Completion | None = None


def _completion(request: TrackedRequest, reason: CompletionReason) -> Completion:
    """What `request` has generated so far, as a completion ending for `reason`."""
    sequence = request.sequence
    return Completion(
        index=sequence.index,
        prompt=request.prompt,
        prompt_token_ids=sequence.prompt_token_ids,
        token_ids=tuple(sequence.output_token_ids),
        text=request.text.text,
        finish_reason=reason,
    )


class _DecodeInputs(NamedTuple):
    """One lane-wide decode step's inputs (inactive slots have start_pos -1)."""

    tokens: torch.Tensor
    start_pos: torch.Tensor
    page_table: torch.Tensor
    sampling_params: SamplingParams
    reset_batch: bool


def _async_read(value: object) -> object:
    """The host value of an asynchronous `read_decode_output`: its `(host_value, events)`."""
    if not isinstance(value, tuple) or len(value) != 2:
        raise TypeError(
            f"read_decode_output(async_read=True) returned {type(value).__name__}; expected a "
            "(host_value, events) pair"
        )
    host_value: object = value[0]
    return host_value


def _token_list(value: object, name: str) -> list[int]:
    """Normalise a tokens output (`tensor`, or `(tokens, log_probs)`) to a list of ints."""
    if isinstance(value, tuple | list) and value and not isinstance(value[0], numbers.Integral):
        value = value[0]
    if isinstance(value, torch.Tensor):
        return [int(t) for t in value.detach().reshape(-1).to("cpu").tolist()]
    if isinstance(value, Sequence):
        return [int(t) for t in value]
    raise TypeError(f"{name} returned {type(value).__name__}; expected sampled token ids")


class GenerationStream:
    """An iterator of `StreamEvent`s that drives one generation call to the end.

    `newly_finished()` returns completions finished since it was last called (the CLI prints
    them as they arrive); `completions` is the input-ordered list once the stream is done.
    """

    def __init__(self, generator: StreamHost, requests: list[TrackedRequest]) -> None:
        self.generator = generator
        self.executor = generator.executor
        self.requests = requests
        self.stats = GenerationStats(requests=len(requests))
        generator.last_stats = self.stats
        self.done = False
        self._finished: list[Completion] = []
        self._by_sequence = {id(r.sequence): r for r in requests}
        self._pending: list[tuple[TrackedRequest, int]] = []
        self._lane = int(self.executor.max_batch_size)
        layout = self.executor.page_table_layout
        if layout is None:
            raise RuntimeError(
                "the executor's KV capacity is not resolved yet (no page-table layout); call "
                "executor.start() before generating"
            )
        self._decode_width = layout.decode_width
        self._last_slots: dict[int, int] | None = None
        self._sampling_key: tuple[GenerationParams | None, ...] | None = None
        self._sampling: SamplingParams | None = None
        self._iterator = self._run()

    def __iter__(self) -> Iterator[StreamEvent]:
        return self

    def __next__(self) -> StreamEvent:
        return next(self._iterator)

    def close(self) -> None:
        """Stop early; unfinished requests are dropped and their blocks released."""
        self._iterator.close()
        self.done = True

    @property
    def completions(self) -> list[Completion]:
        """Every completion in input order (only once the stream is exhausted)."""
        if not self.done:
            raise RuntimeError("the stream has not finished; iterate it to the end first")
        out: list[Completion] = []
        for request in self.requests:
            if request.completion is None:
                raise RuntimeError(
                    f"request {request.sequence.index} did not finish (the stream was closed early)"
                )
            out.append(request.completion)
        return out

    def interrupted_completions(self) -> list[Completion]:
        """What each request without a completion had generated, in input order, for a
        stream stopped early (Ctrl-C): the text so far is not lost with the request. Its
        finish_reason is "interrupted", or the reason it had already finished for (a
        request whose last token was still waiting for this step's text work). Requests
        that had not produced a token are left out."""
        pending, self._pending = self._pending, []
        for request, token in pending:
            if not (request.sequence.finish_reason == "eos" and token in request.eos):
                request.text.push(token)
        out: list[Completion] = []
        for request in self.requests:
            sequence = request.sequence
            if request.completion is not None or not sequence.output_token_ids:
                continue
            tracker = request.text
            tracker.flush()
            reason = sequence.finish_reason or ("stop" if tracker.stopped else "interrupted")
            out.append(_completion(request, reason))
        return out

    def newly_finished(self) -> list[Completion]:
        """Completions finished since the last call, in finishing order."""
        out, self._finished = self._finished, []
        return out

    # -- token bookkeeping ------------------------------------------------------------------------

    def _record(self, request: TrackedRequest, token: int, scheduler: Scheduler) -> None:
        """Append a sampled token and apply the token-id stop rules at once."""
        sequence = request.sequence
        sequence.output_token_ids.append(token)
        if token in request.eos:
            scheduler.finish(sequence, "eos")
        elif len(sequence.output_token_ids) >= sequence.max_new_tokens:
            scheduler.finish(sequence, "length")
        self._pending.append((request, token))

    def _host_work(self, scheduler: Scheduler) -> list[StreamEvent]:
        """Detokenize pending tokens, apply stop strings, finish completions."""
        events: list[StreamEvent] = []
        pending, self._pending = self._pending, []
        for request, token in pending:
            sequence = request.sequence
            tracker = request.text
            is_eos = sequence.finish_reason == "eos" and token in request.eos
            if not is_eos:
                tracker.push(token)
            if tracker.stopped and sequence.finish_reason != "stop":
                scheduler.finish(sequence, "stop")
            final = sequence.finished
            if final:
                tracker.flush()
            events.append(StreamEvent(sequence.index, token, tracker.delta(final=final)))
            if final and request.completion is None:
                assert sequence.finish_reason is not None
                request.completion = _completion(request, sequence.finish_reason)
                self._finished.append(request.completion)
        return events

    # -- device calls -----------------------------------------------------------------------------

    def _sampling_params(self, rows: Sequence[GenerationParams | None]) -> SamplingParams:
        """Per-row sampling values; None rows (inactive slots) are greedy and neutral."""
        key = tuple(rows)
        if key == self._sampling_key and self._sampling is not None:
            return self._sampling
        sp = rows_sampling(rows)
        self._sampling_key, self._sampling = key, sp
        return sp

    def _prefill(self, admissions: list[Admission], scheduler: Scheduler) -> None:
        rows = len(admissions)
        longest = max(len(a.token_ids) for a in admissions)
        width = max(len(a.sequence.table.block_ids) for a in admissions if a.sequence.table)
        tokens = torch.zeros((rows, longest), dtype=torch.int64)
        page_table = torch.full((rows, width), -1, dtype=torch.int32)
        for row, admission in enumerate(admissions):
            ids = admission.token_ids
            tokens[row, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
            table = admission.sequence.table
            assert table is not None
            page_table[row, : len(table.block_ids)] = torch.tensor(
                table.block_ids, dtype=torch.int32
            )
        requests = [self._by_sequence[id(a.sequence)] for a in admissions]
        sampling = rows_sampling([r.params for r in requests])
        clock = time.perf_counter()
        output = self.executor.prefill_forward(
            tokens=tokens,
            page_table=page_table,
            prompt_lens=torch.tensor([len(a.token_ids) for a in admissions], dtype=torch.int64),
            start_pos=torch.tensor([a.cached_tokens for a in admissions], dtype=torch.int64),
            empty_slots=[a.slot for a in admissions],
            sampling_params=sampling,
        )
        sampled = _token_list(output, "prefill_forward")
        self.stats.prefill_seconds += time.perf_counter() - clock
        self.stats.prefill_calls += 1
        if len(sampled) < rows:
            raise RuntimeError(f"prefill_forward returned {len(sampled)} tokens for {rows} rows")
        for admission, request, token in zip(admissions, requests, sampled, strict=False):
            self.stats.prefill_tokens += len(admission.token_ids) - admission.cached_tokens
            self.stats.prefix_cache_hit_tokens += admission.cached_tokens
            self._record(request, token, scheduler)

    def _decode_inputs(self, scheduler: Scheduler) -> tuple[_DecodeInputs, list[TrackedRequest]]:
        # Built as lists, then one tensor each: a torch op per slot and value cost more host
        # time than the rest of this step's bookkeeping.
        lane, width = self._lane, self._decode_width
        tokens, start_pos = [0] * lane, [-1] * lane
        page_rows = [[0] * width for _ in range(lane)]
        rows: list[GenerationParams | None] = [None] * lane
        active: list[TrackedRequest] = []
        slots: dict[int, int] = {}
        for slot, sequence in scheduler.running.items():
            request = self._by_sequence[id(sequence)]
            assert sequence.table is not None
            tokens[slot] = sequence.output_token_ids[-1]
            start_pos[slot] = sequence.next_position
            blocks = sequence.table.block_ids
            if len(blocks) > width:
                raise RuntimeError(
                    f"sequence {sequence.index} holds {len(blocks)} blocks; the decode page "
                    f"table has {width} columns"
                )
            page_rows[slot][: len(blocks)] = blocks
            rows[slot] = request.params
            active.append(request)
            slots[slot] = sequence.index
        reset = slots != self._last_slots
        self._last_slots = slots
        inputs = _DecodeInputs(
            torch.tensor(tokens, dtype=torch.int64),
            torch.tensor(start_pos, dtype=torch.int64),
            torch.tensor(page_rows, dtype=torch.int32),
            self._sampling_params(rows),
            reset,
        )
        return inputs, active

    def _decode_step(self, scheduler: Scheduler) -> list[StreamEvent]:
        """One lane-wide decode with an asynchronous read; host work overlaps the read."""
        clock = time.perf_counter()
        preempted = scheduler.reserve_decode()
        self.stats.preemptions += len(preempted)
        if not scheduler.running:
            return self._host_work(scheduler)
        inputs, active = self._decode_inputs(scheduler)
        executor = self.executor
        raw = executor.decode_forward(
            tokens=inputs.tokens,
            start_pos=inputs.start_pos,
            page_table=inputs.page_table,
            sampling_params=inputs.sampling_params,
            reset_batch=inputs.reset_batch,
            read_from_device=False,
        )
        host_value = _async_read(executor.read_decode_output(raw, async_read=True))
        try:
            events = self._host_work(scheduler)
        finally:
            output = executor.process_decode_output_host(host_value, is_tokens=True)
        sampled = _token_list(output, "process_decode_output_host")
        for request in active:
            sequence = request.sequence
            if sequence.finished or sequence.slot is None:
                continue  # a stop string ended it while this step was in flight
            self._record(request, sampled[sequence.slot], scheduler)
            self.stats.decode_tokens += 1
        self.stats.decode_seconds += time.perf_counter() - clock
        self.stats.decode_steps += 1
        return events

    # -- the loop ---------------------------------------------------------------------------------

    def _run(self) -> PyGenerator[StreamEvent, None, None]:
        generator = self.generator
        scheduler = Scheduler(generator.block_managers, self._lane)
        scheduler.extend(r.sequence for r in self.requests)
        clean = False
        try:
            while scheduler.has_work:
                events: list[StreamEvent] = []
                admissions = scheduler.admit()
                if admissions:
                    self._prefill(admissions, scheduler)
                if scheduler.running:
                    events = self._decode_step(scheduler)
                elif not admissions:
                    raise RuntimeError(
                        f"scheduler stalled with {len(scheduler.waiting)} waiting requests and "
                        "nothing running (the KV pool cannot hold the head request)"
                    )
                else:
                    events = self._host_work(scheduler)
                yield from events
            events = self._host_work(scheduler)
            clean = True
            yield from events
        except GeneratorExit:
            clean = True  # the consumer stopped between steps: every block is consistent
            raise
        finally:
            scheduler.abort_all()
            if not clean:
                generator.reset_after_failure()
            self.stats.preemptions = max(self.stats.preemptions, scheduler.preemptions)
            self.done = True

"""`Generator`: continuous-batching text generation over a SERVING `ModelExecutor`.

Every step admits waiting requests (one `prefill_forward` call for all of them, with prefix-cache
hits skipped through `start_pos`), then decodes every running slot with one `decode_forward`
over the whole lane. Decode reads asynchronously: while the step's output is in flight, the host
detokenizes the previous step's tokens and checks stop strings; a request that a stop string
ended in flight has its extra token dropped. Token-id checks (EOS, max tokens) happen as soon
as a token is read, so no decode is spent on a request that is known to be done.

Requests are validated before any device work; an invalid one raises a `ValueError` naming the
request index and the field, and nothing else is touched.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from collections.abc import Generator as PyGenerator
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import attrs
import torch

from models.generation.block_manager import BlockManager
from models.generation.scheduler import (
    Admission,
    FinishReason,
    Scheduler,
    SequenceState,
)
from runtime.sampling import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_MAX_NEW_TOKENS = 64
DEFAULT_TOP_K = 50
MAX_SEED = 2**64 - 1


# --------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------


class TextTokenizer(Protocol):
    """What generation needs from a tokenizer (`models.llama.tokenizer.LlamaTokenizer` fits)."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str: ...

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids, for models without a tokenizer (tiny-random, vocab >= 256).

    It lets text prompts drive test models end to end; it has no chat template.
    """

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        raise ValueError(
            "this model has no tokenizer and therefore no chat template; drop --chat/chat=True"
        )


# --------------------------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------------------------


def _stop_tuple(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, Sequence):
        return tuple(value)  # items are checked by `GenerationParams.check`
    raise TypeError(f"stop must be a string or a sequence of strings, got {type(value).__name__}")


@attrs.frozen
class GenerationParams:
    """One request's sampling and stopping parameters.

    `temperature` 0 is greedy. A stochastic request (temperature > 0) samples from its
    `top_k` highest tokens (1..the device sampler's limit, 64 for the Llama sampler) and the
    `top_p` nucleus. `seed` makes a request reproducible independently of its batch. `stop`
    strings end a completion (the text stops before the match). `ignore_eos` keeps generating
    past EOS (benchmarks use it for fixed token counts). Values are checked when a request is
    submitted, so errors can name the request.
    """

    temperature: float = 0.0
    top_k: int = DEFAULT_TOP_K
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    stop: tuple[str, ...] = attrs.field(default=(), converter=_stop_tuple)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_sampling_params(
        cls, sp: SamplingParams, *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    ) -> GenerationParams:
        """A scalar `runtime.sampling.SamplingParams` as one request's parameters."""
        temperature, top_k, top_p, seed = sp.temperature, sp.top_k, sp.top_p, sp.seed
        if (
            isinstance(temperature, tuple)
            or isinstance(top_k, tuple)
            or isinstance(top_p, tuple)
            or isinstance(seed, tuple)
        ):
            raise ValueError(
                "SamplingParams has per-row values; give one scalar SamplingParams per request "
                "(or one GenerationParams per prompt)"
            )
        # top_k=0 ("no limit") stays 0: fine for greedy, refused by `check` for sampling rows.
        return cls(
            temperature=float(temperature),
            top_k=int(top_k),
            top_p=float(top_p),
            seed=seed,
            max_new_tokens=max_new_tokens,
        )

    def check(self, where: str, *, max_top_k: int) -> None:
        """Raise ValueError naming `where` (e.g. "request 3") and the field when invalid."""

        def bad(field: str, value: object, allowed: str) -> ValueError:
            return ValueError(f"{where}: {field}={value!r} is invalid: allowed is {allowed}")

        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t < 0:
            raise bad("temperature", t, "a finite number >= 0 (0 means greedy)")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
            raise bad("top_k", k, "an int >= 0")
        if t > 0 and not 1 <= k <= max_top_k:
            raise bad("top_k", k, f"an int in [1, {max_top_k}] when temperature > 0")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 < float(p) <= 1.0:
            raise bad("top_p", p, "a number in (0, 1]")
        s = self.seed
        if s is not None and (
            isinstance(s, bool) or not isinstance(s, numbers.Integral) or not 0 <= s <= MAX_SEED
        ):
            raise bad("seed", s, f"None or an int in [0, {MAX_SEED}]")
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise bad("max_new_tokens", n, "an int >= 1")
        for stop in self.stop:
            if not isinstance(stop, str) or not stop:
                raise bad("stop", self.stop, "a sequence of non-empty strings")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", self.ignore_eos, "a bool")


@attrs.frozen
class Completion:
    """One finished request; `prompt` is what the caller passed (text or token ids)."""

    index: int
    prompt: str | tuple[int, ...]
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason

    def to_json(self) -> dict[str, Any]:
        """The CLI's JSON object (lists, not tuples)."""
        return {
            "index": self.index,
            "prompt": self.prompt if isinstance(self.prompt, str) else list(self.prompt),
            "prompt_token_ids": list(self.prompt_token_ids),
            "token_ids": list(self.token_ids),
            "text": self.text,
            "finish_reason": self.finish_reason,
        }


class StreamEvent(NamedTuple):
    """One generated token: the request index, the token id and the text it added (may be "").

    A tuple, so `for index, token_id, text in stream` works; `index` deliberately shadows
    `tuple.index` to match `Completion.index`.
    """

    index: int  # type: ignore[assignment]
    token_id: int
    text_delta: str


@attrs.define
class GenerationStats:
    """Counters of one generation call (the CLI summary)."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    prefix_cache_hit_tokens: int = 0
    prefill_calls: int = 0
    decode_steps: int = 0
    preemptions: int = 0
    requests: int = 0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def progress_detail(self) -> str:
        """Short live figures for a progress display."""
        return f"{self.decode_tokens} tokens, {self.decode_tokens_per_second:.1f} tokens/s"

    def to_json(self) -> dict[str, Any]:
        out = attrs.asdict(self)
        out["decode_tokens_per_second"] = self.decode_tokens_per_second
        return out


# --------------------------------------------------------------------------------------------
# Incremental text with stop strings
# --------------------------------------------------------------------------------------------


class _TextTracker:
    """Detokenizes one request incrementally and finds stop strings.

    Decoding a window that starts at an earlier, already complete boundary keeps multi-byte
    characters and tokenizer spacing right; text that could still become the start of a stop
    string is held back from the stream until it cannot.
    """

    def __init__(self, tokenizer: TextTokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _append(self, piece: str) -> None:
        if not piece or self.stopped:
            return
        start = max(0, len(self.text) - self.hold)
        self.text += piece
        found = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if found:
            self.text = self.text[: min(found)]
            self.stopped = True

    def push(self, token: int) -> None:
        """Add one text token (EOS is not pushed)."""
        if self.stopped:
            return
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self._append(after[len(before) :])

    def flush(self) -> None:
        """Take whatever is left undecoded (an incomplete character becomes U+FFFD)."""
        if self.stopped or self.read_offset == len(self.ids):
            return
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        self._append(after[len(before) :])

    def delta(self, *, final: bool) -> str:
        """Text not yet streamed that can no longer change."""
        limit = len(self.text) if final or self.stopped else len(self.text) - self.hold
        if limit <= self.emitted:
            return ""
        piece = self.text[self.emitted : limit]
        self.emitted = limit
        return piece


# --------------------------------------------------------------------------------------------
# The generator
# --------------------------------------------------------------------------------------------


@attrs.define(eq=False)
class _Request:
    """Everything the generator keeps about one request besides the scheduler state."""

    sequence: SequenceState
    prompt: str | tuple[int, ...]
    params: GenerationParams
    text: _TextTracker
    eos: frozenset[int]
    completion: Completion | None = None


def _token_list(value: Any, name: str) -> list[int]:
    """Normalise a tokens output (`tensor`, or `(tokens, log_probs)`) to a list of ints."""
    if isinstance(value, tuple | list) and value and not isinstance(value[0], numbers.Integral):
        value = value[0]
    if isinstance(value, torch.Tensor):
        return [int(t) for t in value.detach().reshape(-1).to("cpu").tolist()]
    if isinstance(value, Sequence):
        return [int(t) for t in value]
    raise TypeError(f"{name} returned {type(value).__name__}; expected sampled token ids")


class Generator:
    """Continuous-batching generation over one executor lane (the executor must be SERVING)."""

    def __init__(
        self,
        executor: Any,
        *,
        enable_prefix_cache: bool = True,
        tokenizer: TextTokenizer | None = None,
    ) -> None:
        if not isinstance(enable_prefix_cache, bool):
            raise TypeError(f"enable_prefix_cache must be bool, got {enable_prefix_cache!r}")
        config = getattr(executor, "config", None)
        if config is not None and not getattr(config, "device_sampling_enabled", True):
            raise ValueError(
                "Generator needs device sampling; load the executor with device_sampling=True"
            )
        self.executor = executor
        self.enable_prefix_cache = enable_prefix_cache
        self._tokenizer = tokenizer
        self._block_managers: tuple[BlockManager, ...] | None = None
        self._active: GenerationStream | None = None
        self.last_stats = GenerationStats()

    # -- facts about the executor ------------------------------------------------------------------

    @property
    def tokenizer(self) -> TextTokenizer:
        """The executor's tokenizer, or UTF-8 bytes for a model without one."""
        if self._tokenizer is None:
            found = getattr(self.executor, "tokenizer", None)
            if found is None:
                if self.vocab_size < 256:
                    raise ValueError(
                        f"the model has no tokenizer and a vocabulary of {self.vocab_size} < 256 "
                        "ids, so text prompts cannot be encoded; pass token-id lists"
                    )
                found = ByteTokenizer()
            self._tokenizer = found
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return int(self.executor.model.vocab_size)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        ids = getattr(self.executor, "eos_token_ids", None)
        if ids is None:
            ids = getattr(self.executor.model, "eos_token_ids", None)
        return frozenset(int(i) for i in ids or ())

    @property
    def max_seq_len(self) -> int:
        config = getattr(self.executor, "config", None)
        if config is not None and getattr(config, "max_seq_len", None):
            return int(config.max_seq_len)
        return int(self.executor.model.max_seq_len)

    @property
    def max_top_k(self) -> int:
        if getattr(self.executor.model, "max_top_k", None):  # a lane group's model facts
            return int(self.executor.model.max_top_k)
        sampler = getattr(self.executor.model, "sampling", None)
        sampler_config = getattr(sampler, "config", None)
        return int(getattr(sampler_config, "max_top_k", DEFAULT_TOP_K))

    @property
    def block_manager(self) -> BlockManager:
        """The (first) lane's block tables."""
        return self.block_managers[0]

    @property
    def block_managers(self) -> tuple[BlockManager, ...]:
        """One block manager and prefix cache per lane (a lane group's block ids are lane-local);
        created once the executor's KV capacity is known."""
        if self._block_managers is None:
            num_blocks = self.executor.num_blocks
            if num_blocks is None:
                raise RuntimeError(
                    "the executor's KV capacity is not resolved yet; call executor.start() "
                    "before generating"
                )
            self._block_managers = tuple(
                BlockManager(
                    num_blocks=int(num_blocks),
                    block_size=int(self.executor.block_size),
                    enable_prefix_cache=self.enable_prefix_cache,
                )
                for _ in range(int(getattr(self.executor, "tt_data_parallel", 1)))
            )
        return self._block_managers

    def _check_serving(self) -> None:
        phase = getattr(self.executor, "phase", None)
        if phase is not None and str(phase) != "SERVING":
            raise RuntimeError(
                f"the executor is in {phase}; requests need SERVING: call executor.start() "
                "(or the phase calls up to serve()) first"
            )

    def _reset_after_failure(self) -> None:
        """Drop block tables whose KV contents are unknown after a failed device call."""
        self._block_managers = None

    # -- request validation ------------------------------------------------------------------------

    def _params_list(self, sampling: Any, count: int) -> list[GenerationParams]:
        def one(value: Any, where: str) -> GenerationParams:
            if value is None:
                return GenerationParams()
            if isinstance(value, GenerationParams):
                return value
            if isinstance(value, SamplingParams):
                return GenerationParams.from_sampling_params(value)
            raise TypeError(
                f"{where} must be GenerationParams or SamplingParams, got {type(value).__name__}"
            )

        if sampling is None or isinstance(sampling, GenerationParams | SamplingParams):
            return [one(sampling, "sampling")] * count
        if isinstance(sampling, Sequence) and not isinstance(sampling, str):
            if len(sampling) != count:
                raise ValueError(
                    f"sampling has {len(sampling)} values for {count} prompts; give one value "
                    "for every request or one per prompt"
                )
            return [one(value, f"sampling[{i}]") for i, value in enumerate(sampling)]
        raise TypeError(
            "sampling must be GenerationParams, SamplingParams or a sequence of them, got "
            f"{type(sampling).__name__}"
        )

    def _prompt_ids(self, index: int, prompt: Any, chat: bool) -> list[int]:
        where = f"request {index}"
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"{where}: prompt is empty; give at least one character")
            if chat:
                message = {"role": "user", "content": prompt}
                return list(self.tokenizer.apply_chat_template([message]))
            return list(self.tokenizer.encode(prompt))
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.reshape(-1).tolist()
        if not isinstance(prompt, Sequence) or isinstance(prompt, bytes):
            raise TypeError(
                f"{where}: prompt must be a str or a list of token ids, got {type(prompt).__name__}"
            )
        if chat:
            raise ValueError(f"{where}: chat=True needs a text prompt, got token ids")
        ids: list[int] = []
        for token in prompt:
            if isinstance(token, bool) or not isinstance(token, numbers.Integral):
                raise TypeError(f"{where}: prompt token {token!r} is not an int")
            if not 0 <= int(token) < self.vocab_size:
                raise ValueError(
                    f"{where}: prompt token id {int(token)} is invalid: allowed are ids in "
                    f"[0, {self.vocab_size})"
                )
            ids.append(int(token))
        return ids

    def _build_requests(self, prompts: Sequence[Any], sampling: Any, chat: bool) -> list[_Request]:
        if isinstance(prompts, str) or not isinstance(prompts, Sequence):
            raise TypeError(
                "prompts must be a list of prompts (each a str or a list of token ids), got "
                f"{type(prompts).__name__}"
            )
        if not prompts:
            raise ValueError("prompts is empty; give at least one prompt")
        params = self._params_list(sampling, len(prompts))
        max_top_k = self.max_top_k
        max_seq_len = self.max_seq_len
        manager = self.block_manager
        eos = self.eos_token_ids
        requests: list[_Request] = []
        for index, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            where = f"request {index}"
            p.check(where, max_top_k=max_top_k)
            ids = self._prompt_ids(index, prompt, chat)
            if not ids:
                raise ValueError(f"{where}: prompt encodes to no tokens; give a longer prompt")
            if len(ids) >= max_seq_len:
                raise ValueError(
                    f"{where}: prompt has {len(ids)} tokens but the model context is "
                    f"{max_seq_len} tokens (max_seq_len); a prompt may have at most "
                    f"{max_seq_len - 1} so one token can be generated"
                )
            budget = min(int(p.max_new_tokens), max_seq_len - len(ids))
            kv_tokens = len(ids) + budget - 1
            if manager.blocks_needed(kv_tokens) > manager.num_blocks:
                raise ValueError(
                    f"{where}: prompt ({len(ids)} tokens) + max_new_tokens ({budget}) needs "
                    f"{manager.blocks_needed(kv_tokens)} KV blocks of {manager.block_size} "
                    f"tokens but the pool has {manager.num_blocks}; lower max_new_tokens or "
                    "resolve more KV blocks"
                )
            shown: str | tuple[int, ...] = prompt if isinstance(prompt, str) else tuple(ids)
            requests.append(
                _Request(
                    sequence=SequenceState(
                        index=index, prompt_token_ids=tuple(ids), max_new_tokens=budget
                    ),
                    prompt=shown,
                    params=p,
                    text=_TextTracker(self.tokenizer, p.stop),
                    eos=frozenset() if p.ignore_eos else eos,
                )
            )
        return requests

    # -- public API --------------------------------------------------------------------------------

    def encode(self, prompts: Sequence[Any], *, chat: bool = False) -> list[list[int]]:
        """Token ids of every prompt as `generate` would see them (validated, no device work)."""
        if isinstance(prompts, str) or not isinstance(prompts, Sequence):
            raise TypeError(
                "prompts must be a list of prompts (each a str or a list of token ids), got "
                f"{type(prompts).__name__}"
            )
        out: list[list[int]] = []
        for index, prompt in enumerate(prompts):
            ids = self._prompt_ids(index, prompt, chat)
            if not ids:
                raise ValueError(f"request {index}: prompt encodes to no tokens")
            out.append(ids)
        return out

    def stream(
        self, prompts: Sequence[Any], sampling: Any = None, *, chat: bool = False
    ) -> GenerationStream:
        """Validate every request now, then iterate `StreamEvent`s as tokens are produced.

        `sampling` is one `GenerationParams` (or scalar `SamplingParams`) for every request, or
        one per prompt. Iterating the stream runs the work; `stream.completions` holds the
        results in input order once it is exhausted.
        """
        if self._active is not None and not self._active.done:
            raise RuntimeError(
                "a previous stream of this Generator is still running; exhaust or close() it first"
            )
        requests = self._build_requests(prompts, sampling, chat)
        self._check_serving()
        stream = GenerationStream(self, requests)
        self._active = stream
        return stream

    def generate(
        self,
        prompts: Sequence[Any],
        sampling: Any = None,
        *,
        chat: bool = False,
        progress: Any = None,
    ) -> list[Completion]:
        """Generate for every prompt; completions in input order.

        `progress` (a `models.progress` sink; default: the executor's) shows requests done
        and decode tokens/s while it runs.
        """
        stream = self.stream(prompts, sampling, chat=chat)
        sink = progress if progress is not None else getattr(self.executor, "progress", None)
        if sink is None:
            for _ in stream:
                pass
            return stream.completions
        with sink.step("generate", total=len(prompts)) as step:
            for _ in stream:
                finished = stream.newly_finished()
                if finished:
                    step.advance(len(finished), stream.stats.progress_detail())
            step.advance(len(stream.newly_finished()), stream.stats.progress_detail())
        return stream.completions


class GenerationStream:
    """An iterator of `StreamEvent`s that drives one generation call to the end.

    `newly_finished()` returns completions finished since it was last called (the CLI prints
    them as they arrive); `completions` is the input-ordered list once the stream is done.
    """

    def __init__(self, generator: Generator, requests: list[_Request]) -> None:
        self.generator = generator
        self.executor = generator.executor
        self.requests = requests
        self.stats = GenerationStats(requests=len(requests))
        generator.last_stats = self.stats
        self.done = False
        self._finished: list[Completion] = []
        self._by_sequence = {id(r.sequence): r for r in requests}
        self._pending: list[tuple[_Request, int]] = []
        self._lane = int(self.executor.max_batch_size)
        self._decode_width = int(self.executor.page_table_layout.decode_width)
        self._last_slots: dict[int, int] | None = None
        self._sampling_key: tuple[Any, ...] | None = None
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

    def newly_finished(self) -> list[Completion]:
        """Completions finished since the last call, in finishing order."""
        out, self._finished = self._finished, []
        return out

    # -- token bookkeeping ------------------------------------------------------------------------

    def _record(self, request: _Request, token: int, scheduler: Scheduler) -> None:
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
                request.completion = Completion(
                    index=sequence.index,
                    prompt=request.prompt,
                    prompt_token_ids=sequence.prompt_token_ids,
                    token_ids=tuple(sequence.output_token_ids),
                    text=tracker.text,
                    finish_reason=sequence.finish_reason,
                )
                self._finished.append(request.completion)
        return events

    # -- device calls -----------------------------------------------------------------------------

    def _sampling_params(self, rows: Sequence[GenerationParams | None]) -> SamplingParams:
        """Per-row sampling values; None rows (inactive slots) are greedy and neutral."""
        key = tuple(rows)
        if key == self._sampling_key and self._sampling is not None:
            return self._sampling
        seeds = [None if p is None else p.seed for p in rows]
        sp = SamplingParams(
            temperature=[0.0 if p is None else float(p.temperature) for p in rows],
            top_k=[1 if p is None or p.greedy else int(p.top_k) for p in rows],
            top_p=[1.0 if p is None else float(p.top_p) for p in rows],
            seed=None if all(s is None for s in seeds) else seeds,
        )
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
        sampling = SamplingParams(
            temperature=[float(r.params.temperature) for r in requests],
            top_k=[1 if r.params.greedy else int(r.params.top_k) for r in requests],
            top_p=[float(r.params.top_p) for r in requests],
            seed=None
            if all(r.params.seed is None for r in requests)
            else [r.params.seed for r in requests],
        )
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

    def _decode_inputs(self, scheduler: Scheduler) -> tuple[dict[str, Any], list[_Request]]:
        lane = self._lane
        tokens = torch.zeros(lane, dtype=torch.int64)
        start_pos = torch.full((lane,), -1, dtype=torch.int64)
        page_table = torch.zeros((lane, self._decode_width), dtype=torch.int32)
        rows: list[GenerationParams | None] = [None] * lane
        active: list[_Request] = []
        slots: dict[int, int] = {}
        for slot, sequence in scheduler.running.items():
            request = self._by_sequence[id(sequence)]
            assert sequence.table is not None
            tokens[slot] = sequence.output_token_ids[-1]
            start_pos[slot] = sequence.next_position
            blocks = sequence.table.block_ids
            page_table[slot, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            rows[slot] = request.params
            active.append(request)
            slots[slot] = sequence.index
        reset = slots != self._last_slots
        self._last_slots = slots
        inputs = {
            "tokens": tokens,
            "start_pos": start_pos,
            "page_table": page_table,
            "sampling_params": self._sampling_params(rows),
            "reset_batch": reset,
        }
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
        raw = executor.decode_forward(**inputs, read_from_device=False)
        host_value, _events = executor.read_decode_output(raw, async_read=True)
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
                generator._reset_after_failure()
            self.stats.preemptions = max(self.stats.preemptions, scheduler.preemptions)
            self.done = True

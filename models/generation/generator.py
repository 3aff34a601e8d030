"""`Generator`: continuous-batching text generation over a SERVING `ModelExecutor`.

Requests are validated here, before any device work; an invalid one raises a `ValueError`
naming the request index and the field, and nothing else is touched. The work itself runs
in a `GenerationStream` (`models.generation.stream`) as it is iterated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeAlias

import torch

from models.generation.block_manager import BlockManager
from models.generation.drain import DrainResult, drain_stream
from models.generation.params import DEFAULT_TOP_K, GenerationParams
from models.generation.prompt_ids import prompt_token_ids, text_tokenizer
from models.generation.results import Completion, GenerationStats
from models.generation.scheduler import SequenceState
from models.generation.stream import GenerationStream, StreamExecutor, TrackedRequest
from models.generation.text import TextTracker
from models.generation.tokenizers import TextTokenizer
from models.progress import ProgressSink
from runtime.sampling import SamplingParams

__all__ = ["GenerationExecutor", "GenerationParams", "Generator", "Prompt", "Sampling"]

Prompt: TypeAlias = str | Sequence[int] | torch.Tensor
"""One request's prompt: text, or token ids (a list or a tensor)."""

Sampling: TypeAlias = (
    GenerationParams | SamplingParams | Sequence[GenerationParams | SamplingParams] | None
)
"""Sampling for every request (one value) or per request (one per prompt); None: greedy."""


class ModelFacts(Protocol):
    """What the generator reads of the executor's model (a lane group's are `LaneModelFacts`)."""

    @property
    def vocab_size(self) -> int | None: ...

    @property
    def max_seq_len(self) -> int | None: ...


class GenerationExecutor(StreamExecutor, Protocol):
    """What a `Generator` needs of its executor besides what the stream calls."""

    @property
    def model(self) -> ModelFacts: ...

    @property
    def num_blocks(self) -> int | None: ...

    @property
    def block_size(self) -> int | None: ...


class Generator:
    """Continuous-batching generation over one executor lane (the executor must be SERVING)."""

    def __init__(
        self,
        executor: GenerationExecutor,
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
        self._kv_generation: object = None
        self._active: GenerationStream | None = None
        self.last_stats = GenerationStats()

    # -- facts about the executor ------------------------------------------------------------------

    @property
    def tokenizer(self) -> TextTokenizer:
        """The executor's tokenizer, or UTF-8 bytes for a model without one."""
        if self._tokenizer is None:
            found = getattr(self.executor, "tokenizer", None)
            self._tokenizer = text_tokenizer(found, self.vocab_size)
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        vocab = self.executor.model.vocab_size
        if vocab is None:
            raise RuntimeError("the executor's model does not report its vocabulary size")
        return int(vocab)

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
        limit = self.executor.model.max_seq_len
        if limit is None:
            raise RuntimeError("the executor's model does not report its context (max_seq_len)")
        return int(limit)

    @property
    def max_top_k(self) -> int:
        group_limit = getattr(self.executor.model, "max_top_k", None)  # a lane group's facts
        if group_limit:
            return int(group_limit)
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
        created once the executor's KV capacity is known, and again whenever the executor
        allocated its KV cache anew (a wake): cached prefixes of the old cache are gone."""
        generation = getattr(self.executor, "kv_generation", None)
        if generation != self._kv_generation:
            self._block_managers = None
            self._kv_generation = generation
        if self._block_managers is None:
            num_blocks = self.executor.num_blocks
            block_size = self.executor.block_size
            if num_blocks is None or block_size is None:
                raise RuntimeError(
                    "the executor's KV capacity is not resolved yet; call executor.start() "
                    "before generating"
                )
            self._block_managers = tuple(
                BlockManager(
                    num_blocks=int(num_blocks),
                    block_size=int(block_size),
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

    def reset_after_failure(self) -> None:
        """Drop block tables whose KV contents are unknown after a failed device call."""
        self._block_managers = None

    def drain(self, *, finish: bool = True) -> DrainResult:
        """Drain the executor without losing a request of the running stream.

        `finish=True` runs the stream to its end first; `finish=False` stops it between steps
        and hands the unfinished requests back (`HandedBack.resume_token_ids`). Then the
        executor drains (SERVING -> DRAINED).
        """
        if not isinstance(finish, bool):
            raise TypeError(f"finish must be bool, got {finish!r}")
        drain = getattr(self.executor, "drain", None)
        if not callable(drain):
            raise TypeError(f"{type(self.executor).__name__} has no drain()")
        result = DrainResult((), ())
        stream = self._active
        if stream is not None and not stream.done:
            result = drain_stream(stream, finish=finish)
        drain()
        return result

    # -- request validation ------------------------------------------------------------------------

    def _params_list(self, sampling: Sampling, count: int) -> list[GenerationParams]:
        def one(value: object, where: str) -> GenerationParams:
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

    def _prompt_ids(self, index: int, prompt: Prompt, chat: bool) -> list[int]:
        return prompt_token_ids(
            index, prompt, chat, tokenizer=lambda: self.tokenizer, vocab_size=self.vocab_size
        )

    def _build_requests(
        self, prompts: Sequence[Prompt], sampling: Sampling, chat: bool
    ) -> list[TrackedRequest]:
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
        requests: list[TrackedRequest] = []
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
                TrackedRequest(
                    sequence=SequenceState(
                        index=index, prompt_token_ids=tuple(ids), max_new_tokens=budget
                    ),
                    prompt=shown,
                    params=p,
                    text=TextTracker(self.tokenizer, p.stop),
                    eos=frozenset() if p.ignore_eos else eos,
                )
            )
        return requests

    # -- public API --------------------------------------------------------------------------------

    def encode(self, prompts: Sequence[Prompt], *, chat: bool = False) -> list[list[int]]:
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
        self, prompts: Sequence[Prompt], sampling: Sampling = None, *, chat: bool = False
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
        prompts: Sequence[Prompt],
        sampling: Sampling = None,
        *,
        chat: bool = False,
        progress: ProgressSink | None = None,
    ) -> list[Completion]:
        """Generate for every prompt; completions in input order.

        `progress` (a `models.progress` sink; default: the executor's) shows requests done
        and decode tokens/s while it runs.
        """
        stream = self.stream(prompts, sampling, chat=chat)
        own = getattr(self.executor, "progress", None)
        sink = progress if progress is not None else own if isinstance(own, ProgressSink) else None
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

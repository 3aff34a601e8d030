"""Device sampling in the worker: which vLLM requests the runtime's sampler can take, and how.

A facade that declares `supports_sample_on_device` returns sampled tokens instead of logits
when `prefill_forward` / `decode_forward` get the runtime's `SamplingParams`. This module says
which requests the runtime's parameters express (`DeviceSamplingPolicy.host_reason`: the
others go to vLLM's sampler), lays requests out the way the facade reads them
(`facade_sampling`: prefill parameters by the call's rows, decode parameters by slot, token
histories by slot, rows that sample nothing neutral), and samples such requests on the host
with the runtime's sampler when their call returned logits (`sample_rows_on_host`), drawing
what the device would have drawn.

It reads vLLM's `SamplingParams` by attribute only and imports no vLLM, so the main suite
tests it without vLLM installed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol, TypedDict

import attrs
import torch

from runtime.sampling import DeviceSampler, SamplerConfig, SamplingParams

GREEDY_TEMPERATURE = 1e-5
"""vLLM's rule: a temperature below this is greedy (`SamplingType.GREEDY`)."""
_NEUTRAL = 1e-5
SEED_MODULUS = 2**64
"""vLLM seeds are any Python int; the runtime's are `[0, 2**64)` (taken modulo this)."""
NO_TOKEN = -1
"""History padding the runtime's penalties ignore."""


class RequestSampling(Protocol):
    """The attributes of vLLM's `SamplingParams` the mapping reads."""

    @property
    def temperature(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def top_p(self) -> float: ...
    @property
    def seed(self) -> int | None: ...
    @property
    def presence_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def repetition_penalty(self) -> float: ...
    @property
    def logprobs(self) -> int | None: ...


def is_greedy(params: RequestSampling) -> bool:
    return float(params.temperature) < GREEDY_TEMPERATURE


def has_penalties(params: RequestSampling) -> bool:
    """Whether a presence, frequency or repetition penalty is set (vLLM's neutral values)."""
    return (
        abs(float(params.presence_penalty)) >= _NEUTRAL
        or abs(float(params.frequency_penalty)) >= _NEUTRAL
        or abs(float(params.repetition_penalty) - 1.0) >= _NEUTRAL
    )


def effective_top_k(params: RequestSampling, vocab_size: int) -> int:
    """vLLM's top_k as a count: 0, -1 or at least the vocabulary mean the whole vocabulary."""
    top_k = int(params.top_k)
    return top_k if 0 < top_k < vocab_size else vocab_size


@attrs.frozen
class DeviceSamplingPolicy:
    """What the facade's sampler can honour for one engine.

    `max_top_k`: the facade's device top-k ceiling (None: unknown, so stochastic rows go to
    the host). `penalties`: False on a traced lane, whose compile gate closes at capture while
    warmup compiles no penalty programs (a penalised row there would be refused mid-serving).
    """

    vocab_size: int
    max_top_k: int | None
    penalties: bool

    def host_reason(self, params: RequestSampling) -> str | None:
        """Why this request must be sampled on the host (None: the device can sample it)."""
        if params.logprobs is not None:
            return f"logprobs={params.logprobs} (vLLM's sampler returns them)"
        if not is_greedy(params):
            top_k = effective_top_k(params, self.vocab_size)
            if self.max_top_k is None:
                return "stochastic sampling (the facade names no device top-k limit)"
            if top_k > self.max_top_k:
                asked = "no top_k limit" if top_k == self.vocab_size else f"top_k={top_k}"
                return f"{asked} (the device samples top_k in [1, {self.max_top_k}])"
        if not self.penalties and has_penalties(params):
            return "penalties on a traced lane (warmup compiles no penalty programs)"
        return None

    def first_host_reason(self, rows: Sequence[RequestSampling]) -> str | None:
        """The first host reason among the rows a facade call samples (None: all on device)."""
        for params in rows:
            reason = self.host_reason(params)
            if reason is not None:
                return reason
        return None


@attrs.frozen
class HistoryRow:
    """A request's tokens as vLLM's penalties see them: its prompt, then what it generated."""

    prompt: Sequence[int]
    output: Sequence[int]


class SamplingKeywords(TypedDict, total=False):
    """The sampling keywords a facade call takes (none: it returns logits)."""

    sampling_params: SamplingParams
    prompt_tokens: torch.Tensor
    output_tokens: torch.Tensor | None


@attrs.frozen(eq=False)
class FacadeSampling:
    """The sampling keywords of one `prefill_forward` / `decode_forward` call."""

    sampling_params: SamplingParams
    prompt_tokens: torch.Tensor | None = None
    output_tokens: torch.Tensor | None = None

    def keywords(self) -> SamplingKeywords:
        """`sampling_params` and, with penalties, the slot-indexed token histories."""
        found: SamplingKeywords = {"sampling_params": self.sampling_params}
        if self.prompt_tokens is not None:
            found["prompt_tokens"] = self.prompt_tokens
            found["output_tokens"] = self.output_tokens
        return found


def _seed(params: RequestSampling) -> int | None:
    """The runtime seed of a stochastic row (a greedy row draws no noise)."""
    if params.seed is None or is_greedy(params):
        return None
    return int(params.seed) % SEED_MODULUS


def runtime_sampling_params(
    rows: Sequence[RequestSampling | None], *, vocab_size: int
) -> SamplingParams:
    """Row `i` of the result samples like `rows[i]`; a None row is neutral (greedy).

    Every field is a per-row tuple (a scalar seed would belong to row 0 only).
    """
    if not rows:
        raise ValueError("runtime_sampling_params needs at least one row")
    values = [_Row.of(p, vocab_size) for p in rows]
    seeds = [None if p is None else _seed(p) for p in rows]
    return SamplingParams(
        temperature=[v.temperature for v in values],
        top_k=[v.top_k for v in values],
        top_p=[v.top_p for v in values],
        presence_penalty=[v.presence_penalty for v in values],
        frequency_penalty=[v.frequency_penalty for v in values],
        repetition_penalty=[v.repetition_penalty for v in values],
        seed=None if all(s is None for s in seeds) else seeds,
    )


class _Row(NamedTuple):
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @classmethod
    def of(cls, params: RequestSampling | None, vocab_size: int) -> _Row:
        """One row; a greedy row keeps its penalties (vLLM applies them before argmax too)."""
        if params is None:
            return cls()
        penalties = cls(
            presence_penalty=float(params.presence_penalty),
            frequency_penalty=float(params.frequency_penalty),
            repetition_penalty=float(params.repetition_penalty),
        )
        if is_greedy(params):
            return penalties
        return penalties._replace(
            temperature=float(params.temperature),
            top_k=effective_top_k(params, vocab_size),
            top_p=float(params.top_p),
        )


def token_rows(rows: Sequence[Sequence[int] | None]) -> torch.Tensor:
    """int64 `[len(rows), longest]` (at least one column), padded with -1; None rows empty."""
    width = max([len(r) for r in rows if r is not None] + [1])
    tensor = torch.full((len(rows), width), NO_TOKEN, dtype=torch.int64)
    for index, row in enumerate(rows):
        if row:
            tensor[index, : len(row)] = torch.tensor(list(row), dtype=torch.int64)
    return tensor


def facade_sampling(
    params_rows: Sequence[RequestSampling | None],
    history_rows: Sequence[HistoryRow | None],
    *,
    vocab_size: int,
) -> FacadeSampling:
    """One call's sampling: `params_rows[i]` samples row `i`, `history_rows` as given.

    The worker passes prefill parameters by the call's rows, decode parameters by slot, and
    both calls' histories by slot (lane rows are the one layout the runtime never reads as
    call rows). Histories are built only when a row has a penalty (they feed nothing else).
    """
    sampling = runtime_sampling_params(params_rows, vocab_size=vocab_size)
    if not any(p is not None and has_penalties(p) for p in params_rows):
        return FacadeSampling(sampling)
    return FacadeSampling(
        sampling,
        prompt_tokens=token_rows([None if h is None else h.prompt for h in history_rows]),
        output_tokens=token_rows([None if h is None else h.output for h in history_rows]),
    )


@attrs.frozen
class HostRow:
    """A device-samplable request whose facade call returned logits (another row needed them).

    `position` is the absolute position of the request's last token: the runtime's seeded
    noise is keyed by it, so the row draws exactly what the facade would have drawn.
    """

    params: RequestSampling
    history: HistoryRow
    position: int


def host_runtime_sampler(policy: DeviceSamplingPolicy, max_rows: int) -> DeviceSampler:
    """The runtime's sampler on the host, for device-samplable rows of a call that fell back."""
    top_k = policy.max_top_k or 1  # no ceiling named: only greedy rows come here
    sampler = DeviceSampler(
        SamplerConfig(max_batch_size=max_rows, max_top_k=top_k, vocab_size=policy.vocab_size)
    )
    sampler.materialize("cpu")
    return sampler


def sample_rows_on_host(
    sampler: DeviceSampler, logits: torch.Tensor, rows: Sequence[HostRow]
) -> list[int]:
    """The runtime's sampling of `rows` over their host `logits [len(rows), vocab]`.

    A request sampled here draws what the facade's device sampler draws (same parameters,
    seeded noise by position), so its tokens never depend on which call it shared.
    """
    config = sampler.config
    sampling = facade_sampling(
        [row.params for row in rows], [row.history for row in rows], vocab_size=config.vocab_size
    )
    prepared = sampler.prepare(
        sampling.sampling_params,
        len(rows),
        prompt_tokens=sampling.prompt_tokens,
        output_tokens=sampling.output_tokens,
    )
    positions = torch.tensor([row.position for row in rows], dtype=torch.int64)
    out = sampler.sample(logits.to("cpu", torch.float32), prepared, positions=positions)
    return [int(token) for token in out.tokens.tolist()]

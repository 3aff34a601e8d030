"""Which vLLM request options the llm-runtime worker honours: the one rule every check reads.

The worker samples with the runtime's sampler or vLLM's own `Sampler` over host logits
(`model_runner`), so it honours the options both express and nothing else. A request that
asks for another one is refused where vLLM validates requests (the platform's
`validate_request`, before the request reaches the engine), with a message that names the
option and lists what is supported; the offline script takes its per-request options from
`SUPPORTED_SAMPLING_OPTIONS`, and docs/vllm.md lists the same names.

Reads vLLM's `SamplingParams` by attribute only and imports no vLLM, so the main suite
tests the rule without vLLM installed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import attrs

SUPPORTED_SAMPLING_OPTIONS: tuple[str, ...] = (
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
"""The sampling options the worker honours (besides vLLM's request shaping: `max_tokens`,
`n`, `stop`, `stop_token_ids`, `ignore_eos`, ...), on the device or with vLLM's sampler."""

_EPS = 1e-5
"""vLLM's neutral-value tolerance (a `min_p` below it is off)."""


class RequestOptions(Protocol):
    """The attributes of vLLM's `SamplingParams` the rule reads (0.32 names)."""

    @property
    def prompt_logprobs(self) -> int | None: ...
    @property
    def min_tokens(self) -> int: ...
    @property
    def min_p(self) -> float: ...
    @property
    def logit_bias(self) -> object: ...
    @property
    def allowed_token_ids(self) -> object: ...
    @property
    def bad_words(self) -> object: ...
    @property
    def structured_outputs(self) -> object: ...
    @property
    def logprob_token_ids(self) -> object: ...
    @property
    def thinking_token_budget(self) -> int | None: ...


@attrs.frozen
class UnsupportedOption:
    """One option of a request the worker would not honour.

    `parameter`: the `SamplingParams` field; `asked_as`: how an API request spells it where
    that differs (structured outputs arrive as `response_format`); `value`: the value shown
    in the message (None for collections: the name alone says it).
    """

    parameter: str
    value: object = None
    asked_as: tuple[str, ...] = ()

    def describe(self) -> str:
        """`min_p=0.1`, `logit_bias`, or `response_format/structured_outputs`."""
        if self.asked_as:
            return "/".join(self.asked_as)
        return self.parameter if self.value is None else f"{self.parameter}={self.value}"


@attrs.frozen
class _Rule:
    parameter: str
    asks: Callable[[RequestOptions], bool]
    shows_value: bool = True
    asked_as: tuple[str, ...] = ()


def _present(value: object) -> bool:
    """A collection option is asked for when given and not empty."""
    if value is None:
        return False
    if isinstance(value, Sequence | dict | set):
        return len(value) > 0
    return True


UNSUPPORTED_RULES: tuple[_Rule, ...] = (
    _Rule("prompt_logprobs", lambda p: p.prompt_logprobs is not None),
    _Rule("min_tokens", lambda p: bool(p.min_tokens)),
    _Rule("min_p", lambda p: float(p.min_p) > _EPS),
    _Rule("logit_bias", lambda p: _present(p.logit_bias), shows_value=False),
    _Rule("allowed_token_ids", lambda p: _present(p.allowed_token_ids), shows_value=False),
    _Rule("bad_words", lambda p: _present(p.bad_words), shows_value=False),
    _Rule(
        "structured_outputs",
        lambda p: p.structured_outputs is not None,
        shows_value=False,
        asked_as=("response_format", "structured_outputs"),
    ),
    _Rule("logprob_token_ids", lambda p: _present(p.logprob_token_ids), shows_value=False),
    _Rule("thinking_token_budget", lambda p: p.thinking_token_budget is not None),
)
"""Options the worker refuses, in the order a message names them."""

UNSUPPORTED_OPTION_NAMES: tuple[str, ...] = tuple(
    "/".join(rule.asked_as) if rule.asked_as else rule.parameter for rule in UNSUPPORTED_RULES
)
"""The refused options as a request names them (`response_format/structured_outputs`)."""


def unsupported_options(params: RequestOptions) -> list[UnsupportedOption]:
    """The options of `params` the worker cannot honour (empty when it can)."""
    found: list[UnsupportedOption] = []
    for rule in UNSUPPORTED_RULES:
        if rule.asks(params):
            value = getattr(params, rule.parameter) if rule.shows_value else None
            found.append(UnsupportedOption(rule.parameter, value, rule.asked_as))
    return found


def refusal_message(found: Sequence[UnsupportedOption]) -> str:
    """Why a request is refused: its options by name, and what the worker supports."""
    if not found:
        raise ValueError("refusal_message needs at least one unsupported option")
    named = ", ".join(option.describe() for option in found)
    return (
        f"the llm-runtime vLLM worker does not support {named}; supported sampling options "
        f"are {', '.join(SUPPORTED_SAMPLING_OPTIONS)} (not supported: "
        f"{', '.join(UNSUPPORTED_OPTION_NAMES)}). Drop the option, or serve with vLLM's own "
        "runner (LLM_RUNTIME_VLLM_PLATFORM=0)"
    )

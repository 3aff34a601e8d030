"""The one rule of which vLLM request options the worker honours (no vLLM needed)."""

from __future__ import annotations

import attrs
import pytest

from models.vllm_plugin.request_options import (
    SUPPORTED_SAMPLING_OPTIONS,
    UNSUPPORTED_OPTION_NAMES,
    UnsupportedOption,
    refusal_message,
    unsupported_options,
)


@attrs.define
class Params:
    """vLLM 0.32 `SamplingParams` defaults for the attributes the rule reads."""

    prompt_logprobs: int | None = None
    min_tokens: int = 0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: object = None
    logprob_token_ids: list[int] | None = None
    thinking_token_budget: int | None = None


def test_defaults_and_neutral_values_are_accepted() -> None:
    assert unsupported_options(Params()) == []
    neutral = Params(min_p=1e-6, logit_bias={}, allowed_token_ids=[], bad_words=[])
    assert unsupported_options(neutral) == []


@pytest.mark.parametrize(
    ("params", "described"),
    [
        (Params(min_p=0.1), "min_p=0.1"),
        (Params(min_tokens=3), "min_tokens=3"),
        (Params(logit_bias={5: 1.0}), "logit_bias"),
        (Params(prompt_logprobs=0), "prompt_logprobs=0"),
        (Params(structured_outputs=object()), "response_format/structured_outputs"),
        (Params(allowed_token_ids=[1]), "allowed_token_ids"),
        (Params(bad_words=["x"]), "bad_words"),
        (Params(logprob_token_ids=[3]), "logprob_token_ids"),
        (Params(thinking_token_budget=8), "thinking_token_budget=8"),
    ],
)
def test_each_unsupported_option_is_named_with_what_is_supported(
    params: Params, described: str
) -> None:
    found = unsupported_options(params)
    assert len(found) == 1
    message = refusal_message(found)
    assert f"does not support {described}" in message
    assert "supported sampling options are " + ", ".join(SUPPORTED_SAMPLING_OPTIONS) in message
    assert "LLM_RUNTIME_VLLM_PLATFORM=0" in message


def test_several_options_are_named_in_one_message() -> None:
    found = unsupported_options(Params(min_p=0.2, min_tokens=1, prompt_logprobs=1))
    assert [option.parameter for option in found] == ["prompt_logprobs", "min_tokens", "min_p"]
    assert "does not support prompt_logprobs=1, min_tokens=1, min_p=0.2;" in refusal_message(found)


def test_structured_outputs_carry_the_api_name_the_client_sent() -> None:
    (option,) = unsupported_options(Params(structured_outputs={"json_object": True}))
    assert option == UnsupportedOption(
        "structured_outputs", None, ("response_format", "structured_outputs")
    )
    assert "response_format/structured_outputs" in UNSUPPORTED_OPTION_NAMES


def test_supported_and_unsupported_never_overlap_and_a_message_needs_an_option() -> None:
    assert not set(SUPPORTED_SAMPLING_OPTIONS) & {
        name for names in UNSUPPORTED_OPTION_NAMES for name in names.split("/")
    }
    with pytest.raises(ValueError, match="at least one unsupported option"):
        refusal_message([])

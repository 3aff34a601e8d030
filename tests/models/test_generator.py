"""Generator on a real tiny-random executor: validation, stop rules, streaming, batch invariance.

The greedy-equals-the-model oracle tests live in tests/integration/test_generation_oracle.py.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import attrs
import pytest

from models import load_executor
from models.generation import (
    ByteTokenizer,
    GenerationParams,
    Generator,
    StreamEvent,
)
from runtime.config import WarmupConfig
from runtime.sampling import SamplingParams
from tests.integration.executor_setup import one_torch_thread as one_torch_thread

EOS = 2


@pytest.fixture(scope="module")
def executor() -> Iterator[Any]:
    """A small lane: 3 slots, 8-token blocks, 32-token prefill chunks, one warmed shape."""
    lane = load_executor(
        "tiny-random",
        block_size=8,
        max_batch_size=3,
        max_prefill_chunk_size=32,
        warmup=WarmupConfig(prefill_seq_lens=(32,), prefill_batch_sizes=(1,)),
    )
    lane.resolve_capacity(48)
    lane.start()
    yield lane
    lane.close()


@pytest.fixture()
def generator(executor: Any) -> Generator:
    return Generator(executor)


def prompts(count: int, seed: int = 0, low: int = 3, high: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randint(low, high))] for _ in range(count)]


def work_done(executor: Any) -> tuple[int, int]:
    summary = executor.runtime_summary()
    return summary["eager_prefill_executions"], summary["eager_decode_executions"]


# -- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (GenerationParams(temperature=-0.5), r"request 1: temperature=-0\.5 is invalid"),
        (GenerationParams(temperature=float("nan")), r"request 1: temperature=nan is invalid"),
        (GenerationParams(temperature=0.7, top_k=0), r"request 1: top_k=0 is invalid.*\[1, 64\]"),
        (GenerationParams(temperature=0.7, top_k=65), r"request 1: top_k=65 is invalid"),
        (GenerationParams(top_p=0.0), r"request 1: top_p=0\.0 is invalid: allowed is .*\(0, 1\]"),
        (GenerationParams(max_new_tokens=0), r"request 1: max_new_tokens=0 is invalid"),
        (GenerationParams(seed=-1), r"request 1: seed=-1 is invalid"),
        (GenerationParams(stop=("",)), r"request 1: stop=\(''(,)?\) is invalid"),
    ],
)
def test_invalid_sampling_names_request_and_field_before_device_work(
    executor: Any, generator: Generator, params: GenerationParams, message: str
) -> None:
    before = work_done(executor)
    with pytest.raises(ValueError, match=message):
        generator.generate([[5, 6, 7], [8, 9]], [GenerationParams(), params])
    assert work_done(executor) == before


def test_bad_prompts_name_the_request_and_leave_the_others_unharmed(
    executor: Any, generator: Generator
) -> None:
    good = prompts(2, seed=3)
    params = GenerationParams(max_new_tokens=6)
    expected = generator.generate(good, params)
    before = work_done(executor)
    cases: list[tuple[Any, str]] = [
        ("", r"request 2: prompt is empty"),
        ([], r"request 2: prompt encodes to no tokens"),
        ([1, 300], r"request 2: prompt token id 300 is invalid: allowed are ids in \[0, 256\)"),
        ([7] * 600, r"request 2: prompt has 600 tokens but the model context is 512 tokens"),
        ([7] * 400, r"request 2: prompt \(400 tokens\) \+ max_new_tokens \(6\) needs 51 KV blocks"),
        (3.5, r"request 2: prompt must be a str or a list of token ids, got float"),
    ]
    for bad, message in cases:
        error_type = TypeError if isinstance(bad, float) else ValueError
        with pytest.raises(error_type, match=message):
            generator.generate([*good, bad], params)
    assert work_done(executor) == before
    assert generator.generate(good, params) == expected


def test_sampling_must_be_one_value_or_one_per_prompt(generator: Generator) -> None:
    with pytest.raises(ValueError, match="sampling has 3 values for 2 prompts"):
        generator.generate([[5], [6]], [GenerationParams()] * 3)
    with pytest.raises(TypeError, match=r"sampling\[1\] must be GenerationParams"):
        generator.generate([[5], [6]], [GenerationParams(), {"temperature": 0}])
    with pytest.raises(ValueError, match="prompts is empty"):
        generator.generate([], None)


def test_chat_needs_a_chat_template(generator: Generator) -> None:
    with pytest.raises(ValueError, match="no chat template"):
        generator.generate(["hello"], chat=True)


# -- results and stop rules ----------------------------------------------------------------------


def test_results_come_back_in_input_order_with_every_field(generator: Generator) -> None:
    batch = [*prompts(4, seed=5), "text prompt"]
    out = generator.generate(batch, GenerationParams(max_new_tokens=5))
    assert [c.index for c in out] == list(range(5))
    assert out[4].prompt == "text prompt"
    assert out[4].prompt_token_ids == tuple(ByteTokenizer().encode("text prompt"))
    assert out[0].prompt == tuple(batch[0]) and out[0].prompt_token_ids == tuple(batch[0])
    for completion in out:
        if completion.finish_reason == "length":
            assert len(completion.token_ids) == 5
        else:
            assert completion.finish_reason == "eos"
            assert completion.token_ids[-1] in generator.executor.eos_token_ids
            assert len(completion.token_ids) < 5
        assert set(completion.to_json()) == {
            "index",
            "prompt",
            "prompt_token_ids",
            "token_ids",
            "text",
            "finish_reason",
        }


def test_max_tokens_and_ignore_eos_give_exact_lengths(generator: Generator) -> None:
    out = generator.generate(
        prompts(4, seed=9), GenerationParams(max_new_tokens=7, ignore_eos=True)
    )
    assert all(len(c.token_ids) == 7 and c.finish_reason == "length" for c in out)


def test_eos_ends_a_completion_with_the_eos_token_and_no_text_for_it(generator: Generator) -> None:
    """Seeds 13 and 24 are tiny-random prompts whose greedy continuation reaches EOS early."""
    batch = [prompts(1, seed=13)[0], prompts(1, seed=24)[0], prompts(1, seed=1)[0]]
    out = generator.generate(batch, GenerationParams(max_new_tokens=12))
    assert [c.finish_reason for c in out[:2]] == ["eos", "eos"]
    for completion in out[:2]:
        assert completion.token_ids[-1] == EOS and EOS not in completion.token_ids[:-1]
        assert completion.text == ByteTokenizer().decode(completion.token_ids[:-1])
    (ignored,) = generator.generate(batch[:1], GenerationParams(max_new_tokens=12, ignore_eos=True))
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 12
    assert ignored.token_ids[: len(out[0].token_ids)] == out[0].token_ids


def test_stop_string_truncates_text_and_tokens(generator: Generator) -> None:
    prompt = "stop strings"
    params = GenerationParams(max_new_tokens=24, ignore_eos=True)
    (full,) = generator.generate([prompt], params)
    ascii_tail = [i for i, t in enumerate(full.token_ids) if 32 <= t < 127 and i >= 3]
    assert ascii_tail, f"no printable token to stop on in {full.token_ids}"
    cut = ascii_tail[0]
    stop = chr(full.token_ids[cut])
    (stopped,) = generator.generate(
        [prompt], GenerationParams(max_new_tokens=24, ignore_eos=True, stop=(stop,))
    )
    assert stopped.finish_reason == "stop"
    assert stop not in stopped.text
    assert full.text.startswith(stopped.text)
    assert stopped.token_ids == full.token_ids[: len(stopped.token_ids)]
    assert len(stopped.token_ids) <= cut + 1


def test_stream_events_add_up_to_the_completions(generator: Generator) -> None:
    batch = prompts(5, seed=11)
    params = GenerationParams(max_new_tokens=9, stop=("zz",))
    stream = generator.stream(batch, params)
    events = list(stream)
    assert all(isinstance(e, StreamEvent) for e in events)
    completions = stream.completions
    assert completions == generator.generate(batch, params)
    for completion in completions:
        mine = [e for e in events if e.index == completion.index]
        assert tuple(e.token_id for e in mine) == completion.token_ids
        assert "".join(e.text_delta for e in mine) == completion.text
    stats = stream.stats
    assert stats.decode_tokens + len(batch) == sum(len(c.token_ids) for c in completions)


def test_a_closed_stream_releases_everything(executor: Any, generator: Generator) -> None:
    batch = prompts(4, seed=13)
    params = GenerationParams(max_new_tokens=8, ignore_eos=True)
    stream = generator.stream(batch, params)
    next(iter(stream))
    with pytest.raises(RuntimeError, match="still running"):
        generator.stream(batch, params)
    stream.close()
    with pytest.raises(RuntimeError, match="did not finish"):
        _ = stream.completions
    assert generator.block_manager.free_blocks == executor.num_blocks
    assert len(generator.generate(batch, params)) == 4


def test_a_stream_stopped_early_keeps_what_unfinished_requests_had(generator: Generator) -> None:
    """After 7 events of 5 requests (3 slots): each request that had produced tokens comes
    back "interrupted" with a prefix of its full completion's tokens and text; finished
    ones and never-started ones are not repeated."""
    batch = prompts(5, seed=17)
    params = GenerationParams(max_new_tokens=8, ignore_eos=True)
    full = generator.generate(batch, params)
    stream = generator.stream(batch, params)
    seen = [event for _, event in zip(range(7), stream, strict=False)]
    stream.close()
    cut = stream.interrupted_completions()
    assert cut and all(c.finish_reason == "interrupted" for c in cut)
    started = {event.index for event in seen}
    assert {c.index for c in cut} <= started
    for completion in cut:
        whole = full[completion.index]
        assert 0 < len(completion.token_ids) < len(whole.token_ids)
        assert completion.token_ids == whole.token_ids[: len(completion.token_ids)]
        assert whole.text.startswith(completion.text)
    assert stream.interrupted_completions() == cut  # asking again changes nothing


# -- determinism and batch invariance ------------------------------------------------------------


def test_greedy_output_does_not_depend_on_the_batch(generator: Generator) -> None:
    target = prompts(1, seed=21, low=20, high=30)[0]
    params = GenerationParams(max_new_tokens=12)
    (alone,) = generator.generate([target], params)
    others = prompts(5, seed=22)
    mixed = generator.generate([others[0], others[1], target, *others[2:]], params)
    assert mixed[2].token_ids == alone.token_ids


def test_seeded_sampling_is_reproducible(generator: Generator) -> None:
    batch = prompts(2, seed=31)
    seeded = GenerationParams(temperature=1.0, top_k=40, top_p=0.95, seed=1234, max_new_tokens=10)
    first = generator.generate(batch, seeded)
    assert generator.generate(batch, seeded) == first
    other = generator.generate(batch, attrs.evolve(seeded, seed=99))
    assert [c.token_ids for c in other] != [c.token_ids for c in first]


def test_scalar_sampling_params_are_accepted(generator: Generator) -> None:
    batch = prompts(2, seed=41)
    ours = generator.generate(batch, GenerationParams(max_new_tokens=64))
    theirs = generator.generate(batch, SamplingParams(temperature=0.0))
    assert ours == theirs
    with pytest.raises(ValueError, match="per-row values"):
        generator.generate(batch, SamplingParams(temperature=[0.0, 0.0]))


def test_generator_needs_a_serving_executor() -> None:
    lane = load_executor("tiny-random", block_size=8, max_batch_size=2, max_prefill_chunk_size=32)
    try:
        with pytest.raises(RuntimeError, match=r"call executor.start\(\)"):
            Generator(lane).generate([[5, 6]])
    finally:
        lane.close()

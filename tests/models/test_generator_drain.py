"""`Generator.drain`: a running generation is finished, or handed back, never lost.

Handed-back requests resubmitted after a sleep/wake continue to exactly the tokens they would
have produced; a generator reused across a wake does not reuse prefix-cache blocks of the KV
cache that was released.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lifecycle import Phase
from models.decoder.executor import DecoderExecutor
from models.generation import GenerationParams, Generator
from tests.integration.executor_setup import one_torch_thread as one_torch_thread
from tests.integration.executor_setup import tiny_executor

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14, 15]]
PARAMS = GenerationParams(max_new_tokens=6)


@pytest.fixture
def executor() -> Iterator[DecoderExecutor]:
    target = tiny_executor(max_batch_size=2, trace_mode="decode_only")
    target.start()
    yield target
    target.close()
    assert target.device.live_allocations == 0


def reference(executor: DecoderExecutor) -> list[tuple[int, ...]]:
    return [c.token_ids for c in Generator(executor).generate(PROMPTS, PARAMS)]


def test_drain_finishes_the_running_stream(executor: DecoderExecutor) -> None:
    want = reference(executor)
    generator = Generator(executor)
    stream = generator.stream(PROMPTS, PARAMS)
    next(stream)
    result = generator.drain()
    assert [c.token_ids for c in result.completions] == want
    assert result.handed_back == ()
    assert executor.phase is Phase.DRAINED
    assert executor.decode_runtime.outstanding_lease_count == 0


def test_handed_back_requests_continue_after_a_wake(executor: DecoderExecutor) -> None:
    want = reference(executor)
    generator = Generator(executor)
    stream = generator.stream(PROMPTS, PARAMS)
    for _ in range(3):
        next(stream)
    result = generator.drain(finish=False)
    assert executor.phase is Phase.DRAINED
    done = {c.index: c.token_ids for c in result.completions}
    handed = {h.index: h for h in result.handed_back}
    assert sorted([*done, *handed]) == [0, 1, 2]  # every request, none lost
    assert handed, "three steps into six tokens each, some request is unfinished"
    executor.sleep(1)
    executor.wake()
    for index, request in handed.items():
        assert request.output_token_ids == want[index][: len(request.output_token_ids)]
        params = GenerationParams(max_new_tokens=request.remaining_tokens)
        rest = generator.generate([list(request.resume_token_ids)], params)[0].token_ids
        assert request.output_token_ids + rest == want[index]
    for index, tokens in done.items():
        assert tokens == want[index]


def test_a_reused_generator_forgets_prefixes_of_the_released_cache(
    executor: DecoderExecutor,
) -> None:
    generator = Generator(executor)
    want = [c.token_ids for c in generator.generate(PROMPTS, PARAMS)]
    generation = executor.kv_generation
    generator.drain()
    executor.sleep(1)
    executor.wake()
    assert executor.kv_generation == generation + 1
    again = generator.generate(PROMPTS, PARAMS)
    assert [c.token_ids for c in again] == want
    assert generator.last_stats.prefix_cache_hit_tokens == 0


def test_a_bad_finish_changes_nothing(executor: DecoderExecutor) -> None:
    generator = Generator(executor)
    stream = generator.stream(PROMPTS, PARAMS)
    next(stream)
    with pytest.raises(TypeError, match="finish must be bool"):
        generator.drain(finish="yes")  # type: ignore[arg-type]
    assert executor.phase is Phase.SERVING and not stream.done
    remaining = list(stream)
    assert remaining or stream.done
    assert len(stream.completions) == len(PROMPTS)

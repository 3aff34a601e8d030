"""Sleep and wake on CUDA: after `sleep(1)` the GPU holds what it held before the model
loaded (`torch.cuda.memory_allocated()`), and the woken executor answers as before.

Run on a GPU machine with `bash benchmarks/gpu_session.sh tests`.
"""

from __future__ import annotations

import gc

import pytest
import torch

from models.decoder.executor import DecoderExecutor, load_executor
from models.generation import GenerationParams, Generator

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU (torch.cuda.is_available() is False)",
    ),
]

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12]]


def greedy(executor: DecoderExecutor) -> list[tuple[int, ...]]:
    params = GenerationParams(max_new_tokens=6)
    return [c.token_ids for c in Generator(executor).generate(PROMPTS, params)]


def allocated() -> int:
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


@pytest.mark.parametrize("mode", ["none", "decode_only"])
def test_sleep_returns_the_gpu_to_its_pre_load_level(mode: str) -> None:
    warm = torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")  # cuBLAS's own
    del warm
    before_load = allocated()
    executor = load_executor(
        "tiny-random",
        device="cuda",
        trace_mode=mode,
        block_size=16,
        max_batch_size=2,
        max_seq_len=64,
        max_prefill_chunk_size=32,
    )
    executor.start()
    want = greedy(executor)
    assert allocated() > before_load
    executor.drain()
    executor.sleep(1)
    assert executor.device.live_allocations == 0
    assert allocated() == before_load, f"{allocated() - before_load} bytes still on the GPU"
    executor.wake()
    assert greedy(executor) == want
    executor.drain()
    executor.sleep(2)
    assert allocated() == before_load
    executor.wake(tags=("weights",))
    executor.reload_weights("tiny-random")
    executor.wake(tags=("kv_cache",))
    assert greedy(executor) == want
    executor.close()

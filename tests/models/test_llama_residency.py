"""The Llama model's resident tensors through sleep and wake: float32 and GGUF block weights
(`--weights stored`), every trace mode's output kept, a reload refused at the first tensor
that differs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models import load_executor
from models.decoder import load_model, random_state_dict
from models.decoder.executor import DecoderExecutor
from models.decoder.fused_decode import FusedDecodeStack
from models.decoder.layers import Projection
from models.generation.generator import GenerationParams, Generator
from models.llama import LlamaArgs
from runtime.weight_reload import WeightMismatchError
from runtime.weight_residency import WeightResidency
from tests.gguf_files import MIXED, write_llama_gguf
from tests.integration.executor_setup import one_torch_thread as one_torch_thread

ARGS = LlamaArgs.tiny_random("q256")
PROMPTS = [[5, 17, 99, 3], [200, 201, 7]]
SMALL = {"max_batch_size": 2, "max_seq_len": 64, "block_size": 16, "max_prefill_chunk_size": 32}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("residency-gguf")


def gguf(folder: Path, qtype: str) -> Path:
    path = folder / f"tiny-{qtype}.gguf"
    if not path.exists():
        write_llama_gguf(path, ARGS, random_state_dict(ARGS, seed=3), qtype=qtype)
    return path


def greedy(executor: DecoderExecutor) -> list[tuple[int, ...]]:
    params = GenerationParams(max_new_tokens=6)
    return [c.token_ids for c in Generator(executor).generate(PROMPTS, params)]


def blocks_of(executor: DecoderExecutor) -> list[torch.Tensor]:
    return [
        block.qs
        for module in executor.loaded.model.modules()
        if isinstance(module, Projection) and module.blocks is not None
        for block in module.blocks
    ]


@pytest.mark.parametrize("mode", ["none", "decode_only"])
def test_block_weights_survive_both_sleep_levels(files: Path, mode: str) -> None:
    path = str(gguf(files, MIXED))
    executor = load_executor(path, trace_mode=mode, **SMALL)
    assert isinstance(executor, DecoderExecutor)
    executor.start()
    want = greedy(executor)
    assert blocks_of(executor), "the mixed file keeps its projections in blocks"
    executor.drain()
    executor.sleep(1)
    assert all(qs.numel() == 0 for qs in blocks_of(executor))
    assert executor.residency is not None and executor.residency.device_bytes() == 0
    executor.wake()
    assert greedy(executor) == want
    executor.drain()
    executor.sleep(2)
    executor.wake(tags=("weights",))
    executor.reload_weights(path)
    executor.wake(tags=("kv_cache",))
    assert greedy(executor) == want
    executor.close()
    assert executor.device.live_allocations == 0


def test_a_reload_in_another_form_is_refused_naming_the_tensor(files: Path) -> None:
    executor = load_executor(str(gguf(files, "Q4_0")), **SMALL)
    assert isinstance(executor, DecoderExecutor)
    executor.start()
    executor.drain()
    before = {k: v.clone() for k, v in executor.loaded.model.resident_weights().items()}
    with pytest.raises(WeightMismatchError, match=r"blocks\.0\.(qs|scales|mins)"):
        executor.reload_weights(str(gguf(files, "Q8_0")))
    with pytest.raises(WeightMismatchError, match=r"is missing from the source"):
        executor.reload_weights(load_model(gguf(files, "Q4_0"), weights="float32"))
    after = executor.loaded.model.resident_weights()
    assert all(torch.equal(before[k], after[k]) for k in before)
    executor.close()


def test_the_fused_stack_over_blocks_reads_the_woken_weights(files: Path) -> None:
    """The mixed stack's parts table holds block addresses: after a level-2 sleep, a wake and
    a reload the weights live elsewhere and the stack must read them there."""
    path = gguf(files, MIXED)
    model = load_model(path, weights="stored", with_tokenizer=False).model
    model.fused_decode = FusedDecodeStack(model, buckets=[1], rows=[1])
    block_size, blocks = 16, 4
    model.configure_paged_attention(block_size=block_size, max_num_blocks=blocks)
    shape = model.kv_cache_shape(blocks)
    model.set_kv_cache([[torch.zeros(shape), torch.zeros(shape)] for _ in model.layers])
    tokens, pos, pages = torch.tensor([7]), torch.tensor([0]), torch.tensor([[0, 1, 2, 3]])

    def step() -> torch.Tensor:
        with torch.inference_mode():
            return model.decode(tokens, positions=pos, page_table=pages)

    want = step()
    residency = WeightResidency(model)
    residency.sleep(2)
    residency.wake()
    source = load_model(path, weights="stored", with_tokenizer=False).model
    residency.reload(model.reload_pairs(source))
    assert torch.equal(step(), want)

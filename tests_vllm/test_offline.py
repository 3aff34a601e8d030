"""`vllm.LLM` through the plugin: greedy tokens equal `llm-runtime generate`'s.

The settings force every path of the worker: a small token budget chunks the long prompts
(chunks that start mid-block), a small KV pool preempts running requests (resumed later as
prefills of prompt plus output), shared prefixes and a second pass hit vLLM's prefix cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests_vllm.conftest import generate_oracle, run_offline

SHARED = "The quick brown fox jumps over the lazy dog while the cat watches. "


def tiny_prompts() -> list[str]:
    long_text = "In a village by the sea there lived an old fisherman and his wife. " * 3
    return [
        SHARED + "Then what?",
        SHARED + "A second question follows here.",
        long_text + "The end",
        "short",
        SHARED + SHARED + "twice over",
        "x",
        long_text[:150] + "?",
        SHARED + "Third.",
        "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
        "hello world",
    ]


def requests_from(oracle: list[dict[str, Any]], max_tokens: int, eos: list[int]) -> list[Any]:
    return [
        {
            "prompt_token_ids": row["prompt_token_ids"],
            "max_tokens": max_tokens,
            "stop_token_ids": eos,
        }
        for row in oracle
    ]


def assert_same_tokens(report: Any, oracle: list[dict[str, Any]]) -> None:
    expected = [row["token_ids"] for row in oracle]
    for run in report["runs"]:
        for index, (got, want) in enumerate(zip(run["outputs"], expected, strict=True)):
            assert got == want, f"prompt {index}: vLLM+llm-runtime {got} != generate {want}"


def test_tiny_random_equals_generate_with_chunks_preemption_and_prefix_hits(
    tmp_path: Path, tiny_folder: Path
) -> None:
    max_tokens = 24
    oracle = generate_oracle("tiny-random", tiny_prompts(), max_tokens)
    assert all(len(row["prompt_token_ids"]) > 0 for row in oracle)
    report = run_offline(
        tmp_path,
        tiny_folder,
        requests_from(oracle, max_tokens, [2]),
        "--block-size", "16",
        "--max-num-seqs", "4",
        "--max-num-batched-tokens", "64",
        "--num-gpu-blocks", "26",
        "--max-model-len", "256",
        "--repeat", "2",
    )  # fmt: skip
    assert_same_tokens(report, oracle)
    stats, metrics = report["runtime_stats"], report["metrics"]
    assert report["num_gpu_blocks"] == 26
    assert stats["partial_prefill_rows"] > 0, stats  # chunked prefill went through the runtime
    assert stats["resumed_requests"] > 0 and metrics["vllm:num_preemptions"] > 0, (stats, metrics)
    assert stats["prefix_hit_requests"] > 0 and metrics["vllm:prefix_cache_hits"] > 0
    assert stats["decode_rows"] > stats["decode_calls"] > 0  # decodes were batched
    # vLLM's async scheduling (the facade declares async decode): every step's output was
    # handed back pending and read after the next step was scheduled.
    assert report["async_scheduling"] is True
    assert stats["async_steps"] >= stats["decode_calls"], stats
    # Greedy requests only: the facade sampled every row on the device.
    assert stats["device_sampled_rows"] > 0 and stats["host_sampling_calls"] == 0, stats
    assert stats["host_sampled_rows"] == stats["host_runtime_sampled_rows"] == 0, stats


def test_block_count_comes_from_the_runtime_with_traced_decode(
    tmp_path: Path, tiny_folder: Path
) -> None:
    oracle = generate_oracle("tiny-random", ["hello world", "abc"], 8)
    report = run_offline(
        tmp_path,
        tiny_folder,
        requests_from(oracle, 8, [2]),
        "--max-num-seqs", "3",
        "--trace-mode", "decode_only",
        "--no-async-scheduling",
    )  # fmt: skip
    assert_same_tokens(report, oracle)
    assert report["async_scheduling"] is False and report["runtime_stats"]["async_steps"] == 0
    # The runtime's capacity: every slot can reach max_model_len (512) in blocks of 32, plus
    # one block per slot (vLLM's null block and each request's partial block).
    assert report["num_gpu_blocks"] == 3 * 512 // 32 + 3
    # The traced decode samples on the device (warmup captured the sampled decode programs).
    stats = report["runtime_stats"]
    assert stats["device_sampled_rows"] > 0 and stats["host_sampled_rows"] == 0, stats


def test_smollm2_equals_generate(tmp_path: Path, smollm2_folder: Path) -> None:
    story = (
        "Once upon a time, in a land far away, there lived a curious young inventor who "
        "spent her days building machines out of scrap metal and old clocks."
    )
    prompts = [
        story + " One morning",
        "Write a short poem about the mountains and the rivers that flow through the valley.",
        story + " Her best friend",
        "Explain why the sky is blue in one simple sentence for a child.",
        "List five fruits that are red or orange in colour, separated by commas:",
        story + " The machines",
        "The history of the printing press begins in the fifteenth century when",
    ]
    max_tokens = 24
    oracle = generate_oracle("smollm2-135m", prompts, max_tokens)
    report = run_offline(
        tmp_path,
        smollm2_folder,
        requests_from(oracle, max_tokens, []),
        "--block-size", "16",
        "--max-num-seqs", "4",
        "--max-num-batched-tokens", "32",
        "--num-gpu-blocks", "7",
        "--max-model-len", "96",
    )  # fmt: skip
    assert_same_tokens(report, oracle)
    stats = report["runtime_stats"]
    assert stats["partial_prefill_rows"] > 0 and stats["resumed_requests"] > 0, stats
    assert stats["prefix_hit_requests"] > 0, stats

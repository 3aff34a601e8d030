"""Sampling through the plugin: on the device where the facade declares it, vLLM's otherwise.

One request list, two engines: device sampling on (the default for the Llama facade) and off
(`device_sampling: false`, every row through vLLM's `Sampler` on host logits). Greedy rows
equal `llm-runtime generate`'s in both; a greedy request with penalties samples the same on
both; a request with logprobs is sampled by vLLM's sampler and gets its logprobs; two equal
seeded requests draw the same tokens; the worker's counters say which sampler took each row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests_vllm.conftest import generate_oracle, run_offline
from tests_vllm.test_offline import requests_from, tiny_prompts

MAX_TOKENS = 16
ENGINE = (
    "--block-size", "16",
    "--max-num-seqs", "4",
    "--max-num-batched-tokens", "64",
    "--max-model-len", "256",
)  # fmt: skip


def sampling_requests(greedy: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The greedy requests, then one of each kind the worker routes differently."""
    seeded = {"temperature": 0.8, "top_k": 20, "seed": 7}
    return [
        *greedy,
        {**greedy[0], "logprobs": 2},  # vLLM's sampler: it returns the logprobs
        {**greedy[1], **seeded},  # the runtime's sampler (device, or host logits)
        {**greedy[1], **seeded},  # the same seeded request: the same draws
        {**greedy[2], "temperature": 0.9, "seed": 3},  # no top_k: wider than the device's 64
        {**greedy[3], "repetition_penalty": 1.5, "frequency_penalty": 0.4},  # greedy, penalised
    ]


def test_device_sampling_equals_the_host_path_and_falls_back_per_request(
    tmp_path: Path, tiny_folder: Path
) -> None:
    oracle = generate_oracle("tiny-random", tiny_prompts()[:6], MAX_TOKENS)
    greedy = requests_from(oracle, MAX_TOKENS, [2])
    requests = sampling_requests(greedy)
    (tmp_path / "on").mkdir()
    (tmp_path / "off").mkdir()
    on = run_offline(tmp_path / "on", tiny_folder, requests, *ENGINE)
    off = run_offline(tmp_path / "off", tiny_folder, requests, *ENGINE, "--device-sampling", "off")
    expected = [row["token_ids"] for row in oracle]
    n = len(greedy)
    for name, report in (("device", on), ("host", off)):
        outputs = report["outputs"]
        assert outputs[:n] == expected, f"{name} sampling: greedy tokens differ from generate"
        logprob_tokens, logprobs = outputs[n], report["runs"][-1]["logprobs"][n]
        assert logprob_tokens == expected[0], f"{name}: the logprobs request is greedy"
        assert logprobs is not None and len(logprobs) == len(logprob_tokens)
        for token, entry in zip(logprob_tokens, logprobs, strict=True):
            assert str(token) in entry and len(entry) >= 2, entry
            assert entry[str(token)] == max(entry.values())  # greedy: the top logprob
        assert all(report["runs"][-1]["logprobs"][i] is None for i in range(n))
        assert all(0 < len(o) <= MAX_TOKENS for o in outputs[n + 1 :])
    assert on["outputs"][n + 1] == on["outputs"][n + 2]  # seeded: same request, same draws
    # Penalties: the runtime's sampler applies vLLM's rules exactly (greedy, so comparable).
    assert on["outputs"][n + 4] == off["outputs"][n + 4]
    assert on["outputs"][n + 4] != expected[3]  # and the penalties changed the output
    stats, host = on["runtime_stats"], off["runtime_stats"]
    assert stats["device_sampled_rows"] > 0, stats
    assert stats["host_sampled_rows"] > 0 and stats["host_sampling_calls"] > 0, stats
    # Device-samplable rows of a call that returned logits: the runtime's sampler on the host.
    assert stats["host_runtime_sampled_rows"] > 0, stats
    total = sum(len(o) for o in on["outputs"])
    counted = (
        stats["device_sampled_rows"]
        + stats["host_sampled_rows"]
        + stats["host_runtime_sampled_rows"]
    )
    assert counted == total, (counted, total, stats)
    assert host["device_sampled_rows"] == host["host_runtime_sampled_rows"] == 0, host
    assert host["host_sampled_rows"] == sum(len(o) for o in off["outputs"]), host

"""Run token prompts through `vllm.LLM` and write the generated token ids as JSON.

`python -m models.vllm_plugin.offline --model DIR --requests IN.json --out OUT.json [...]`

The end-to-end test and `benchmarks/vllm_compare.py` both drive vLLM through this script, in
a fresh process each time (vLLM spawns its engine core, hence the `__main__` guard). With
`--platform vllm` it runs vLLM's own CPU model runner on the same folder, for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NotRequired, Protocol, TypedDict

from models.vllm_plugin.request_options import SUPPORTED_SAMPLING_OPTIONS

if TYPE_CHECKING:
    from vllm import LLM

VLLM_CPU_KV_BYTES = 1 << 30
METRICS = ("vllm:num_preemptions", "vllm:prefix_cache_hits", "vllm:prefix_cache_queries")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a Hugging Face folder")
    parser.add_argument("--requests", required=True, type=Path, help="JSON list of requests")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--platform", choices=("llm-runtime", "vllm"), default="llm-runtime")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--num-gpu-blocks", type=int, default=None, help="num_gpu_blocks_override")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--trace-mode", default=None, help="additional_config llm_runtime")
    parser.add_argument(
        "--device-sampling",
        choices=("auto", "on", "off"),
        default="auto",
        help="additional_config llm_runtime device_sampling (auto: where the facade has it)",
    )
    parser.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="vLLM's --no-async-scheduling (by default on where the facade has async decode)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="run the request list N times")
    parser.add_argument(
        "--sleep-cycle",
        type=int,
        choices=(1, 2),
        default=None,
        help="with --enable-sleep-mode: after the first run, sleep at this level, wake the "
        "weights, reload them (level 2), wake the KV cache, then run the requests again",
    )
    return parser.parse_args(argv)


class OfflineRequest(TypedDict):
    """One request of the `--requests` file; greedy unless it carries sampling options
    (`SUPPORTED_SAMPLING_OPTIONS`, read by name)."""

    prompt_token_ids: list[int]
    max_tokens: int
    ignore_eos: NotRequired[bool]
    stop_token_ids: NotRequired[list[int]]


class RunReport(TypedDict):
    """One pass over the requests: its time and every request's tokens (and logprobs)."""

    seconds: float
    generated_tokens: int
    outputs: list[list[int]]
    logprobs: list[list[dict[str, float]] | None]


class HasLogprob(Protocol):
    """vLLM's `Logprob` as the report reads it."""

    @property
    def logprob(self) -> float: ...


def _metrics(llm: LLM) -> dict[str, float | str]:
    found: dict[str, float | str] = {}
    try:
        for metric in llm.get_metrics():
            if metric.name in METRICS:
                found[metric.name] = float(getattr(metric, "value", 0.0))
    except Exception as error:  # metrics are diagnostics, never a failure of the run
        found["error"] = str(error)
    return found


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.platform == "vllm":
        os.environ["LLM_RUNTIME_VLLM_PLATFORM"] = "0"
    from vllm import LLM

    requests: list[OfflineRequest] = json.loads(args.requests.read_text())
    has_tokenizer = (Path(args.model) / "tokenizer.json").is_file()
    clock = time.perf_counter()
    llm = LLM(**_engine_options(args, has_tokenizer))
    startup = time.perf_counter() - clock
    runs = _timed_runs(llm, requests, has_tokenizer, args.repeat)
    cycle: dict[str, float | bool] | None = None
    if args.sleep_cycle is not None:
        cycle = _sleep_cycle(llm, args.sleep_cycle)
        runs += _timed_runs(llm, requests, has_tokenizer, 1)
    stats: dict[str, float] | None = None
    if args.platform == "llm-runtime":
        stats = llm.collective_rpc("runtime_stats")[0]
    report = {
        "platform": args.platform,
        "startup_seconds": startup,
        "runs": runs,
        "outputs": runs[-1]["outputs"] if runs else [],
        "metrics": _metrics(llm),
        "runtime_stats": stats,
        "num_gpu_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
        "async_scheduling": bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling),
        "sleep_cycle": cycle,
    }
    args.out.write_text(json.dumps(report))
    del llm
    return 0


def _engine_options(args: argparse.Namespace, has_tokenizer: bool) -> dict[str, object]:
    """`vllm.LLM` keywords: greedy-friendly defaults plus the flags that were given."""
    options: dict[str, object] = {
        "model": args.model,
        "dtype": args.dtype,
        "enforce_eager": True,
        "max_num_seqs": args.max_num_seqs,
        "enable_prefix_caching": not args.no_prefix_caching,
        "enable_chunked_prefill": True,
        "skip_tokenizer_init": not has_tokenizer,
        "seed": 0,
        "disable_log_stats": False,
    }
    if args.sleep_cycle is not None:
        options["enable_sleep_mode"] = True
    if args.no_async_scheduling:
        options["async_scheduling"] = False
    for key, value in (
        ("block_size", args.block_size),
        ("max_num_batched_tokens", args.max_num_batched_tokens),
        ("max_model_len", args.max_model_len),
        ("num_gpu_blocks_override", args.num_gpu_blocks),
    ):
        if value is not None:
            options[key] = value
    if args.platform == "vllm":  # vLLM's CPU worker sizes its KV cache from this budget
        options["kv_cache_memory_bytes"] = VLLM_CPU_KV_BYTES
    runtime: dict[str, object] = {}
    if args.trace_mode:
        runtime["trace_mode"] = args.trace_mode
    if args.device_sampling != "auto":
        runtime["device_sampling"] = args.device_sampling == "on"
    if args.platform == "llm-runtime" and runtime:
        options["additional_config"] = {"llm_runtime": runtime}
    return options


def _timed_runs(
    llm: LLM, requests: list[OfflineRequest], has_tokenizer: bool, repeat: int
) -> list[RunReport]:
    """Generate for every request `repeat` times (greedy); seconds and token ids of each run."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in requests]
    params = [
        SamplingParams(
            **{"temperature": 0.0, **_sampling_options(r)},
            max_tokens=int(r["max_tokens"]),
            ignore_eos=bool(r.get("ignore_eos", False)),
            stop_token_ids=list(r.get("stop_token_ids") or []),
            detokenize=has_tokenizer,
        )
        for r in requests
    ]
    runs: list[RunReport] = []
    for _ in range(repeat):
        clock = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - clock
        outputs = [list(r.outputs[0].token_ids) for r in results]
        runs.append(
            {
                "seconds": seconds,
                "generated_tokens": sum(len(o) for o in outputs),
                "outputs": outputs,
                "logprobs": [_logprobs(r.outputs[0].logprobs) for r in results],
            }
        )
    return runs


def _sleep_cycle(llm: LLM, level: int) -> dict[str, float | bool]:
    """vLLM's sleep mode, staged: each step's seconds and whether the engine said it slept."""
    report: dict[str, float | bool] = {"level": level}

    def step(name: str, call: Callable[[], object]) -> None:
        clock = time.perf_counter()
        call()
        report[f"{name}_seconds"] = time.perf_counter() - clock
        report[f"sleeping_after_{name}"] = bool(llm.llm_engine.is_sleeping())

    step("sleep", lambda: llm.sleep(level=level))
    step("wake_weights", lambda: llm.wake_up(tags=["weights"]))
    if level == 2:
        step("reload", lambda: llm.collective_rpc("reload_weights"))
    step("wake_kv_cache", lambda: llm.wake_up(tags=["kv_cache"]))
    return report


def _sampling_options(request: Mapping[str, object]) -> dict[str, object]:
    """The request's sampling options by name (the rest of it is not sampling)."""
    return {k: request[k] for k in SUPPORTED_SAMPLING_OPTIONS if k in request}


def _logprobs(
    per_token: Sequence[Mapping[int, HasLogprob]] | None,
) -> list[dict[str, float]] | None:
    """A request's logprobs as JSON: one `{token id: logprob}` per generated token."""
    if per_token is None:
        return None
    return [{str(token): float(lp.logprob) for token, lp in row.items()} for row in per_token]


if __name__ == "__main__":
    sys.exit(main())

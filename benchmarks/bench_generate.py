"""Generation throughput of this runtime's `Generator` against Hugging Face transformers `generate`.

Run: `llm-runtime bench --model smollm2-135m --batch-sizes 1,8,32 --prompt-len 128
--new-tokens 64 --compare transformers [--json]` (this file is the implementation; it can
also be run directly with the same arguments: `python benchmarks/bench_generate.py ...`).

Method (the same for both engines, in one process, same weights, same thread count):

* prompts are random token ids (fixed seed) of one length, or of lengths drawn uniformly from
  LOW-HIGH (`--prompt-len 32-512`); every row generates exactly `new_tokens` tokens, greedy,
  EOS ignored (ours: `ignore_eos`; transformers: `min_new_tokens = max_new_tokens`);
* two rates per engine. Decode-only: decode time excludes prompt processing and is measured
  inside one run, so load that drifts between runs cannot leak into it: ours sums the wall
  time of every decode step (block reservation, inputs, `decode_forward`, the asynchronous
  read, host work); transformers is timed by a streamer from the first generated token to
  the last (`new_tokens - 1` steps); decode tokens/s = `batch * (new_tokens - 1) / decode
  seconds`. End-to-end (the usual serving metric): `batch * new_tokens / wall seconds` of the
  whole generate call (prompt processing, every step, host work);
* ours runs on an executor whose lane has exactly `batch` slots (what one would deploy for
  that batch), warmed up on the same prompts first; transformers pads on the left with an
  attention mask and is warmed up the same way;
* with `--lanes N` (N > 1) a data-parallel lane group of N lanes x batch/N slots
  (`--lane-transport`, `--threads-per-lane T`, default 1) runs against the anchor, one lane
  of the same total batch with N*T torch threads, in the same run and alternating; the
  group's host overhead per decode step (routing, splitting, joining, transport waits not
  spent in a lane) comes from its own step counters;
* the engines alternate within every repeat (`--repeats`, default 2) and the best rate of each
  (per metric) is reported, so a burst of background load does not decide the ratio.
"""

from __future__ import annotations

import logging
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

if __name__ == "__main__":  # direct runs: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.generation.generator import GenerationParams, Generator

logger = logging.getLogger(__name__)

Log = Callable[[str], None]


class BenchUsageError(ValueError):
    """A benchmark setting that cannot run (the CLI exits 2)."""


@attrs.frozen
class BenchConfig:
    """One benchmark run: which model, which batch sizes, how long the prompts and outputs."""

    model: str = "smollm2-135m"
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    prompt_len: tuple[int, int] = (128, 128)
    new_tokens: int = 64
    compare: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    trace_mode: str = "none"
    block_size: int = 32
    prefill_chunk: int = 256
    seed: int = 0
    repeats: int = 2
    lanes: int = 1
    lane_transport: str = "process"
    threads_per_lane: int | None = None
    kernels: str | None = None

    def check(self) -> None:
        if not self.batch_sizes or any(b <= 0 for b in self.batch_sizes):
            raise BenchUsageError(f"--batch-sizes {self.batch_sizes} is invalid: allowed are >= 1")
        low, high = self.prompt_len
        if not 1 <= low <= high:
            raise BenchUsageError(
                f"--prompt-len {self.prompt_len} is invalid: need 1 <= LOW <= HIGH"
            )
        if self.new_tokens < 2:
            raise BenchUsageError(
                f"--new-tokens {self.new_tokens} is invalid: allowed is >= 2 (decode is "
                "measured from the second generated token)"
            )
        if self.repeats < 1:
            raise BenchUsageError(f"--repeats {self.repeats} is invalid: allowed is >= 1")
        if self.lanes < 1:
            raise BenchUsageError(f"--lanes {self.lanes} is invalid: allowed is >= 1")
        for batch in self.batch_sizes:
            if batch % self.lanes:
                raise BenchUsageError(
                    f"--batch-sizes {batch} does not split over --lanes {self.lanes}: every "
                    "batch size must be a multiple of the lane count"
                )
        if self.compare not in (None, "transformers"):
            raise BenchUsageError(f"--compare {self.compare!r} is invalid: allowed is transformers")


def make_prompts(config: BenchConfig, batch: int, vocab_size: int) -> list[list[int]]:
    """Random token-id prompts; ids from 100 up avoid the special tokens of small vocabularies."""
    rng = random.Random(config.seed * 1000 + batch)
    low, high = config.prompt_len
    first = min(100, vocab_size // 2)
    return [
        [rng.randrange(first, vocab_size) for _ in range(rng.randint(low, high))]
        for _ in range(batch)
    ]


# --------------------------------------------------------------------------------------------
# this runtime
# --------------------------------------------------------------------------------------------


def _runtime_executor(config: BenchConfig, batch: int, *, lanes: int = 1) -> Any:
    from models import load_executor
    from models.llama.sources import ModelNotAvailableError

    longest = config.prompt_len[1] + config.new_tokens
    block = config.block_size
    per_request = -(-longest // block)
    try:
        executor = load_executor(
            config.model,
            device=config.device,
            dtype=config.dtype,
            trace_mode=config.trace_mode,
            block_size=block,
            max_batch_size=batch,
            max_prefill_chunk_size=config.prefill_chunk,
            max_seq_len=per_request * block,
            # Per lane; warmup prefills a whole chunk (plus one block) into one row.
            num_blocks=max(-(-config.prefill_chunk // block) + 1, batch // lanes * per_request),
            kernels=config.kernels,
            **(
                {
                    "lanes": lanes,
                    "lane_transport": config.lane_transport,
                    "threads_per_lane": config.threads_per_lane
                    if config.lane_transport == "process"
                    else None,
                }
                if lanes > 1
                else {}
            ),
        )
    except ModelNotAvailableError as error:
        raise BenchUsageError(str(error)) from error
    except ValueError as error:
        raise BenchUsageError(str(error)) from error
    executor.resolve_capacity()  # num_blocks above: KV blocks per lane
    executor.start()
    return executor


@attrs.frozen
class RunTimes:
    """One timed generation: decode-only seconds and wall seconds of the whole call."""

    decode_seconds: float
    total_seconds: float


def _runtime_run(generator: Generator, prompts: list[list[int]], new_tokens: int) -> RunTimes:
    """One timed generation: decode seconds (the Generator's step counter) and wall seconds."""
    params = GenerationParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    completions = generator.generate(prompts, params)
    total = time.perf_counter() - start
    produced = {len(c.token_ids) for c in completions}
    if produced != {new_tokens}:
        raise RuntimeError(f"expected {new_tokens} tokens per row, got lengths {produced}")
    stats = generator.last_stats
    if stats.decode_steps != new_tokens - 1 or stats.preemptions:
        raise RuntimeError(
            f"expected {new_tokens - 1} decode steps without preemption, got "
            f"{stats.decode_steps} steps and {stats.preemptions} preemptions"
        )
    return RunTimes(decode_seconds=stats.decode_seconds, total_seconds=total)


# --------------------------------------------------------------------------------------------
# transformers
# --------------------------------------------------------------------------------------------


def load_transformers(model: str, dtype: str) -> Any:
    """transformers' model with the weights our loader reads for `model`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    from models.llama.sources import load_model, resolve_source

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    source = resolve_source(model)
    if source.kind == "gguf":
        from transformers import AutoModelForCausalLM

        assert source.path is not None
        hf: Any = AutoModelForCausalLM.from_pretrained(
            str(source.path.parent), gguf_file=source.path.name, dtype=torch_dtype
        )
    elif source.kind == "hf_dir":
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(source.path), dtype=torch_dtype)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        loaded = load_model(model, dtype=torch_dtype, with_tokenizer=False)
        hf = LlamaForCausalLM(LlamaConfig(**loaded.args.to_hf_config()))
        hf = hf.to(dtype=torch_dtype)
        result = hf.load_state_dict(loaded.model.canonical_state_dict(), strict=False)
        if result.unexpected_keys or not set(result.missing_keys) <= {"lm_head.weight"}:
            raise RuntimeError(f"state dict mismatch: {result}")
        if loaded.args.tie_word_embeddings:
            hf.tie_weights()
    return hf.eval()


class _StepClock:
    """A transformers streamer that only records when each step's tokens arrive."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value: Any) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def _hf_run(hf: Any, prompts: list[list[int]], new_tokens: int, *, pad: int) -> RunTimes:
    """One timed `generate`: seconds from the first generated token to the last, and wall
    seconds from building the padded inputs to the returned ids."""
    start = time.perf_counter()
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt) :] = torch.tensor(prompt)
        mask[row, longest - len(prompt) :] = 1
    clock = _StepClock()
    with torch.inference_mode():
        out = hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad,
            streamer=clock,
        )
    total = time.perf_counter() - start
    if out.shape[1] != longest + new_tokens:
        raise RuntimeError(f"transformers generated {out.shape[1] - longest} tokens per row")
    # put() #0 is the prompt, #1 the token from prefill, #new_tokens the last decode step.
    if len(clock.stamps) != new_tokens + 1:
        raise RuntimeError(f"expected {new_tokens + 1} streamer calls, got {len(clock.stamps)}")
    return RunTimes(decode_seconds=clock.stamps[-1] - clock.stamps[1], total_seconds=total)


def bench_batch(config: BenchConfig, batch: int, hf: Any, log: Log) -> dict[str, Any]:
    """One batch size: our lane of `batch` slots and (optionally) transformers, alternating."""
    if config.lanes > 1:
        return bench_lanes(config, batch, log)
    log(f"batch {batch}: loading the model and warming up a lane of {batch} slot(s)")
    clock = time.perf_counter()
    executor = _runtime_executor(config, batch)
    try:
        prompts = make_prompts(config, batch, int(executor.model.vocab_size))
        lengths = [len(p) for p in prompts]
        generator = Generator(executor, enable_prefix_cache=False)
        _runtime_run(generator, prompts, 2)  # compiles every shape this batch uses
        log(f"batch {batch}: ready in {time.perf_counter() - clock:.1f} s")
        # One warm 2-token run per engine times a prefill and a decode step: the estimate.
        estimate = _estimate_run(_runtime_run(generator, prompts, 2), config.new_tokens)
        if hf is not None:
            _hf_run(hf, prompts, 2, pad=0)
            estimate += _estimate_run(_hf_run(hf, prompts, 2, pad=0), config.new_tokens)
        log(
            f"batch {batch}: measuring {config.repeats} repeat(s) of {config.new_tokens} "
            f"tokens x {batch} row(s){' per engine' if hf is not None else ''} "
            f"(estimated {config.repeats * estimate:.1f} s)"
        )
        ours: list[RunTimes] = []
        theirs: list[RunTimes] = []
        for repeat in range(config.repeats):
            log(f"batch {batch}: repeat {repeat + 1}/{config.repeats}")
            ours.append(_runtime_run(generator, prompts, config.new_tokens))
            if hf is not None:
                theirs.append(_hf_run(hf, prompts, config.new_tokens, pad=0))
        row: dict[str, Any] = {
            "batch_size": batch,
            "prompt_len_min": min(lengths),
            "prompt_len_max": max(lengths),
            "prompt_len_mean": sum(lengths) / len(lengths),
            "new_tokens": config.new_tokens,
            "runtime": {
                **_rates(ours, batch, config.new_tokens),
                "prefill_seconds": generator.last_stats.prefill_seconds,
                "kernels": executor.warmup.kernel_choice,
            },
        }
        if hf is not None:
            row["transformers"] = _rates(theirs, batch, config.new_tokens)
            mine, other = row["runtime"], row["transformers"]
            # `ratio` is the decode-only ratio (the original metric, kept under its name).
            row["ratio"] = mine["decode_tokens_per_second"] / other["decode_tokens_per_second"]
            row["end_to_end_ratio"] = (
                mine["end_to_end_tokens_per_second"] / other["end_to_end_tokens_per_second"]
            )
        return row
    finally:
        executor.close()


def bench_lanes(config: BenchConfig, batch: int, log: Log) -> dict[str, Any]:
    """One batch size: N lanes of batch/N slots against one lane of `batch` slots."""
    threads = config.lanes * (config.threads_per_lane or 1)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)  # the anchor lane gets every thread the lanes get together
    anchor = _runtime_executor(config, batch)
    group: Any = None
    try:
        group = _runtime_executor(config, batch, lanes=config.lanes)
        prompts = make_prompts(config, batch, int(anchor.model.vocab_size))
        lengths = [len(p) for p in prompts]
        one = Generator(anchor, enable_prefix_cache=False)
        many = Generator(group, enable_prefix_cache=False)
        _runtime_run(one, prompts, 2)
        _runtime_run(many, prompts, 2)
        ours: list[RunTimes] = []
        lanes: list[RunTimes] = []
        overhead: list[dict[str, Any]] = []
        for repeat in range(config.repeats):
            log(f"batch {batch}: repeat {repeat + 1}/{config.repeats}")
            ours.append(_runtime_run(one, prompts, config.new_tokens))
            group.reset_step_counters()
            lanes.append(_runtime_run(many, prompts, config.new_tokens))
            overhead.append(group.runtime_summary())
        mine = {**_rates(ours, batch, config.new_tokens), "torch_threads": threads}
        theirs = {
            **_rates(lanes, batch, config.new_tokens),
            "lanes": config.lanes,
            "lane_transport": config.lane_transport,
            "threads_per_lane": config.threads_per_lane or 1,
            "per_decode_step": overhead,
        }
        return {
            "batch_size": batch,
            "prompt_len_min": min(lengths),
            "prompt_len_max": max(lengths),
            "prompt_len_mean": sum(lengths) / len(lengths),
            "new_tokens": config.new_tokens,
            "runtime": mine,
            "lane_group": theirs,
            "lanes_ratio": theirs["decode_tokens_per_second"] / mine["decode_tokens_per_second"],
            "lanes_end_to_end_ratio": theirs["end_to_end_tokens_per_second"]
            / mine["end_to_end_tokens_per_second"],
        }
    finally:
        if group is not None:
            group.close()
        anchor.close()
        torch.set_num_threads(previous)


def _estimate_run(two_tokens: RunTimes, new_tokens: int) -> float:
    """Seconds one run of `new_tokens` should take, from a timed 2-token run."""
    step = two_tokens.decode_seconds
    return max(0.0, two_tokens.total_seconds - step) + step * (new_tokens - 1)


def _rates(runs: list[RunTimes], batch: int, new_tokens: int) -> dict[str, Any]:
    """Per-run seconds and the best decode-only and end-to-end rates (tokens/s) of one engine."""
    decode = [run.decode_seconds for run in runs]
    total = [run.total_seconds for run in runs]
    return {
        "decode_seconds": decode,
        "decode_tokens_per_second": batch * (new_tokens - 1) / min(decode),
        "total_seconds": total,
        "end_to_end_tokens_per_second": batch * new_tokens / min(total),
    }


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


def run_benchmark(config: BenchConfig, *, log: Log | None = None) -> dict[str, Any]:
    """Measure every batch size; returns a JSON-ready report."""
    config.check()
    say = log or (lambda message: logger.info("%s", message))
    from models.llama.sources import ModelNotAvailableError, resolve_source

    try:
        resolve_source(config.model)
    except ModelNotAvailableError as error:
        raise BenchUsageError(str(error)) from error
    except ValueError as error:
        raise BenchUsageError(f"--model {config.model}: {error}") from error
    say(
        f"bench: {len(config.batch_sizes)} batch size(s) {list(config.batch_sizes)}, "
        f"{config.repeats} repeat(s) each; every phase is announced with its estimated length"
    )
    hf = None
    if config.compare:
        say("loading transformers' model (--compare transformers)")
        hf = load_transformers(config.model, config.dtype)
    results: list[dict[str, Any]] = []
    for batch in config.batch_sizes:
        row = bench_batch(config, batch, hf, say)
        results.append(row)
        say(format_row(row))
    return {
        "model": config.model,
        "device": config.device,
        "dtype": config.dtype,
        "trace_mode": config.trace_mode,
        "torch_threads": torch.get_num_threads(),
        "method": (
            "decode tokens/s = batch*(new_tokens-1) / decode seconds (ours: step counter; "
            "transformers: streamer, first to last generated token); end-to-end tokens/s = "
            "batch*new_tokens / wall seconds of the whole generate call (prompt processing "
            f"included); best of {config.repeats} alternating repeats per metric; greedy, EOS "
            "ignored, prefix cache off"
        ),
        "results": results,
    }


def format_row(row: dict[str, Any]) -> str:
    """One batch size: decode-only and end-to-end tokens/s of each engine, with the ratios."""
    ours = row["runtime"]
    text = f"batch {row['batch_size']:>3}  prompts {row['prompt_len_min']}-{row['prompt_len_max']}"
    for label, key, ratio in (
        ("decode-only", "decode_tokens_per_second", "ratio"),
        ("end-to-end", "end_to_end_tokens_per_second", "end_to_end_ratio"),
    ):
        text += f"\n  {label:<11}  runtime {ours[key]:8.1f} tok/s"
        if "transformers" in row:
            theirs = row["transformers"][key]
            text += f"  transformers {theirs:8.1f} tok/s  ratio {row[ratio]:.2f}x"
        if "lane_group" in row:
            group = row["lane_group"]
            lanes_ratio = row["lanes_ratio" if ratio == "ratio" else "lanes_end_to_end_ratio"]
            text += (
                f" ({ours['torch_threads']} threads)  {group['lanes']} {group['lane_transport']} "
                f"lanes {group[key]:8.1f} tok/s  ratio {lanes_ratio:.2f}x"
            )
    if "lane_group" in row:
        for step in row["lane_group"]["per_decode_step"]:
            text += (
                f"\n  per decode step: group bookkeeping {step['host_overhead_us_per_step']:.0f} us"
                f", transport {step['transport_us_per_step']:.0f} us, slowest lane "
                f"{step['slowest_lane_us_per_step']:.0f} us"
            )
    return text


def format_report(report: dict[str, Any]) -> str:
    """Plain text: decode-only and end-to-end tokens/s per batch size."""
    lines = [
        f"{report['model']} {report['dtype']} on {report['device']} "
        f"({report['torch_threads']} torch threads); {report['method']}",
    ]
    lines.extend(format_row(row) for row in report["results"])
    return "\n".join(lines)


if __name__ == "__main__":
    from models.cli import main

    sys.exit(main(["bench", *sys.argv[1:]]))

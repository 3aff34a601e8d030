"""Host-side cost of the runtime, excluding the model body.

1. Planning 1,000 mixed prefill rows (`plan_prefill_requests`): target under 5 ms. Planning
   defers request tensors to first read, so the same plan followed by the host inputs the
   prefill runtime stages for every chunk (`host_inputs`) is measured too: no target, it is
   the honest total of what planning used to build eagerly.
2. One decode step's host work at lane capacity 32 (`DecodeRuntime.prepare` + staging +
   consume), with a model whose `decode` returns a preallocated logits tensor, so the model
   body costs nothing: target under 200 us.
3. With `--batch`: one whole public decode step (`decode_forward`, logits path, every row
   active) at each batch size, through a single lane (`tiny-random`, eager `--trace none` and
   traced `decode_only`) and an in-process lane group of 2 lanes (batch >= 2), each lane's
   `model.decode` replaced by a preallocated logits tensor so only host work is timed. This is
   the decode host overhead per step a serving loop pays.

Run: `.venv/bin/python benchmarks/host_overhead.py [--batch 1 32] [--repeat N] [--skip-plan]`.
Prints medians of repeated runs. To compare two commits, run this file with `PYTHONPATH` set
to each checkout in turn (it only uses public calls), alternating, in the same minutes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from runtime.backends.torch_device import TorchDevice
from runtime.config import PagedKVCacheConfig, PageTableLayout, RuntimePolicy
from runtime.decode import DecodeRuntime, DecodeRuntimeConfig
from runtime.model_contract import AttentionMetadata, PagedAttentionConfig
from runtime.output_reader import OutputReader
from runtime.paged_kv_cache import PagedKVCacheManager
from runtime.prefill.inputs import host_inputs
from runtime.prefill.plan import plan_prefill_requests
from runtime.prefill.request import PrefillRequest

LANE = 32
BLOCK = 32
VOCAB = 49152


def median_seconds(fn: Callable[[], object], repeat: int) -> float:
    """Median wall time of `fn` over `repeat` runs (after one warm-up run)."""
    fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def planning_case() -> Callable[[], tuple[PrefillRequest, ...]]:
    """1,000 rows of mixed lengths (some cached, some long enough to chunk), 32-slot lanes."""
    generator = torch.Generator().manual_seed(0)
    rows = 1000
    lengths = torch.randint(1, 3000, (rows,), generator=generator)
    cached = (torch.randint(0, 3, (rows,), generator=generator) * BLOCK).minimum(lengths - 1)
    cached = cached // BLOCK * BLOCK
    cached = torch.where(torch.rand(rows, generator=generator) < 0.2, cached, 0)
    width = -(-int(lengths.max()) // BLOCK)
    tokens = torch.zeros(rows, int(lengths.max()), dtype=torch.long)
    page_table = torch.arange(rows * width, dtype=torch.int32).reshape(rows, width)
    policy = RuntimePolicy.ttnn()

    def run() -> tuple[PrefillRequest, ...]:
        return plan_prefill_requests(
            tokens=tokens,
            page_table=page_table,
            prompt_lens=lengths,
            start_pos=cached,
            block_size=BLOCK,
            max_batch_size=rows,
            max_prefill_chunk_size=2048,
            supports_batched_prefill=True,
            max_prefill_batch_size=32,
            policy=RuntimePolicy(
                prefill_padding_buckets=policy.prefill_padding_buckets,
                chunk_size_multiple=policy.chunk_size_multiple,
                decode_lane_capacity_limit=rows,
            ),
        )

    return run


def staging_case(plan: Callable[[], tuple[PrefillRequest, ...]]) -> Callable[[], object]:
    """`plan`, then every chunk's host inputs as `PrefillSequenceRunner` stages them."""

    def run() -> object:
        staged = 0
        for request in plan():
            for chunk in request.chunks:
                staged += host_inputs(request, chunk).tokens.numel()
        return staged

    return run


class NullModel:
    """A model whose decode returns preallocated logits: only host work is measured."""

    n_layers = 1
    vocab_size = VOCAB
    max_seq_len = 4096
    sampling = None

    def __init__(self) -> None:
        self.logits = torch.zeros(LANE, VOCAB)
        self.cache: Any = None

    def attention_metadata(self) -> list[AttentionMetadata]:
        return [AttentionMetadata(torch.float32, 1, 8, PagedAttentionConfig(BLOCK, 256))]

    def configure_paged_attention(self, *, block_size: int, max_num_blocks: int) -> None:
        return None

    def set_kv_cache(self, cache: Any) -> None:
        self.cache = cache

    def iter_executor_named_modules(self) -> Any:
        return iter(())

    def decode(self, tokens: Any, *, positions: Any, page_table: Any) -> torch.Tensor:
        return self.logits


def decode_case() -> tuple[Callable[[], object], Callable[[], None]]:
    """prepare + invoke (staging and a free model body) + blocking consume at lane 32."""
    device = TorchDevice("cpu")
    model = NullModel()
    manager = PagedKVCacheManager(
        model,
        PagedKVCacheConfig(
            block_size=BLOCK, max_num_blocks=256, dtype=torch.float32, num_blocks=256
        ),
        device=device,
    )
    manager.allocate()
    layout = PageTableLayout.resolve(
        block_size=BLOCK,
        model_max_sequence_length=4096,
        physical_num_blocks=256,
        max_prefill_chunk_size=2048,
    )
    reader = OutputReader(device)
    runtime = DecodeRuntime(
        DecodeRuntimeConfig.resolve(
            model=model,
            device=device,
            output_reader=reader,
            lane_capacity=LANE,
            page_table_layout=layout,
            device_sampling_enabled=False,
            policy=RuntimePolicy.torch_default(),
        )
    )
    tokens = torch.arange(LANE, dtype=torch.long)
    positions = torch.arange(100, 100 + LANE, dtype=torch.long)
    table = torch.arange(LANE * 8, dtype=torch.int32).reshape(LANE, 8)

    def step() -> object:
        prepared = runtime.prepare(tokens, positions, table)
        result = runtime.invoke(prepared)
        return runtime.consume(result)

    return step, manager.release


def _null_decode(model: Any, rows: int) -> None:
    """Replace `model.decode` by one that returns preallocated logits (no model body)."""
    logits = torch.zeros(rows, int(model.vocab_size))

    def decode(tokens: torch.Tensor, *, positions: torch.Tensor, page_table: torch.Tensor) -> Any:
        return logits

    model.decode = decode


def _step_inputs(batch: int, vocab: int) -> dict[str, torch.Tensor]:
    """Every row active at position 100 + row, 5 distinct blocks per row."""
    width = 5
    return {
        "tokens": torch.arange(batch, dtype=torch.long) % vocab,
        "start_pos": torch.arange(100, 100 + batch, dtype=torch.long),
        "page_table": torch.arange(batch * width, dtype=torch.int32).reshape(batch, width),
    }


def executor_case(batch: int, trace_mode: str, lanes: int) -> tuple[Callable[[], object], Any]:
    """One `decode_forward` of a started executor (one lane, or an in-process lane group)."""
    if lanes == 1:
        from models.decoder.executor import load_executor

        executor: Any = load_executor("tiny-random", max_batch_size=batch, trace_mode=trace_mode)
        executor.start()
        models = [executor.model]
    else:
        from models.lane_loading import load_lane_group

        executor = load_lane_group(
            "tiny-random",
            lanes=lanes,
            lane_transport="inprocess",
            max_batch_size=batch,
            trace_mode=trace_mode,
        )
        executor.start()
        models = [lane.executor.model for lane in executor.lanes]
    for model in models:
        _null_decode(model, batch // lanes)
    inputs = _step_inputs(batch, int(models[0].vocab_size))

    def step() -> object:
        return executor.decode_forward(**inputs)

    return step, executor


def executor_rows(batches: list[int], repeat: int) -> list[tuple[str, float]]:
    """Median microseconds per `decode_forward` for each batch, single lane and group."""
    rows: list[tuple[str, float]] = []
    for batch in batches:
        cases = [(f"lane, trace {mode}", mode, 1) for mode in ("none", "decode_only")]
        if batch >= 2 and batch % 2 == 0:
            cases += [(f"group 2 lanes, trace {mode}", mode, 2) for mode in ("none", "decode_only")]
        for name, mode, lanes in cases:
            step, executor = executor_case(batch, mode, lanes)
            for _ in range(20):
                step()
            seconds = median_seconds(step, repeat=repeat)
            executor.close()
            rows.append((f"decode_forward batch {batch:>3}, {name}", seconds * 1e6))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--batch",
        type=int,
        nargs="*",
        default=[],
        help="batch sizes of the whole-step decode_forward rows (e.g. 1 32); none: skip them",
    )
    parser.add_argument("--repeat", type=int, default=300, help="timed steps per row (300)")
    parser.add_argument(
        "--skip-plan", action="store_true", help="skip the planning and lane-32 runtime rows"
    )
    options = parser.parse_args()
    print("host-side overhead (median, this machine, torch threads:", torch.get_num_threads(), ")")
    if not options.skip_plan:
        plan = planning_case()
        plan_s = median_seconds(plan, repeat=7)
        stage_s = median_seconds(staging_case(plan), repeat=7)
        step, close = decode_case()
        step_s = median_seconds(step, repeat=200)
        close()
        print(f"  plan 1,000 mixed prefill rows        {plan_s * 1e3:9.2f} ms   (target < 5 ms)")
        print(f"  ... plus every chunk's host inputs   {stage_s * 1e3:9.2f} ms   (no target)")
        print(f"  decode host step at lane 32          {step_s * 1e6:9.1f} us   (target < 200 us)")
    for name, micros in executor_rows(options.batch, options.repeat):
        print(f"  {name:<52} {micros:9.1f} us")


if __name__ == "__main__":
    main()

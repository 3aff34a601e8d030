"""Traced vs eager SmolLM2 decode: correctness, step latency, warmup and capture time.

Run: `python benchmarks/cuda_traces.py --device cuda --out results.json` (under five minutes on
one H200) or `--device cpu` (use `--quick` for small settings). On CUDA a trace is a real CUDA
graph and eager CUDA runs the same graph-safe model code; on CPU a trace re-runs the captured
function, so the CPU numbers measure the trace semantics' replay overhead, not a speed-up.

Method:

* (a) correctness, at one batch (`--check-batch`, one inactive slot): the same prompts are
  prefilled and decoded greedily for `--check-steps` steps (logits path, next token = argmax)
  by executors with `trace_mode="none"`, `"decode_only"` and `"all"`; every step's logits and
  tokens must equal the eager ones (bit-identical is expected: traced and eager run the same
  code on the same device; the max abs difference is reported either way);
* (b) latency, for each batch size B: an eager (`trace_mode="none"`) and a traced
  (`"decode_only"`) executor from `load_executor("smollm2-135m", max_batch_size=B, ...)`, both
  started, both prefilled with the same `B` random prompts of `--prompt-len` tokens. Then
  `decode_forward` steps (device greedy sampling, tokens read back, so every step ends
  synchronised; the device is also synchronised around each timed call) are timed in
  interleaved rounds, so background load hits every variant alike: eager with the model's
  default path (CPU: dynamic, CUDA: graph-safe), trace replay, and eager with the other path
  (`model.graph_safe` flipped for that step). `--warmup-steps` untimed rounds first; median and
  min of `--steps` rounds;
* (c) setup time from the executor journal: `compile` (warmup: every configured program run
  once, ALLOCATED -> COMPILED) and `capture` (COMPILED -> CAPTURED), plus weight loading and
  the whole `start()`.

Prints a table and writes everything (settings, environment, per-step samples) as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from models.decoder.executor import DecoderExecutor, load_executor
from runtime.config import SUPPORTED_PREFILL_BATCH_SIZES, WarmupConfig
from runtime.sampling import SamplingParams

MODEL = "smollm2-135m"
BLOCK_SIZE = 32


def _parse_sizes(text: str) -> tuple[int, ...]:
    sizes = tuple(int(part) for part in text.split(",") if part.strip())
    if not sizes or min(sizes) <= 0:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive integers, got {text!r}")
    return sizes


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument(
        "--model", default=MODEL, help=f"model name or path (default {MODEL}; any Llama-family)"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--batch-sizes", type=_parse_sizes, default=(1, 8, 32))
    parser.add_argument("--prompt-len", type=int, default=None, help="default 128 (cpu: 32)")
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=None, help="timed steps (cuda 50, cpu 8)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="(cuda 10, cpu 2)")
    parser.add_argument("--check-batch", type=int, default=8)
    parser.add_argument("--check-steps", type=int, default=4)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--quick", action="store_true", help="small settings (batch 1,4)")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if args.quick:
        args.batch_sizes = (1, 4)
        args.check_batch = 4
        args.check_steps = 3
    if args.prompt_len is None:
        args.prompt_len = 128 if cuda else 32
    if args.steps is None:
        args.steps = 50 if cuda else (4 if args.quick else 8)
    if args.warmup_steps is None:
        args.warmup_steps = 10 if cuda else 2
    total = args.prompt_len + args.check_steps + 2 * (args.warmup_steps + args.steps) + 1
    if total > args.max_seq_len:
        parser.error(f"prompt + steps need {total} positions; raise --max-seq-len")
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU (torch.cuda.is_available() is False)")
    return args


# ---------------------------------------------------------------------------------- helpers
def log(message: str) -> None:
    """Progress on stderr (the table and JSON are the results)."""
    print(f"[cuda_traces] {message}", file=sys.stderr, flush=True)


def build(
    args: argparse.Namespace, batch: int, trace_mode: str
) -> tuple[DecoderExecutor, dict[str, float]]:
    """A started executor for a lane of `batch` slots, and its setup timings (seconds)."""
    clock = time.perf_counter()
    executor = load_executor(
        args.model,
        device=args.device,
        dtype=args.dtype,
        trace_mode=trace_mode,
        block_size=BLOCK_SIZE,
        max_batch_size=batch,
        max_prefill_chunk_size=max(BLOCK_SIZE, -(-args.prompt_len // BLOCK_SIZE) * BLOCK_SIZE),
        max_seq_len=args.max_seq_len,
        warmup=WarmupConfig(
            prefill_seq_lens=(args.prompt_len,),
            # Waves may be split (the runtime caps the prefill batch): cover every smaller size.
            prefill_batch_sizes=tuple(s for s in SUPPORTED_PREFILL_BATCH_SIZES if s <= batch),
        ),
    )
    loaded = time.perf_counter() - clock
    clock = time.perf_counter()
    executor.start()
    started = time.perf_counter() - clock
    durations = executor.journal.durations_by_dest(executor.owner_name)
    return executor, {
        "load_s": loaded,
        "start_s": started,
        "warmup_compile_s": durations.get("COMPILED", 0.0),
        "capture_s": durations.get("CAPTURED", 0.0),
    }


def page_table(executor: DecoderExecutor, batch: int, width: int) -> torch.Tensor:
    """Row r owns the contiguous run of blocks that reaches max_seq_len."""
    per_row = executor.page_table_layout.raw_capacity_width
    table = torch.full((batch, width), -1, dtype=torch.int32)
    cols = min(per_row, width)
    for row in range(batch):
        table[row, :cols] = torch.arange(row * per_row, row * per_row + cols, dtype=torch.int32)
    return table


def prompts(batch: int, length: int, vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(3, vocab, (batch, length), generator=generator)


def prefill(executor: DecoderExecutor, batch: int, length: int) -> torch.Tensor:
    """Prefill every slot; returns the greedy next token of each row."""
    layout = executor.page_table_layout
    logits = executor.prefill_forward(
        tokens=prompts(batch, length, executor.model.vocab_size),
        page_table=page_table(executor, batch, layout.prefill_width),
        prompt_lens=torch.full((batch,), length),
        empty_slots=list(range(batch)),
    )
    return torch.as_tensor(logits).reshape(batch, -1).argmax(-1)


def synchronize(executor: DecoderExecutor) -> None:
    executor.device.synchronize()


def timed(step: Callable[[], None], executor: DecoderExecutor) -> float:
    """Seconds of one synchronised call."""
    synchronize(executor)
    clock = time.perf_counter()
    step()
    synchronize(executor)
    return time.perf_counter() - clock


class GreedyLane:
    """Decode state of one lane: next tokens and positions, advanced by every step."""

    def __init__(
        self, executor: DecoderExecutor, batch: int, first: torch.Tensor, start: int
    ) -> None:
        self.executor = executor
        self.tokens = first.clone()
        self.positions = torch.full((batch,), start)
        self.table = page_table(executor, batch, executor.page_table_layout.decode_width)
        self.sampling = SamplingParams(temperature=(0.0,) * batch)

    def sampled_step(self) -> None:
        out = self.executor.decode_forward(
            tokens=self.tokens,
            start_pos=self.positions,
            page_table=self.table,
            sampling_params=self.sampling,
        )
        tokens = out[0] if isinstance(out, tuple) else out
        self.tokens = torch.as_tensor(tokens).reshape(-1).clone()
        self.positions = self.positions + (self.positions >= 0).long()

    def logits_step(self) -> torch.Tensor:
        out = self.executor.decode_forward(
            tokens=self.tokens, start_pos=self.positions, page_table=self.table
        )
        logits = torch.as_tensor(out).reshape(self.tokens.shape[0], -1).clone()
        self.tokens = logits.argmax(-1)
        self.positions = self.positions + (self.positions >= 0).long()
        return logits


def _summary(samples: list[float]) -> dict[str, Any]:
    return {
        "median_ms": statistics.median(samples) * 1e3,
        "min_ms": min(samples) * 1e3,
        "samples_ms": [s * 1e3 for s in samples],
    }


# ---------------------------------------------------------------------------- measurements
def check_correctness(args: argparse.Namespace) -> dict[str, Any]:
    """(a) traced == eager for greedy decode logits and tokens over several steps."""
    batch = args.check_batch
    inactive = 3 % batch if batch > 1 else None
    runs: dict[str, dict[str, Any]] = {}
    for mode in ("none", "decode_only", "all"):
        log(f"correctness: batch {batch}, trace_mode={mode}")
        executor, _ = build(args, batch, mode)
        try:
            first = prefill(executor, batch, args.prompt_len)
            lane = GreedyLane(executor, batch, first, args.prompt_len)
            if inactive is not None:
                lane.positions[inactive] = -1
            steps = [lane.logits_step() for _ in range(args.check_steps)]
            runs[mode] = {
                "first": first,
                "logits": steps,
                "replays": executor.trace_compiler.replay_counts
                if executor.trace_compiler is not None
                else {},
                "graph_safe": executor.model.uses_graph_safe_path(),
            }
        finally:
            executor.close()
    eager = runs["none"]
    result: dict[str, Any] = {"batch": batch, "steps": args.check_steps, "inactive_slot": inactive}
    for mode in ("decode_only", "all"):
        run = runs[mode]
        diffs = [
            float((a - b).abs().max()) for a, b in zip(run["logits"], eager["logits"], strict=True)
        ]
        result[mode] = {
            "prefill_tokens_equal": bool(torch.equal(run["first"], eager["first"])),
            "logits_bit_identical": all(
                torch.equal(a, b) for a, b in zip(run["logits"], eager["logits"], strict=True)
            ),
            "tokens_equal": all(
                torch.equal(a.argmax(-1), b.argmax(-1))
                for a, b in zip(run["logits"], eager["logits"], strict=True)
            ),
            "max_abs_diff": max(diffs),
            "replays": run["replays"],
        }
    result["graph_safe_model_path"] = eager["graph_safe"]
    return result


def measure_batch(args: argparse.Namespace, batch: int) -> dict[str, Any]:
    """(b) + (c) for one lane size."""
    log(f"latency: batch {batch}")
    eager, eager_setup = build(args, batch, "none")
    traced: DecoderExecutor | None = None
    try:
        traced, traced_setup = build(args, batch, "decode_only")
        lanes = {
            mode: GreedyLane(executor, batch, prefill(executor, batch, args.prompt_len), start)
            for mode, executor, start in (
                ("eager", eager, args.prompt_len),
                ("traced", traced, args.prompt_len),
            )
        }
        model = eager.model
        default = model.uses_graph_safe_path()

        def other_path_step() -> None:
            model.graph_safe = not default
            try:
                lanes["eager"].sampled_step()
            finally:
                model.graph_safe = None

        variants: dict[str, tuple[Callable[[], None], DecoderExecutor]] = {
            "eager": (lanes["eager"].sampled_step, eager),
            "traced": (lanes["traced"].sampled_step, traced),
            "eager_other_path": (other_path_step, eager),
        }
        samples: dict[str, list[float]] = {name: [] for name in variants}
        for round_index in range(args.warmup_steps + args.steps):
            for name, (step, executor) in variants.items():
                seconds = timed(step, executor)
                if round_index >= args.warmup_steps:
                    samples[name].append(seconds)
        assert traced.trace_compiler is not None
        row: dict[str, Any] = {
            "batch": batch,
            "eager": {
                **eager_setup,
                **_summary(samples["eager"]),
                "path": "graph-safe" if default else "dynamic",
            },
            "eager_other_path": {
                **_summary(samples["eager_other_path"]),
                "path": "dynamic" if default else "graph-safe",
            },
            "traced": {
                **traced_setup,
                **_summary(samples["traced"]),
                "decode_replays": traced.trace_compiler.replay_counts["decode"],
            },
        }
    finally:
        eager.close()
        if traced is not None:
            traced.close()
    row["replay_vs_eager"] = row["eager"]["median_ms"] / row["traced"]["median_ms"]
    return row


def environment(args: argparse.Namespace) -> dict[str, Any]:
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    if args.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def print_table(results: dict[str, Any]) -> None:
    print(f"\ndevice {results['settings']['device']}  {results['environment']}")
    check = results["correctness"]
    for mode in ("decode_only", "all"):
        c = check[mode]
        print(
            f"correctness {mode:>11} vs none (batch {check['batch']}, {check['steps']} steps): "
            f"logits bit-identical={c['logits_bit_identical']} tokens equal={c['tokens_equal']} "
            f"prefill tokens equal={c['prefill_tokens_equal']} max|diff|={c['max_abs_diff']:.3g}"
        )
    header = (
        "| batch | eager ms (default path) | eager ms (other path) | trace replay ms | "
        "eager/replay | warmup s (eager / traced) | capture s | load s |"
    )
    print("\n" + header)
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in results["batches"]:
        eager, traced, other = row["eager"], row["traced"], row["eager_other_path"]
        print(
            f"| {row['batch']} | {eager['median_ms']:.2f} ({eager['path']}) | "
            f"{other['median_ms']:.2f} ({other['path']}) | {traced['median_ms']:.2f} | "
            f"{row['replay_vs_eager']:.2f}x | {eager['warmup_compile_s']:.2f} / "
            f"{traced['warmup_compile_s']:.2f} | {traced['capture_s']:.2f} | "
            f"{traced['load_s']:.1f} |"
        )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.perf_counter()
    settings = {
        key: (list(value) if isinstance(value, tuple) else value)
        for key, value in vars(args).items()
        if key != "out"
    }
    results: dict[str, Any] = {"settings": settings, "environment": environment(args)}

    def save() -> None:
        """Write what is measured so far: a run cut short still leaves its results."""
        if args.out is not None:
            args.out.write_text(json.dumps(results, indent=2) + "\n")

    results["correctness"] = check_correctness(args)
    save()
    results["batches"] = []
    for batch in args.batch_sizes:
        results["batches"].append(measure_batch(args, batch))
        save()
    results["wall_s"] = time.perf_counter() - clock
    save()
    print_table(results)
    print(f"\ntotal {results['wall_s']:.1f} s")
    if args.out is not None:
        print(f"wrote {args.out}")
    check = results["correctness"]
    ok = all(check[mode]["tokens_equal"] for mode in ("decode_only", "all"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""`llm-runtime bench`: check the arguments, run `models.benchmark` and print its report."""

from __future__ import annotations

import argparse
import json
import sys

from models.cli.errors import EXIT_OK, PipeClosed, UsageError
from models.cli.loading import check_block_geometry, model_args


def bench(args: argparse.Namespace) -> int:
    """Measure throughput per batch size; text report, or one JSON document with --json."""
    check_block_geometry(args)
    model = model_args(args.model)
    longest = args.prompt_len[1] + args.new_tokens
    if longest > model.max_seq_len:
        raise UsageError(
            f"--prompt-len {args.prompt_len[1]} with --new-tokens {args.new_tokens} needs "
            f"{longest} tokens per sequence, over the model's context of {model.max_seq_len}: "
            f"allowed is --prompt-len + --new-tokens <= {model.max_seq_len}"
        )
    from models.benchmark import BenchConfig, BenchUsageError, format_report, run_benchmark

    config = BenchConfig(
        model=args.model,
        batch_sizes=args.batch_sizes,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        compare=args.compare,
        device=args.device,
        dtype="bfloat16" if args.weights == "bfloat16" else args.dtype,
        weights=args.weights,
        trace_mode=args.trace,
        block_size=args.block_size,
        prefill_chunk=args.prefill_chunk,
        seed=args.seed,
        repeats=args.repeats,
        lanes=args.lanes,
        lane_transport=args.lane_transport,
        threads_per_lane=args.threads_per_lane,
        kernels=args.kernels,
    )

    def log(message: str) -> None:
        if args.progress != "never":
            print(message, file=sys.stderr, flush=True)

    try:
        report = run_benchmark(config, log=log)
    except BenchUsageError as error:
        raise UsageError(error) from error
    text = json.dumps(report, indent=2) if args.json else format_report(report)
    try:
        print(text, flush=True)
    except BrokenPipeError as error:
        raise PipeClosed() from error
    return EXIT_OK

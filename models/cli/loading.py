"""From parsed arguments to a loaded executor: the checks and loading `generate`, `bringup`
and `bench` share.

Every check here runs before any weight loads or device work, and a failure is a
`UsageError` naming the flag the user typed. torch-heavy modules are imported inside the
functions so `--help` and argument errors stay fast.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from models.cli.errors import UsageError, one_line
from models.cli.lane_bounds import check_lane_memory

if TYPE_CHECKING:
    from models.cli.executor_view import CliExecutor
    from models.decoder.config import DecoderArgs
    from models.decoder.tokenizer import DecoderTokenizer
    from models.progress import ConsoleProgress, NullProgress, ProgressSink
    from runtime.config import WarmupConfig


def model_args(model: str) -> DecoderArgs:
    """The model's architecture without its weights; a bad name or file is a UsageError."""
    from models.decoder.sources import ModelNotAvailableError
    from models.decoder.sources import model_args as read_model_args

    try:
        return read_model_args(model)
    except ModelNotAvailableError as error:
        raise UsageError(str(error)) from error
    except (ValueError, OSError) as error:
        raise UsageError(f"--model {model}: {one_line(error)}") from error


def model_args_and_tokenizer(model: str) -> tuple[DecoderArgs, DecoderTokenizer | None]:
    """`model_args` and the model's tokenizer (None: it has none), still without weights."""
    from models.decoder.sources import ModelNotAvailableError
    from models.decoder.sources import model_args_and_tokenizer as read_model

    try:
        return read_model(model)
    except ModelNotAvailableError as error:
        raise UsageError(str(error)) from error
    except (ValueError, OSError) as error:
        raise UsageError(f"--model {model}: {one_line(error)}") from error


def check_block_geometry(args: argparse.Namespace) -> None:
    """--block-size and --prefill-chunk fit together (every subcommand that loads a model)."""
    from models.decoder.executor import geometry_problem

    problem = geometry_problem(
        args.block_size, args.prefill_chunk, names=("--block-size", "--prefill-chunk")
    )
    if problem:
        raise UsageError(problem)


def check_lane_arguments(args: argparse.Namespace, model: DecoderArgs | None = None) -> DecoderArgs:
    """Block size, chunk, lanes and context checked together, before anything loads.

    `model` is the model's architecture when the caller has read it already."""
    check_block_geometry(args)
    if getattr(args, "lanes", 1) != 1 or getattr(args, "threads_per_lane", None) is not None:
        from models.lane_loading import check_lane_arguments as check_lanes

        try:
            check_lanes(args.lanes, args.lane_transport, args.threads_per_lane, args.max_batch)
        except ValueError as error:
            raise UsageError(error) from error
    if model is None:
        model = model_args(args.model)
    limit = getattr(args, "max_seq_len", None)
    if limit is not None and limit > model.max_seq_len:
        raise UsageError(
            f"--max-seq-len {limit} is invalid: the model {args.model} has a context of "
            f"{model.max_seq_len} tokens; allowed is 1..{model.max_seq_len}"
        )
    if hasattr(args, "max_batch"):
        check_slot_capacity(args, model)
    if hasattr(args, "lane_transport"):
        check_lane_memory(args, model)
    return model


KV_ITEM_BYTES = {"float32": 4, "bfloat16": 2}
"""Bytes per K/V element by `--dtype` (the KV cache has the weights' dtype)."""


def check_slot_capacity(args: argparse.Namespace, model: DecoderArgs) -> None:
    """--max-batch no larger than the KV pool can give one block to every slot.

    A slot holds a request only while it owns at least one KV block (the block its next
    token is written to), so slots beyond the pool's blocks can never hold a request; they
    only widen every decode step and warmup. Two facts bound them, before anything loads:
    `--num-blocks` (per lane) when given, and the host memory left for one block per slot.
    """
    lanes = getattr(args, "lanes", 1)
    per_lane = args.max_batch // lanes
    blocks = getattr(args, "num_blocks", None)
    if blocks is not None and per_lane > blocks:
        lane_text = f" ({per_lane} per lane over --lanes {lanes})" if lanes > 1 else ""
        raise UsageError(
            f"--num-blocks {blocks} is too small for --max-batch {args.max_batch}{lane_text}: "
            f"every slot needs a KV block of its own to hold even one token, so a lane of "
            f"{per_lane} slots needs at least {per_lane} blocks; allowed is --num-blocks >= "
            f"{per_lane}, or --max-batch <= {blocks * lanes}"
        )
    if args.device != "cpu":
        return  # a CUDA device's free memory is read when the cache is sized (after load)
    from runtime.backends.memory import available_memory_bytes, format_bytes

    available = available_memory_bytes("cpu")
    per_block = (
        2 * model.n_layers * model.n_kv_heads * model.head_dim * args.block_size
    ) * KV_ITEM_BYTES.get(args.dtype, 4)
    if available is None or args.max_batch * per_block <= available:
        return
    most = available // per_block // lanes * lanes
    raise UsageError(
        f"--max-batch {args.max_batch} is invalid: every slot needs at least one KV block of "
        f"its own ({format_bytes(per_block)} for {args.model} at --block-size "
        f"{args.block_size}, {args.dtype}), so {args.max_batch} slots need "
        f"{format_bytes(args.max_batch * per_block)} and this host has "
        f"{format_bytes(available)} available; allowed is 1..{most}"
        + (f" (a multiple of --lanes {lanes})" if lanes > 1 else "")
    )


def load(model: str, **kwargs: object) -> CliExecutor:
    """Build the executor (CONSTRUCTED); a missing model, bad file or geometry is a UsageError."""
    from models import load_executor
    from models.decoder.kernels import KernelPlanError
    from models.decoder.sources import ModelNotAvailableError
    from runtime.backends.cpu_features import UnsupportedCpuFeatureError

    try:
        executor: CliExecutor = load_executor(model, **kwargs)
    except (ModelNotAvailableError, KernelPlanError, UnsupportedCpuFeatureError) as error:
        raise UsageError(str(error)) from error
    except (ValueError, TypeError) as error:
        raise UsageError(f"--model {model}: {one_line(error)}") from error
    return executor


def load_from_args(
    args: argparse.Namespace, progress: ProgressSink, **extra: object
) -> CliExecutor:
    """`load` with the model and lane geometry that `generate` and `bringup` share."""
    return load(
        args.model,
        device=args.device,
        dtype="bfloat16" if args.weights == "bfloat16" else args.dtype,
        weights=args.weights,
        trace_mode=args.trace,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_batch_size=args.max_batch,
        max_prefill_chunk_size=args.prefill_chunk,
        max_seq_len=args.max_seq_len,
        warmup=warmup_config(args),
        **_lane_arguments(args),
        progress=progress,
        kernels=args.kernels,
        **extra,
    )


def _lane_arguments(args: argparse.Namespace) -> dict[str, int | str | None]:
    if args.lanes == 1 and args.threads_per_lane is None:
        return {}
    return {
        "lanes": args.lanes,
        "lane_transport": args.lane_transport,
        "threads_per_lane": args.threads_per_lane,
    }


def progress_from_args(args: argparse.Namespace) -> ConsoleProgress | NullProgress:
    """The `--progress` sink (stderr; a terminal only unless `--progress always`)."""
    from models.progress import progress_for

    return progress_for(args.progress)


def close_progress(progress: ProgressSink) -> None:
    """End a console display (a sink without `close` has nothing to end)."""
    close = getattr(progress, "close", None)
    if callable(close):
        close()


def warmup_config(args: argparse.Namespace) -> WarmupConfig | None:
    """The declared coverage: full (the executor's default) or one prefill shape.

    Sampling (temperature > 0) decodes on the top-k path, so a traced lane must capture it too.
    """
    from runtime.config import TraceConfig, WarmupConfig

    sampling = getattr(args, "temperature", 0.0) > 0
    traced = TraceConfig.of(args.trace).enabled
    if args.warmup == "full" or (args.warmup == "auto" and traced):
        return WarmupConfig(include_decode_top_k=True) if sampling else None
    if traced:
        raise UsageError(
            f"--warmup minimal needs --trace none (got --trace {args.trace}): traced lanes "
            "close the compile gate at capture, so every shape must be warmed; use --warmup full"
        )
    return WarmupConfig(prefill_seq_lens=(min(32, args.prefill_chunk),), prefill_batch_sizes=(1,))


def resolve_capacity(executor: CliExecutor, blocks: int, *, given: bool) -> None:
    """Make KV capacity final; too many blocks for free memory is refused before allocating."""
    from models.executor import KVCapacityError

    try:
        executor.resolve_capacity(blocks)
    except KVCapacityError as error:
        flag = f"--num-blocks {blocks}" if given else f"the {blocks} KV blocks these prompts need"
        raise UsageError(f"{flag}: {one_line(error)}") from error
    except ValueError as error:
        raise UsageError(f"--num-blocks {blocks}: {one_line(error)}") from error

"""Warmup's choice of the fused decode stack, per decode bucket, by measurement.

Why measure: the fused stack (`models.decoder.fused_decode`) saves the per-op overhead of a
decode step, but whether it beats the per-op path at a given row count depends on the CPU,
the thread count and the projection forms the plan chose. So for every decode bucket of at
most `FUSED_MAX_ROWS` rows, warmup times a whole decode step both ways on the model's own
weights (all layers, so they stream from memory as in a real step) against a scratch paged
cache of the model's block size, and keeps the fused stack where it measures faster. Where
the CPU has VNNI and weights are held in q4 blocks, the stack is also timed with int16
activations (`native/quant_blocks_i16.h`), and with `--weights stored-int8` with int8 ones
(`native/quant_blocks_i8.h`); the fastest variant over the buckets is kept. Each variant is
timed with the LM head as the stack's last stage and with it in its own call, in its plan
form; per bucket the default placement (in the call up to 4 rows) is kept unless the other
measured faster by a margin (on Zen 4: in the call at 32 rows, 2-3% faster). The result is
recorded in the kernel plan (`KernelPlan.fused_decode`, `fused_head`), so a replayed plan
makes the same choice without timing anything.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import attrs
import torch

from models.decoder.bound_cache import BoundCache
from models.decoder.fused_decode import FusedDecodeStack, StackSource, fused_unsupported_reason
from models.decoder.kernels import (
    FUSED_MAX_ROWS,
    KernelPlan,
    head_in_call_by_default,
    int8_activations_available,
    int16_activations_available,
)
from models.decoder.layers import Projection
from runtime.backends import native_kernels
from runtime.model_contract import PagedAttentionConfig


class TimedDecoder(StackSource, Protocol):
    """What timing the fused stack against the per-op path needs of the model (`DecoderModel`;
    not imported here): its fused stack slot and its unchecked decode of active rows."""

    fused_decode: FusedDecodeStack | None
    int8_activations: bool

    @property
    def n_layers(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def paged_attention_config(self) -> PagedAttentionConfig | None: ...

    def decode_rows(
        self, cache: BoundCache, tokens: torch.Tensor, pos: torch.Tensor, pages: torch.Tensor
    ) -> torch.Tensor: ...


logger = logging.getLogger(__name__)

# Timed steps per path and bucket (best kept), after one warm-up step each; the two paths
# alternate so background load hits both alike.
_ROUNDS = 3
# Context of the timed rows: a few pages at a typical block size, so the step's attention
# crosses page boundaries like a real one.
_CONTEXT = 96
_DEFAULT_BLOCK_SIZE = 32
# The share of a step by which the LM head's other placement must measure faster to replace
# the default (in the call up to `HEAD_IN_STACK_UP_TO` rows, apart above): at 1-4 rows the two
# differ by less than warmup's noise, at 8 the call is 2-4% slower, at 32 2-3% faster (Zen 4).
HEAD_MARGIN = 0.015

# Choices made in this process, by the projection plan they were measured on (lanes of one
# model in one process compute alike; see `kernel_measure._MEASURED`).
_CHOSEN: dict[int, tuple[KernelPlan, KernelPlan]] = {}


def choose_fused_decode(model: TimedDecoder, plan: KernelPlan) -> KernelPlan:
    """`plan` (already applied to `model`) with the fused decode buckets chosen."""
    cached = _CHOSEN.get(id(plan))
    if cached is not None and cached[0] is plan:
        return cached[1]
    chosen = _choose(model, plan)
    _CHOSEN[id(plan)] = (plan, chosen)
    return chosen


def _choose(model: TimedDecoder, plan: KernelPlan) -> KernelPlan:
    reason = fused_unsupported_reason(model)
    # The decode buckets (the plan's last bucket is the prefill chunk's, `row_buckets`).
    buckets = [bucket for bucket in plan.buckets[:-1] if bucket <= FUSED_MAX_ROWS]
    if reason is None and not buckets:
        reason = f"no decode bucket of at most {FUSED_MAX_ROWS} rows"
    if reason is not None:
        return attrs.evolve(plan, notes=(*plan.notes, f"fused decode off: {reason}"))
    paged = model.paged_attention_config
    block_size = paged.block_size if paged is not None else _DEFAULT_BLOCK_SIZE
    variants = _variants(model)
    timings: list[tuple[int, dict[str, float], float]] = []
    placements: dict[int, dict[str, tuple[float, float]]] = {}
    started = time.perf_counter()
    with torch.inference_mode():
        for bucket in buckets:
            placed, per_op = _time_bucket(model, bucket, block_size, variants)
            placements[bucket] = {v: (i * 1e6, a * 1e6) for v, (i, a) in placed.items()}
            fused = {
                v: in_call if _head_in_call(bucket, in_call, apart) else apart
                for v, (in_call, apart) in placements[bucket].items()
            }
            timings.append((bucket, fused, per_op * 1e6))
    logger.info("measured the fused decode stack in %.2f s", time.perf_counter() - started)
    # One parts table serves every bucket: the variant fastest over the buckets, each bucket
    # weighed alike (time relative to float32's), so a few milliseconds of noise at 32 rows,
    # where the variants run the same exact panels, cannot outvote a 5% gain at 1 row.
    kept = min(variants, key=lambda v: sum(fused[v] / fused["float32"] for _, fused, _ in timings))
    chosen = tuple(bucket for bucket, fused, per_op in timings if fused[kept] < per_op)
    head = {bucket: placements[bucket][kept] for bucket, _, _ in timings}
    return attrs.evolve(
        plan,
        fused_decode=chosen,
        fused_timings=tuple((bucket, fused[kept], per_op) for bucket, fused, per_op in timings),
        fused_head=tuple(b for b in chosen if _head_in_call(b, *head[b])),
        fused_head_timings=tuple((b, in_call, apart) for b, (in_call, apart) in head.items()),
        fused_activations=kept,
        fused_variant_timings=tuple(
            (variant, bucket, fused[variant])
            for bucket, fused, _ in timings
            for variant in variants
            if len(variants) > 1
        ),
    )


def _head_in_call(bucket: int, in_call: float, apart: float) -> bool:
    """Whether a bucket's steps run the LM head in the stack's call, from its two timings:
    the default placement unless the other measured faster by more than HEAD_MARGIN."""
    if head_in_call_by_default(bucket):
        return in_call <= apart * (1 + HEAD_MARGIN)
    return in_call < apart * (1 - HEAD_MARGIN)


def _variants(model: TimedDecoder) -> tuple[str, ...]:
    """The stack's activation variants to time: float32; int16 where this CPU has VNNI and a
    projection holds q4 blocks; int8 where also asked for (`--weights stored-int8`) and a
    projection holds blocks the int8 form takes."""
    held = [
        part
        for layer in model.layers
        for projection in layer.children()
        if isinstance(projection, Projection) and projection.blocks is not None
        for part in projection.blocks
    ]
    variants = ["float32"]
    if int16_activations_available() and any(native_kernels.int16_takes(p) for p in held):
        variants.append("int16")
    if (
        model.int8_activations
        and int8_activations_available()
        and any(native_kernels.int8_takes(p) for p in held)
    ):
        variants.append("int8")
    return tuple(variants)


def _time_bucket(
    model: TimedDecoder, rows: int, block_size: int, variants: tuple[str, ...]
) -> tuple[dict[str, tuple[float, float]], float]:
    """Best seconds of one decode step of `rows` rows: fused (per activation variant, with
    the LM head in the call and apart), then per-op."""
    pages_per_row = (_CONTEXT + rows) // block_size + 1
    blocks = rows * pages_per_row
    shape = (blocks, model.args.n_kv_heads, block_size, model.args.head_dim)
    generator = torch.Generator().manual_seed(0)
    layers = tuple(
        (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
        for _ in range(model.n_layers)
    )
    cache = BoundCache(layers, block_size)
    pages = torch.arange(blocks, dtype=torch.long).view(rows, pages_per_row)
    positions = torch.arange(rows, dtype=torch.long) + _CONTEXT
    tokens = torch.arange(rows, dtype=torch.long) % model.vocab_size
    stacks: dict[tuple[str, bool] | None, FusedDecodeStack | None] = {
        (variant, in_call): FusedDecodeStack(
            model, [rows], [rows], activations=variant, head_rows=[rows] if in_call else []
        )
        for variant in variants
        for in_call in (True, False)
    }
    stacks[None] = None  # the per-op path
    saved = model.fused_decode
    best = dict.fromkeys(stacks, float("inf"))
    try:
        for round_index in range(_ROUNDS + 1):
            for key, stack in stacks.items():
                model.fused_decode = stack
                start = time.perf_counter()
                model.decode_rows(cache, tokens, positions, pages)
                seconds = time.perf_counter() - start
                if round_index:
                    best[key] = min(best[key], seconds)
    finally:
        model.fused_decode = saved
    return {v: (best[(v, True)], best[(v, False)]) for v in variants}, best[None]

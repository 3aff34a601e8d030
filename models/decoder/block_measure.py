"""Timing the block forms of a block-quantized projection (`block_forms`), per row bucket.

The same rules as the float forms (`kernel_measure`): weight-bound buckets (few rows) stream
every layer's matrix, compute-bound ones time one layer and scale; the best of a few rounds
is kept after one warm-up pass. Every candidate's time is recorded, not just the winner's,
so `bringup` and the benchmark can show what each form costs on this CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from models.decoder.block_forms import BLOCK_FORMS, block_product, release_converted
from models.decoder.kernels import ProjectionChoice
from runtime.quant.matrix import QuantizedMatrix

_ROUNDS = 3
_COMPUTE_BOUND_ROUNDS = 2
_STREAMING_ROWS = 64


def measure_block_projection(
    weights: Sequence[tuple[QuantizedMatrix, ...]],
    blocks: str,
    buckets: Sequence[int],
    measured: Callable[[int], None] | None = None,
    *,
    int8: bool = False,
) -> ProjectionChoice:
    """The fastest block form per bucket for these weights (one per layer), with every
    candidate's microseconds (all layers) in `candidates`. `int8`: the int8-activation form
    is a candidate too (`--weights stored-int8`; it is not bit-equal to the others)."""
    fan_in = weights[0][0].cols
    generator = torch.Generator().manual_seed(0)
    picked: list[tuple[int, str, float]] = []
    times: dict[str, list[float]] = {}
    for rows in buckets:
        x = torch.randn(rows, fan_in, generator=generator)
        names = [
            n
            for n, f in BLOCK_FORMS.items()
            if f.fits(rows)
            and f.available()
            and all(f.applies(p) for p in weights[0])
            and (int8 or n != "q_int8")
        ]
        streaming = rows <= _STREAMING_ROWS
        best = dict.fromkeys(names, float("inf"))
        for round_index in range((_ROUNDS if streaming else _COMPUTE_BOUND_ROUNDS) + 1):
            for name in names:
                layers = weights if streaming and not BLOCK_FORMS[name].converted else weights[:1]
                start = time.perf_counter()
                for parts in layers:
                    block_product(parts, x, name)
                seconds = (time.perf_counter() - start) * len(weights) / len(layers)
                if round_index:
                    best[name] = min(best[name], seconds)
        for name in BLOCK_FORMS:
            times.setdefault(name, []).append(best.get(name, float("nan")) * 1e6)
        seconds, form = min((s, n) for n, s in best.items())
        picked.append((rows, form, seconds))
        if measured is not None:
            measured(rows)
    if all(form != "torch_int4" for _, form, _ in picked):
        # The converted copies were for timing only.
        release_converted(part for stack in weights for part in stack)
    merged: list[tuple[int, str]] = []
    for rows, form, _ in picked:
        if merged and merged[-1][1] == form:
            merged[-1] = (rows, form)
        else:
            merged.append((rows, form))
    return ProjectionChoice(
        layout="out_in",
        split=False,
        forms=tuple(merged),
        microseconds=tuple(seconds * 1e6 for _, _, seconds in picked),
        blocks=blocks,
        candidates=tuple((name, tuple(us)) for name, us in sorted(times.items())),
    )

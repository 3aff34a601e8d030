"""Measuring a kernel plan: every candidate form timed on the model's own weights, once.

Why measure: the fastest form of a projection depends on the CPU (see `kernels`). For every
projection kind and row bucket, the candidates run on all layers' weights (so they stream
from memory as in a real step) and the fastest is kept; block-quantized projections
(`runtime.quant`) are timed among the block forms (`block_forms`). The result is a
`KernelPlan`, measured once per process for a given geometry.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol, TypeAlias

import attrs
import torch

from models.decoder.block_forms import default_block_form
from models.decoder.block_measure import measure_block_projection
from models.decoder.kernels import (
    FORMS,
    LAYOUTS,
    RESTORE_MARGIN,
    STORED,
    Form,
    KernelPlan,
    Layout,
    ProjectionChoice,
    ProjectionShape,
    default_form,
)
from models.progress import ProgressSink, as_progress
from runtime.quant.matrix import QuantizedMatrix

logger = logging.getLogger(__name__)

# Timing: timed passes per candidate (best kept, after one warm-up pass). Row counts up to
# `_STREAMING_ROWS` are bound by reading weights, so their passes stream every layer's
# matrix; larger ones are bound by arithmetic, so one matrix stands for all layers.
_ROUNDS = 3
_COMPUTE_BOUND_ROUNDS = 2
_STREAMING_ROWS = 64


def row_buckets(decode_rows: int, prefill_rows: int) -> tuple[int, ...]:
    """Powers of two up to the lane's decode batch, the batch itself, then a prefill chunk."""
    buckets = {decode_rows, max(prefill_rows, decode_rows + 1)}
    rows = 1
    while rows < decode_rows:
        buckets.add(rows)
        rows *= 2
    return tuple(sorted(buckets))


@attrs.frozen
class _Candidate:
    layout: Layout
    split: bool
    form: Form


def _candidates(parts: Sequence[int], rows: int) -> Iterator[_Candidate]:
    for split in (False, True) if len(parts) > 1 else (False,):
        for form in FORMS.values():
            if form.fits(rows) and form.available():
                yield _Candidate(form.layout, split, form)


def _run(
    candidate: _Candidate, weights: Sequence[torch.Tensor], parts: Sequence[int], x: torch.Tensor
) -> None:
    compute = candidate.form.compute
    dim = 0 if candidate.layout == "out_in" else 1
    for weight in weights:
        if candidate.split:
            torch.cat(
                [compute(part, x) for part in weight.split_with_sizes(list(parts), dim=dim)], dim=1
            )
        else:
            compute(weight, x)


def _best_times(
    hf_weights: Sequence[torch.Tensor],
    parts: Sequence[int],
    buckets: Sequence[int],
    measured: Callable[[int], None] | None,
) -> dict[tuple[int, Layout, bool, str], float]:
    """Best seconds of every candidate `(rows, layout, split, form)`, scaled to all layers
    (a compute-bound bucket times one layer's weights)."""
    layouts: dict[Layout, list[torch.Tensor]] = {
        "out_in": list(hf_weights),
        "in_out": [w.t().contiguous() for w in hf_weights],
    }
    fan_in = hf_weights[0].shape[1]
    best: dict[tuple[int, Layout, bool, str], float] = {}
    generator = torch.Generator().manual_seed(0)
    for rows in buckets:
        x = torch.randn(rows, fan_in, generator=generator).to(hf_weights[0].dtype)
        candidates = list(_candidates(parts, rows))
        streaming = rows <= _STREAMING_ROWS
        for round_index in range((_ROUNDS if streaming else _COMPUTE_BOUND_ROUNDS) + 1):
            for candidate in candidates:
                weights = layouts[candidate.layout]
                if not streaming:
                    weights = weights[:1]
                start = time.perf_counter()
                _run(candidate, weights, parts, x)
                seconds = time.perf_counter() - start
                if round_index == 0:
                    continue  # first pass: caches and allocator warm-up
                key = (rows, candidate.layout, candidate.split, candidate.form.name)
                scale = len(hf_weights) / len(weights)
                best[key] = min(best.get(key, float("inf")), seconds * scale)
        if measured is not None:
            measured(rows)
    return best


def measure_projection(
    hf_weights: Sequence[torch.Tensor],
    parts: Sequence[int],
    buckets: Sequence[int],
    measured: Callable[[int], None] | None = None,
) -> tuple[ProjectionChoice, dict[tuple[Layout, bool], float]]:
    """Time every candidate on these `[out, in]` weights (one per layer) at every bucket.

    Returns the choice and each `(layout, split)`'s score (the sum over buckets of its best
    time divided by the best of all candidates; 1.0 per bucket is perfect). One layout and
    split serve all buckets, because the weights are stored once. `measured(rows)` is
    called after each bucket (progress).
    """
    best = _best_times(hf_weights, parts, buckets, measured)
    scores: dict[tuple[Layout, bool], float] = {}
    chosen: dict[tuple[Layout, bool], list[tuple[int, str, float]]] = {}
    for rows in buckets:
        overall = min(s for (r, _, _, _), s in best.items() if r == rows)
        for layout in LAYOUTS:
            for split in (False, True) if len(parts) > 1 else (False,):
                options = [
                    (s, form)
                    for (r, lay, spl, form), s in best.items()
                    if (r, lay, spl) == (rows, layout, split)
                ]
                seconds, form = min(options)
                scores[(layout, split)] = scores.get((layout, split), 0.0) + seconds / overall
                chosen.setdefault((layout, split), []).append((rows, form, seconds))
    layout, split = pick_storage(scores, len(buckets))
    picked = chosen[(layout, split)]
    return (
        ProjectionChoice(
            layout=layout,
            split=split,
            forms=_merge_buckets([(rows, form) for rows, form, _ in picked]),
            microseconds=tuple(seconds * 1e6 for _, _, seconds in picked),
        ),
        scores,
    )


def pick_storage(scores: Mapping[tuple[Layout, bool], float], buckets: int) -> tuple[Layout, bool]:
    """The `(layout, split)` with the best score, unless the checkpoint's own storage is
    within `RESTORE_MARGIN` per bucket of it (then that one: no re-layout for noise)."""
    best = min(scores, key=lambda key: (scores[key], LAYOUTS.index(key[0]), key[1]))
    if STORED in scores and scores[STORED] - scores[best] <= RESTORE_MARGIN * buckets:
        return STORED
    return best


def _merge_buckets(forms: Sequence[tuple[int, str]]) -> tuple[tuple[int, str], ...]:
    """Adjacent buckets with the same form become one (the larger bound covers both)."""
    merged: list[tuple[int, str]] = []
    for rows, form in forms:
        if merged and merged[-1][1] == form:
            merged[-1] = (rows, form)
        else:
            merged.append((rows, form))
    return tuple(merged)


class MeasuredProjection(Protocol):
    """What measuring reads of one projection module (`layers.Projection`)."""

    @property
    def parts(self) -> tuple[int, ...]: ...

    @property
    def blocks(self) -> tuple[QuantizedMatrix, ...] | None: ...

    @property
    def block_source(self) -> str: ...

    def hf_weight(self) -> torch.Tensor: ...


class MeasuredModel(Protocol):
    """What a kernel plan is measured (or defaulted) on: the model's projections by kind
    (`kernel_hooks.KernelPlanHooks` provides them; this module does not import it)."""

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    def projection_shapes(self) -> Mapping[str, ProjectionShape]: ...

    def projection_groups(self) -> Mapping[str, Sequence[MeasuredProjection]]: ...

    @property
    def int8_activations(self) -> bool:
        """Block products may run with int8 activations (`--weights stored-int8`)."""
        ...


# Plans measured in this process, by what they depend on: lanes of one model in one process
# (and an eager lane next to a traced one) compute with the same forms, bit for bit.
_PlanKey: TypeAlias = tuple[
    tuple[tuple[str, ProjectionShape], ...], torch.dtype, tuple[int, ...], int, str, tuple[str, ...]
]
"""What a measured plan depends on: shapes, dtype, buckets, torch threads, attention, notes."""
_MEASURED: dict[_PlanKey, KernelPlan] = {}


INT8_NOTE = "int8 activations allowed (--weights stored-int8)"


def measure_kernel_plan(
    model: MeasuredModel,
    *,
    buckets: Sequence[int],
    attention: str,
    notes: Sequence[str] = (),
    progress: ProgressSink | None = None,
) -> KernelPlan:
    """Measure every projection of `model` at `buckets` (see `measure_projection`), once per
    process for a given geometry, dtype, thread count and attention. `progress` gets one
    advance per projection and bucket (`measure kernels i/n: q_proj rows=64`)."""
    shapes = tuple(sorted(model.projection_shapes().items()))
    if model.int8_activations:
        notes = (*notes, INT8_NOTE)
    key: _PlanKey = (
        shapes,
        model.dtype,
        tuple(buckets),
        torch.get_num_threads(),
        attention,
        tuple(notes),
    )
    plan = _MEASURED.get(key)
    if plan is None:
        plan = _measure(model, buckets=buckets, attention=attention, notes=notes, progress=progress)
        _MEASURED[key] = plan
    return plan


def _measure(
    model: MeasuredModel,
    *,
    buckets: Sequence[int],
    attention: str,
    notes: Sequence[str],
    progress: ProgressSink | None,
) -> KernelPlan:
    from runtime.backends.cpu_features import CpuFeatures

    projections: list[tuple[str, ProjectionChoice]] = []
    started = time.perf_counter()
    groups = model.projection_groups()
    sink = as_progress(progress)
    total = len(groups) * len(buckets)
    with torch.inference_mode(), sink.step("measure kernels", total=total, each=True) as step:
        for name, modules in groups.items():

            def measured(rows: int, name: str = name) -> None:
                step.advance(1, f"{name} rows={rows}")

            timed = _group_buckets(name, buckets)
            held = [module.blocks for module in modules]
            if all(blocks is not None for blocks in held):
                stacks = [blocks for blocks in held if blocks is not None]
                source = modules[0].block_source
                choice = measure_block_projection(
                    stacks, source, timed, measured, int8=model.int8_activations
                )
            else:
                weights = [module.hf_weight() for module in modules]
                weights = [w if w.is_contiguous() else w.contiguous() for w in weights]
                choice, scores = measure_projection(weights, modules[0].parts, timed, measured)
                logger.debug("kernel scores for %s: %s", name, scores)
            for rows in buckets[len(timed) :]:
                step.advance(1, f"{name} rows={rows} not timed (one row per sequence)")
            projections.append((name, choice))
    logger.info("measured projection kernels in %.2f s", time.perf_counter() - started)
    return KernelPlan(
        projections=tuple(projections),
        decode_attention=attention,
        buckets=tuple(buckets),
        source="measured",
        dtype=str(model.dtype).removeprefix("torch."),
        threads=torch.get_num_threads(),
        cpu=CpuFeatures.probe().summary(),
        notes=tuple(notes),
    )


def _group_buckets(name: str, buckets: Sequence[int]) -> Sequence[int]:
    """The buckets a projection group is timed at. The LM head sees one row per sequence
    (prefill returns each row's last token), never a prefill chunk's tokens: timing it there
    would build a `[chunk, vocab]` product (SmolLM2: 50 MB) no step ever makes. Rows past
    its last bucket take that bucket's form."""
    if name == "lm_head" and len(buckets) > 1:
        return buckets[:-1]
    return buckets


def fixed_plan(
    model: MeasuredModel,
    *,
    buckets: Sequence[int],
    attention: str,
    source: str,
    notes: Sequence[str] = (),
) -> KernelPlan:
    """The un-measured plan (the default forms), for devices where nothing is timed."""
    on_cpu = model.device.type == "cpu"
    projections = []
    for name, modules in model.projection_groups().items():
        blocks = modules[0].block_source
        if blocks:
            forms = _merge_buckets([(rows, default_block_form(rows)) for rows in buckets])
        else:
            forms = _merge_buckets([(rows, default_form(rows, on_cpu)) for rows in buckets])
        projections.append((name, ProjectionChoice("out_in", False, forms, blocks=blocks)))
    from runtime.backends.cpu_features import CpuFeatures

    return KernelPlan(
        projections=tuple(projections),
        decode_attention=attention,
        buckets=tuple(buckets),
        source=source,
        dtype=str(model.dtype).removeprefix("torch."),
        threads=torch.get_num_threads(),
        cpu=CpuFeatures.probe().summary() if on_cpu else model.device.type,
        notes=tuple(notes),
    )

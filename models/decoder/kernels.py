"""Projection kernels and decode attention chosen by measurement, once, at warmup.

Why measure: the fastest form of a projection depends on the CPU. `torch.mm(W, x.T)` with
one row padded to two was fastest on one AVX-512 machine and twice as slow as `F.linear` on
an AVX2 one. So for every projection shape of the model and every row-count bucket a lane
will run (decode batch sizes, prefill chunks) warmup times the candidate forms on the
model's own weights (all layers, so they stream from memory as in a real step), picks the
fastest, and re-lays the weights out once in the layout the choice needs.

A `KernelPlan` records the choice. It is deterministic once recorded: it goes into the
coverage manifest and the journal, and `--kernels FILE` (a saved plan or a coverage
manifest holding one) replays it without timing anything, so runs can be compared.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Literal, TypeGuard

import attrs
import torch
import torch.nn.functional as F

from models.decoder.block_forms import BLOCK_FORMS, NEEDS_NATIVE
from runtime.backends import native_kernels
from runtime.json_types import JSONValue

logger = logging.getLogger(__name__)

Layout = Literal["out_in", "in_out"]
LAYOUTS: tuple[Layout, ...] = ("out_in", "in_out")
PLAN_VERSION = 2
# Plan versions `--kernels FILE` reads: version 1 plans predate the fused decode choice
# (they replay with it off).
READABLE_PLAN_VERSIONS = (1, 2)
# The fused decode stack (`models.decoder.fused_decode`) is offered for decode buckets of at
# most this many rows: above, the products stop being bound by streaming the weights.
FUSED_MAX_ROWS = 64
# Rows up to which the fused stack runs the LM head as its last stage (a read-bound stream
# there, like the layers' projections) where a plan does not say (`KernelPlan.fused_head`:
# plans that predate the measured choice, stacks built without a plan); larger buckets run it
# in its own call, in its form.
HEAD_IN_STACK_UP_TO = 4
# Decode attention implementations (`DecoderModel.decode_attention`): the native kernel
# reading K/V pages in place, prefetching the next page during each page's read pass or
# through its math (same results; warmup times both, `attention_choice`), or gathering the
# pages into a workspace for SDPA.
READ_PASS = "paged_inplace"
SPREAD = "paged_inplace_spread"
IN_PLACE_ATTENTION = (READ_PASS, SPREAD)
ATTENTION_KINDS = (*IN_PLACE_ATTENTION, "gather")
# Rows from which the pre-measurement default uses `F.linear` (see `default_form`).
LINEAR_FROM_ROWS = 64
# Another storage than the checkpoint's ([out, in], fused parts) must beat it by this share of
# a bucket's best time, summed over the buckets: weights are stored once, the fused decode
# stack streams [out, in] fastest, and near-equal forms trade places under load.
RESTORE_MARGIN = 0.05
STORED: tuple[Layout, bool] = ("out_in", False)


def head_in_call_by_default(bucket: int) -> bool:
    """Whether the fused stack runs the LM head in its call for `bucket` where no measured
    choice says otherwise (`HEAD_IN_STACK_UP_TO`)."""
    return bucket <= HEAD_IN_STACK_UP_TO


def _linear(weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return F.linear(rows, weight)


def _mm_wxt(weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    # MKL's two-row product streams a weight faster than its matrix-vector product on some
    # CPUs, hence the padding of a single row.
    if rows.shape[0] == 1:
        return torch.mm(weight, torch.cat((rows, rows)).t())[:, :1].t().contiguous()
    return torch.mm(weight, rows.t()).t().contiguous()


def _mv(weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return torch.mv(weight, rows[0]).unsqueeze(0)


def _mm_xw(weight_t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return torch.mm(rows, weight_t)


def _mv_t(weight_t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return torch.mv(weight_t.t(), rows[0]).unsqueeze(0)


# oneDNN packed copies (`onednn` form) live on their weight tensor (or the tensor a split
# part is a view of), so they die with it; each is checked against the weight's address and
# version counter, so moved or reloaded weights are packed again.
_PACK_ATTRIBUTE = "_onednn_packed"


def _onednn_available() -> bool:
    built = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    return bool(built) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _packs(weight: torch.Tensor) -> dict[tuple[int, ...], tuple[int, int, torch.Tensor]]:
    base = weight if weight._base is None else weight._base
    packs: dict[tuple[int, ...], tuple[int, int, torch.Tensor]] = base.__dict__.setdefault(
        _PACK_ATTRIBUTE, {}
    )
    return packs


def _packed(weight: torch.Tensor) -> torch.Tensor:
    packs = _packs(weight)
    key = (weight.storage_offset(), *weight.shape, *weight.stride())
    held = packs.get(key)
    if held is None or held[:2] != (weight.data_ptr(), weight._version):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 32)
        held = packs[key] = (weight.data_ptr(), weight._version, packed)
    return held[2]


def _onednn(weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    # oneDNN's inner-product over a weight packed into its blocked layout (a converted copy):
    # on AMD Zen, where MKL's generic path is slow, 2-4x F.linear's GFLOP/s at 8-128 rows.
    if weight.device.type != "cpu":
        return F.linear(rows, weight)
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
        rows.contiguous(), _packed(weight), None, "none", [], ""
    )
    return out


def packed_bytes(weights: Iterable[torch.Tensor]) -> int:
    """Bytes of oneDNN's packed copies (`onednn` form) held for `weights`."""
    holders = [w if w._base is None else w._base for w in weights]
    return sum(
        packed.numel() * packed.element_size()
        for holder in holders
        for _, _, packed in holder.__dict__.get(_PACK_ATTRIBUTE, {}).values()
    )


def release_packed(weights: Iterable[torch.Tensor]) -> None:
    """Drop the packed copies held for `weights` (and for views of the same tensors)."""
    for weight in weights:
        base = weight if weight._base is None else weight._base
        base.__dict__.pop(_PACK_ATTRIBUTE, None)


def _native_rows(weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    # Projection weights are contiguous 2-D CPU tensors (split parts are row slices of one).
    return native_kernels.small_rows_matmul().unchecked(weight, rows).to(weight.dtype)


FUSED_ACTIVATIONS = native_kernels.ACTIVATIONS


def int8_activations_available() -> bool:
    """Whether this CPU runs block products with int8 activations (AVX-512 VNNI)."""
    return native_kernels.unavailable_reason() is None and (
        native_kernels.quant_matmul().int8_available
    )


def int16_activations_available() -> bool:
    """Whether this CPU runs q4 block products with int16 activations (AVX-512 VNNI)."""
    return native_kernels.unavailable_reason() is None and (
        native_kernels.quant_matmul().int16_available
    )


def _native_available() -> bool:
    return native_kernels.unavailable_reason() is None


def _always() -> bool:
    return True


@attrs.frozen
class Form:
    """One way to compute `rows @ W^T` from a weight stored in `layout`, for at most
    `max_rows` rows (None: any), where `available()` says it can run."""

    name: str
    layout: Layout
    compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    max_rows: int | None = None
    available: Callable[[], bool] = _always
    needs: str = NEEDS_NATIVE
    """What `available()` checks, for errors."""

    def fits(self, rows: int) -> bool:
        return self.max_rows is None or rows <= self.max_rows


FORMS: dict[str, Form] = {
    form.name: form
    for form in (
        Form("linear", "out_in", _linear),  # F.linear(x, W[out, in])
        Form("mm_wxt", "out_in", _mm_wxt),  # mm(W[out, in], x^T)^T, one row padded to two
        Form("mv", "out_in", _mv, max_rows=1),  # mv(W[out, in], x)
        # the native weight-streaming product (runtime/backends/native/small_rows_matmul.c)
        Form("native_rows", "out_in", _native_rows, max_rows=16, available=_native_available),
        # oneDNN's packed inner product; runs from a packed copy kept beside the weight
        Form(
            "onednn",
            "out_in",
            _onednn,
            available=_onednn_available,
            needs="torch built with oneDNN (torch.backends.mkldnn)",
        ),
        Form("mm_xw", "in_out", _mm_xw),  # mm(x, W^T[in, out])
        Form("mv_t", "in_out", _mv_t, max_rows=1),  # mv(W^T[in, out]^T, x)
    )
}


def default_form(rows: int, on_cpu: bool) -> str:
    """The form an un-warmed model uses (the previous fixed policy, `out_in` layout)."""
    return "mm_wxt" if on_cpu and rows < LINEAR_FROM_ROWS else "linear"


@attrs.frozen
class ProjectionChoice:
    """How one projection (the same shape in every layer) is stored and computed.

    `forms` pairs each row bucket with its form: a call with `r` rows uses the first bucket
    `>= r` (the last one past them). `split` computes a fused projection (qkv, gate/up) part
    by part from views of the one stored matrix. `microseconds` are the measured times of
    the chosen forms per bucket (all layers), for the record.
    """

    layout: Layout
    split: bool
    forms: tuple[tuple[int, str], ...]
    microseconds: tuple[float, ...] = ()
    # The GGUF types of a block-quantized weight ("Q4_1"); "" for a float weight. Block
    # weights run block forms (`block_forms.BLOCK_FORMS`), always `out_in` and unsplit.
    blocks: str = ""
    # Every candidate form's microseconds per bucket (block weights: what each form costs).
    candidates: tuple[tuple[str, tuple[float, ...]], ...] = ()

    def form_for(self, rows: int) -> str:
        for bucket, form in self.forms:
            if rows <= bucket:
                return form
        return self.forms[-1][1]


@attrs.frozen
class ProjectionShape:
    """A projection's geometry: `[out, in]` with the output split into `parts` (fused)."""

    fan_in: int
    fan_out: int
    parts: tuple[int, ...]
    count: int
    blocks: str = ""


def _by_name(
    projections: Sequence[tuple[str, ProjectionChoice]],
) -> tuple[tuple[str, ProjectionChoice], ...]:
    return tuple(sorted(projections, key=lambda item: item[0]))


@attrs.frozen
class KernelPlan:
    """Every projection's choice plus the decode attention, and how they were obtained."""

    projections: tuple[tuple[str, ProjectionChoice], ...] = attrs.field(converter=_by_name)
    decode_attention: str
    buckets: tuple[int, ...]
    source: str
    dtype: str
    threads: int
    cpu: str
    notes: tuple[str, ...] = ()
    # Decode buckets (of `buckets`, at most `FUSED_MAX_ROWS` rows) that run the fused decode
    # stack, and what warmup measured for it: `(bucket, fused us, per-op us)` per bucket.
    fused_decode: tuple[int, ...] = ()
    fused_timings: tuple[tuple[int, float, float], ...] = ()
    # How the fused stack's block weights meet their activations (`FUSED_ACTIVATIONS`):
    # "float32", "int16" (q4 blocks, rounded per block; `native/quant_blocks_i16.h`) or "int8"
    # (quantized per block; `native/quant_blocks_i8.h`), and, where more than one variant was
    # timed, each variant's measured `(activations, bucket, us)`.
    fused_activations: str = "float32"
    fused_variant_timings: tuple[tuple[str, int, float], ...] = ()
    # Fused buckets whose steps run the final norm's LM head as the stack's last stage rather
    # than in its own call (None: those of at most `HEAD_IN_STACK_UP_TO` rows), and what warmup
    # measured for the kept variant: `(bucket, head in the call us, head apart us)`. Measured
    # on Zen 4: 1.3-2 ms a step faster in the call at 32 rows, 0.5-1 ms slower at 8.
    fused_head: tuple[int, ...] | None = None
    fused_head_timings: tuple[tuple[int, float, float], ...] = ()

    def choice(self, name: str) -> ProjectionChoice:
        return dict(self.projections)[name]

    def head_in_stack(self) -> tuple[int, ...]:
        """The fused buckets whose steps run the LM head in the stack's call."""
        if self.fused_head is not None:
            return tuple(bucket for bucket in self.fused_head if bucket in self.fused_decode)
        return tuple(filter(head_in_call_by_default, self.fused_decode))

    def to_json(self) -> dict[str, JSONValue]:
        """JSON-ready (the format `--kernels FILE` reads back)."""
        return {
            "version": PLAN_VERSION,
            "source": self.source,
            "dtype": self.dtype,
            "threads": self.threads,
            "cpu": self.cpu,
            "buckets": list(self.buckets),
            "decode_attention": self.decode_attention,
            "notes": list(self.notes),
            "summary": self.summary(),
            "fused_decode": {
                "buckets": list(self.fused_decode),
                "head_buckets": list(self.head_in_stack()),
                "activations": self.fused_activations,
                "measured_us": [
                    {
                        "bucket": bucket,
                        "fused": round(fused, 1),
                        "per_op": round(per_op, 1),
                        **{
                            f"fused_{variant}": round(us, 1)
                            for variant, timed, us in self.fused_variant_timings
                            if timed == bucket
                        },
                        **{
                            key: round(us, 1)
                            for timed, in_call, apart in self.fused_head_timings
                            if timed == bucket
                            for key, us in (("head_in_call", in_call), ("head_apart", apart))
                        },
                    }
                    for bucket, fused, per_op in self.fused_timings
                ],
            },
            "projections": {
                name: {
                    "layout": choice.layout,
                    "split": choice.split,
                    "forms": [[bucket, form] for bucket, form in choice.forms],
                    "microseconds": [round(us, 1) for us in choice.microseconds],
                    **({"blocks": choice.blocks} if choice.blocks else {}),
                    **(
                        {
                            "candidates_us": {
                                form: [_timed_us(us) for us in times]
                                for form, times in choice.candidates
                            }
                        }
                        if choice.candidates
                        else {}
                    ),
                }
                for name, choice in self.projections
            },
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=True)

    def summary(self) -> str:
        """One line for the journal and bring-up output."""
        parts = []
        for name, choice in self.projections:
            forms = ",".join(f"{form}@{bucket}" for bucket, form in choice.forms)
            fused = " split" if choice.split else ""
            held = f" {choice.blocks} blocks" if choice.blocks else ""
            parts.append(f"{name}{held} {choice.layout}{fused} {forms}")
        fused = ",".join(f"@{bucket}" for bucket in self.fused_decode) or " off"
        notes = []
        if self.fused_decode and self.fused_activations != "float32":
            notes.append(f"{self.fused_activations} activations")
        head = ",".join(f"@{bucket}" for bucket in self.head_in_stack())
        if head:
            notes.append(f"final norm and LM head in the call {head}")
        if notes:
            fused += f" ({'; '.join(notes)})"
        return (
            f"kernels {self.source}: {'; '.join(parts)}; decode attention {self.decode_attention}"
            f"; fused decode{fused}"
        )


class KernelPlanError(ValueError):
    """A kernel plan (file) that cannot be used; the message names where it came from."""


def _error(where: str, message: str) -> KernelPlanError:
    return KernelPlanError(f"{where}: {message}")


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _row_counts(value: object, field: str, where: str) -> tuple[int, ...]:
    """A list of row counts (positive integers), e.g. the plan's decode buckets."""
    if not isinstance(value, list) or any(type(b) is not int or b < 1 for b in value):
        raise _error(where, f"{field}={value!r} is invalid: allowed is a list of row counts >= 1")
    return tuple(value)


def _thread_count(value: object, where: str) -> int:
    if type(value) is not int or value < 0:
        raise _error(where, f"threads={value!r} is invalid: allowed is an integer >= 0")
    return value


def _notes(value: object, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
        raise _error(where, f"notes={value!r} is invalid: allowed is a list of strings")
    return tuple(value)


def _numbers(value: object, field: str, where: str) -> tuple[float, ...]:
    """A list of recorded microseconds."""
    if not isinstance(value, list) or not all(_is_number(us) for us in value):
        raise _error(where, f"{field}={value!r} is invalid: allowed is a list of numbers")
    return tuple(float(us) for us in value)


def _measured(entry: dict[str, object], where: str) -> list[dict[str, object]]:
    """The fused stack's recorded timings, one object per bucket with its `bucket` and numeric
    fields (which fields depends on what warmup timed: each parser reads its own)."""
    items = entry.get("measured_us", [])
    if not isinstance(items, list) or not all(
        isinstance(item, dict)
        and type(item.get("bucket")) is int
        and all(_is_number(v) for k, v in item.items() if k != "bucket")
        for item in items
    ):
        raise _error(
            where,
            f"fused_decode measured_us={items!r} is invalid: allowed is a list of objects, "
            "each with an integer 'bucket' and numbers of microseconds",
        )
    return items


def _timed(item: dict[str, object], key: str) -> float:
    """One of `_measured`'s numbers (checked there)."""
    value = item[key]
    assert isinstance(value, int | float)
    return float(value)


def parse_kernel_plan(data: object, *, where: str) -> KernelPlan:
    """A plan from its JSON form (or a coverage manifest holding one under "kernels").

    `where` names the origin for errors (`--kernels FILE`). Checks the structure only; shape
    agreement with a model is `check_plan_fits`.
    """
    if isinstance(data, dict) and "kernels" in data and "projections" not in data:
        data = data["kernels"]
    if not isinstance(data, dict) or not isinstance(data.get("projections"), dict):
        raise _error(where, "is not a kernel plan: allowed is a JSON object with 'projections'")
    if data.get("version") not in READABLE_PLAN_VERSIONS:
        raise _error(
            where, f"has version {data.get('version')!r}: allowed are {READABLE_PLAN_VERSIONS}"
        )
    attention = data.get("decode_attention")
    if attention not in ATTENTION_KINDS:
        raise _error(
            where, f"decode_attention={attention!r} is invalid: allowed are {ATTENTION_KINDS}"
        )
    projections = [
        (name, _parse_projection(name, entry, where))
        for name, entry in sorted(data["projections"].items())
    ]
    buckets = _row_counts(data.get("buckets", []), "buckets", where)
    entry = data.get("fused_decode")
    measured = _measured(entry, where) if isinstance(entry, dict) else []
    fused, timings = _parse_fused(entry, buckets, measured, where)
    activations, variant_timings = _parse_fused_activations(entry, measured, where)
    head, head_timings = _parse_fused_head(entry, fused, measured, where)
    return KernelPlan(
        projections=tuple(projections),
        decode_attention=attention,
        buckets=buckets,
        source=str(data.get("source", "file")),
        dtype=str(data.get("dtype", "")),
        threads=_thread_count(data.get("threads", 0), where),
        cpu=str(data.get("cpu", "")),
        notes=_notes(data.get("notes", []), where),
        fused_decode=fused,
        fused_timings=timings,
        fused_activations=activations,
        fused_variant_timings=variant_timings,
        fused_head=head,
        fused_head_timings=head_timings,
    )


def _parse_fused_head(
    entry: object, fused: Sequence[int], measured: list[dict[str, object]], where: str
) -> tuple[tuple[int, ...] | None, tuple[tuple[int, float, float], ...]]:
    """Where the fused stack runs the LM head (absent before warmup measured it: None, the
    default rule) and the timings behind that choice."""
    if not isinstance(entry, dict) or "head_buckets" not in entry:
        return None, ()
    chosen = entry["head_buckets"]
    if not isinstance(chosen, list) or any(type(b) is not int or b not in fused for b in chosen):
        raise _error(
            where,
            f"fused_decode head_buckets={chosen!r} is invalid: allowed is a list naming buckets "
            f"the fused stack runs ({list(fused)})",
        )
    timings = tuple(
        (int(_timed(item, "bucket")), _timed(item, "head_in_call"), _timed(item, "head_apart"))
        for item in measured
        if "head_in_call" in item and "head_apart" in item
    )
    return tuple(sorted(set(chosen))), timings


def _parse_fused_activations(
    entry: object, measured: list[dict[str, object]], where: str
) -> tuple[str, tuple[tuple[str, int, float], ...]]:
    """A plan's fused-stack activations (absent before int8 existed: float32) and the rounded
    variants' timings (`fused_int16`, `fused_int8` beside each bucket's)."""
    if not isinstance(entry, dict):
        return "float32", ()
    activations = entry.get("activations", "float32")
    if activations not in FUSED_ACTIVATIONS:
        raise _error(
            where,
            f"fused_decode activations={activations!r} is invalid: allowed are "
            f"{list(FUSED_ACTIVATIONS)}",
        )
    timings = tuple(
        (variant, int(_timed(item, "bucket")), _timed(item, f"fused_{variant}"))
        for item in measured
        for variant in FUSED_ACTIVATIONS
        if f"fused_{variant}" in item
    )
    return str(activations), timings


def _parse_fused(
    entry: object, buckets: Sequence[int], measured: list[dict[str, object]], where: str
) -> tuple[tuple[int, ...], tuple[tuple[int, float, float], ...]]:
    """A plan's `fused_decode` record (absent in version 1 plans: fused decode off)."""
    if entry is None:
        return (), ()
    chosen = entry.get("buckets") if isinstance(entry, dict) else None
    if (
        not isinstance(entry, dict)
        or not isinstance(chosen, list)
        or any(type(b) is not int or b not in buckets or b > FUSED_MAX_ROWS for b in chosen)
    ):
        raise _error(
            where,
            f"fused_decode={entry!r} is invalid: allowed is {{'buckets': [...]}} naming "
            f"decode buckets of the plan ({list(buckets)}) of at most {FUSED_MAX_ROWS} rows",
        )
    timings = tuple(
        (int(_timed(item, "bucket")), _timed(item, "fused"), _timed(item, "per_op"))
        for item in measured
        if "fused" in item and "per_op" in item
    )
    return tuple(sorted(set(chosen))), timings


def _parse_projection(name: str, entry: object, where: str) -> ProjectionChoice:
    """One projection's entry of a plan file: layout, forms per row bucket, split."""
    if not isinstance(entry, dict):
        raise _error(where, f"projection {name!r} must be an object")
    layout = entry.get("layout")
    if layout not in LAYOUTS:
        raise _error(where, f"{name}.layout={layout!r} is invalid: allowed are {LAYOUTS}")
    forms_raw = entry.get("forms")
    if not isinstance(forms_raw, list) or not forms_raw:
        raise _error(where, f"{name}.forms must be a non-empty list of [rows, form]")
    blocks = entry.get("blocks", "")
    if not isinstance(blocks, str):
        raise _error(where, f"{name}.blocks={blocks!r} is invalid: allowed is a GGUF type name")
    forms = [_parse_form(name, layout, item, where, bool(blocks)) for item in forms_raw]
    if [b for b, _ in forms] != sorted({b for b, _ in forms}):
        raise _error(where, f"{name}.forms buckets must be strictly increasing")
    split = entry.get("split", False)
    if not isinstance(split, bool):
        raise _error(where, f"{name}.split={split!r} is invalid: allowed is true or false")
    micro = _numbers(entry.get("microseconds", []), f"{name}.microseconds", where)
    if blocks and (layout != "out_in" or split):
        raise _error(where, f"{name} holds {blocks} blocks: allowed is out_in, unsplit")
    candidates_raw = entry.get("candidates_us", {})
    candidates = tuple(
        (str(form), _candidate_times(times, f"{name}.candidates_us.{form}", where))
        for form, times in sorted(candidates_raw.items())
        if isinstance(candidates_raw, dict) and isinstance(times, list)
    )
    return ProjectionChoice(layout, split, tuple(forms), micro, blocks, candidates)


def _candidate_times(times: list[object], field: str, where: str) -> tuple[float, ...]:
    """A candidate's recorded microseconds per bucket (null: not timed there, read as NaN)."""
    out: list[float] = []
    for us in times:
        if us is None:
            out.append(math.nan)
        elif _is_number(us):
            out.append(float(us))
        else:
            raise _error(where, f"{field} holds {us!r}: allowed are numbers and null")
    return tuple(out)


def _timed_us(us: float) -> float | None:
    """A candidate's microseconds for the file: null where it was not timed (the form does
    not run that bucket), so the manifest stays strict JSON (no NaN)."""
    return None if math.isnan(us) else round(us, 1)


def _parse_form(
    name: str, layout: Layout, item: object, where: str, blocks: bool
) -> tuple[int, str]:
    """One `[rows, form]` entry of a projection's forms, runnable from `layout` (a block
    form when the projection holds `blocks`)."""
    allowed = sorted(BLOCK_FORMS if blocks else FORMS)
    if (
        not isinstance(item, list)
        or len(item) != 2
        or type(item[0]) is not int
        or item[0] < 1
        or item[1] not in allowed
    ):
        raise _error(
            where,
            f"{name}.forms entry {item!r} is invalid: allowed is [rows >= 1, form] "
            f"with form one of {allowed}",
        )
    if blocks:
        block_form = BLOCK_FORMS[item[1]]
        if not block_form.fits(item[0]):
            raise _error(where, f"{name}: form {item[1]!r} cannot run {item[0]} rows")
        return item[0], item[1]
    form = FORMS[item[1]]
    if form.layout != layout or not form.fits(item[0]):
        raise _error(where, f"{name}: form {form.name!r} cannot run {item[0]} rows from {layout}")
    return item[0], item[1]


def load_kernel_plan(path: str | Path) -> KernelPlan:
    """Read a plan file (or a coverage manifest holding one); errors name the file."""
    where = f"--kernels {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise _error(where, f"cannot be read ({error.strerror or error})") from error
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise _error(where, f"is not JSON ({error})") from error
    plan = parse_kernel_plan(data, where=where)
    return attrs.evolve(plan, source=f"replayed from {Path(path).name} ({plan.source})")


def check_plan_fits(plan: KernelPlan, shapes: Mapping[str, ProjectionShape], where: str) -> None:
    """Refuse a plan whose projections are not exactly this model's (named by `where`)."""
    names = sorted(name for name, _ in plan.projections)
    if names != sorted(shapes):
        raise _error(
            where, f"covers projections {names}: allowed are this model's {sorted(shapes)}"
        )
    for name, choice in plan.projections:
        if choice.split and len(shapes[name].parts) == 1:
            raise _error(where, f"{name} is split, but this model's {name} has one part")
        held = shapes[name].blocks
        if choice.blocks != held:
            planned = f"{choice.blocks} blocks" if choice.blocks else "float weights"
            here = f"{held} blocks" if held else "float weights (--weights float32)"
            raise _error(
                where,
                f"{name} was planned for {planned}, this model holds {here}: allowed is a "
                "plan recorded with the same --weights on the same file",
            )
        for _, form in choice.forms:
            available = BLOCK_FORMS[form].available if held else FORMS[form].available
            if not available():
                needs = BLOCK_FORMS[form].needs if held else FORMS[form].needs
                native = native_kernels.unavailable_reason() if needs == NEEDS_NATIVE else None
                reason = native or f"it needs {needs}"
                raise _error(where, f"{name} uses form {form!r}, which cannot run here ({reason})")
    runs = {"int8": int8_activations_available, "int16": int16_activations_available}
    if plan.fused_activations in runs and not runs[plan.fused_activations]():
        allowed = ["float32"] + [name for name, available in runs.items() if available()]
        raise _error(
            where,
            f"fused_decode activations {plan.fused_activations!r} cannot run here (it needs "
            f"AVX-512 VNNI): allowed on this CPU are {allowed} (record the plan again here)",
        )

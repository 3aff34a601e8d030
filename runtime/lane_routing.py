"""Pure routing of one global request over data-parallel lanes, and the way back.

A global slot `s` belongs to lane `s // per_lane` at local slot `s % per_lane`. Prefill rows
follow their slots (keeping their relative order within a lane); decode splits the fixed
global batch into contiguous lane ranges. Row-scoped sampling fields travel with their rows;
length-1 values broadcast. Outputs come back in source-row order (prefill) or lane order
(decode); log probabilities of rows whose lane returned none read 1.0.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from runtime.prefill.batch import IntVector
from runtime.sampling import SamplingParams, slice_sampling_params
from runtime.steps import DecodeStep, PrefillStep
from runtime.validation import is_int

MISSING_LOGPROB = 1.0
EXECUTIONS = ("eager", "traced")
"""The per-lane `execution` names a lane executor takes (None: the lane's trace mode)."""


@attrs.frozen
class LaneRows:
    """The rows of one global prefill that one lane serves."""

    lane: int
    rows: tuple[int, ...]
    local_slots: tuple[int, ...]


def _int_list(name: str, value: object) -> list[int]:
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.reshape(-1).tolist()]
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        out: list[int] = []
        for item in value:
            if not is_int(item):
                raise TypeError(f"{name} must hold integers, got {item!r}")
            out.append(item)
        return out
    raise TypeError(f"{name} must be a sequence of slots, got {type(value).__name__}")


def route_prefill_rows(
    batch: int, empty_slots: IntVector, *, per_lane: int, lanes: int
) -> tuple[LaneRows, ...]:
    """Assign each source row to the lane of its global slot (only lanes with rows)."""
    slots = list(range(batch)) if empty_slots is None else _int_list("empty_slots", empty_slots)
    if len(slots) != batch:
        raise ValueError(f"empty_slots has {len(slots)} entries for a batch of {batch} rows")
    capacity = per_lane * lanes
    by_lane: dict[int, list[tuple[int, int]]] = {}
    for row, slot in enumerate(slots):
        if slot < 0 or slot >= capacity:
            raise ValueError(
                f"empty slot {slot} maps to an invalid DP lane (global slots are 0..{capacity - 1}"
                f" over {lanes} lanes of {per_lane})"
            )
        by_lane.setdefault(slot // per_lane, []).append((row, slot % per_lane))
    return tuple(
        LaneRows(lane, tuple(r for r, _ in pairs), tuple(s for _, s in pairs))
        for lane, pairs in sorted(by_lane.items())
    )


def select_rows(value: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """Rows of a row-scoped tensor (a 0-d tensor passes through)."""
    if value.dim() == 0:
        return value
    return value.index_select(0, torch.tensor(list(rows), dtype=torch.long))


def select_vector(value: IntVector, rows: Sequence[int]) -> IntVector:
    """Rows of a per-row vector (a tensor, list or tuple, kept as that kind); None stays."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return select_rows(value, rows)
    if isinstance(value, list):
        return [value[r] for r in rows]
    return tuple(value[r] for r in rows)


def slice_sampling(
    sampling_params: SamplingParams | None, rows: Sequence[int]
) -> SamplingParams | None:
    """Row-scoped sampling fields follow their rows; length-1 fields broadcast."""
    if sampling_params is None:
        return None
    if not isinstance(sampling_params, SamplingParams):
        raise TypeError(
            f"sampling_params must be SamplingParams or None, got {type(sampling_params).__name__}"
        )
    return slice_sampling_params(sampling_params, list(rows))


def history_for_lane(
    name: str,
    value: torch.Tensor | None,
    lane_rows: LaneRows,
    *,
    per_lane: int,
    capacity: int,
) -> torch.Tensor | None:
    """Prompt/output token history placed at the lane's local slots (other slots -1)."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor) or value.dim() < 1:
        raise TypeError(f"{name} must be a tensor [rows, ...], got {type(value).__name__}")
    count = value.shape[0]
    if count == 1:
        picked = value.expand(len(lane_rows.rows), *value.shape[1:])
    elif count == capacity:
        global_slots = [lane_rows.lane * per_lane + s for s in lane_rows.local_slots]
        picked = value.index_select(0, torch.tensor(global_slots, dtype=torch.long))
    else:
        picked = select_rows(value, lane_rows.rows)
    fill: bool | int = False if value.dtype == torch.bool else -1
    out = torch.full((per_lane, *value.shape[1:]), fill, dtype=value.dtype)
    out[torch.tensor(list(lane_rows.local_slots), dtype=torch.long)] = picked
    return out


def remap_for_lane(
    slot_remap: IntVector, lane: int, *, per_lane: int, lanes: int
) -> torch.Tensor | None:
    """A slot remap as lane-local indices (a global remap must stay inside each lane)."""
    if slot_remap is None:
        return None
    sources = _int_list("slot_remap", slot_remap)
    if len(sources) == per_lane:
        if any(s < 0 or s >= per_lane for s in sources):
            raise ValueError(f"slot_remap sources must be < the lane capacity {per_lane}")
        return torch.tensor(sources, dtype=torch.long)
    if len(sources) == per_lane * lanes:
        window = sources[lane * per_lane : (lane + 1) * per_lane]
        low = lane * per_lane
        if any(s < low or s >= low + per_lane for s in window):
            raise ValueError("slot_remap cannot move request-owned sampling state across DP lanes")
        return torch.tensor([s - low for s in window], dtype=torch.long)
    raise ValueError(
        f"slot_remap must have {per_lane} (one lane) or {per_lane * lanes} (global) entries, "
        f"got {len(sources)}"
    )


def per_lane_argument(name: str, value: object, lanes: int) -> list[object]:
    """A per-lane sequence argument (`kv_cache`, `execution`); None means the default."""
    if value is None:
        return [None] * lanes
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        raise TypeError(
            f"{name} must be a sequence with one entry per DP lane, got {type(value).__name__}"
        )
    if len(value) != lanes:
        raise ValueError(f"{name} has {len(value)} entries for {lanes} DP lanes")
    return list(value)


# -- one step, split ------------------------------------------------------------------------------


def lane_executions(value: object, lanes: int) -> list[str | None]:
    """`execution` per lane: None (each lane's own choice) or one name or None per lane."""
    entries: list[str | None] = []
    for entry in per_lane_argument("execution", value, lanes):
        if entry is not None and entry not in EXECUTIONS:
            raise ValueError(f"execution must be None, 'eager' or 'traced', got {entry!r}")
        entries.append(entry if isinstance(entry, str) else None)
    return entries


def split_prefill(
    step: PrefillStep,
    *,
    per_lane: int,
    lanes: int,
    kv_caches: Sequence[object],
    executions: Sequence[str | None],
) -> tuple[dict[int, PrefillStep], dict[int, LaneRows]]:
    """One global prefill as per-lane steps (only lanes with rows), and each lane's rows."""
    routes = route_prefill_rows(
        int(step.tokens.shape[0]), step.empty_slots, per_lane=per_lane, lanes=lanes
    )
    capacity = per_lane * lanes
    steps: dict[int, PrefillStep] = {}
    for lane_rows in routes:
        rows = lane_rows.rows
        steps[lane_rows.lane] = PrefillStep(
            tokens=select_rows(step.tokens, rows),
            page_table=select_rows(step.page_table, rows),
            prompt_lens=select_vector(step.prompt_lens, rows),
            start_pos=select_vector(step.start_pos, rows),
            empty_slots=list(lane_rows.local_slots),
            sampling_params=slice_sampling(step.sampling_params, rows),
            prompt_tokens=history_for_lane(
                "prompt_tokens", step.prompt_tokens, lane_rows, per_lane=per_lane, capacity=capacity
            ),
            output_tokens=history_for_lane(
                "output_tokens", step.output_tokens, lane_rows, per_lane=per_lane, capacity=capacity
            ),
            slot_remap=remap_for_lane(
                step.slot_remap, lane_rows.lane, per_lane=per_lane, lanes=lanes
            ),
            kv_cache=kv_caches[lane_rows.lane],
            execution=executions[lane_rows.lane],
        )
    return steps, {r.lane: r for r in routes}


def split_decode(
    step: DecodeStep,
    *,
    per_lane: int,
    lanes: int,
    kv_caches: Sequence[object],
    executions: Sequence[str | None],
) -> list[DecodeStep]:
    """One checked global decode (fixed global batch) as contiguous lane steps."""
    split: list[DecodeStep] = []
    for lane in range(lanes):
        rows = range(lane * per_lane, (lane + 1) * per_lane)
        split.append(
            DecodeStep(
                tokens=step.tokens[rows.start : rows.stop],
                start_pos=step.start_pos[rows.start : rows.stop],
                page_table=step.page_table[rows.start : rows.stop],
                sampling_params=slice_sampling(step.sampling_params, rows),
                prompt_tokens=_lane_history(step.prompt_tokens, rows, per_lane * lanes),
                output_tokens=_lane_history(step.output_tokens, rows, per_lane * lanes),
                slot_remap=remap_for_lane(step.slot_remap, lane, per_lane=per_lane, lanes=lanes),
                reset_batch=step.reset_batch,
                kv_cache=kv_caches[lane],
                execution=executions[lane],
                read_from_device=step.read_from_device,
                checked=step.checked,
            )
        )
    return split


def _lane_history(value: torch.Tensor | None, rows: range, capacity: int) -> torch.Tensor | None:
    """A global-slot history's lane rows; a broadcast (or lane-wide) history as it is."""
    if value is not None and int(value.shape[0]) == capacity:
        return value[rows.start : rows.stop]
    return value


def trace_probes(
    tokens: torch.Tensor,
    prompt_lens: IntVector,
    start_pos: IntVector,
    empty_slots: IntVector,
    *,
    per_lane: int,
    lanes: int,
) -> dict[int, dict[str, object]]:
    """Each participating lane's `can_trace_prefill` keywords: its rows of the three vectors
    that decide a trace (no page table: a probe reads none)."""
    routes = route_prefill_rows(int(tokens.shape[0]), empty_slots, per_lane=per_lane, lanes=lanes)
    return {
        lane_rows.lane: {
            "tokens": select_rows(tokens, lane_rows.rows),
            "prompt_lens": select_vector(prompt_lens, lane_rows.rows),
            "start_pos": select_vector(start_pos, lane_rows.rows),
        }
        for lane_rows in routes
    }


def one_per_lane(name: str, values: object, lanes: int) -> list[object]:
    """A list or tuple with exactly one value per lane (e.g. each lane's raw output)."""
    if not isinstance(values, list | tuple) or len(values) != lanes:
        raise ValueError(
            f"{name} needs one value per DP lane ({lanes}), got "
            f"{type(values).__name__}"
            + (f" of length {len(values)}" if isinstance(values, list | tuple) else "")
        )
    return list(values)


# -- the way back -------------------------------------------------------------------------------


def join_async_reads(outputs: Sequence[object]) -> tuple[list[object], list[object]]:
    """Each lane's `(host_value, events)` as one list of hosts and one flat list of events."""
    hosts: list[object] = []
    events: list[object] = []
    for index, output in enumerate(outputs):
        if not isinstance(output, tuple) or len(output) != 2:
            raise TypeError(
                f"DP lane {index} async read returned {type(output).__name__}; "
                "expected (host_value, events)"
            )
        hosts.append(output[0])
        events.extend(output[1])
    return hosts, events


LaneOutput = torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]
"""What one lane's prefill or decode returns: values, or values with their log-probs."""


def _split_logprobs(output: object) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """(values, log-probs or None, whether the lane returned a pair)."""
    paired = isinstance(output, tuple)
    if isinstance(output, tuple):
        if len(output) != 2:
            raise TypeError(f"a lane returned a {len(output)}-tuple; expected (values, log_probs)")
        values, logprobs = output
    else:
        values, logprobs = output, None
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"a lane returned {type(values).__name__}; expected a tensor")
    if logprobs is not None and not isinstance(logprobs, torch.Tensor):
        raise TypeError(
            f"a lane returned log-probs as {type(logprobs).__name__}; expected a tensor"
        )
    return values, logprobs, paired


def scatter_prefill(outputs: Sequence[tuple[LaneRows, object]], batch: int) -> LaneOutput:
    """Lane outputs back into one `[B, ...]` value in source-row order."""
    parts = [(rows, *_split_logprobs(out)) for rows, out in outputs]
    first = parts[0][1]
    integer = not first.is_floating_point()
    dtype = torch.int64 if integer else first.dtype
    result = torch.zeros((batch, *first.shape[1:]), dtype=dtype)
    any_logprobs = any(has and lp is not None for _, _, lp, has in parts)
    logprobs = torch.full((batch,), MISSING_LOGPROB, dtype=torch.float32)
    for rows, values, lane_logprobs, _ in parts:
        index = torch.tensor(list(rows.rows), dtype=torch.long)
        result[index] = values[: len(rows.rows)].to(dtype)
        if lane_logprobs is not None:
            logprobs[index] = lane_logprobs.reshape(-1)[: len(rows.rows)].to(torch.float32)
    if any(has for _, _, _, has in parts):
        return (result, logprobs if any_logprobs else None)
    return result


def concat_decode(outputs: Sequence[object], *, force_int64: bool = False) -> LaneOutput:
    """Lane outputs of one decode step, concatenated in lane order (None: a skipped lane)."""
    present = [out for out in outputs if out is not None]
    if not present:
        raise ValueError("no DP lane produced a decode output")
    template, _, _ = _split_logprobs(present[0])
    parts = [
        _split_logprobs(out if out is not None else torch.zeros_like(template)) for out in outputs
    ]
    values = [v for v, _, _ in parts]
    if force_int64 or not values[0].is_floating_point():
        values = [v.to(torch.int64) for v in values]
    joined = torch.cat(values, dim=0)
    if not any(has for _, _, has in parts):
        return joined
    if all(lp is None for _, lp, _ in parts):
        return (joined, None)
    logprobs = [
        lp.reshape(-1).to(torch.float32)
        if lp is not None
        else torch.full((v.shape[0],), MISSING_LOGPROB, dtype=torch.float32)
        for v, lp, _ in parts
    ]
    return (joined, torch.cat(logprobs))

"""Pure routing of one global request over data-parallel lanes, and the way back.

A global slot `s` belongs to lane `s // per_lane` at local slot `s % per_lane`. Prefill rows
follow their slots (keeping their relative order within a lane); decode splits the fixed
global batch into contiguous lane ranges. Row-scoped sampling fields travel with their rows;
length-1 values broadcast. Outputs come back in source-row order (prefill) or lane order
(decode); log probabilities of rows whose lane returned none read 1.0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from runtime.sampling import SamplingParams, slice_sampling_params
from runtime.validation import is_int

MISSING_LOGPROB = 1.0


@attrs.frozen
class LaneRows:
    """The rows of one global prefill that one lane serves."""

    lane: int
    rows: tuple[int, ...]
    local_slots: tuple[int, ...]


def _int_list(name: str, value: Any) -> list[int]:
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
    batch: int, empty_slots: Any, *, per_lane: int, lanes: int
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


def select_rows(value: Any, rows: Sequence[int]) -> Any:
    """Rows of a row-scoped tensor or sequence; None and scalars pass through."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return value
        return value.index_select(0, torch.tensor(list(rows), dtype=torch.long))
    if isinstance(value, list | tuple):
        return type(value)(value[r] for r in rows)
    return value


def slice_sampling(sampling_params: Any, rows: Sequence[int]) -> Any:
    """Row-scoped sampling fields follow their rows; length-1 fields broadcast."""
    if sampling_params is None:
        return None
    if not isinstance(sampling_params, SamplingParams):
        raise TypeError(
            f"sampling_params must be SamplingParams or None, got {type(sampling_params).__name__}"
        )
    return slice_sampling_params(sampling_params, list(rows))


def history_for_lane(
    name: str, value: Any, lane_rows: LaneRows, *, per_lane: int, capacity: int
) -> Any:
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


def remap_for_lane(slot_remap: Any, lane: int, *, per_lane: int, lanes: int) -> Any:
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


def per_lane_argument(name: str, value: Any, lanes: int) -> list[Any]:
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


# -- one request, split ---------------------------------------------------------------------------

_HISTORY = ("prompt_tokens", "output_tokens")


def split_prefill(
    request: dict[str, Any], *, per_lane: int, lanes: int
) -> tuple[dict[int, dict[str, Any]], dict[int, LaneRows]]:
    """One global prefill as per-lane requests (only lanes with rows), and each lane's rows."""
    request = dict(request)
    tokens = request.pop("tokens")
    routes = route_prefill_rows(
        int(tokens.shape[0]), request.pop("empty_slots", None), per_lane=per_lane, lanes=lanes
    )
    caches = per_lane_argument("kv_cache", request.pop("kv_cache", None), lanes)
    executions = per_lane_argument("execution", request.pop("execution", None), lanes)
    per_lane_requests: dict[int, dict[str, Any]] = {}
    for lane_rows in routes:
        out = {"tokens": select_rows(tokens, lane_rows.rows)}
        for name, value in request.items():
            out[name] = _prefill_field(name, value, lane_rows, per_lane=per_lane, lanes=lanes)
        out["empty_slots"] = list(lane_rows.local_slots)
        _add_lane_defaults(out, caches[lane_rows.lane], executions[lane_rows.lane])
        per_lane_requests[lane_rows.lane] = out
    return per_lane_requests, {r.lane: r for r in routes}


def _prefill_field(name: str, value: Any, lane_rows: LaneRows, *, per_lane: int, lanes: int) -> Any:
    rows = lane_rows.rows
    if name in ("page_table", "prompt_lens", "start_pos"):
        return select_rows(value, rows)
    if name == "sampling_params":
        return slice_sampling(value, rows)
    if name in _HISTORY:
        return history_for_lane(
            name, value, lane_rows, per_lane=per_lane, capacity=per_lane * lanes
        )
    if name == "slot_remap":
        return remap_for_lane(value, lane_rows.lane, per_lane=per_lane, lanes=lanes)
    return value


def _add_lane_defaults(out: dict[str, Any], kv_cache: Any, execution: Any) -> None:
    """A lane's own KV cache and execution choice, only where the caller gave one."""
    if kv_cache is not None:
        out["kv_cache"] = kv_cache
    if execution is not None:
        out["execution"] = execution


def split_decode(
    request: dict[str, Any], *, per_lane: int, lanes: int, compile_only: bool = False
) -> list[dict[str, Any]]:
    """Validate one global decode (fixed global batch) and split it into contiguous lane batches."""
    request = dict(request)
    global_batch = per_lane * lanes
    for name in ("tokens", "start_pos", "page_table"):
        value = request.get(name)
        if value is None:
            if compile_only:
                continue
            raise TypeError(f"decode_forward() needs {name}")
        if int(value.shape[0]) != global_batch:
            raise ValueError(
                f"DP decode expects fixed global batch {global_batch}; {name} has "
                f"{int(value.shape[0])} rows ({lanes} lanes x {per_lane})"
            )
    caches = per_lane_argument("kv_cache", request.pop("kv_cache", None), lanes)
    executions = per_lane_argument("execution", request.pop("execution", None), lanes)
    split: list[dict[str, Any]] = []
    for lane in range(lanes):
        rows = range(lane * per_lane, (lane + 1) * per_lane)
        out = {
            name: _decode_field(name, value, lane, rows, per_lane=per_lane, lanes=lanes)
            for name, value in request.items()
        }
        _add_lane_defaults(out, caches[lane], executions[lane])
        split.append(out)
    return split


def _decode_field(
    name: str, value: Any, lane: int, rows: range, *, per_lane: int, lanes: int
) -> Any:
    if name in ("tokens", "start_pos", "page_table"):
        return value[rows.start : rows.stop]
    if name == "sampling_params":
        return slice_sampling(value, rows)
    if name in _HISTORY:
        whole = value is not None and int(value.shape[0]) == per_lane * lanes
        return value[rows.start : rows.stop] if whole else value
    if name == "slot_remap":
        return remap_for_lane(value, lane, per_lane=per_lane, lanes=lanes)
    return value


def one_per_lane(name: str, values: Any, lanes: int) -> list[Any]:
    """A list or tuple with exactly one value per lane (e.g. each lane's raw output)."""
    if not isinstance(values, list | tuple) or len(values) != lanes:
        raise ValueError(
            f"{name} needs one value per DP lane ({lanes}), got "
            f"{type(values).__name__}"
            + (f" of length {len(values)}" if isinstance(values, list | tuple) else "")
        )
    return list(values)


# -- the way back -------------------------------------------------------------------------------


def join_async_reads(outputs: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """Each lane's `(host_value, events)` as one list of hosts and one flat list of events."""
    hosts: list[Any] = []
    events: list[Any] = []
    for index, output in enumerate(outputs):
        if not isinstance(output, tuple) or len(output) != 2:
            raise TypeError(
                f"DP lane {index} async read returned {type(output).__name__}; "
                "expected (host_value, events)"
            )
        hosts.append(output[0])
        events.extend(output[1])
    return hosts, events


def _split_logprobs(output: Any) -> tuple[Any, Any, bool]:
    if isinstance(output, tuple):
        if len(output) != 2:
            raise TypeError(f"a lane returned a {len(output)}-tuple; expected (values, log_probs)")
        return output[0], output[1], True
    return output, None, False


def scatter_prefill(outputs: Sequence[tuple[LaneRows, Any]], batch: int) -> Any:
    """Lane outputs back into one `[B, ...]` value in source-row order."""
    parts = [(rows, *_split_logprobs(out)) for rows, out in outputs]
    first = parts[0][1]
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"a lane returned {type(first).__name__}; expected a tensor")
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


def concat_decode(outputs: Sequence[Any], *, force_int64: bool = False) -> Any:
    """Lane outputs of one decode step, concatenated in lane order (None: a skipped lane)."""
    present = [out for out in outputs if out is not None]
    if not present:
        raise ValueError("no DP lane produced a decode output")
    template, _, _ = _split_logprobs(present[0])
    outputs = [out if out is not None else torch.zeros_like(template) for out in outputs]
    parts = [_split_logprobs(out) for out in outputs]
    values = [v for v, _, _ in parts]
    if not all(isinstance(v, torch.Tensor) for v in values):
        raise TypeError("every lane must return a tensor from decode")
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

"""The benchmark's text report: decode-only and end-to-end tokens/s per batch size."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NotRequired, TypedDict, final

from runtime.json_types import JSONValue


class EngineRates(TypedDict):
    """One engine's runs at one batch size: seconds per run and the best rates (tokens/s)."""

    decode_seconds: list[float]
    decode_tokens_per_second: float
    total_seconds: list[float]
    end_to_end_tokens_per_second: float


@final
class LaneRates(EngineRates):
    """This runtime's rates on one lane, with its prefill time and its kernel choice."""

    prefill_seconds: float
    kernels: JSONValue


@final
class AnchorRates(EngineRates):
    """The one-lane anchor of a lane comparison, with the torch threads it was given."""

    torch_threads: int


class LaneGroupRates(EngineRates):
    """A lane group's rates, its shape and its per-decode-step host bookkeeping per repeat."""

    lanes: int
    lane_transport: str
    threads_per_lane: int
    per_decode_step: list[Mapping[str, int | float]]


class BenchRow(TypedDict):
    """One batch size: what it measured, this runtime's rates and what they are compared to."""

    batch_size: int
    prompt_len_min: int
    prompt_len_max: int
    prompt_len_mean: float
    new_tokens: int
    runtime: LaneRates | AnchorRates
    transformers: NotRequired[EngineRates]
    ratio: NotRequired[float]
    end_to_end_ratio: NotRequired[float]
    lane_group: NotRequired[LaneGroupRates]
    lanes_ratio: NotRequired[float]
    lanes_end_to_end_ratio: NotRequired[float]


class BenchReport(TypedDict):
    """The whole benchmark (`--json` prints it as is)."""

    model: str
    cpu: str  # model, generation and the SIMD flags that matter (rates differ most by these)
    load_average: dict[str, list[float]]  # 1/5/15-minute load at the start and the end
    device: str
    dtype: str
    weights: str
    trace_mode: str
    torch_threads: int
    method: str
    results: list[BenchRow]


def format_row(row: BenchRow) -> str:
    """One batch size: decode-only and end-to-end tokens/s of each engine, with the ratios."""
    ours = row["runtime"]
    text = f"batch {row['batch_size']:>3}  prompts {row['prompt_len_min']}-{row['prompt_len_max']}"
    for label, decode_only in (("decode-only", True), ("end-to-end", False)):
        text += f"\n  {label:<11}  runtime {_rate(ours, decode_only):8.1f} tok/s"
        if "transformers" in row:
            theirs = _rate(row["transformers"], decode_only)
            ratio = row["ratio"] if decode_only else row["end_to_end_ratio"]
            text += f"  transformers {theirs:8.1f} tok/s  ratio {ratio:.2f}x"
        if "lane_group" in row:
            group = row["lane_group"]
            lanes_ratio = row["lanes_ratio"] if decode_only else row["lanes_end_to_end_ratio"]
            threads = ours.get("torch_threads", "?")
            text += (
                f" ({threads} threads)  {group['lanes']} {group['lane_transport']} "
                f"lanes {_rate(group, decode_only):8.1f} tok/s  ratio {lanes_ratio:.2f}x"
            )
    if "lane_group" in row:
        for step in row["lane_group"]["per_decode_step"]:
            text += (
                f"\n  per decode step: group bookkeeping {step['host_overhead_us_per_step']:.0f} us"
                f", transport {step['transport_us_per_step']:.0f} us, slowest lane "
                f"{step['slowest_lane_us_per_step']:.0f} us"
            )
    return text


def _rate(rates: EngineRates, decode_only: bool) -> float:
    """The decode-only or the end-to-end tokens/s of one engine."""
    if decode_only:
        return rates["decode_tokens_per_second"]
    return rates["end_to_end_tokens_per_second"]


def format_report(report: BenchReport) -> str:
    """Plain text: decode-only and end-to-end tokens/s per batch size."""
    lines = [
        f"{report['model']} {report['dtype']} (--weights {report['weights']}) on "
        f"{report['device']} "
        f"({report['torch_threads']} torch threads); {report['method']}",
    ]
    lines.extend(format_row(row) for row in report["results"])
    return "\n".join(lines)

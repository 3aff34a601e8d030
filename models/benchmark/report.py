"""The benchmark's text report: decode-only and end-to-end tokens/s per batch size."""

from __future__ import annotations

from typing import Any


def format_row(row: dict[str, Any]) -> str:
    """One batch size: decode-only and end-to-end tokens/s of each engine, with the ratios."""
    ours = row["runtime"]
    text = f"batch {row['batch_size']:>3}  prompts {row['prompt_len_min']}-{row['prompt_len_max']}"
    for label, key, ratio in (
        ("decode-only", "decode_tokens_per_second", "ratio"),
        ("end-to-end", "end_to_end_tokens_per_second", "end_to_end_ratio"),
    ):
        text += f"\n  {label:<11}  runtime {ours[key]:8.1f} tok/s"
        if "transformers" in row:
            theirs = row["transformers"][key]
            text += f"  transformers {theirs:8.1f} tok/s  ratio {row[ratio]:.2f}x"
        if "lane_group" in row:
            group = row["lane_group"]
            lanes_ratio = row["lanes_ratio" if ratio == "ratio" else "lanes_end_to_end_ratio"]
            text += (
                f" ({ours['torch_threads']} threads)  {group['lanes']} {group['lane_transport']} "
                f"lanes {group[key]:8.1f} tok/s  ratio {lanes_ratio:.2f}x"
            )
    if "lane_group" in row:
        for step in row["lane_group"]["per_decode_step"]:
            text += (
                f"\n  per decode step: group bookkeeping {step['host_overhead_us_per_step']:.0f} us"
                f", transport {step['transport_us_per_step']:.0f} us, slowest lane "
                f"{step['slowest_lane_us_per_step']:.0f} us"
            )
    return text


def format_report(report: dict[str, Any]) -> str:
    """Plain text: decode-only and end-to-end tokens/s per batch size."""
    lines = [
        f"{report['model']} {report['dtype']} on {report['device']} "
        f"({report['torch_threads']} torch threads); {report['method']}",
    ]
    lines.extend(format_row(row) for row in report["results"])
    return "\n".join(lines)

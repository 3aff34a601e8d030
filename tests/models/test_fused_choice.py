"""Warmup's choice of the fused stack, its activation variant and where it runs the LM head
(`fused_choice`), on made-up timings: each decode bucket weighs alike, so noise at 32 rows
(where the variants run the same exact panels) cannot outvote a gain at 1 row; buckets keep
the stack only where it beat the per-op path; the head goes in the call where that measured
faster; every variant's time is recorded."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

import models.decoder.fused_choice as fused_choice
from models.decoder.kernels import KernelPlan

# bucket -> ({variant: fused us}, per-op us)
TIMINGS = {
    1: ({"float32": 3300.0, "int16": 3100.0}, 6600.0),
    8: ({"float32": 10400.0, "int16": 9300.0}, 13300.0),
    # the same exact panels both ways: 5% of noise against int16, 1.5 ms of it
    32: ({"float32": 29700.0, "int16": 31200.0}, 29000.0),
}
# bucket -> what running the LM head in its own call adds to the fused step (us)
HEAD_APART = {1: 300.0, 8: -500.0, 32: 1500.0}


def _plan() -> KernelPlan:
    return KernelPlan(
        projections=(),
        decode_attention="paged_inplace",
        buckets=(1, 8, 32, 256),  # the last bucket is the prefill chunk's
        source="measured",
        dtype="float32",
        threads=2,
        cpu="test",
    )


def test_the_variant_faster_per_bucket_is_kept_and_every_time_recorded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def timed(model: Any, rows: int, block_size: int, variants: tuple[str, ...]) -> Any:
        """Each variant's time with the head in the call; apart it costs HEAD_APART more."""
        fused, per_op = TIMINGS[rows]
        return {
            v: (fused[v] / 1e6, (fused[v] + HEAD_APART[rows]) / 1e6) for v in variants
        }, per_op / 1e6

    monkeypatch.setattr(fused_choice, "fused_unsupported_reason", lambda model: None)
    monkeypatch.setattr(fused_choice, "_variants", lambda model: ("float32", "int16"))
    monkeypatch.setattr(fused_choice, "_time_bucket", timed)
    model = SimpleNamespace(paged_attention_config=None)
    chosen = fused_choice._choose(model, _plan())  # type: ignore[arg-type]
    # summed plainly float32 would win (43400 against 43600 us); bucket by bucket int16 does
    assert chosen.fused_activations == "int16"
    assert chosen.fused_decode == (1, 8)  # at 32 rows the per-op path measured faster
    # at 8 rows the stack is faster with the head in its own call
    measured = [value for timing in chosen.fused_timings for value in timing]
    assert measured == pytest.approx([1, 3100, 6600, 8, 8800, 13300, 32, 31200, 29000])
    assert chosen.fused_head == (1,) and chosen.head_in_stack() == (1,)
    placed = [value for timing in chosen.fused_head_timings for value in timing]
    assert placed == pytest.approx([1, 3100, 3400, 8, 9300, 8800, 32, 31200, 32700])
    assert {(v, b) for v, b, _ in chosen.fused_variant_timings} == {
        (v, b) for b in TIMINGS for v in ("float32", "int16")
    }
    recorded = chosen.to_json()["fused_decode"]
    assert isinstance(recorded, dict)
    first = {"bucket": 1, "fused": 3100.0, "per_op": 6600.0}
    assert recorded["measured_us"][0] == {
        **first,
        "fused_float32": 3300.0,
        "fused_int16": 3100.0,
        "head_in_call": 3100.0,
        "head_apart": 3400.0,
    }
    assert recorded["head_buckets"] == [1]


@pytest.mark.parametrize(
    ("bucket", "in_call", "apart", "expected"),
    [
        (1, 1010.0, 1000.0, True),  # apart 1% faster: within the margin, the default stays
        (4, 1030.0, 1000.0, False),  # apart 3% faster: moved out
        (8, 990.0, 1000.0, False),  # in the call 1% faster: within the margin, stays apart
        (32, 970.0, 1000.0, True),  # in the call 3% faster: moved in
    ],
)
def test_the_head_leaves_its_default_place_only_past_the_margin(
    bucket: int, in_call: float, apart: float, expected: bool
) -> None:
    assert fused_choice._head_in_call(bucket, in_call, apart) is expected

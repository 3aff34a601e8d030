"""Warmup times the in-place decode attention's two prefetch placements and records the
faster in the kernel plan; a replayed plan applies its placement, or is refused naming the
plan where the in-place kernel cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
import torch

from models.decoder import DecoderModel, attention_choice, random_state_dict
from models.decoder.attention_choice import choose_in_place_attention
from models.decoder.kernels import (
    IN_PLACE_ATTENTION,
    READ_PASS,
    SPREAD,
    KernelPlan,
    load_kernel_plan,
)
from models.llama import LlamaArgs
from runtime.backends import native_kernels

REASON = native_kernels.unavailable_reason()
needs_native = pytest.mark.skipif(
    REASON is not None, reason=f"the native CPU kernels need a C compiler (gcc): {REASON}"
)


def _model() -> DecoderModel:
    args = LlamaArgs.tiny_random("gqa")
    return DecoderModel.from_state_dict(args, random_state_dict(args, seed=3))


@pytest.fixture
def fresh_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget this process's earlier timings, so that each test times (or fakes) anew."""
    monkeypatch.setattr(attention_choice, "_CHOSEN", {})


@pytest.mark.usefixtures("fresh_choices")
@pytest.mark.parametrize(("times", "expected"), [((2.0, 1.0), SPREAD), ((1.0, 2.0), READ_PASS)])
def test_the_faster_placement_is_chosen_and_kept_for_the_process(
    monkeypatch: pytest.MonkeyPatch, times: tuple[float, float], expected: str
) -> None:
    calls: list[int] = []

    def fake(*geometry: object) -> tuple[float, float]:
        calls.append(1)
        return times

    monkeypatch.setattr(attention_choice, "_time_placements", fake)
    kind, note = choose_in_place_attention(n_kv_heads=2, group=2, head_dim=16, dtype=torch.float32)
    assert kind == expected
    assert (
        f"read pass {times[0] * 1e3:.2f} ms, spread through the math {times[1] * 1e3:.2f}" in note
    )
    again = choose_in_place_attention(n_kv_heads=2, group=2, head_dim=16, dtype=torch.float32)
    assert again == (kind, note) and len(calls) == 1  # one timing per geometry and process


@needs_native
@pytest.mark.usefixtures("fresh_choices")
def test_the_real_timing_reads_memory_and_names_both_times() -> None:
    read_pass, spread = attention_choice._time_placements(3, 3, 64, torch.float32)
    assert 0.0 < read_pass < 1.0 and 0.0 < spread < 1.0
    kind, note = choose_in_place_attention(n_kv_heads=3, group=3, head_dim=64, dtype=torch.float32)
    assert kind in IN_PLACE_ATTENTION and "spread through the math" in note


@needs_native
@pytest.mark.usefixtures("fresh_choices")
def test_warmup_records_the_placement_and_a_replay_applies_the_other(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(attention_choice, "_time_placements", lambda *g: (1.0, 2.0))
    model = _model()
    record = model.choose_kernels(decode_rows=4, prefill_rows=32)
    assert record["decode_attention"] == READ_PASS == model.decode_attention
    assert any("decode attention prefetch timed" in str(n) for n in record["notes"])
    assert model.kernel_plan is not None
    recorded = attrs.evolve(model.kernel_plan, decode_attention=SPREAD, fused_decode=(1, 2, 4))
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps({"kernels": recorded.to_json()}), encoding="utf-8")
    replayed = _model()
    replayed.replay_kernels(load_kernel_plan(path), where=f"--kernels {path}")
    again = replayed.choose_kernels(decode_rows=4, prefill_rows=32)
    assert again["decode_attention"] == SPREAD == replayed.decode_attention
    assert replayed.fused_decode is not None and replayed.fused_decode.spread_attention
    assert "decode attention paged_inplace_spread" in str(again["summary"])


def _hand_plan(model: DecoderModel) -> KernelPlan:
    """A plan of the default forms, with the spread placement, as a file would hold it."""
    model.choose_kernels(decode_rows=1, prefill_rows=16)
    assert model.kernel_plan is not None
    return attrs.evolve(model.kernel_plan, decode_attention=SPREAD, fused_decode=())


@pytest.mark.usefixtures("no_compiler")
def test_without_a_compiler_a_plan_naming_the_spread_placement_is_refused() -> None:
    source = _model()
    plan = _hand_plan(source)
    model = _model()
    with pytest.raises(
        ValueError,
        match=r"--kernels k\.json: decode_attention 'paged_inplace_spread' cannot run here "
        r"\(no C compiler found.*allowed here is 'gather'",
    ):
        model.replay_kernels(plan, where="--kernels k.json")
    assert model.kernel_plan is None and model.decode_attention is None

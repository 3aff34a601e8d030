"""`benchmarks/decode_step_breakdown.py`: what a negative rest means, the allocated page order,
the paired ratios (its flags: `test_benchmark_flags.py`)."""

from __future__ import annotations

import random
import time

import attrs
import pytest
import torch

from benchmarks.decode_step_breakdown import (
    Pair,
    _paired,
    _paired_lines,
    _paired_summary,
    _rest_lines,
    _step_inputs,
    cache_resident,
)
from benchmarks.model_step_times import BLOCK_SIZE, _cases
from models.decoder import DecoderModel, random_state_dict
from models.llama import LlamaArgs
from runtime.backends import native_kernels
from runtime.backends.native_kernels import STACK_PHASES


def test_a_positive_rest_is_one_line() -> None:
    lines = _rest_lines(80.0, 72.5)
    assert len(lines) == 1
    assert lines[0].startswith("rest (per-op step - parts)")
    assert lines[0].endswith("7.50 ms")


def test_a_negative_rest_says_to_measure_longer() -> None:
    lines = _rest_lines(70.0, 72.5)
    assert lines[0].endswith("-2.50 ms")
    assert "raise --reps or --passes" in lines[1]


def test_allocated_pages_are_consecutive_per_row_with_the_shuffled_cases_rows() -> None:
    """`--pages allocated` changes only where the pages are: the same rows, positions and
    tokens as the shuffled case, each row's pages one consecutive run."""
    args = attrs.evolve(LlamaArgs.tiny_random("gqa"), max_seq_len=1024)  # contexts to 520
    model = DecoderModel.from_state_dict(args, random_state_dict(args, seed=3))
    seen = {}
    for order in ("shuffled", "allocated"):
        call = _cases(model, random.Random(0), order)["decode b32 ctx48-520"]
        seen[order] = _step_inputs(model, call)
    shuffled, allocated = seen["shuffled"], seen["allocated"]
    assert torch.equal(shuffled["positions"], allocated["positions"])
    table = allocated["page_table"].long()
    for row, position in enumerate(allocated["positions"].tolist()):
        pages = table[row, : position // BLOCK_SIZE + 1]
        assert torch.equal(pages, torch.arange(int(pages[0]), int(pages[0]) + len(pages)))
    assert not torch.equal(shuffled["page_table"], allocated["page_table"])
    with pytest.raises(ValueError, match="pages='random' is invalid"):
        _cases(model, random.Random(0), "random")


def test_paired_ratios_use_each_pairs_own_probe_and_split_by_read_mode() -> None:
    """A part's ratio is its time over the floor at the rate of the probe timed just before
    it, so a mode change between pairs moves the floor with the part; the fastest third of
    the probe rates is reported apart."""
    kv_bytes = 1e9
    pairs = [
        # slow mode: 30 GB/s, floor 33.3 ms
        Pair("attention", 30e9, 0.040),  # 1.2x
        Pair("walk", 30e9, 0.035),  # 1.05x
        Pair("attention", 31e9, 0.0400),
        Pair("walk", 31e9, 0.0350),
        # fast mode: 60 GB/s, floor 16.7 ms
        Pair("attention", 60e9, 0.025),  # 1.5x
        Pair("walk", 60e9, 0.022),  # 1.32x
    ]
    slow, middle, fast = _paired_summary(pairs, kv_bytes)
    assert fast["probe_gb_s"] == pytest.approx([60.0, 60.0])
    assert fast["median_ratio"] == pytest.approx({"attention": 1.5, "walk": 1.32})
    assert slow["median_ratio"] == pytest.approx({"attention": 1.2, "walk": 1.05})
    assert sum(sum(group["pairs"].values()) for group in (slow, middle, fast)) == len(pairs)
    lines = _paired_lines([fast])
    assert lines == ["paired with a probe at 60.0-60.0 GB/s (medians): attention 1.50x, walk 1.32x"]
    single = _paired_summary(pairs[:2], kv_bytes)  # too few to split: one group
    assert len(single) == 1 and single[0]["pairs"] == {"attention": 1, "walk": 1}


def test_a_fused_parts_pair_times_its_attention_phase_and_the_others_their_call() -> None:
    """`_paired`: for the fused step and its reads-only twin, the seconds are the attention
    phase their own call recorded, not the whole call; other parts are timed whole."""
    phases: dict[str, list[list[float]]] = {"fused": [], "fused walk": []}

    def fused_call(name: str, attention: float) -> None:
        seconds = [0.5] * len(STACK_PHASES)
        seconds[STACK_PHASES.index("attention")] = attention
        phases[name].append(seconds)

    parts = {
        "plain": lambda: None,
        "fused": lambda: fused_call("fused", 0.012),
        "fused walk": lambda: fused_call("fused walk", 0.009),
    }
    pairs = _paired(lambda: time.sleep(1e-4), parts, phases, 2)
    assert [pair.part for pair in pairs] == ["plain", "fused", "fused walk"] * 2
    by_part = {pair.part: pair.seconds for pair in pairs}
    assert by_part["fused"] == 0.012 and by_part["fused walk"] == 0.009
    assert by_part["plain"] < 0.1
    assert len(phases["fused"]) == len(phases["fused walk"]) == 2


def test_the_cache_resident_table_keeps_the_rows_and_math_on_two_pages() -> None:
    """The CPU-work reference: every mapped page becomes page 0 or 1, unmapped ones stay -1,
    so the kernel does the same math over K/V that fit in cache; its output is the attention
    over those two pages' keys, which the per-row gather of the same table reproduces."""
    pages = torch.tensor([[7, 12, 3, -1], [5, -1, 8, 9]])
    resident = cache_resident(pages)
    assert resident.tolist() == [[1, 0, 1, -1], [1, -1, 0, 1]]
    assert torch.equal(pages, torch.tensor([[7, 12, 3, -1], [5, -1, 8, 9]]))  # not changed
    kv, group, head_dim, block = 2, 3, 16, 4
    k = torch.randn(16, kv, block, head_dim)
    v = torch.randn(16, kv, block, head_dim)
    q = torch.randn(2, kv, group, head_dim)
    n_keys = torch.tensor([14, 16])
    out = native_kernels.paged_decode_attention().unchecked(q, k, v, resident, n_keys, 0.25)
    for row in range(2):
        keys, values = [], []
        for slot in range(4):
            page = int(resident[row, slot])
            count = min(block, int(n_keys[row]) - slot * block)
            if page >= 0 and count > 0:
                keys.append(k[page, :, :count])
                values.append(v[page, :, :count])
        kk, vv = torch.cat(keys, dim=1), torch.cat(values, dim=1)  # [kv, keys, hd]
        weights = torch.softmax(torch.einsum("hgd,hkd->hgk", q[row], kk) * 0.25, dim=-1)
        expected = torch.einsum("hgk,hkd->hgd", weights, vv)
        assert torch.allclose(out[row], expected, atol=1e-5)

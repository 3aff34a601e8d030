"""The native greedy choice (`native/argmax_rows.c`) gives `torch.argmax(x, dim=-1)` exactly:
ties to the first index, the first NaN where a row has one, infinities, rows shorter than a
vector and vector tails; what it does not take falls back to torch (`greedy_tokens`)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from runtime.backends import native_kernels
from runtime.sampling.greedy import greedy_tokens
from tests.runtime.test_quant_kernels import torch_threads

REASON = native_kernels.unavailable_reason()
pytestmark = pytest.mark.skipif(
    REASON is not None, reason=f"the native CPU kernels need a C compiler (gcc): {REASON}"
)
SPECIALS = (float("nan"), float("inf"), float("-inf"), -0.0)


# 16 and 17 columns: one full vector, then one with a tail of 1; 49152: SmolLM2's vocabulary.
@example(rows=1, columns=16, levels=3, specials=0, threads=1, seed=1)
@example(rows=3, columns=17, levels=2, specials=2, threads=2, seed=2)
@example(rows=2, columns=49152, levels=5, specials=1, threads=2, seed=3)
@given(
    rows=st.integers(1, 40),
    columns=st.integers(1, 300),
    levels=st.integers(1, 6),
    specials=st.integers(0, 3),
    threads=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_native_argmax_equals_torch(
    rows: int, columns: int, levels: int, specials: int, threads: int, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    # few distinct values, so most rows have ties for the largest
    x = torch.randint(0, levels, (rows, columns), generator=generator).float()
    for _ in range(specials):
        row = int(torch.randint(0, rows, (1,), generator=generator))
        column = int(torch.randint(0, columns, (1,), generator=generator))
        x[row, column] = SPECIALS[int(torch.randint(0, len(SPECIALS), (1,), generator=generator))]
    with torch_threads(threads):
        got = native_kernels.argmax_rows()(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, torch.argmax(x, dim=-1))


def test_rows_of_one_value_pick_their_first_index() -> None:
    kernel = native_kernels.argmax_rows()
    for value in (float("-inf"), 0.0, float("nan")):
        assert kernel(torch.full((2, 40), value)).tolist() == [0, 0]


def test_what_the_kernel_does_not_take_is_refused_and_greedy_falls_back() -> None:
    kernel = native_kernels.argmax_rows()
    x = torch.randn(4, 33)
    for bad in (x.to(torch.bfloat16), x.t(), x[0], torch.empty(3, 0)):
        assert not kernel.takes(bad)
        with pytest.raises(ValueError, match="allowed is a contiguous 2-D float32 CPU tensor"):
            kernel(bad)
    for other in (x.to(torch.bfloat16), x.t()):
        assert torch.equal(greedy_tokens(other), torch.argmax(other, dim=-1))

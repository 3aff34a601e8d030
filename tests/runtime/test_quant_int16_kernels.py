"""The int16-activation product over q4 and Q8_0 blocks (`q_int16`, VNNI) stays within its
stated error bound (`runtime.quant.rounded_activations.error_bound(..., INT16_LEVELS)`) of the
`gguf` package's dequantized weights, rounds for real (it is not `q_rows` under another
name), and refuses blocks it does not take."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from runtime.backends import native_kernels
from runtime.quant.gguf_blocks import STORED_TYPES, repack
from runtime.quant.rounded_activations import INT16_LEVELS, error_bound
from tests.runtime.quant_fixtures import gguf_reference, raw_blocks
from tests.runtime.test_quant_kernels import torch_threads

REASON = native_kernels.unavailable_reason()
INT16 = REASON is None and native_kernels.quant_matmul().int16_available
pytestmark = pytest.mark.skipif(
    not INT16,
    reason="the int16-activation kernel needs gcc and a CPU with AVX-512 VNNI "
    f"({REASON or 'this CPU has no AVX-512 VNNI'})",
)
# q4 blocks, and q8 ones of 32 values (Q8_0; Q6_K repacks into q8 blocks of 16: refused)
TAKEN_TYPES = [*sorted(name for name in STORED_TYPES if name.startswith("Q4")), "Q8_0"]


# An odd block count leaves the last pair half empty; 17 blocks cross a 16-block scale group.
# One activation row takes its own layout in groups of 4 blocks (`qb_q4_i16_row_tile`): 5 and
# 7 blocks end in a part group, read masked (Q4_K's float32 scales in place, to the last byte);
# Q8_0 in pairs of blocks (an odd count ends in half a pair).
@example(type_name="Q4_K", blocks=7, half_rows=5, batch=1, threads=2, seed=8)
@example(type_name="Q4_0", blocks=5, half_rows=1, batch=1, threads=3, seed=9)
@example(type_name="Q4_1", blocks=8, half_rows=6, batch=1, threads=1, seed=10)
@example(type_name="Q8_0", blocks=6, half_rows=9, batch=1, threads=3, seed=11)
# From 11 rows (Q8_0 at every row count) the product runs on int16 panels
# (`gemm_panels_i16.h`): 16-row groups up to 16 rows, 32-row groups past them, 128 rows a pass
# (131: a second pass of 3).
@example(type_name="Q4_0", blocks=17, half_rows=3, batch=5, threads=2, seed=1)
@example(type_name="Q4_1", blocks=3, half_rows=0, batch=1, threads=1, seed=2)
@example(type_name="Q4_1", blocks=5, half_rows=8, batch=11, threads=2, seed=3)
@example(type_name="Q4_K", blocks=1, half_rows=2, batch=17, threads=3, seed=4)
@example(type_name="Q4_0", blocks=3, half_rows=20, batch=131, threads=2, seed=5)
@example(type_name="Q8_0", blocks=3, half_rows=4, batch=1, threads=2, seed=6)
@example(type_name="Q8_0", blocks=1, half_rows=3, batch=40, threads=3, seed=7)
@given(
    type_name=st.sampled_from(TAKEN_TYPES),
    blocks=st.integers(1, 8),
    half_rows=st.integers(0, 40),
    batch=st.integers(1, 70),
    threads=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_int16_product_is_within_its_bound_of_the_gguf_reference(
    type_name: str, blocks: int, half_rows: int, batch: int, threads: int, seed: int
) -> None:
    rows = 2 * half_rows + 1
    cols = blocks * STORED_TYPES[type_name][0]
    raw = raw_blocks(type_name, rows, cols, seed)
    matrix = repack(type_name, raw, rows, cols)
    x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(seed))
    x[:, :: max(1, cols // 7)] *= 50.0  # outliers: steps are set by each block's largest value
    with torch_threads(threads):
        got = native_kernels.quant_matmul().unchecked_int16(matrix, x)
    assert got.shape == (batch, rows) and got.dtype == torch.float32
    want = x.double() @ gguf_reference(type_name, raw).T
    excess = (got.double() - want).abs() - error_bound(matrix, x, INT16_LEVELS)
    assert float(excess.max()) <= 0.0, f"worst error exceeds its bound by {float(excess.max())}"


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0"])
def test_int16_product_rounds_the_activations(type_name: str, batch: int) -> None:
    """Activations off the int16 steps differ from the float32 form by more than float32
    rounding does; on the steps (integers up to 32767 with a 32767 in each block) they give
    the exact product (one row: split into high and low bytes, summed exactly)."""
    raw = raw_blocks(type_name, 48, 256, seed=5)
    matrix = repack(type_name, raw, 48, 256)
    kernels = native_kernels.quant_matmul()
    x = torch.randn(batch, 256, generator=torch.Generator().manual_seed(5))
    x[:, ::32] = 1000.0  # each block's step is 1000 / 32767: the others round coarsely
    difference = (kernels.unchecked_int16(matrix, x) - kernels(matrix, x)).abs().max()
    assert float(difference) > 1e-4
    steps = torch.randint(-32767, 32768, (batch, 256), generator=torch.Generator().manual_seed(6))
    steps[:, ::32] = 32767
    on_steps = steps.float()
    want = (on_steps.double() @ gguf_reference(type_name, raw).T).float()
    torch.testing.assert_close(kernels.unchecked_int16(matrix, on_steps), want, rtol=1e-5, atol=1.0)


def test_int16_refuses_blocks_it_does_not_take() -> None:
    matrix = repack("Q6_K", raw_blocks("Q6_K", 4, 256, seed=1), 4, 256)
    assert matrix.kind == "q8" and matrix.block == 16
    assert not native_kernels.int16_takes(matrix)
    with pytest.raises(ValueError, match="q4 blocks and q8 blocks of 32 values only"):
        native_kernels.quant_matmul().unchecked_int16(matrix, torch.zeros(1, 256))
    assert native_kernels.int16_takes(repack("Q8_0", raw_blocks("Q8_0", 4, 64, seed=1), 4, 64))

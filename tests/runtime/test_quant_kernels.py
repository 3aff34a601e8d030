"""The native products over quantized blocks equal the `gguf` package's dequantized weights.

Tolerance of `quant_matmul` (float32 activations and accumulators against a float64
reference): `|err| <= 1e-4 * (|W| @ |x|) + 1e-5` elementwise, W the exact dequantized weight.
`dequantize_rows` is held to bit equality with `QuantizedMatrix.dequantize`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from runtime.backends import native_kernels
from runtime.quant.gguf_blocks import STORED_TYPES, repack
from runtime.quant.matrix import QuantizedMatrix
from tests.runtime.quant_fixtures import gguf_reference, raw_blocks

REASON = native_kernels.unavailable_reason()
pytestmark = pytest.mark.skipif(
    REASON is not None, reason=f"the native CPU kernels need a C compiler (gcc): {REASON}"
)


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run with `threads` torch (and so kernel) threads, restoring the count after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _assert_close(got: torch.Tensor, weight: torch.Tensor, x: torch.Tensor) -> None:
    x64 = x.double()
    want = x64 @ weight.T
    bound = 1e-4 * (x64.abs() @ weight.abs().T) + 1e-5
    excess = (got.double() - want).abs() - bound
    assert float(excess.max()) <= 0.0, f"worst error exceeds its bound by {float(excess.max())}"


@given(
    type_name=st.sampled_from(sorted(STORED_TYPES)),
    blocks=st.integers(1, 8),
    half_rows=st.integers(0, 40),
    batch=st.integers(1, 33),
    threads=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_product_equals_dequantizedgguf_reference(
    type_name: str,
    blocks: int,
    half_rows: int,
    batch: int,
    threads: int,
    seed: int,
) -> None:
    rows, cols = 2 * half_rows + 1, blocks * STORED_TYPES[type_name][0]
    raw = raw_blocks(type_name, rows, cols, seed)
    matrix = repack(type_name, raw, rows, cols)
    x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(seed))
    with torch_threads(threads):
        got = native_kernels.quant_matmul()(matrix, x)
    assert got.shape == (batch, rows) and got.dtype == torch.float32
    _assert_close(got, gguf_reference(type_name, raw), x)


@given(
    type_name=st.sampled_from(sorted(STORED_TYPES)),
    blocks=st.integers(1, 4),
    rows=st.integers(1, 70),
    data=st.data(),
    threads=st.integers(1, 3),
)
def test_dequantize_rows_is_bit_equal(
    type_name: str,
    blocks: int,
    rows: int,
    data: st.DataObject,
    threads: int,
) -> None:
    cols = blocks * STORED_TYPES[type_name][0]
    raw = raw_blocks(type_name, rows, cols, seed=rows * 31 + blocks)
    matrix = repack(type_name, raw, rows, cols)
    start = data.draw(st.integers(0, rows))
    stop = data.draw(st.integers(start, rows))
    out = torch.full((stop - start + 1, cols), float("nan"))  # one spare row stays untouched
    with torch_threads(threads):
        native_kernels.quant_matmul().dequantize_rows(matrix, start, stop, out)
    assert torch.equal(out[: stop - start], matrix.dequantize(start, stop))
    assert bool(out[stop - start :].isnan().all())
    assert torch.equal(matrix.dequantize().double(), gguf_reference(type_name, raw))


@pytest.mark.parametrize("block", [2, 8, 24])
def test_q8_blocks_of_any_even_size_take_the_scalar_path(block: int) -> None:
    generator = torch.Generator().manual_seed(block)
    rows, cols = 9, block * 5
    matrix = QuantizedMatrix(
        kind="q8",
        source="test",
        rows=rows,
        cols=cols,
        block=block,
        qs=torch.randint(-128, 128, (rows, cols), dtype=torch.int8, generator=generator),
        scales=torch.rand(rows, 5, generator=generator),
    )
    x = torch.randn(6, cols, generator=generator)
    got = native_kernels.quant_matmul()(matrix, x)
    _assert_close(got, matrix.dequantize().double(), x)


def test_rows_of_a_matrix_and_strided_activations() -> None:
    """A row slice (a fused projection's part) and a non-contiguous x give the same rows (up
    to summation order: a row's place in the 4-row tiles may differ)."""
    raw = raw_blocks("Q4_K", 40, 512, seed=3)
    matrix = repack("Q4_K", raw, 40, 512)
    part = matrix.row_slice(16, 33)
    x = torch.randn(512, 3).T  # strided: the wrapper makes it contiguous
    kernels = native_kernels.quant_matmul()
    whole = kernels(matrix, x)
    sliced = kernels(part, x)
    torch.testing.assert_close(sliced, whole[:, 16:33], rtol=1e-5, atol=1e-4)
    _assert_close(sliced, gguf_reference("Q4_K", raw)[16:33], x)


def test_checked_call_names_the_bad_argument() -> None:
    matrix = repack("Q8_0", raw_blocks("Q8_0", 4, 64, seed=1), 4, 64)
    kernels = native_kernels.quant_matmul()
    with pytest.raises(ValueError, match=r"x is \[2, 32\].*\[R, 64\]"):
        kernels(matrix, torch.zeros(2, 32))
    with pytest.raises(ValueError, match="at least 128 elements"):
        kernels.dequantize_rows(matrix, 1, 3, torch.zeros(100))
    with pytest.raises(ValueError, match=r"rows \[3, 5\)"):
        kernels.dequantize_rows(matrix, 3, 5, torch.zeros(1000))


@given(
    type_name=st.sampled_from(sorted(STORED_TYPES)),
    rows=st.integers(1, 40),
    data=st.data(),
)
def test_take_rows_is_bit_equal(type_name: str, rows: int, data: st.DataObject) -> None:
    """The native gather of scattered rows (token embeddings) equals `take_rows`, and an
    index outside the matrix is refused before any row is read."""
    cols = STORED_TYPES[type_name][0]
    matrix = repack(type_name, raw_blocks(type_name, rows, cols, seed=rows), rows, cols)
    index = torch.tensor(
        data.draw(st.lists(st.integers(0, rows - 1), max_size=9)), dtype=torch.long
    )
    got = native_kernels.quant_matmul().take_rows(matrix, index)
    assert torch.equal(got, matrix.take_rows(index))
    with pytest.raises(ValueError, match=r"outside \[0, "):
        native_kernels.quant_matmul().take_rows(matrix, torch.tensor([0, rows]))

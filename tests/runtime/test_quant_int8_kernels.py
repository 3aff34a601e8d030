"""The int8-activation block product (`q_int8`, VNNI) stays within its stated error bound
(`runtime.quant.rounded_activations.error_bound`) of the `gguf` package's dequantized weights,
and rounds for real (it is a different form from `q_rows`, not a copy of it)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from runtime.backends import native_kernels
from runtime.quant.gguf_blocks import STORED_TYPES, repack
from runtime.quant.matrix import QuantizedMatrix
from runtime.quant.rounded_activations import error_bound
from tests.runtime.quant_fixtures import gguf_reference, raw_blocks
from tests.runtime.test_quant_kernels import torch_threads

REASON = native_kernels.unavailable_reason()
INT8 = REASON is None and native_kernels.quant_matmul().int8_available
pytestmark = pytest.mark.skipif(
    not INT8,
    reason="the int8-activation kernel needs gcc and a CPU with AVX-512 VNNI "
    f"({REASON or 'this CPU has no AVX-512 VNNI'})",
)


def _assert_within_bound(
    got: torch.Tensor, matrix: QuantizedMatrix, exact: torch.Tensor, x: torch.Tensor
) -> None:
    want = x.double() @ exact.T
    excess = (got.double() - want).abs() - error_bound(matrix, x)
    assert float(excess.max()) <= 0.0, f"worst error exceeds its bound by {float(excess.max())}"


@given(
    type_name=st.sampled_from(sorted(STORED_TYPES)),
    blocks=st.integers(1, 8),
    half_rows=st.integers(0, 40),
    batch=st.integers(1, 33),
    threads=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_int8_product_is_within_its_bound_of_the_gguf_reference(
    type_name: str, blocks: int, half_rows: int, batch: int, threads: int, seed: int
) -> None:
    rows, cols = 2 * half_rows + 1, blocks * STORED_TYPES[type_name][0]
    raw = raw_blocks(type_name, rows, cols, seed)
    matrix = repack(type_name, raw, rows, cols)
    x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(seed))
    with torch_threads(threads):
        got = native_kernels.quant_matmul().unchecked_int8(matrix, x)
    assert got.shape == (batch, rows) and got.dtype == torch.float32
    _assert_within_bound(got, matrix, gguf_reference(type_name, raw), x)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0"])
def test_int8_product_rounds_the_activations(type_name: str) -> None:
    """Activations that are not multiples of their block's step differ from the `q_rows`
    form (float32, or int16 steps 258x finer) by more than float rounding; multiples of it
    (integers up to 127 with a 127 in each block) give the exact product."""
    raw = raw_blocks(type_name, 48, 256, seed=5)
    matrix = repack(type_name, raw, 48, 256)
    kernels = native_kernels.quant_matmul()
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(5))
    assert float((kernels.unchecked_int8(matrix, x) - kernels(matrix, x)).abs().max()) > 1e-3
    exact = torch.randint(-127, 128, (3, 256), generator=torch.Generator().manual_seed(6))
    exact[:, ::32] = 127
    exact_x = exact.float()
    want = (exact_x.double() @ gguf_reference(type_name, raw).T).float()
    torch.testing.assert_close(kernels.unchecked_int8(matrix, exact_x), want, rtol=1e-5, atol=1e-3)


def test_int8_refuses_blocks_it_does_not_take() -> None:
    matrix = QuantizedMatrix(
        kind="q8",
        source="test",
        rows=4,
        cols=48,
        block=24,
        qs=torch.zeros(4, 48, dtype=torch.int8),
        scales=torch.ones(4, 2),
    )
    assert not native_kernels.int8_takes(matrix)
    with pytest.raises(ValueError, match="q8 blocks of 16, 32 or 64"):
        native_kernels.quant_matmul().unchecked_int8(matrix, torch.zeros(1, 48))

"""Every float-activation block form (`models.decoder.block_forms`) equals the `gguf`
package's dequantized weight times x, within `test_quant_kernels`' tolerance, on the row
counts warmup offers it (odd output counts, and multiples of 16 for `torch_int4`; including
`q_gemm`'s 16- and 32-row groups, their zero-padded tails and its 128-row chunks).
`q_int8` and `q_int16` round the activations and have their own bounds
(`test_quant_int8_kernels`, `test_quant_int16_kernels`)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from models.decoder.block_forms import BLOCK_FORMS, block_product, default_block_form
from runtime.backends import native_kernels
from runtime.quant.gguf_blocks import STORED_TYPES, repack
from tests.runtime.quant_fixtures import gguf_reference, raw_blocks
from tests.runtime.test_quant_kernels import _assert_close, torch_threads

FLOAT_FORMS = sorted(name for name in BLOCK_FORMS if name not in ("q_int8", "q_int16"))


@settings(max_examples=60, deadline=None)
@given(
    form=st.sampled_from(FLOAT_FORMS),
    type_name=st.sampled_from(sorted(STORED_TYPES)),
    blocks=st.integers(1, 8),
    rows=st.one_of(st.integers(0, 30).map(lambda h: 2 * h + 1), st.sampled_from([16, 48, 96])),
    batch=st.one_of(st.integers(1, 33), st.integers(34, 140)),
    threads=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_every_block_form_equals_the_gguf_reference(
    form: str, type_name: str, blocks: int, rows: int, batch: int, threads: int, seed: int
) -> None:
    chosen = BLOCK_FORMS[form]
    cols = blocks * STORED_TYPES[type_name][0]
    raw = raw_blocks(type_name, rows, cols, seed)
    matrix = repack(type_name, raw, rows, cols)
    if not (chosen.available() and chosen.applies(matrix) and chosen.fits(batch)):
        return  # warmup never offers it this product
    x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(seed))
    with torch_threads(threads):
        got = block_product((matrix,), x, form)
    assert got.shape == (batch, rows) and got.dtype == torch.float32
    _assert_close(got, gguf_reference(type_name, raw), x)


@pytest.mark.skipif(
    native_kernels.unavailable_reason() is not None,
    reason="the native block kernels need a C compiler (gcc)",
)
def test_many_row_form_is_the_default_past_the_streaming_rows() -> None:
    """An un-warmed model multiplies 32 rows with `q_gemm` (not the library's GEMM on a
    tile), and a row-stacked weight's parts give the whole weight's product."""
    assert default_block_form(4) == "q_rows" and default_block_form(32) == "q_gemm"
    raw = raw_blocks("Q4_1", 40, 96, seed=9)
    whole = repack("Q4_1", raw, 40, 96)
    x = torch.randn(37, 96, generator=torch.Generator().manual_seed(9))
    parts = (whole.row_slice(0, 13), whole.row_slice(13, 40))
    torch.testing.assert_close(
        block_product(parts, x, "q_gemm"), block_product((whole,), x, "q_gemm")
    )
    _assert_close(block_product(parts, x, "q_gemm"), gguf_reference("Q4_1", raw), x)


@pytest.mark.skipif(
    native_kernels.unavailable_reason() is not None,
    reason="the native block kernels need a C compiler (gcc)",
)
@pytest.mark.parametrize("type_name", sorted(STORED_TYPES))
def test_many_row_form_reads_the_exact_weights(type_name: str) -> None:
    """One-hot rows pick single weights: `q_gemm`'s panels hold the weight bit-equal to
    `QuantizedMatrix.dequantize` (its dequantization is a lookup, not an approximation)."""
    cols = 2 * STORED_TYPES[type_name][0]
    matrix = repack(type_name, raw_blocks(type_name, 25, cols, seed=4), 25, cols)
    picks = torch.eye(cols)[:40]
    got = block_product((matrix,), picks, "q_gemm")
    assert torch.equal(got, matrix.dequantize()[:, :40].T)

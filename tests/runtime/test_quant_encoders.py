"""The test encoders write valid ggml blocks, and `repack` keeps every stored type exact.

Tolerance of the K encoders (checked per 256-value super-block, against `gguf`'s own
dequantization): every value is within one quantization step of its super-block, the step
being the widest sub-block's span of `[min(x, 0), max(x, 0)]` over its levels (15 for Q4_K,
31 for Q5_K) or `max|x| / 32` (Q6_K), plus 1e-4 absolute for float16 scales near underflow.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from runtime.quant.gguf_blocks import STORED_TYPES, repack
from tests.quant_encoders import BLOCK_SIZES, QUANTIZED_TYPES, decode, encode

K_LEVELS = {"Q4_K": 15, "Q5_K": 31}
ATOL = 1e-4


def _k_step(x: npt.NDArray[np.float32], type_name: str) -> npt.NDArray[np.float32]:
    """The tolerance per super-block: `[n_super]`."""
    supers = x.reshape(-1, 256)
    if type_name == "Q6_K":
        step: npt.NDArray[np.float32] = np.abs(supers).max(axis=1) / np.float32(32.0)
        return step
    sub = supers.reshape(-1, 8, 32)
    widths = np.maximum(sub.max(axis=-1), 0.0) - np.minimum(sub.min(axis=-1), 0.0)
    step = (widths.max(axis=-1) / K_LEVELS[type_name]).astype(np.float32)
    return step


def _varied(rows: int, cols: int, seed: int) -> npt.NDArray[np.float32]:
    """Sub-blocks of very different magnitudes and offsets, some all-positive or zero."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    x *= 10.0 ** rng.uniform(-3, 1, size=(rows, cols // 16, 1)).repeat(16, axis=2).reshape(
        rows, cols
    )
    x[0] = np.abs(x[0]) + 0.5  # no negative value: min is 0
    x[1] = -np.abs(x[1])  # no positive value
    x[2] = 0.0
    x[3] = 0.25  # constant
    return x


def _check_k_round_trip(x: npt.NDArray[np.float32], type_name: str) -> None:
    raw = encode(x, type_name)
    values, size = BLOCK_SIZES[type_name]
    assert raw.dtype == np.uint8 and raw.shape == (x.shape[0], x.shape[1] // values * size)
    error = np.abs(decode(raw, type_name) - x).reshape(-1, 256).max(axis=1)
    bound = _k_step(x, type_name) + ATOL
    worst = int(np.argmax(error - bound))
    assert np.all(error <= bound), (type_name, worst, error[worst], bound[worst])


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_encoders_are_within_one_step(type_name: str) -> None:
    for seed in range(3):
        _check_k_round_trip(_varied(8, 1024, seed), type_name)
    # And on plain Gaussian weights the error is what the type's bits allow.
    x = np.random.default_rng(7).standard_normal((16, 512)).astype(np.float32)
    rms = float(np.sqrt(np.mean((decode(encode(x, type_name), type_name) - x) ** 2)))
    assert rms < {"Q4_K": 0.09, "Q5_K": 0.045, "Q6_K": 0.025}[type_name]


@given(
    type_name=st.sampled_from(["Q4_K", "Q5_K", "Q6_K"]),
    x=hnp.arrays(
        np.float32,
        st.tuples(st.integers(1, 3), st.sampled_from([256, 512])),
        elements=st.floats(-1000, 1000, width=32),
    ),
)
def test_k_encoders_within_one_step_on_any_values(
    type_name: str, x: npt.NDArray[np.float32]
) -> None:
    _check_k_round_trip(x, type_name)


@pytest.mark.parametrize("type_name", QUANTIZED_TYPES)
def test_every_encoder_round_trips_closely(type_name: str) -> None:
    x = np.random.default_rng(3).standard_normal((4, 512)).astype(np.float32)
    raw = encode(x, type_name)
    assert raw.shape == (4, 512 // BLOCK_SIZES[type_name][0] * BLOCK_SIZES[type_name][1])
    bits = int(type_name[1])
    assert np.abs(decode(raw, type_name) - x).max() < 8.0 / 2**bits


def _random_blocks(type_name: str, rows: int, cols: int, seed: int) -> npt.NDArray[np.uint8]:
    """Random bytes with every float16 field set to a finite value: any bit pattern of the
    integer fields (6-bit scales with high bits set, negative Q6_K scales) is a valid block."""
    values, size = BLOCK_SIZES[type_name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // values, size), dtype=np.uint8)
    f16_at = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}
    for at in f16_at[type_name]:
        finite = rng.uniform(-0.1, 0.1, size=raw.shape[:2]).astype("<f2")
        raw[..., at : at + 2] = finite.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("type_name", sorted(STORED_TYPES))
def test_repack_equals_gguf_dequantize_bit_exactly(type_name: str) -> None:
    rows, cols = 6, 512
    for raw in (
        encode(_varied(rows, cols, seed=11), type_name),
        _random_blocks(type_name, rows, cols, seed=12),
    ):
        reference = torch.from_numpy(decode(raw, type_name))
        matrix = repack(type_name, raw, rows, cols)
        assert matrix.source == type_name
        assert torch.equal(matrix.dequantize(), reference), type_name
        assert torch.equal(matrix.dequantize(2, 5), reference[2:5])


def test_encode_names_what_it_refuses() -> None:
    with pytest.raises(ValueError, match=r"type_name='Q3_K' is unknown"):
        encode(np.zeros((2, 256), dtype=np.float32), "Q3_K")
    with pytest.raises(ValueError, match=r"\[2, 64\] is invalid for Q4_K.*multiple of 256"):
        encode(np.zeros((2, 64), dtype=np.float32), "Q4_K")
    with pytest.raises(ValueError, match=r"\[2, 48\] is invalid for Q8_0.*multiple of 32"):
        encode(np.zeros((2, 48), dtype=np.float32), "Q8_0")

"""Decode attention that reads K/V pages in place equals the gather path and transformers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from models.decoder import DecoderModel, allocate_kv_cache
from models.decoder.kernels import IN_PLACE_ATTENTION
from models.llama import TINY_PRESETS
from runtime.backends import native_kernels
from tests.models.llama_oracle import assert_four_rows_greedy_match_transformers, tiny_pair

REASON = native_kernels.unavailable_reason()
pytestmark = pytest.mark.skipif(
    REASON is not None, reason=f"the native CPU kernels need a C compiler (gcc): {REASON}"
)


@pytest.fixture
def attention_mode() -> Iterator[None]:
    """Restore the (cached, shared) tiny models' decode attention after each test."""
    models = [tiny_pair(preset)[0] for preset in sorted(TINY_PRESETS)]
    yield
    for model in models:
        model.decode_attention = None


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pages: torch.Tensor, n_keys: torch.Tensor
) -> torch.Tensor:
    """Row by row: gather the row's keys (unmapped pages masked) and run SDPA."""
    block = k.shape[2]
    out = []
    for row in range(q.shape[0]):
        positions = torch.arange(int(n_keys[row]))
        table = pages[row, positions // block]
        mapped = table >= 0
        keys = k[table.clamp(min=0), :, positions % block].transpose(0, 1).float()
        values = v[table.clamp(min=0), :, positions % block].transpose(0, 1).float()
        if not bool(mapped.any()):
            out.append(torch.zeros_like(q[row]))  # nothing to attend to: zeros
            continue
        out.append(F.scaled_dot_product_attention(q[row], keys, values, attn_mask=mapped))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_gathered_sdpa_on_shuffled_and_unmapped_pages(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(2)
    blocks, kv, block, head_dim, group = 24, 2, 8, 16, 3
    k = torch.randn(blocks, kv, block, head_dim, generator=generator).to(dtype)
    v = torch.randn(blocks, kv, block, head_dim, generator=generator).to(dtype)
    pages = torch.stack([torch.randperm(blocks, generator=generator)[:6] for _ in range(4)])
    pages[2, 1] = -1  # an unmapped page inside row 2's range: its keys are masked out
    n_keys = torch.tensor([1, 48, 20, 33])
    q = torch.randn(4, kv, group, head_dim, generator=generator)
    got = native_kernels.paged_decode_attention()(q, k, v, pages, n_keys, head_dim**-0.5)
    torch.testing.assert_close(got, _reference(q, k, v, pages, n_keys), atol=2e-6, rtol=1e-5)


_FEW_ROWS = st.integers(1, 9)


@st.composite
def _paged_problem(
    draw: st.DrawFn, batches: st.SearchStrategy[int] = _FEW_ROWS
) -> tuple[torch.Tensor, ...]:
    """A random decode attention: GQA geometry, rows whose contexts cross pages, shuffled
    pages with some unmapped, float32 or bfloat16 caches."""
    kv = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 3, 4, 8]))
    head_dim = draw(st.sampled_from([8, 16, 24, 64, 72]))
    block = draw(st.sampled_from([1, 4, 16, 32]))
    batch = draw(batches)
    width = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**16))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    generator = torch.Generator().manual_seed(seed)
    blocks = batch * width + 2
    k = torch.randn(blocks, kv, block, head_dim, generator=generator).to(dtype)
    v = torch.randn(blocks, kv, block, head_dim, generator=generator).to(dtype)
    pages = torch.randperm(blocks, generator=generator)[: batch * width].view(batch, width)
    unmapped = torch.rand(batch, width, generator=generator) < 0.15
    pages = pages.masked_fill(unmapped, -1)
    n_keys = torch.randint(0, width * block + 1, (batch,), generator=generator)
    q = 3 * torch.randn(batch, kv, group, head_dim, generator=generator)
    return q, k, v, pages, n_keys


@settings(max_examples=60, deadline=None)
@given(problem=_paged_problem(), threads=st.sampled_from([1, 2, 3]))
def test_kernel_equals_gathered_sdpa_for_any_geometry(
    problem: tuple[torch.Tensor, ...], threads: int
) -> None:
    """Every batch size, context length (0 keys, one page, crossing pages), GQA group,
    head size (vector and scalar loops) and thread count (rows split over keys or not)."""
    q, k, v, pages, n_keys = problem
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = native_kernels.paged_decode_attention()(q, k, v, pages, n_keys, q.shape[-1] ** -0.5)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(got, _reference(q, k, v, pages, n_keys), atol=1e-5, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(problem=_paged_problem(batches=st.integers(5, 64)), threads=st.sampled_from([1, 2, 3]))
def test_spread_prefetch_gives_the_read_pass_results_bit_for_bit(
    problem: tuple[torch.Tensor, ...], threads: int
) -> None:
    """`paged_inplace_spread` only moves the next page's prefetches into the math: 5-64
    rows crossing pages, both cache dtypes, vector and scalar head sizes, 1-3 threads."""
    q, k, v, pages, n_keys = problem
    attention = native_kernels.paged_decode_attention()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        scale = q.shape[-1] ** -0.5
        read_pass = attention(q, k, v, pages, n_keys, scale)
        spread = attention(q, k, v, pages, n_keys, scale, spread=True)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(spread, read_pass)
    torch.testing.assert_close(spread, _reference(q, k, v, pages, n_keys), atol=1e-5, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(
    problem=_paged_problem(batches=st.integers(1, 64)),
    threads=st.sampled_from([1, 2, 3]),
    data=st.data(),
)
def test_walk_reads_exactly_the_bytes_the_attention_reads(
    problem: tuple[torch.Tensor, ...], threads: int, data: st.DataObject
) -> None:
    """The benchmarks' page walk (the attention's reads without its math) covers every byte
    of every mapped key and value below each row's key count, and no other: with those
    bytes zero but one, and every other byte 0xFF, it returns that one byte."""
    q, k, v, pages, n_keys = problem
    block = k.shape[2]
    region = sorted(
        {
            (int(pages[row, t // block]), t % block)
            for row in range(q.shape[0])
            for t in range(int(n_keys[row]))
            if int(pages[row, t // block]) >= 0
        }
    )
    k_bytes, v_bytes = k.view(torch.uint8), v.view(torch.uint8)  # [blocks, kv, block, bytes]
    for cache in (k_bytes, v_bytes):
        cache.fill_(0xFF)
        for page, offset in region:
            cache[page, :, offset] = 0
    expected = 0
    if region:
        page, offset = data.draw(st.sampled_from(region))
        cache = data.draw(st.sampled_from([k_bytes, v_bytes]))
        head = data.draw(st.integers(0, k.shape[1] - 1))
        at = data.draw(st.integers(0, k_bytes.shape[-1] - 1))
        expected = data.draw(st.integers(1, 0xFE))
        cache[page, head, offset, at] = expected
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        seen = native_kernels.paged_decode_attention().walk(q, k, v, pages, n_keys, 1.0)
    finally:
        torch.set_num_threads(previous)
    assert seen == expected


def test_walk_reads_the_last_byte_of_a_region_shorter_than_a_vector() -> None:
    """Three bfloat16 keys of 8 dims are 48 bytes: less than one vector, read byte by byte."""
    k = torch.zeros(2, 1, 4, 8, dtype=torch.bfloat16)
    v = torch.zeros_like(k)
    v.view(torch.uint8)[1, 0, 2, 15] = 0x5A  # the last byte of the last key read
    v.view(torch.uint8)[1, 0, 3] = 0xFF  # the key past n_keys: not read
    q = torch.zeros(1, 1, 1, 8)
    attention = native_kernels.paged_decode_attention()
    assert attention.walk(q, k, v, torch.tensor([[1]]), torch.tensor([3]), 1.0) == 0x5A
    # Unchecked (as the breakdown times it, checking once).
    pages, n_keys = torch.tensor([[1]]), torch.tensor([3])
    assert attention.unchecked_walk(q.shape, k, v, pages, n_keys) == 0x5A
    assert attention.unchecked_walk(q.shape, k, v, pages, n_keys - 1) == 0


def test_walk_refuses_what_the_attention_refuses() -> None:
    k = torch.zeros(4, 1, 8, 16)
    attention = native_kernels.paged_decode_attention()
    with pytest.raises(ValueError, match=r"outside -1 and \[0, 4\)"):
        attention.walk(torch.zeros(1, 1, 1, 16), k, k, torch.tensor([[4]]), torch.tensor([3]), 1.0)
    with pytest.raises(ValueError, match="does not fit the caches"):
        attention.walk(torch.zeros(1, 2, 1, 16), k, k, torch.tensor([[0]]), torch.tensor([3]), 1.0)


def test_kernel_handles_heads_larger_than_its_stack_scratch() -> None:
    """A [g, hd] state bigger than the kernel's on-stack scratch takes heap scratch."""
    generator = torch.Generator().manual_seed(5)
    k = torch.randn(6, 1, 32, 1024, generator=generator)
    v = torch.randn(6, 1, 32, 1024, generator=generator)
    q = torch.randn(2, 1, 9, 1024, generator=generator)
    pages = torch.tensor([[3, 0, 5], [1, 4, -1]])
    n_keys = torch.tensor([70, 64])
    got = native_kernels.paged_decode_attention()(q, k, v, pages, n_keys, 1024**-0.5)
    torch.testing.assert_close(got, _reference(q, k, v, pages, n_keys), atol=1e-5, rtol=1e-5)


def test_kernel_refuses_pages_outside_the_cache() -> None:
    k = torch.zeros(4, 1, 8, 16)
    kernel = native_kernels.paged_decode_attention()
    with pytest.raises(ValueError, match=r"outside -1 and \[0, 4\)"):
        kernel(torch.zeros(1, 1, 1, 16), k, k, torch.tensor([[4]]), torch.tensor([3]), 1.0)
    with pytest.raises(ValueError, match="n_keys exceed the 1 page"):
        kernel(torch.zeros(1, 1, 1, 16), k, k, torch.tensor([[0]]), torch.tensor([9]), 1.0)


def _mixed_decode(model: DecoderModel, mode: str) -> torch.Tensor:
    """Decode logits of a mixed batch (inactive row, shuffled pages) in one attention mode."""
    block, width = 8, 8
    generator = torch.Generator().manual_seed(7)
    model.set_kv_cache(None)
    model.configure_paged_attention(block_size=block, max_num_blocks=40)
    cache = allocate_kv_cache(model, 40)
    for k, v in cache:
        k.copy_(torch.randn(k.shape, generator=generator))
        v.copy_(torch.randn(v.shape, generator=generator))
    model.set_kv_cache(cache)
    pages = torch.stack([torch.randperm(40, generator=generator)[:width] for _ in range(5)])
    pages[4, 5:] = -1  # past row 4's position: never read
    positions = torch.tensor([3, 60, -1, 17, 39])
    tokens = torch.tensor([5, 9, 11, 2, 7])
    model.decode_attention = mode
    try:
        return model.decode(tokens, positions=positions, page_table=pages.to(torch.int32))
    finally:
        model.set_kv_cache(None)


@pytest.mark.usefixtures("attention_mode")
@pytest.mark.parametrize("mode", IN_PLACE_ATTENTION)
@pytest.mark.parametrize("preset", sorted(TINY_PRESETS))
def test_in_place_decode_equals_the_gather_path(preset: str, mode: str) -> None:
    model, _ = tiny_pair(preset)
    in_place = _mixed_decode(model, mode)
    gathered = _mixed_decode(model, "gather")
    assert torch.equal(in_place[2], torch.zeros_like(in_place[2]))  # inactive row
    torch.testing.assert_close(in_place, gathered, atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("attention_mode")
@pytest.mark.parametrize("mode", IN_PLACE_ATTENTION)
@pytest.mark.parametrize("preset", sorted(TINY_PRESETS))
def test_in_place_decode_greedy_matches_transformers(preset: str, mode: str) -> None:
    model, hf = tiny_pair(preset)
    model.decode_attention = mode
    assert_four_rows_greedy_match_transformers(model, hf, preset)

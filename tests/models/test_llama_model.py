"""The tensor model against transformers (tiny-random shapes) and its paged-KV contract."""

from __future__ import annotations

import itertools

import pytest
import torch

from models.decoder import (
    DecoderModel,
    allocate_kv_cache,
    greedy_generate,
    random_state_dict,
)
from models.decoder.attention_layout import plan_key_groups
from models.decoder.kernels import LINEAR_FROM_ROWS
from models.decoder.layers import Projection
from models.decoder.reference import contiguous_page_table, prefill_prompts
from models.llama import TINY_PRESETS, LlamaArgs
from runtime.model_contract import AttentionMetadata, PagedAttentionConfig, PagedModel
from tests.models.llama_oracle import (
    full_prefill_logits,
    hf_greedy,
    hf_last_logits,
    tiny_pair,
)

PRESETS = sorted(TINY_PRESETS)


def _prompt(length: int, vocab: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=generator).tolist()


def _bound(
    preset: str = "gqa", *, block_size: int = 4, num_blocks: int = 32
) -> tuple[DecoderModel, list[tuple[torch.Tensor, torch.Tensor]]]:
    args = LlamaArgs.tiny_random(preset)
    model = DecoderModel.from_state_dict(args, random_state_dict(args, seed=3))
    model.configure_paged_attention(block_size=block_size, max_num_blocks=num_blocks)
    cache = allocate_kv_cache(model, num_blocks)
    model.set_kv_cache(cache)
    return model, cache


@pytest.mark.parametrize(
    "shape", [(1, 24), (2, 24), (1, 1, 24), (3, 5, 24), (LINEAR_FROM_ROWS - 1, 24), (1, 70, 24)]
)
def test_projection_equals_linear_for_every_row_count(shape: tuple[int, ...]) -> None:
    """One row (padded to two), a few rows (`W @ x^T`) and many rows (`F.linear`) agree."""
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(40, 24, generator=generator)
    projection = Projection(24, 40, dtype=torch.float32, device=torch.device("cpu"))
    projection.load(weight)
    x = torch.randn(*shape, generator=generator)
    out = projection(x)
    assert out.shape == (*shape[:-1], 40) and out.is_contiguous()
    assert torch.allclose(out, torch.nn.functional.linear(x, weight), atol=1e-5, rtol=1e-5)
    assert torch.equal(projection.hf_weight(), weight)
    with pytest.raises(ValueError, match=r"allowed is \[40, 24\]"):
        projection.load(weight.t())


# ----------------------------------------------------------------------- against transformers
@pytest.mark.parametrize("preset", PRESETS)
def test_full_prompt_logits_match_transformers(preset: str) -> None:
    model, hf = tiny_pair(preset)
    for length in (1, 7, 64, 200):
        prompt = _prompt(length, model.vocab_size, seed=length)
        ours = full_prefill_logits(model, prompt)
        ref = hf_last_logits(hf, prompt)
        assert (ours - ref).abs().max().item() < 1e-4, (preset, length)


def test_rope_scaling_reaches_the_oracle() -> None:
    """The scaled presets really are scaled on both sides (else the comparison proves little)."""
    _, hf_llama3 = tiny_pair("llama3-rope")
    _, hf_linear = tiny_pair("linear-rope")
    assert hf_llama3.config.rope_parameters["rope_type"] == "llama3"
    assert hf_linear.config.rope_parameters["rope_type"] == "linear"
    args = LlamaArgs.tiny_random("llama3-rope")
    unscaled = LlamaArgs(**{**_fields(args), "rope_scaling": None})
    state = random_state_dict(args, seed=0)
    prompt = _prompt(80, args.vocab_size, seed=5)
    scaled_logits = full_prefill_logits(DecoderModel.from_state_dict(args, state), prompt)
    plain_logits = full_prefill_logits(DecoderModel.from_state_dict(unscaled, state), prompt)
    assert (scaled_logits - plain_logits).abs().max().item() > 1e-2


def _fields(args: LlamaArgs) -> dict[str, object]:
    import attrs

    return attrs.asdict(args, recurse=False)


@pytest.mark.parametrize("preset", PRESETS)
def test_batched_paged_greedy_matches_transformers_generate(preset: str) -> None:
    model, hf = tiny_pair(preset)
    lengths = (1, 3, 9, 16, 17, 30, 41, 64)
    prompts = [_prompt(n, model.vocab_size, seed=100 + n) for n in lengths]
    eos = model.eos_token_ids
    ours = greedy_generate(model, prompts, 48, block_size=8, stop_token_ids=eos)
    for prompt, got in zip(prompts, ours, strict=True):
        assert got == hf_greedy(hf, prompt, 48, eos), (preset, len(prompt))
    assert all(len(o) == 48 for o in ours)  # the comparison covers all 48 steps


def test_chunked_batched_greedy_equals_unchunked() -> None:
    model, _ = tiny_pair("gqa")
    prompts = [_prompt(n, model.vocab_size, seed=n) for n in (5, 23, 40)]
    whole = greedy_generate(model, prompts, 12, block_size=4)
    chunked = greedy_generate(model, prompts, 12, block_size=4, chunk_size=8)
    assert whole == chunked


def test_batched_greedy_with_one_attention_group_per_length_matches_transformers() -> None:
    """Decode attention split into many groups (rows sorted by length) is still exact."""
    model, hf = tiny_pair("gqa")
    lengths = (41, 3, 17, 9, 64, 1, 30, 16)  # unsorted: decode reorders rows internally
    prompts = [_prompt(n, model.vocab_size, seed=200 + n) for n in lengths]
    model.group_cost = 0
    try:
        ours = greedy_generate(model, prompts, 24, block_size=8)
    finally:
        del model.group_cost
    for prompt, got in zip(prompts, ours, strict=True):
        assert got == hf_greedy(hf, prompt, 24, ()), len(prompt)


# ------------------------------------------------------------------------ attention groups
def test_plan_key_groups_covers_rows_in_order() -> None:
    assert plan_key_groups([]) == [(0, 0)]
    assert plan_key_groups([7]) == [(0, 1)]
    keys = [32, 32, 32, 64, 64, 512, 512]
    assert plan_key_groups(keys, group_cost=10**9) == [(0, 7)]
    assert plan_key_groups(keys, group_cost=0) == [(0, 3), (3, 5), (5, 7)]
    many = list(range(1, 301))  # more rows than planning units: groups still tile the rows
    groups = plan_key_groups(many, group_cost=64)
    assert groups[0][0] == 0 and groups[-1][1] == 300
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in itertools.pairwise(groups))
    assert len(groups) > 1


def test_grouped_decode_equals_single_group_and_graph_safe() -> None:
    """Mixed lengths, shuffled blocks, an inactive row and an unmapped page: the grouped
    dynamic decode gives the single-group result and the graph-safe one."""
    model, _ = _bound(block_size=4, num_blocks=64)
    lengths = [13, 2, 30, 7, 21, 9]
    prompts = [_prompt(n, model.vocab_size, seed=50 + n) for n in lengths]
    order = torch.randperm(64, generator=torch.Generator().manual_seed(1)).tolist()
    table = torch.full((len(lengths), 9), -1, dtype=torch.int32)
    for row, n in enumerate(lengths):
        count = n // 4 + 1
        table[row, :count] = torch.tensor([order.pop() for _ in range(count)])
    logits = prefill_prompts(model, prompts, table)
    table[4, 1] = -1  # row 4 can no longer see positions 4..7
    positions = torch.tensor(lengths)
    positions[3] = -1  # inactive
    tokens = logits.argmax(-1)
    cache = model.kv_cache
    assert cache is not None
    snapshot = [(k.clone(), v.clone()) for k, v in cache]
    results = []
    for cost, graph_safe in ((0, None), (10**9, None), (0, True)):
        for (k, v), (k0, v0) in zip(cache, snapshot, strict=True):
            k.copy_(k0)
            v.copy_(v0)
        model.group_cost, model.graph_safe = cost, graph_safe
        results.append(model.decode(tokens, positions=positions, page_table=table))
    model.graph_safe = None
    del model.group_cost
    grouped, single, static = results
    assert torch.equal(grouped[3], torch.zeros_like(grouped[3]))
    assert (grouped - single).abs().max().item() < 1e-5
    assert (grouped - static).abs().max().item() < 1e-5


# ------------------------------------------------------------------------------- contract
def test_model_satisfies_the_paged_model_protocol() -> None:
    model, _ = tiny_pair("gqa")
    assert isinstance(model, PagedModel)
    assert model.n_layers == 2
    assert model.vocab_size == 256
    assert model.max_seq_len == 512
    assert model.eos_token_ids == (2,)
    names = dict(model.iter_executor_named_modules())
    assert "layers.0" in names and "lm_head" in names and "" not in names


def test_attention_metadata_before_and_after_configuration() -> None:
    args = LlamaArgs.tiny_random("mqa")
    model = DecoderModel.from_state_dict(args, random_state_dict(args))
    meta = model.attention_metadata()
    assert len(meta) == args.n_layers
    assert all(m.paged_attention_config is None for m in meta)
    assert meta[0] == AttentionMetadata(
        kv_cache_dtype=torch.float32,
        n_kv_heads=1,
        head_dim=24,
        paged_attention_config=None,
        n_local_kv_heads=1,
    )
    model.configure_paged_attention(block_size=16, max_num_blocks=7)
    assert {m.paged_attention_config for m in model.attention_metadata()} == {
        PagedAttentionConfig(block_size=16, max_num_blocks=7)
    }
    built = DecoderModel.from_state_dict(
        args, random_state_dict(args), paged_attention=PagedAttentionConfig(8, 3)
    )
    assert built.attention_metadata()[0].paged_attention_config == PagedAttentionConfig(8, 3)


def test_bfloat16_model_runs_and_stays_close_to_float32() -> None:
    args = LlamaArgs.tiny_random("gqa")
    state = random_state_dict(args, seed=1)
    model16 = DecoderModel.from_state_dict(args, state, dtype=torch.bfloat16)
    assert model16.attention_metadata()[0].kv_cache_dtype == torch.bfloat16
    prompt = _prompt(20, args.vocab_size, seed=9)
    out16 = full_prefill_logits(model16, prompt)
    out32 = full_prefill_logits(DecoderModel.from_state_dict(args, state), prompt)
    assert out16.dtype == torch.float32
    assert torch.isfinite(out16).all()
    assert (out16 - out32).abs().max().item() < 0.1 * out32.abs().max().item()
    tokens = greedy_generate(model16, [prompt], 4)
    assert len(tokens[0]) == 4


def test_prefill_skips_unmapped_pages_and_padding_rows() -> None:
    model, cache = _bound(block_size=4, num_blocks=8)
    prompt = _prompt(8, model.vocab_size, seed=2)
    table = torch.tensor([[0, -1], [-1, -1]], dtype=torch.int32)
    tokens = torch.tensor([prompt, [0] * 8])
    logits = model.prefill(
        tokens,
        page_table=table,
        prompt_lens=torch.tensor([8, 0]),
        chunk_start=torch.tensor([0, 0]),
    )
    k0, v0 = cache[0]
    assert k0[0].abs().sum() > 0 and v0[0].abs().sum() > 0  # block 0 written
    assert k0[1:].abs().sum() == 0 and v0[1:].abs().sum() == 0  # nothing else touched
    assert torch.equal(logits[1], torch.zeros_like(logits[1]))  # padding row
    ref = full_prefill_logits(tiny_pair("gqa")[0], prompt)  # different weights: just finite
    assert torch.isfinite(ref).all() and torch.isfinite(logits).all()


def test_decode_inactive_rows_write_nothing_and_active_rows_match() -> None:
    model, cache = _bound(block_size=4, num_blocks=8)
    prompt = _prompt(6, model.vocab_size, seed=4)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    logits = prefill_prompts(model, [prompt, prompt], table)
    assert torch.allclose(logits[0], logits[1], atol=1e-5)
    snapshot = [(k.clone(), v.clone()) for k, v in cache]
    nxt = logits.argmax(-1)
    out = model.decode(nxt, positions=torch.tensor([6, -1]), page_table=table)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    for (k, v), (k_old, v_old) in zip(cache, snapshot, strict=True):
        assert torch.equal(k[2:4], k_old[2:4]) and torch.equal(v[2:4], v_old[2:4])
        assert not torch.equal(k[1], k_old[1])  # row 0 wrote position 6 into block 1
    both = model.decode(nxt, positions=torch.tensor([6, 6]), page_table=table)
    assert (both[0] - out[0]).abs().max().item() < 1e-5
    assert (both[1] - both[0]).abs().max().item() < 1e-5
    all_inactive = model.decode(nxt, positions=torch.tensor([-1, -1]), page_table=table)
    assert torch.equal(all_inactive, torch.zeros_like(all_inactive))


# ---------------------------------------------------------------------------- set_kv_cache
def test_set_kv_cache_rejects_wrong_shape_and_keeps_previous_binding() -> None:
    model, cache = _bound(block_size=4, num_blocks=8)
    bad = [(k.clone(), v.clone()) for k, v in cache]
    bad[1] = (bad[1][0], torch.zeros(8, model.args.n_kv_heads, 4, model.args.head_dim + 1))
    with pytest.raises(ValueError, match=r"cache\[1\]\.V has shape \[8, 2, 4, 17\]"):
        model.set_kv_cache(bad)
    assert model.kv_cache is not None
    assert all(a[0] is b[0] and a[1] is b[1] for a, b in zip(model.kv_cache, cache, strict=True))
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    prompt = _prompt(5, model.vocab_size, seed=1)
    prefill_prompts(model, [prompt], table)
    assert cache[0][0][0].abs().sum() > 0  # the previous binding is the one written to


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: c[:-1], r"cache has 1 layer\(s\): allowed is exactly n_layers=2"),
        (lambda c: [(k.double(), v) for k, v in c], r"cache\[0\]\.K has dtype torch\.float64"),
        (lambda c: [(k[:, :1], v) for k, v in c], r"cache\[0\]\.K has shape \[8, 1, 4, 16\]"),
        (
            lambda c: [(k, v[:4]) for k, v in c],
            r"cache\[0\]\.V has 4 blocks: allowed is the same count",
        ),
        (
            lambda c: [(torch.zeros(9, *k.shape[1:]),) * 2 for k, v in c],
            r"cache\[0\]\.K has 9 blocks.*max_num_blocks=8",
        ),
        (lambda c: [], r"cache has 0 layer"),
        (lambda c: [(k,) for k, v in c], r"cache\[0\] must be a \(K, V\) pair"),
    ],
)
def test_set_kv_cache_validation_names_the_problem(mutate: object, message: str) -> None:
    model, cache = _bound(block_size=4, num_blocks=8)
    assert callable(mutate)
    with pytest.raises(ValueError, match=message):
        model.set_kv_cache(mutate(cache))
    assert model.kv_cache is not None and model.kv_cache[0][0] is cache[0][0]


def test_set_kv_cache_rejects_non_contiguous_and_unconfigured() -> None:
    model, cache = _bound(block_size=4, num_blocks=8)
    strided = [(torch.zeros(8, 2, 16, 4).transpose(2, 3), v) for k, v in cache]
    with pytest.raises(ValueError, match="not contiguous"):
        model.set_kv_cache(strided)
    args = LlamaArgs.tiny_random("gqa")
    fresh = DecoderModel.from_state_dict(args, random_state_dict(args))
    with pytest.raises(RuntimeError, match="configure_paged_attention"):
        fresh.set_kv_cache(cache)


def test_unbinding_makes_forward_calls_fail_loudly() -> None:
    model, _ = _bound()
    model.set_kv_cache(None)
    assert model.kv_cache is None
    with pytest.raises(RuntimeError, match="set_kv_cache"):
        model.decode(torch.tensor([1]), positions=torch.tensor([0]), page_table=torch.zeros(1, 1))


def test_configure_paged_attention_validation() -> None:
    model, _ = _bound(block_size=4, num_blocks=8)
    with pytest.raises(ValueError, match="block_size=0 is invalid"):
        model.configure_paged_attention(block_size=0, max_num_blocks=8)
    with pytest.raises(ValueError, match="max_num_blocks=-1 is invalid"):
        model.configure_paged_attention(block_size=4, max_num_blocks=-1)
    with pytest.raises(RuntimeError, match=r"set_kv_cache\(None\) first"):
        model.configure_paged_attention(block_size=8, max_num_blocks=8)
    model.configure_paged_attention(block_size=4, max_num_blocks=16)  # growing is fine


# -------------------------------------------------------------------------- input errors
def test_prefill_and_decode_input_validation() -> None:
    model, _ = _bound(block_size=4, num_blocks=4)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    one = torch.tensor([1])
    with pytest.raises(ValueError, match="tokens has shape"):
        model.prefill(torch.tensor([1, 2]), page_table=table, prompt_lens=one, chunk_start=one)
    with pytest.raises(ValueError, match="page_table is too narrow"):
        model.prefill(
            torch.ones(1, 12, dtype=torch.long),
            page_table=table,
            prompt_lens=torch.tensor([12]),
            chunk_start=torch.tensor([0]),
        )
    with pytest.raises(ValueError, match=r"page_table has entries in \[0, 9\]"):
        model.decode(one, positions=one, page_table=torch.tensor([[0, 9]]))
    with pytest.raises(ValueError, match=r"page_table has dtype torch\.float32"):
        model.decode(one, positions=one, page_table=torch.zeros(1, 2))
    with pytest.raises(ValueError, match="positions has shape"):
        model.decode(one, positions=torch.tensor([1, 2]), page_table=table)
    with pytest.raises(ValueError, match="exceed max_seq_len=512"):
        model.decode(one, positions=torch.tensor([512]), page_table=table)
    with pytest.raises(ValueError, match="page_table is too narrow"):
        model.decode(one, positions=torch.tensor([8]), page_table=table)
    with pytest.raises(ValueError, match="chunk_start"):
        model.prefill(
            torch.ones(1, 2, dtype=torch.long),
            page_table=table,
            prompt_lens=torch.tensor([2]),
            chunk_start=torch.tensor([-4]),
        )


def test_dtype_validation_names_allowed_values() -> None:
    with pytest.raises(ValueError, match=r"dtype=torch\.float16 is not supported"):
        DecoderModel(LlamaArgs.tiny_random(), dtype=torch.float16)


def test_contiguous_page_table_helper() -> None:
    table, used = contiguous_page_table([5, 1, 8], 4)
    assert used == 5
    assert table.tolist() == [[0, 1], [2, -1], [3, 4]]

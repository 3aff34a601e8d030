"""The device sampler: argmax exactness, seeds, penalties, log-probs, buffers, traces."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from runtime.sampling import (
    DeviceSampler,
    PreparedSamplingParams,
    SamplerConfig,
    SamplerPlan,
    SamplingParams,
    apply_penalties,
    prepare_sampling_params,
)

VOCAB = 32


def make_sampler(batch: int = 4, top_k: int = 16, vocab: int = VOCAB) -> DeviceSampler:
    sampler = DeviceSampler(SamplerConfig(max_batch_size=batch, max_top_k=top_k, vocab_size=vocab))
    sampler.materialize("cpu")
    return sampler


def prepared(sampler: DeviceSampler, batch: int, **kwargs: Any) -> PreparedSamplingParams:
    history = {k: kwargs.pop(k) for k in ("prompt_tokens", "output_tokens") if k in kwargs}
    return sampler.prepare(SamplingParams(**kwargs), batch, **history)


def test_runtime_sampling_imports_nothing_from_models() -> None:
    """The sampler is model-independent: importing it loads no `models` module (models ->
    runtime -> lifecycle), in a fresh interpreter so other tests' imports do not hide one."""
    code = (
        "import sys, runtime.sampling; "
        "print([m for m in sys.modules if m == 'models' or m.startswith('models.')])"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root
    )
    assert done.stdout.strip() == "[]"


# ---- config and buffers -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"max_batch_size": 0, "max_top_k": 4, "vocab_size": 8}, ValueError),
        ({"max_batch_size": 1, "max_top_k": True, "vocab_size": 8}, ValueError),
        ({"max_batch_size": 1, "max_top_k": 4, "vocab_size": -1}, ValueError),
        (
            {"max_batch_size": 1, "max_top_k": 4, "vocab_size": 8, "allow_force_argmax": 1},
            TypeError,
        ),
    ],
)
def test_sampler_config_validation(kwargs: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        SamplerConfig(**kwargs)


def test_buffers_materialize_release_idempotently() -> None:
    sampler = DeviceSampler(SamplerConfig(max_batch_size=3, max_top_k=4, vocab_size=8))
    assert not sampler.materialized and dict(sampler.buffers) == {}
    with pytest.raises(RuntimeError, match=r"call materialize\(device\)"):
        sampler.sample(torch.zeros(1, 8), sampler.prepare(SamplingParams(), 1))
    sampler.materialize("cpu")
    first = dict(sampler.buffers)
    assert set(first) >= {"top_k", "top_p", "inverse_temperature", "seeded"}
    assert all(t.shape == (3,) and t.device.type == "cpu" for t in first.values())
    sampler.materialize(torch.device("cpu"))  # same device: no reallocation
    assert all(sampler.buffers[name] is tensor for name, tensor in first.items())
    with pytest.raises(RuntimeError, match=r"call release\(\) before"):
        sampler.materialize("meta")
    sampler.release()
    sampler.release()
    assert not sampler.materialized and dict(sampler.buffers) == {}
    sampler.materialize("meta")
    assert sampler.device == torch.device("meta")


def test_stage_writes_buffers_in_place() -> None:
    sampler = make_sampler(batch=3)
    top_k = sampler.buffers["top_k"]
    plan = sampler.stage(prepared(sampler, 2, temperature=[0.5, 0.0], top_k=7, seed=[2**40 + 3]))
    assert sampler.buffers["top_k"] is top_k
    assert top_k[:2].tolist() == [7, 1]
    assert sampler.buffers["inverse_temperature"][:2].tolist() == [2.0, 1.0]
    assert sampler.buffers["seeded"][:2].tolist() == [True, False]
    assert sampler.buffers["seed_low"][0].item() == 3
    assert sampler.buffers["seed_high"][0].item() == 2**8
    assert plan == SamplerPlan(
        batch_size=2,
        sampling_path="topk",
        penalties_enabled=False,
        log_probs_enabled=False,
        top_n=0,
        seeded=True,
    )


def test_a_greedy_plan_reads_no_buffer_so_staging_it_copies_nothing() -> None:
    """The argmax path without penalties never reads the buffers: staging it leaves what an
    earlier plan staged, and sampling with it is still the argmax. With penalties the same
    path reads them, so they are staged."""
    sampler = make_sampler(batch=2)
    sampler.stage(prepared(sampler, 2, temperature=[0.5, 0.25], top_k=7))
    before = {name: tensor.clone() for name, tensor in sampler.buffers.items()}
    greedy = prepared(sampler, 2, temperature=[0.0, 0.0])
    plan = sampler.stage(greedy)
    assert plan.sampling_path == "argmax" and not plan.reads_buffers
    assert all(torch.equal(sampler.buffers[name], value) for name, value in before.items())
    logits = torch.randn(2, VOCAB)
    assert torch.equal(sampler.run(logits, plan).tokens, logits.argmax(dim=-1))
    penalised = prepared(sampler, 2, temperature=[0.0, 0.0], repetition_penalty=1.5)
    plan = sampler.stage(penalised)
    assert plan.sampling_path == "argmax" and plan.reads_buffers
    assert sampler.buffers["repetition_penalty"].tolist() == [1.5, 1.5]
    assert sampler.buffers["top_k"].tolist() == [1, 1]


def test_stage_rejects_values_beyond_the_sampler() -> None:
    sampler = make_sampler(batch=2, top_k=4)
    with pytest.raises(ValueError, match="exceeds the sampler batch"):
        sampler.stage(sampler.prepare(SamplingParams(), 3))
    wide = SamplingParams(temperature=1.0, top_k=8)
    too_wide = prepare_sampling_params(wide, 2, max_device_top_k=8, allow_force_argmax=True)
    with pytest.raises(ValueError, match="exceeds the sampler's max_top_k 4"):
        sampler.stage(too_wide)
    no_argmax = DeviceSampler(
        SamplerConfig(max_batch_size=2, max_top_k=4, vocab_size=8, allow_force_argmax=False)
    )
    no_argmax.materialize("cpu")
    argmax = prepare_sampling_params(
        SamplingParams(), 2, max_device_top_k=4, allow_force_argmax=True
    )
    with pytest.raises(ValueError, match="allow_force_argmax=False"):
        no_argmax.stage(argmax)


def test_run_checks_shapes_and_positions() -> None:
    sampler = make_sampler()
    plan = sampler.stage(prepared(sampler, 2, temperature=1.0, top_k=4, seed=1))
    with pytest.raises(ValueError, match=r"logits must be \[2, vocab\]"):
        sampler.run(torch.zeros(3, VOCAB), plan, positions=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="sampler vocab is 32"):
        sampler.run(torch.zeros(2, 10), plan, positions=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"positions must be \[2\]"):
        sampler.run(torch.zeros(2, VOCAB), plan, positions=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="seeded rows need positions"):
        sampler.run(torch.zeros(2, VOCAB), plan)


# ---- greedy exactness -------------------------------------------------------------------


def test_temperature_zero_is_exactly_argmax_including_ties() -> None:
    torch.manual_seed(0)
    sampler = make_sampler()
    logits = torch.randn(4, VOCAB)
    logits[1, 5] = logits[1, 9] = logits[1].max() + 1.0  # tie: argmax takes the first index
    for sp_kwargs in (
        {"temperature": [0.0] * 4},
        {"temperature": [0.0] * 4, "enable_log_probs": True},  # topk path, still argmax
    ):
        out = sampler.sample(logits, prepared(sampler, 4, **sp_kwargs))
        assert torch.equal(out.tokens, torch.argmax(logits, dim=-1))
        assert out.tokens[1].item() == 5
        assert out.tokens.dtype == torch.int64


def test_top_k_one_equals_argmax_for_stochastic_rows() -> None:
    torch.manual_seed(1)
    sampler = make_sampler()
    logits = torch.randn(4, VOCAB)
    logits[2, 3] = logits[2, 30] = 10.0
    p = prepared(sampler, 4, temperature=[0.3, 1.0, 2.0, 5.0], top_k=1, top_p=0.9)
    for _ in range(5):
        assert torch.equal(sampler.sample(logits, p).tokens, torch.argmax(logits, dim=-1))


def test_argmax_path_applies_penalties_first() -> None:
    sampler = make_sampler(batch=1)
    logits = torch.zeros(1, VOCAB)
    logits[0, 4] = 2.0
    logits[0, 6] = 1.5
    p = prepared(sampler, 1, repetition_penalty=2.0, output_tokens=torch.tensor([[4]]))
    assert p.sampling_path == "argmax"
    assert sampler.sample(logits, p).tokens.tolist() == [6]


# ---- seeds ------------------------------------------------------------------------------


def _seeded_token(
    sampler: DeviceSampler, logits: torch.Tensor, seeds: list[int | None], positions: list[int]
) -> torch.Tensor:
    rows = logits.shape[0]
    # A scalar temperature activates one row only: give every row its own temperature.
    p = sampler.prepare(
        SamplingParams(temperature=[1.0] * rows, top_k=16, top_p=1.0, seed=seeds), rows
    )
    return sampler.sample(logits, p, positions=torch.tensor(positions)).tokens


def test_seeded_sampling_is_reproducible() -> None:
    sampler = make_sampler()
    logits = torch.zeros(2, VOCAB)  # flat: every token equally likely
    first = [_seeded_token(sampler, logits, [3, 4], [p, p]).tolist() for p in range(20)]
    again = [_seeded_token(sampler, logits, [3, 4], [p, p]).tolist() for p in range(20)]
    assert first == again
    assert len({row[0] for row in first}) > 5  # the stream moves with the position


def test_seeded_row_is_independent_of_slot_and_of_other_rows() -> None:
    torch.manual_seed(2)
    sampler = make_sampler()
    row = torch.randn(VOCAB) * 0.3
    for position in range(15):
        alone = _seeded_token(sampler, row[None, :], [42], [position])[0]
        others = torch.randn(3, VOCAB) * 5
        batch = torch.stack([others[0], others[1], row, others[2]])
        mixed = _seeded_token(
            sampler, batch, [7, None, 42, 42 + position + 1], [9, 0, position, position]
        )
        assert mixed[2] == alone


def test_equal_seeds_at_equal_positions_share_the_stream_and_different_seeds_differ() -> None:
    sampler = make_sampler()
    logits = torch.zeros(4, VOCAB)
    same = [_seeded_token(sampler, logits, [5, 5, 6, 2**63], [p] * 4) for p in range(20)]
    assert all(t[0] == t[1] for t in same)
    assert any(t[0] != t[2] for t in same)
    assert any(t[2] != t[3] for t in same)


def test_unseeded_rows_vary_between_calls() -> None:
    torch.manual_seed(3)
    sampler = make_sampler(batch=1)
    p = prepared(sampler, 1, temperature=1.0, top_k=16)
    draws = {sampler.sample(torch.zeros(1, VOCAB), p).tokens.item() for _ in range(40)}
    assert len(draws) > 5


def test_seeded_draws_follow_the_softmax_distribution() -> None:
    rows = 500
    sampler = make_sampler(batch=rows, top_k=4, vocab=4)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(rows, 4).contiguous()
    sp = SamplingParams(temperature=[1.0] * rows, top_k=4, seed=list(range(1, rows + 1)))
    p = sampler.prepare(sp, rows)
    counts = torch.zeros(4)
    for position in range(8):
        tokens = sampler.sample(logits, p, positions=torch.full((rows,), position)).tokens
        counts += torch.bincount(tokens, minlength=4)
    freq = counts / counts.sum()
    expected = torch.softmax(logits[0], dim=0)
    assert torch.allclose(freq, expected, atol=0.02), (freq, expected)


# ---- top-k / top-p ------------------------------------------------------------------------


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass() -> None:
    sampler = make_sampler(batch=1, top_k=8, vocab=8)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0, 0.0, 0.0, 0.0]) + 1e-9
    logits = probs.log()[None, :]
    for top_p, allowed in ((0.5, {0}), (0.6, {0, 1}), (0.8, {0, 1}), (0.81, {0, 1, 2})):
        p = sampler.prepare(SamplingParams(temperature=1.0, top_k=8, top_p=top_p, seed=[9]), 1)
        seen = {
            sampler.sample(logits, p, positions=torch.tensor([i])).tokens.item() for i in range(200)
        }
        assert seen == allowed, (top_p, seen)


def test_temperature_scales_before_top_p() -> None:
    sampler = make_sampler(batch=1, top_k=4, vocab=4)
    logits = torch.tensor([[1.0, 0.0, -10.0, -20.0]])  # p0 = 0.731 at temperature 1
    hot = sampler.prepare(SamplingParams(temperature=100.0, top_k=4, top_p=0.7, seed=[1]), 1)
    seen = {
        sampler.sample(logits, hot, positions=torch.tensor([i])).tokens.item() for i in range(300)
    }
    assert seen == {0, 1, 2}  # flattened by the temperature: three tokens needed for 0.7


# ---- penalties ----------------------------------------------------------------------------


def test_apply_penalties_matches_the_hand_computed_definition() -> None:
    logits = torch.tensor(
        [
            [2.0, -1.0, 4.0, 0.5, -3.0, 1.0],
            [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
        ]
    )
    prompt = torch.tensor([[0, 1, -1], [-1, -1, -1]])
    output = torch.tensor([[2, 2, 3, -1], [5, 7, 5, 5]])  # 7 is outside the vocab: ignored
    out = apply_penalties(
        logits,
        prompt_tokens=prompt,
        output_tokens=output,
        presence_penalty=torch.tensor([0.25, 0.5]),
        frequency_penalty=torch.tensor([0.5, 0.125]),
        repetition_penalty=torch.tensor([2.0, 1.0]),
    )
    # row 0: seen = {0, 1 (prompt), 2, 3 (output)}; output counts: 2 -> 2, 3 -> 1
    #   token 0: 2 / 2 = 1; token 1: -1 * 2 = -2
    #   token 2: 4 / 2 - 0.5 * 2 - 0.25 = 0.75; token 3: 0.5 / 2 - 0.5 * 1 - 0.25 = -0.5
    # row 1: repetition 1; token 5 seen 3 times: 1 - 0.125 * 3 - 0.5 = 0.125
    expected = torch.tensor(
        [
            [1.0, -2.0, 0.75, -0.5, -3.0, 1.0],
            [1.0, 1.0, 1.0, 1.0, 1.0, 0.125],
        ]
    )
    assert torch.equal(out, expected)
    assert torch.equal(logits[0, 0], torch.tensor(2.0))  # input untouched


def test_neutral_penalties_leave_logits_bit_identical() -> None:
    torch.manual_seed(4)
    logits = torch.randn(3, VOCAB)
    history = torch.randint(-1, VOCAB, (3, 10))
    out = apply_penalties(logits, prompt_tokens=history, output_tokens=history)
    assert torch.equal(out, logits)


def test_apply_penalties_shape_errors() -> None:
    with pytest.raises(ValueError, match=r"logits must be \[batch, vocab\]"):
        apply_penalties(torch.zeros(4))
    with pytest.raises(ValueError, match=r"output_tokens must be \[2, length\]"):
        apply_penalties(torch.zeros(2, 4), output_tokens=torch.zeros(3, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="repetition_penalty has 3 rows"):
        apply_penalties(torch.zeros(2, 4), repetition_penalty=torch.ones(3))


def test_sampler_uses_prepared_history_for_penalties() -> None:
    sampler = make_sampler(batch=2)
    logits = torch.zeros(2, VOCAB)
    logits[:, 1] = 1.0
    logits[:, 2] = 0.9
    p = prepared(
        sampler,
        2,
        temperature=[0.0, 0.0],
        presence_penalty=[0.5, 0.0],
        output_tokens=torch.tensor([[1], [1]]),
    )
    assert p.penalties_enabled
    assert sampler.sample(logits, p).tokens.tolist() == [2, 1]
    # explicit history overrides the prepared one
    out = sampler.sample(logits, p, output_tokens=torch.tensor([[-1], [-1]]))
    assert out.tokens.tolist() == [1, 1]


# ---- log-probs --------------------------------------------------------------------------


def test_log_probs_are_log_softmax_of_the_processed_logits_at_the_token() -> None:
    torch.manual_seed(5)
    sampler = make_sampler()
    logits = torch.randn(4, VOCAB, dtype=torch.bfloat16)
    p = prepared(
        sampler,
        4,
        temperature=[0.0, 0.5, 2.0, 1.0],
        top_k=8,
        top_p=0.9,
        frequency_penalty=0.5,
        enable_log_probs=[True, True, True, False],
        output_tokens=torch.tensor([[0, 1], [2, 3], [4, -1], [5, 6]]),
    )
    out = sampler.sample(logits, p, positions=torch.arange(4))
    assert out.log_probs is not None and out.log_probs.dtype == torch.float32
    processed = (
        apply_penalties(logits, output_tokens=p.output_tokens, frequency_penalty=0.5)
        * torch.tensor([1.0, 2.0, 0.5, 1.0])[:, None]
    )
    expected = torch.log_softmax(processed, dim=-1).gather(1, out.tokens[:, None]).squeeze(1)
    assert torch.allclose(out.log_probs[:3], expected[:3], atol=1e-6)
    assert out.log_probs[3].item() == 1.0  # row did not ask
    assert out.top_tokens is None


def test_no_log_probs_unless_requested_and_top_n_when_asked() -> None:
    sampler = make_sampler()
    logits = torch.randn(2, VOCAB)
    assert sampler.sample(logits, prepared(sampler, 2, temperature=[0.0, 0.0])).log_probs is None
    p = prepared(sampler, 2, temperature=[0.0, 0.0], enable_log_probs=True, num_logprobs=[3, 0])
    out = sampler.sample(logits, p)
    assert out.top_tokens is not None and out.top_log_probs is not None
    assert out.top_tokens.shape == (2, 3)
    assert torch.equal(out.top_tokens[0], torch.topk(logits[0], 3).indices)
    assert torch.allclose(out.top_log_probs[0], torch.log_softmax(logits[0], 0)[out.top_tokens[0]])


# ---- trace-style reuse ------------------------------------------------------------------


def test_restaged_buffers_drive_a_captured_run_like_a_fresh_sample() -> None:
    """A trace replays `run` over persistent inputs; staging new params must be all it needs."""
    torch.manual_seed(6)
    sampler = make_sampler()
    logits_buffer = torch.randn(3, VOCAB)
    positions_buffer = torch.zeros(3, dtype=torch.int64)
    first = prepared(sampler, 3, temperature=[1.0, 0.5, 0.0], top_k=4, seed=[1, 2, 3])
    plan = sampler.stage(first)

    def captured() -> torch.Tensor:
        return sampler.run(logits_buffer, plan, positions=positions_buffer).tokens

    captured()  # "capture"
    second = prepared(sampler, 3, temperature=[0.7, 1.3, 0.0], top_k=[2, 8, 3], seed=[5, 6, 7])
    assert sampler.stage(second) == plan
    logits_buffer.copy_(torch.randn(3, VOCAB))
    positions_buffer.copy_(torch.tensor([11, 12, 13]))
    replayed = captured()
    fresh = sampler.sample(logits_buffer, second, positions=positions_buffer).tokens
    assert torch.equal(replayed, fresh)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replay_matches_eager() -> None:
    sampler = DeviceSampler(SamplerConfig(max_batch_size=4, max_top_k=16, vocab_size=VOCAB))
    sampler.materialize("cuda")
    logits = torch.randn(4, VOCAB, device="cuda")
    positions = torch.arange(4, device="cuda")
    p = prepared(sampler, 4, temperature=[1.0, 0.5, 0.0, 2.0], top_k=8, seed=[1, 2, 3, 4])
    plan = sampler.stage(p)
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sampler.run(logits, plan, positions=positions)  # warm up kernels outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sampler.run(logits, plan, positions=positions)
    q = prepared(sampler, 4, temperature=[0.3, 1.0, 0.0, 1.0], top_k=[2, 16, 1, 4], seed=[9] * 4)
    sampler.stage(q)
    logits.copy_(torch.randn(4, VOCAB, device="cuda"))
    positions.copy_(torch.tensor([7, 8, 9, 10], device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    eager = sampler.sample(logits, q, positions=positions)
    assert torch.equal(out.tokens, eager.tokens)


# ---- properties -------------------------------------------------------------------------


@st.composite
def sampling_cases(draw: st.DrawFn) -> tuple[torch.Tensor, SamplingParams, list[int], int]:
    rows = draw(st.integers(min_value=1, max_value=4))
    vocab = draw(st.integers(min_value=2, max_value=24))
    values = draw(
        st.lists(
            st.floats(min_value=-8.0, max_value=8.0, width=32),
            min_size=rows * vocab,
            max_size=rows * vocab,
        )
    )
    logits = torch.tensor(values, dtype=torch.float32).reshape(rows, vocab)
    sp = SamplingParams(
        temperature=draw(
            st.lists(
                st.one_of(st.just(0.0), st.floats(min_value=0.05, max_value=3.0)),
                min_size=rows,
                max_size=rows,
            )
        ),
        top_k=draw(st.lists(st.integers(1, 12), min_size=rows, max_size=rows)),
        top_p=draw(st.lists(st.floats(0.01, 1.0), min_size=rows, max_size=rows)),
        seed=draw(
            st.lists(st.one_of(st.none(), st.integers(0, 2**64 - 1)), min_size=rows, max_size=rows)
        ),
        enable_log_probs=True,
    )
    positions = draw(st.lists(st.integers(0, 10_000), min_size=rows, max_size=rows))
    return logits, sp, positions, vocab


@given(case=sampling_cases())
def test_sampled_token_is_in_the_top_k_set_and_the_top_p_nucleus(
    case: tuple[torch.Tensor, SamplingParams, list[int], int],
) -> None:
    logits, sp, positions, vocab = case
    rows = logits.shape[0]
    sampler = make_sampler(batch=4, top_k=12, vocab=vocab)
    p = sampler.prepare(sp, rows)
    out = sampler.sample(logits, p, positions=torch.tensor(positions))
    assert out.log_probs is not None
    scaled = logits * torch.tensor(p.inverse_temperature)[:, None]
    expected_lp = torch.log_softmax(scaled, -1).gather(1, out.tokens[:, None]).squeeze(1)
    assert torch.allclose(out.log_probs, expected_lp, atol=1e-5)
    for r in range(rows):
        token = int(out.tokens[r])
        assert 0 <= token < vocab
        if p.greedy_mask[r]:
            assert token == int(torch.argmax(logits[r]))
            continue
        k = min(p.top_k[r], vocab)
        top_values = torch.topk(scaled[r], k).values
        chosen = scaled[r, token]
        assert chosen >= top_values[-1]  # inside the top-k set
        probs = torch.softmax(top_values, dim=0)
        above = probs[top_values > chosen].sum().item()
        assert above < p.top_p[r] + 1e-5  # inside the nucleus: the mass before it is < p


@given(case=sampling_cases(), shift=st.integers(min_value=0, max_value=2))
def test_seeded_rows_do_not_depend_on_batch_position(
    case: tuple[torch.Tensor, SamplingParams, list[int], int], shift: int
) -> None:
    logits, sp, positions, vocab = case
    rows = logits.shape[0]
    seeds = [7 + r for r in range(rows)]
    sampler = make_sampler(batch=8, top_k=12, vocab=vocab)
    base_sp = SamplingParams(temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, seed=seeds)
    base = sampler.sample(
        logits, sampler.prepare(base_sp, rows), positions=torch.tensor(positions)
    ).tokens
    # Put the same rows behind `shift` unseeded noise rows, in reverse order.
    order = list(reversed(range(rows)))
    noise = torch.randn(shift, vocab) * 4
    moved_logits = torch.cat([noise, logits[order]])

    def per_row(value: Any) -> list[Any]:
        return list(value) if isinstance(value, tuple) else [value] * rows

    moved_sp = SamplingParams(
        temperature=[1.0] * shift + [per_row(sp.temperature)[i] for i in order],
        top_k=[4] * shift + [per_row(sp.top_k)[i] for i in order],
        top_p=[1.0] * shift + [per_row(sp.top_p)[i] for i in order],
        seed=[None] * shift + [seeds[i] for i in order],
    )
    moved_positions = torch.tensor([0] * shift + [positions[i] for i in order])
    moved = sampler.sample(
        moved_logits, sampler.prepare(moved_sp, shift + rows), positions=moved_positions
    ).tokens
    assert moved[shift:].tolist() == [int(base[i]) for i in order]


# ---- buffers owned by a runtime device -----------------------------------------------------


def _device_sampler() -> DeviceSampler:
    return DeviceSampler(SamplerConfig(max_batch_size=4, max_top_k=8, vocab_size=VOCAB))


def test_buffers_from_a_runtime_device_are_counted_and_released_once() -> None:
    from runtime.backends.faults import FaultInjectingDevice, FaultPlan
    from runtime.backends.torch_device import TorchDevice

    device = FaultInjectingDevice(TorchDevice("cpu"), FaultPlan())
    sampler = _device_sampler()
    sampler.materialize(device)
    buffers = dict(sampler.buffers)
    assert device.live_allocations == len(buffers) > 0
    assert all(device.is_owned(tensor) for tensor in buffers.values())
    sampler.materialize(device)  # idempotent: nothing more allocated
    assert device.live_allocations == len(buffers)
    plan = sampler.stage(prepared(sampler, 2, temperature=(0.0, 0.0)))
    tokens = sampler.run(torch.randn(2, VOCAB), plan).tokens
    assert tokens.shape[0] == 2
    sampler.release()
    sampler.release()  # idempotent
    assert device.live_allocations == 0 and device.deallocated_twice == 0
    assert not sampler.materialized and dict(sampler.buffers) == {}


def test_failed_buffer_allocation_leaves_nothing_allocated() -> None:
    from runtime.backends.faults import FaultInjectingDevice, InjectedFault
    from runtime.backends.torch_device import TorchDevice

    device = FaultInjectingDevice(TorchDevice("cpu"), "allocate:3")
    sampler = _device_sampler()
    with pytest.raises(InjectedFault):
        sampler.materialize(device)
    assert device.live_allocations == 0
    assert not sampler.materialized
    sampler.materialize(device)  # the fault fired once: a retry allocates everything
    assert device.live_allocations == len(sampler.buffers)
    sampler.release()
    assert device.live_allocations == 0


def test_failed_buffer_release_keeps_the_buffer_for_a_retry() -> None:
    from runtime.backends.faults import FaultInjectingDevice, InjectedFault
    from runtime.backends.torch_device import TorchDevice

    device = FaultInjectingDevice(TorchDevice("cpu"), "deallocate:2")
    sampler = _device_sampler()
    sampler.materialize(device)
    count = len(sampler.buffers)
    with pytest.raises(InjectedFault):
        sampler.release()
    assert device.live_allocations == 1 and len(sampler.buffers) == 1
    assert sampler.materialized
    sampler.release()
    assert device.live_allocations == 0 and device.deallocated_twice == 0
    assert not sampler.materialized
    assert count > 2

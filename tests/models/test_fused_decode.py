"""The fused decode stack equals the per-op decode and transformers; warmup's choice of it is
recorded, replayed, and falls back with a reason where it cannot run."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from models.decoder import DecoderModel, random_state_dict
from models.decoder.fused_decode import FusedDecodeStack
from models.decoder.kernels import (
    FUSED_MAX_ROWS,
    KernelPlan,
    KernelPlanError,
    Layout,
    ProjectionChoice,
    load_kernel_plan,
    parse_kernel_plan,
)
from models.llama import TINY_PRESETS, LlamaArgs
from runtime.backends import native_kernels
from tests.models.llama_oracle import assert_four_rows_greedy_match_transformers, tiny_pair

REASON = native_kernels.unavailable_reason()
needs_native = pytest.mark.skipif(
    REASON is not None, reason=f"the native CPU kernels need a C compiler (gcc): {REASON}"
)
ALL_ROWS = tuple(range(1, FUSED_MAX_ROWS + 1))


def _model(args: LlamaArgs, seed: int = 4) -> DecoderModel:
    return DecoderModel.from_state_dict(args, random_state_dict(args, seed=seed))


def _plan(model: DecoderModel, layouts: dict[str, Layout]) -> KernelPlan:
    """A hand-written plan storing each projection in `layouts[name]` (default `out_in`)."""
    forms: dict[Layout, tuple[tuple[int, str], ...]] = {
        "out_in": ((1, "mv"), (64, "linear")),
        "in_out": ((1, "mv_t"), (64, "mm_xw")),
    }
    projections = []
    for name in model.projection_shapes():
        layout = layouts.get(name, "out_in")
        projections.append((name, ProjectionChoice(layout, False, forms[layout])))
    return KernelPlan(
        projections=tuple(projections),
        decode_attention="paged_inplace",
        buckets=(1, 2, 4, 64),
        source="hand-written",
        dtype="float32",
        threads=torch.get_num_threads(),
        cpu="test",
    )


def _decode_both_ways(
    model: DecoderModel,
    *,
    block_size: int,
    positions: list[int],
    shared_pages: bool,
    seed: int,
    spread: bool = False,
    head_in_call: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """One decode step per-op and fused from the same random cache: logits and caches
    (`spread`: the fused stack's attention prefetches through its math; `head_in_call`: the
    LM head runs in the stack's call at every row count, or in its own; None: the default
    rule)."""
    generator = torch.Generator().manual_seed(seed)
    rows = len(positions)
    width = max(positions) // block_size + 1
    blocks = rows * width + 3 + rows  # the last `rows` pages: spares for write-slot clashes
    model.set_kv_cache(None)
    model.configure_paged_attention(block_size=block_size, max_num_blocks=blocks)
    shape = model.kv_cache_shape(blocks)
    cache = [
        (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
        for _ in range(model.n_layers)
    ]
    drawn = blocks - rows
    if shared_pages:  # rows drawing pages independently may share some
        pages = torch.stack([torch.randperm(drawn, generator=generator)[:width] for _ in positions])
    else:
        pages = torch.randperm(drawn, generator=generator)[: rows * width].view(rows, width)
    written: set[tuple[int, int]] = set()
    for row, position in enumerate(positions):
        pages[row, position // block_size + 1 :] = -1  # past the row's position: unmapped
        # Shared pages are fine, but no engine lets two rows write one K/V slot in a step
        # (which write lands would be a race): such a row writes into its own spare page.
        slot = (int(pages[row, position // block_size]), position % block_size)
        if slot in written:
            pages[row, position // block_size] = drawn + row
            slot = (drawn + row, position % block_size)
        written.add(slot)
    tokens = torch.randint(0, model.vocab_size, (rows,), generator=generator)
    results = []
    for fused in (False, True):
        copy = [(k.clone(), v.clone()) for k, v in cache]
        model.set_kv_cache(copy)
        head_rows = None if head_in_call is None else ALL_ROWS if head_in_call else ()
        model.fused_decode = (
            FusedDecodeStack(
                model, ALL_ROWS, ALL_ROWS, spread_attention=spread, head_rows=head_rows
            )
            if fused
            else None
        )
        try:
            logits = model.decode(
                tokens, positions=torch.tensor(positions), page_table=pages.to(torch.int32)
            )
        finally:
            model.fused_decode = None
            model.set_kv_cache(None)
        results.append((logits, [t for pair in copy for t in pair]))
    (per_op, per_op_cache), (fused_logits, fused_cache) = results
    return per_op, fused_logits, per_op_cache, fused_cache


@needs_native
@given(
    n_kv=st.integers(1, 3),
    group=st.integers(1, 3),
    head_dim=st.sampled_from([8, 16, 24, 64]),
    dim=st.integers(8, 80),
    ffn=st.integers(8, 120),
    layers=st.integers(1, 3),
    block_size=st.sampled_from([1, 4, 8, 16]),
    positions=st.lists(st.integers(0, 70), min_size=1, max_size=FUSED_MAX_ROWS),
    layouts=st.dictionaries(
        st.sampled_from(["wqkv", "wo", "w_gate_up", "w_down"]), st.sampled_from(["in_out"])
    ),
    shared_pages=st.booleans(),
    seed=st.integers(0, 2**16),
    spread=st.booleans(),
    head_in_call=st.sampled_from([None, True, False]),
)
def test_fused_stack_equals_the_per_op_decode(
    n_kv: int,
    group: int,
    head_dim: int,
    dim: int,
    ffn: int,
    layers: int,
    block_size: int,
    positions: list[int],
    layouts: dict[str, Layout],
    shared_pages: bool,
    seed: int,
    spread: bool,
    head_in_call: bool | None,
) -> None:
    """Random tiny configs (GQA, odd widths, both weight layouts), 1-64 rows at positions
    crossing page boundaries, either attention prefetch placement, the LM head in the
    stack's call or in its own: same logits and same K/V written as the per-op path."""
    args = LlamaArgs(
        dim=dim,
        n_layers=layers,
        n_heads=n_kv * group,
        n_kv_heads=n_kv,
        vocab_size=96,
        ffn_dim=ffn,
        head_dim=head_dim,
        max_seq_len=128,
        rope_theta=10000.0 + seed,
        name="tiny-random-fused",
    )
    model = _model(args, seed=seed)
    model.apply_kernel_plan(_plan(model, layouts))
    per_op, fused, per_op_cache, fused_cache = _decode_both_ways(
        model,
        block_size=block_size,
        positions=positions,
        shared_pages=shared_pages,
        seed=seed,
        spread=spread,
        head_in_call=head_in_call,
    )
    torch.testing.assert_close(fused, per_op, atol=2e-5, rtol=2e-5)
    for got, expected in zip(fused_cache, per_op_cache, strict=True):
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


@needs_native
@pytest.mark.parametrize("rows", [1, 5])
def test_the_fused_silu_matches_torch_far_from_zero(rows: int) -> None:
    """Gate values out to +-500 (past the exponent's clamp at -87 on both sides of zero), an
    FFN width that splits into a vector part and a scalar tail per thread: the fused
    stack's SiLU equals torch's, with no inf or NaN."""
    args = LlamaArgs(
        dim=32,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        vocab_size=96,
        ffn_dim=53,
        head_dim=16,
        max_seq_len=64,
        rope_theta=10000.0,
        name="tiny-random-silu",
    )
    weights = random_state_dict(args, seed=7)
    gate = weights["model.layers.0.mlp.gate_proj.weight"]
    gate.mul_(500.0 / gate.abs().max())
    model = DecoderModel.from_state_dict(args, weights)
    model.apply_kernel_plan(_plan(model, {}))
    per_op, fused, _, _ = _decode_both_ways(
        model,
        block_size=8,
        positions=[3 + 9 * row for row in range(rows)],
        shared_pages=False,
        seed=rows,
    )
    assert torch.isfinite(fused).all()
    torch.testing.assert_close(fused, per_op, atol=2e-5, rtol=2e-5)


@needs_native
def test_timing_a_fused_step_changes_nothing_and_times_every_phase() -> None:
    """`FusedDecodeLayers.timing`: bit-identical logits and caches, a positive time for every
    phase of a step that runs the final norm and head, summing to less than the step's wall
    time; nothing added once the block is left."""
    args = LlamaArgs(
        dim=64, n_layers=2, n_heads=6, n_kv_heads=2, vocab_size=96, ffn_dim=96,
        head_dim=16, max_seq_len=128, rope_theta=10000.0, name="tiny-random-timed",
    )  # fmt: skip
    model = _model(args)
    model.apply_kernel_plan(_plan(model, {}))

    def step() -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        positions = [3, 17, 40, 9, 70]
        return _decode_both_ways(
            model, block_size=8, positions=positions, shared_pages=False, seed=1
        )

    _, plain, _, plain_cache = step()
    kernel = native_kernels.fused_decode_layers()
    with kernel.timing() as seconds:
        start = time.perf_counter()
        _, timed, _, timed_cache = step()
        wall = time.perf_counter() - start
    assert torch.equal(timed, plain)
    assert all(torch.equal(a, b) for a, b in zip(timed_cache, plain_cache, strict=True))
    assert seconds.shape == (len(native_kernels.STACK_PHASES),)
    named = dict(zip(native_kernels.STACK_PHASES, seconds.tolist(), strict=True))
    assert bool((seconds > 0).all()), named
    assert float(seconds.sum()) < wall
    kept = seconds.clone()
    step()
    assert torch.equal(seconds, kept)


@needs_native
@pytest.mark.parametrize("spread", [False, True])
def test_attention_reads_only_skips_just_the_attentions_math(spread: bool) -> None:
    """`FusedDecodeLayers.attention_reads_only`, the benchmarks' page walk inside the step:
    its logits and K/V writes are those of the same model with the attention's output
    projection zeroed (the attention adds nothing, all else runs), and the next call outside
    the block is the normal step again."""
    args = LlamaArgs(
        dim=64, n_layers=2, n_heads=6, n_kv_heads=2, vocab_size=96, ffn_dim=96,
        head_dim=16, max_seq_len=128, rope_theta=10000.0, name="tiny-random-reads-only",
    )  # fmt: skip
    weights = random_state_dict(args, seed=4)
    silent = {
        name: torch.zeros_like(tensor) if name.endswith("o_proj.weight") else tensor
        for name, tensor in weights.items()
    }
    model, without_attention = (
        DecoderModel.from_state_dict(args, state) for state in (weights, silent)
    )
    for each in (model, without_attention):
        each.apply_kernel_plan(_plan(each, {}))
    positions = [3, 17, 40, 9, 70]

    def step(of: DecoderModel) -> tuple[torch.Tensor, torch.Tensor]:
        _, logits, _, cache = _decode_both_ways(
            of, block_size=8, positions=positions, shared_pages=False, seed=1, spread=spread
        )
        return logits, torch.cat([t.flatten() for t in cache])

    normal, _ = step(model)
    expected, expected_cache = step(without_attention)
    kernel = native_kernels.fused_decode_layers()
    with kernel.attention_reads_only():
        walked, walked_cache = step(model)
    torch.testing.assert_close(walked, expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(walked_cache, expected_cache, atol=2e-5, rtol=2e-5)
    assert not torch.allclose(walked, normal, atol=1e-3)
    again, _ = step(model)
    assert torch.equal(again, normal)


@pytest.fixture
def fused_tiny_models() -> Iterator[None]:
    """Route the (cached, shared) tiny models' decode through the fused stack, then back."""
    models = [tiny_pair(preset)[0] for preset in sorted(TINY_PRESETS)]
    for model in models:
        model.fused_decode = FusedDecodeStack(model, ALL_ROWS, ALL_ROWS)
    yield
    for model in models:
        model.fused_decode = None


@needs_native
@pytest.mark.usefixtures("fused_tiny_models")
@pytest.mark.parametrize("preset", sorted(TINY_PRESETS))
def test_fused_decode_greedy_matches_transformers(preset: str) -> None:
    """Every preset's rope variant, GQA/MQA/MHA and tied head, four rows at once."""
    model, hf = tiny_pair(preset)
    assert_four_rows_greedy_match_transformers(model, hf, preset)


@needs_native
def test_warmup_records_the_measured_choice_and_a_replay_reproduces_it(tmp_path: Path) -> None:
    model = _model(LlamaArgs.tiny_random("gqa"))
    record = model.choose_kernels(decode_rows=4, prefill_rows=32)
    fused = record["fused_decode"]
    measured = {item["bucket"]: item for item in fused["measured_us"]}
    assert sorted(measured) == [1, 2, 4]  # every decode bucket of at most 4 rows, timed
    assert fused["buckets"] == [b for b, m in sorted(measured.items()) if m["fused"] < m["per_op"]]
    assert model.kernel_plan is not None
    stack = model.fused_decode
    for rows in (1, 2, 3, 4, 5):
        bucket = next(b for b in (1, 2, 4, 32) if rows <= b)
        runs = stack is not None and stack.runs(rows)
        assert runs == (bucket in fused["buckets"]), rows
    # Replay a choice measurement would not make (fused exactly where it was not chosen).
    flipped = [b for b in (1, 2, 4) if b not in fused["buckets"]]
    recorded = attrs.evolve(model.kernel_plan, fused_decode=tuple(flipped))
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps({"kernels": recorded.to_json()}), encoding="utf-8")
    replayed = _model(LlamaArgs.tiny_random("gqa"))
    replayed.replay_kernels(load_kernel_plan(path), where=f"--kernels {path}")
    again = replayed.choose_kernels(decode_rows=4, prefill_rows=32)
    assert again["fused_decode"]["buckets"] == flipped
    assert replayed.kernel_plan is not None and replayed.kernel_plan.fused_decode == tuple(flipped)
    assert (replayed.fused_decode is not None) == bool(flipped)
    assert ("fused decode off" in again["summary"]) == (not flipped)


@needs_native
def test_the_plans_head_placement_is_recorded_replayed_and_defaults_for_older_plans() -> None:
    """`head_buckets` names the fused buckets whose steps run the LM head in the stack's call:
    it survives the file round trip, the applied stack follows it, and a plan without it (made
    before warmup measured the placement) keeps the old rule: buckets of at most 4 rows."""
    model = _model(LlamaArgs.tiny_random("gqa"))
    base = _plan(model, {})
    timed = attrs.evolve(
        base,
        fused_decode=(1, 2, 64),
        fused_timings=((1, 10.0, 20.0), (2, 11.0, 21.0), (64, 30.0, 40.0)),
        fused_head=(2, 64),
        fused_head_timings=((1, 12.0, 10.0), (2, 11.0, 13.0), (64, 30.0, 31.0)),
    )
    data = timed.to_json()
    entry = data["fused_decode"]
    assert isinstance(entry, dict) and entry["head_buckets"] == [2, 64]
    assert entry["measured_us"][0] == {  # type: ignore[index]
        "bucket": 1,
        "fused": 10.0,
        "per_op": 20.0,
        "head_in_call": 12.0,
        "head_apart": 10.0,
    }
    assert "final norm and LM head in the call @2,@64" in timed.summary()
    parsed = parse_kernel_plan(json.loads(json.dumps(data)), where="--kernels k.json")
    assert parsed.head_in_stack() == (2, 64)
    assert parsed.fused_head_timings == timed.fused_head_timings
    del entry["head_buckets"]
    older = parse_kernel_plan(data, where="--kernels old.json")
    assert older.fused_head is None and older.head_in_stack() == (1, 2)
    model.apply_kernel_plan(parsed)
    stack = model.fused_decode
    assert stack is not None
    placed = {rows: stack._head_for(rows) is not None for rows in (1, 2, 3, 40, 64)}
    assert placed == {1: False, 2: True, 3: False, 40: True, 64: True}


@pytest.mark.parametrize("chosen", [[4], [True], "2", [3]])
def test_a_plan_with_bad_head_buckets_is_refused_naming_it(chosen: object) -> None:
    model = _model(LlamaArgs.tiny_random("gqa"))
    data = attrs.evolve(_plan(model, {}), fused_decode=(1, 2)).to_json()
    entry = data["fused_decode"]
    assert isinstance(entry, dict)
    entry["head_buckets"] = chosen
    with pytest.raises(
        KernelPlanError, match=r"--kernels k\.json: fused_decode head_buckets=.* is invalid"
    ):
        parse_kernel_plan(data, where="--kernels k.json")


def test_a_version_1_plan_replays_with_the_fused_stack_off() -> None:
    model = _model(LlamaArgs.tiny_random("gqa"))
    data = _plan(model, {}).to_json()
    data["version"] = 1
    del data["fused_decode"]
    plan = parse_kernel_plan(data, where="--kernels old.json")
    assert plan.fused_decode == () and plan.projections == _plan(model, {}).projections
    model.replay_kernels(plan)
    model.choose_kernels(decode_rows=4, prefill_rows=64)
    assert model.fused_decode is None


@pytest.mark.parametrize(
    "entry", [{"buckets": [8]}, {"buckets": [3]}, {"buckets": "1"}, [1], {"buckets": [True]}]
)
def test_a_plan_with_bad_fused_buckets_is_refused_naming_it(entry: object) -> None:
    data = _plan(_model(LlamaArgs.tiny_random("gqa")), {}).to_json()
    data["fused_decode"] = entry
    with pytest.raises(KernelPlanError, match=r"--kernels k\.json: fused_decode=.* is invalid"):
        parse_kernel_plan(data, where="--kernels k.json")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("buckets", ["x"], r"buckets=\['x'\] is invalid: allowed is a list of row counts >= 1"),
        ("buckets", 5, r"buckets=5 is invalid"),
        ("buckets", [0, 2], r"buckets=\[0, 2\] is invalid"),
        ("threads", "two", r"threads='two' is invalid: allowed is an integer >= 0"),
        ("notes", 5, r"notes=5 is invalid: allowed is a list of strings"),
        ("measured_us", 7, r"fused_decode measured_us=7 is invalid: allowed is a list of objects"),
        ("measured_us", [1], r"fused_decode measured_us=\[1\] is invalid"),
        (
            "measured_us",
            [{"bucket": "a", "fused": 1.0, "per_op": 2.0}],
            r"fused_decode measured_us=.* is invalid",
        ),
        (
            "measured_us",
            [{"bucket": 1, "fused": "fast", "per_op": 2.0}],
            r"fused_decode measured_us=.* is invalid",
        ),
        (
            "microseconds",
            ["x"],
            r"\w+\.microseconds=\['x'\] is invalid: allowed is a list of numbers",
        ),
    ],
)
def test_a_hand_edited_plans_bad_field_is_refused_naming_the_file(
    field: str, value: object, message: str
) -> None:
    """The plan's other fields are checked as its choices are: a value of the wrong kind is a
    named refusal (`--kernels FILE: field=value ...: allowed is ...`), not a traceback."""
    data = _plan(_model(LlamaArgs.tiny_random("gqa")), {}).to_json()
    fused, projections = data["fused_decode"], data["projections"]
    assert isinstance(fused, dict) and isinstance(projections, dict)
    if field == "measured_us":
        fused[field] = value
    elif field == "microseconds":
        first = projections[sorted(projections)[0]]
        assert isinstance(first, dict)
        first[field] = value
    else:
        data[field] = value
    with pytest.raises(KernelPlanError, match=r"--kernels k\.json: " + message):
        parse_kernel_plan(data, where="--kernels k.json")


@pytest.mark.usefixtures("no_compiler")
def test_without_a_compiler_warmup_keeps_the_per_op_path_and_says_why() -> None:
    model = _model(LlamaArgs.tiny_random("gqa"))
    record = model.choose_kernels(decode_rows=2, prefill_rows=32)
    assert record["fused_decode"]["buckets"] == [] and model.fused_decode is None
    assert any(
        note.startswith("fused decode off: no C compiler found") for note in record["notes"]
    ), record["notes"]


@pytest.mark.usefixtures("no_compiler")
def test_without_a_compiler_a_plan_choosing_the_fused_stack_is_refused() -> None:
    model = _model(LlamaArgs.tiny_random("gqa"))
    plan = attrs.evolve(_plan(model, {}), decode_attention="gather", fused_decode=(1,))
    with pytest.raises(ValueError, match=r"--kernels k\.json: fused_decode buckets \[1\] cannot"):
        model.replay_kernels(plan, where="--kernels k.json")
    assert model.kernel_plan is None and model.fused_decode is None


def test_bfloat16_and_graph_safe_models_refuse_the_fused_stack() -> None:
    args = LlamaArgs.tiny_random("gqa")
    bf16 = DecoderModel.from_state_dict(args, random_state_dict(args, seed=1), dtype=torch.bfloat16)
    plan = attrs.evolve(
        _plan(bf16, {}), decode_attention="gather", fused_decode=(1,), dtype="bfloat16"
    )
    with pytest.raises(ValueError, match="fused decode stack is float32 only"):
        bf16.replay_kernels(plan, where="--kernels k.json")
    graph_safe = _model(args)
    graph_safe.graph_safe = True
    record = graph_safe.choose_kernels(decode_rows=1, prefill_rows=16)
    assert record["fused_decode"]["buckets"] == []
    assert any("graph-safe" in note for note in record["notes"])


def test_a_missing_cc_makes_the_kernels_unavailable_naming_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("LLM_RUNTIME_NATIVE_CACHE", str(tmp_path / "native"))
    native_kernels._load.cache_clear()
    try:
        reason = native_kernels.unavailable_reason()
    finally:
        native_kernels._load.cache_clear()
    assert reason is not None and "no-such-cc" in reason and "cannot run" in reason, reason

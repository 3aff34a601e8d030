"""The graph-safe (CUDA-graph capturable) decode and prefill of `DecoderModel`.

On CPU the graph-safe path is forced with `model.graph_safe = True` and checked against the
dynamic path: same logits (1e-5 in float32), same cache writes, no byte of the cache touched
outside the slots real tokens write, and no host read or data-dependent shape (proved twice:
`torch.compile(fullgraph=True)` refuses graph breaks, and a torch-function mode raises on any
host read). The CUDA tests capture the real thing and skip without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

import models.decoder.model as model_module
from models.decoder import DecoderModel, random_state_dict
from models.decoder.graph_safe import redirect_writes
from models.llama import TINY_PRESETS, LlamaArgs

ATOL = 1e-5
PRESETS = sorted(TINY_PRESETS)
CUDA_REASON = "needs a CUDA GPU (torch.cuda.is_available() is False)"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_REASON)

KV = list[tuple[torch.Tensor, torch.Tensor]]


@cache
def _model(preset: str) -> DecoderModel:
    args = LlamaArgs.tiny_random(preset)
    return DecoderModel.from_state_dict(args, random_state_dict(args, seed=5))


def _random_cache(model: DecoderModel, num_blocks: int, block_size: int, seed: int) -> KV:
    """Random (not zero) K/V, so a wrong gather or a stray write changes results."""
    generator = torch.Generator().manual_seed(seed)
    shape = (num_blocks, model.args.n_kv_heads, block_size, model.args.head_dim)
    return [
        (
            torch.randn(shape, generator=generator, dtype=model.dtype),
            torch.randn(shape, generator=generator, dtype=model.dtype),
        )
        for _ in range(model.n_layers)
    ]


def _clone(kv: KV) -> KV:
    return [(k.clone(), v.clone()) for k, v in kv]


@contextmanager
def _bound(model: DecoderModel, kv: KV, block_size: int, *, graph_safe: bool) -> Iterator[None]:
    """Bind `kv` with `block_size` and force a path; restore the shared model afterwards."""
    model.set_kv_cache(None)
    model.configure_paged_attention(block_size=block_size, max_num_blocks=kv[0][0].shape[0])
    model.set_kv_cache(kv)
    model.graph_safe = graph_safe
    try:
        yield
    finally:
        model.graph_safe = None
        model.set_kv_cache(None)


def _written_slots(kv: KV, slots: set[tuple[int, int]]) -> torch.Tensor:
    """Bool mask over `[num_blocks, kv, block_size, head_dim]` of (block, offset) slots."""
    mask = torch.zeros(kv[0][0].shape, dtype=torch.bool)
    for block, offset in slots:
        mask[block, :, offset] = True
    return mask


def _assert_only_slots_changed(before: KV, after: KV, slots: set[tuple[int, int]]) -> None:
    """Every byte outside `slots` is identical; every slot inside changed (random caches)."""
    mask = _written_slots(before, slots)
    for layer, (old_pair, new_pair) in enumerate(zip(before, after, strict=True)):
        for old, new in zip(old_pair, new_pair, strict=True):
            assert torch.equal(old[~mask], new[~mask]), f"layer {layer}: a stray write"
            assert bool((old[mask] != new[mask]).all()), f"layer {layer}: a write is missing"


def _assert_caches_close(a: KV, b: KV) -> None:
    for pair_a, pair_b in zip(a, b, strict=True):
        for x, y in zip(pair_a, pair_b, strict=True):
            assert (x - y).abs().max().item() < ATOL


# ----------------------------------------------------------------------------- decode lanes
@attrs.frozen
class DecodeLane:
    """One decode step over a lane with inactive rows and a shuffled page table."""

    preset: str
    block_size: int
    positions: tuple[int, ...]  # negative = inactive
    tokens: tuple[int, ...]
    table: tuple[tuple[int, ...], ...]
    num_blocks: int
    seed: int

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (
            torch.tensor(self.tokens),
            torch.tensor(self.positions),
            torch.tensor(self.table, dtype=torch.int32),
        )

    def written(self) -> set[tuple[int, int]]:
        """(block, offset) slots the step must write: active rows on mapped pages."""
        slots = set()
        for row, pos in enumerate(self.positions):
            if pos >= 0 and self.table[row][pos // self.block_size] >= 0:
                slots.add((self.table[row][pos // self.block_size], pos % self.block_size))
        return slots


@st.composite
def decode_lanes(draw: st.DrawFn, *, allow_all_inactive: bool = False) -> DecodeLane:
    preset = draw(st.sampled_from(PRESETS))
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    rows = draw(st.integers(1, 6))
    active = [draw(st.booleans()) for _ in range(rows)]
    if not allow_all_inactive and not any(active):
        active[draw(st.integers(0, rows - 1))] = True
    positions: list[int] = []
    for flag in active:
        if not flag:
            positions.append(draw(st.sampled_from([-1, -2, -100])))
            continue
        block = draw(st.integers(0, 5))
        # Bias towards block boundaries: first and last slot of a block.
        offset = draw(st.sampled_from([0, bs - 1, draw(st.integers(0, bs - 1))]))
        positions.append(block * bs + offset)
    needed = [p // bs + 1 if p >= 0 else 0 for p in positions]
    width = max(max(needed), 1) + draw(st.integers(0, 2))
    total = sum(needed)
    num_blocks = total + draw(st.integers(1, 3))
    physical = draw(st.permutations(range(num_blocks)))
    table: list[list[int]] = []
    used = 0
    for row, count in enumerate(needed):
        filler = draw(st.sampled_from([-1, 0]))  # runtime tables are zero-filled, callers -1
        entries = [*physical[used : used + count], *([filler] * (width - count))]
        used += count
        pos = positions[row]
        if pos >= bs and draw(st.integers(0, 4)) == 0:
            entries[pos // bs] = -1  # an active row whose current page is unmapped
        table.append(entries)
    for row, pos in enumerate(positions):
        if pos < 0 and table and draw(st.booleans()):
            # An inactive row that still points at live blocks (e.g. a finished sequence).
            table[row] = list(table[draw(st.integers(0, rows - 1))])
    tokens = tuple(draw(st.integers(0, 255)) for _ in range(rows))
    return DecodeLane(
        preset=preset,
        block_size=bs,
        positions=tuple(positions),
        tokens=tokens,
        table=tuple(tuple(r) for r in table),
        num_blocks=num_blocks,
        seed=draw(st.integers(0, 2**16)),
    )


def _decode(lane: DecodeLane, *, graph_safe: bool) -> tuple[torch.Tensor, KV, KV]:
    """(logits, cache before, cache after) of one step on a fresh random cache."""
    model = _model(lane.preset)
    before = _random_cache(model, lane.num_blocks, lane.block_size, lane.seed)
    after = _clone(before)
    tokens, positions, table = lane.inputs()
    with _bound(model, after, lane.block_size, graph_safe=graph_safe):
        assert model.uses_graph_safe_path() is graph_safe
        logits = model.decode(tokens, positions=positions, page_table=table)
    return logits, before, after


@given(decode_lanes())
def test_graph_safe_decode_equals_dynamic_decode(lane: DecodeLane) -> None:
    dynamic, _, dynamic_cache = _decode(lane, graph_safe=False)
    static, _, static_cache = _decode(lane, graph_safe=True)
    assert static.shape == dynamic.shape == (len(lane.positions), 256)
    active = torch.tensor(lane.positions) >= 0
    assert (static[active] - dynamic[active]).abs().max().item() < ATOL
    assert bool((static[~active] == 0).all())
    _assert_caches_close(static_cache, dynamic_cache)


@given(decode_lanes(allow_all_inactive=True))
def test_graph_safe_decode_writes_only_active_slots(lane: DecodeLane) -> None:
    _, before, after = _decode(lane, graph_safe=True)
    _assert_only_slots_changed(before, after, lane.written())


@pytest.mark.parametrize("preset", PRESETS)
def test_all_inactive_graph_safe_decode_is_a_no_op(preset: str) -> None:
    """No row writes: zero logits and a bit-identical cache, unlike a naive redirect."""
    lane = DecodeLane(
        preset=preset,
        block_size=4,
        positions=(-1, -1, -1),
        tokens=(7, 8, 9),
        table=((2, 0, -1), (2, 0, -1), (1, -1, -1)),
        num_blocks=4,
        seed=1,
    )
    logits, before, after = _decode(lane, graph_safe=True)
    assert bool((logits == 0).all())
    _assert_only_slots_changed(before, after, set())
    unmapped = attrs.evolve(lane, positions=(5, -1, 6), table=((2, -1, -1),) * 3)
    _, before, after = _decode(unmapped, graph_safe=True)  # active rows, none may write
    _assert_only_slots_changed(before, after, set())


def test_redirected_writes_repeat_the_first_writer() -> None:
    writer = torch.tensor([False, False, True, False, True])
    rows = torch.arange(10).view(5, 2)
    source, index, any_writer = redirect_writes(writer, rows)
    assert source.tolist() == [2, 2, 2, 2, 4]
    assert index.tolist() == [4, 5] * 4 + [8, 9]
    assert bool(any_writer)
    source, _, any_writer = redirect_writes(torch.zeros(3, dtype=torch.bool), rows[:3])
    assert source.tolist() == [0, 0, 0] and not bool(any_writer)


def test_garbage_in_inactive_rows_changes_nothing() -> None:
    """Inactive rows may carry any token, position or page: active rows and the cache agree."""
    clean = DecodeLane("gqa", 4, (5, -1, 9), (3, 0, 4), ((0, 1, 2), (0, 0, 0), (3, 4, 5)), 6, 2)
    dirty = attrs.evolve(clean, tokens=(3, -50, 4), positions=(5, -7, 9), table=clean.table)
    dirty_oob = attrs.evolve(dirty, tokens=(3, 10_000, 4))
    reference, _, reference_cache = _decode(clean, graph_safe=True)
    for lane in (dirty, dirty_oob):
        logits, _, cache_after = _decode(lane, graph_safe=True)
        assert torch.equal(logits, reference)
        for pair_a, pair_b in zip(cache_after, reference_cache, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(pair_a, pair_b, strict=True))


def test_eager_graph_safe_decode_still_validates_values() -> None:
    model = _model("gqa")
    kv = _random_cache(model, 4, 4, seed=0)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    with _bound(model, kv, 4, graph_safe=True):
        with pytest.raises(ValueError, match="too narrow"):
            model.decode(torch.tensor([1]), positions=torch.tensor([8]), page_table=table)
        with pytest.raises(ValueError, match="exceed max_seq_len"):
            model.decode(
                torch.tensor([1]),
                positions=torch.tensor([model.max_seq_len]),
                page_table=torch.zeros(1, model.max_seq_len // 4 + 1, dtype=torch.int32),
            )
        with pytest.raises(ValueError, match="entries in"):
            model.decode(
                torch.tensor([1]),
                positions=torch.tensor([0]),
                page_table=torch.tensor([[9, 0]], dtype=torch.int32),
            )
        with pytest.raises(ValueError, match="dtype"):
            model.decode_graph_safe(
                torch.tensor([1]), positions=torch.tensor([0]), page_table=table.float()
            )


# ---------------------------------------------------------------------------- prefill chunks
@attrs.frozen
class PrefillChunk:
    """One padded prefill chunk: cached prefixes, padding rows, rows already done."""

    preset: str
    block_size: int
    tokens: tuple[tuple[int, ...], ...]
    prompt_lens: tuple[int, ...]
    chunk_start: tuple[int, ...]
    table: tuple[tuple[int, ...], ...]
    num_blocks: int
    seed: int

    def inputs(self) -> tuple[torch.Tensor, ...]:
        return (
            torch.tensor(self.tokens),
            torch.tensor(self.table, dtype=torch.int32),
            torch.tensor(self.prompt_lens),
            torch.tensor(self.chunk_start),
        )

    def written(self) -> set[tuple[int, int]]:
        seq = len(self.tokens[0])
        slots = set()
        for row, (length, start) in enumerate(zip(self.prompt_lens, self.chunk_start, strict=True)):
            for pos in range(start, start + max(0, min(length - start, seq))):
                block = self.table[row][pos // self.block_size]
                if block >= 0:
                    slots.add((block, pos % self.block_size))
        return slots


@st.composite
def prefill_chunks(draw: st.DrawFn) -> PrefillChunk:
    preset = draw(st.sampled_from(PRESETS))
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    rows = draw(st.integers(1, 4))
    seq = draw(st.integers(1, 12))
    lens: list[int] = []
    starts: list[int] = []
    for _ in range(rows):
        kind = draw(st.sampled_from(["fresh", "cached", "padding", "done"]))
        start = 0 if kind in ("fresh", "padding") else draw(st.integers(1, 20))
        if kind == "padding":
            length = 0
        elif kind == "done":
            length = draw(st.integers(0, start))
        else:
            length = start + draw(st.integers(1, seq + 3))
        lens.append(length)
        starts.append(start)
    needed = [-(-max(n, s) // bs) for n, s in zip(lens, starts, strict=True)]
    width = max(max(needed), 1) + draw(st.integers(0, 2))
    num_blocks = sum(needed) + draw(st.integers(1, 3))
    physical = draw(st.permutations(range(num_blocks)))
    table: list[list[int]] = []
    used = 0
    for count in needed:
        entries = [*physical[used : used + count], *([-1] * (width - count))]
        used += count
        if count > 1 and draw(st.integers(0, 4)) == 0:
            entries[draw(st.integers(0, count - 1))] = -1  # an unmapped page inside the prompt
        table.append(entries)
    tokens = tuple(tuple(draw(st.integers(0, 255)) for _ in range(seq)) for _ in range(rows))
    return PrefillChunk(
        preset=preset,
        block_size=bs,
        tokens=tokens,
        prompt_lens=tuple(lens),
        chunk_start=tuple(starts),
        table=tuple(tuple(r) for r in table),
        num_blocks=num_blocks,
        seed=draw(st.integers(0, 2**16)),
    )


def _prefill(chunk: PrefillChunk, *, graph_safe: bool) -> tuple[torch.Tensor, KV, KV]:
    model = _model(chunk.preset)
    before = _random_cache(model, chunk.num_blocks, chunk.block_size, chunk.seed)
    after = _clone(before)
    tokens, table, lens, start = chunk.inputs()
    with _bound(model, after, chunk.block_size, graph_safe=graph_safe):
        logits = model.prefill(tokens, page_table=table, prompt_lens=lens, chunk_start=start)
    return logits, before, after


@given(prefill_chunks())
def test_graph_safe_prefill_equals_dynamic_prefill(chunk: PrefillChunk) -> None:
    dynamic, _, dynamic_cache = _prefill(chunk, graph_safe=False)
    static, before, static_cache = _prefill(chunk, graph_safe=True)
    assert (static - dynamic).abs().max().item() < ATOL
    _assert_caches_close(static_cache, dynamic_cache)
    _assert_only_slots_changed(before, static_cache, chunk.written())


def test_eager_graph_safe_prefill_still_validates_values() -> None:
    model = _model("gqa")
    kv = _random_cache(model, 4, 4, seed=0)
    with _bound(model, kv, 4, graph_safe=True):
        with pytest.raises(ValueError, match="chunk_start"):
            model.prefill(
                torch.zeros(1, 4, dtype=torch.long),
                page_table=torch.tensor([[0, 1]], dtype=torch.int32),
                prompt_lens=torch.tensor([4]),
                chunk_start=torch.tensor([-4]),
            )
        with pytest.raises(ValueError, match="too narrow"):
            model.prefill(
                torch.zeros(1, 4, dtype=torch.long),
                page_table=torch.tensor([[0]], dtype=torch.int32),
                prompt_lens=torch.tensor([8]),
                chunk_start=torch.tensor([4]),
            )


# ------------------------------------------------------------------ no host synchronisation
_HOST_READS = frozenset(
    {"__bool__", "__int__", "__float__", "__index__", "item", "tolist", "numpy", "nonzero"}
    | {"masked_select", "unique", "unique_consecutive", "argwhere", "repeat_interleave"}
)


class _RefuseHostReads(TorchFunctionMode):
    """Raises on any Python-level tensor read to the host or data-dependent shape."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        name = getattr(func, "__name__", "")
        if name in _HOST_READS:
            raise AssertionError(f"host read or data-dependent shape: Tensor.{name}")
        if name in ("__getitem__", "__setitem__") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for i in (args[1] if isinstance(args[1], tuple) else (args[1],))
        ):
            raise AssertionError(f"host read or data-dependent shape: boolean {name}")
        return func(*args, **(kwargs or {}))


_LANE = DecodeLane("gqa", 4, (5, -1, 9, 0), (3, 0, 4, 1), ((0, 1, 2),) * 4, 4, 3)
_CHUNK = PrefillChunk(
    preset="gqa",
    block_size=4,
    tokens=((1, 2, 3, 4, 5),) * 3,
    prompt_lens=(9, 0, 3),
    chunk_start=(4, 0, 0),
    table=((0, 1, 2), (3, -1, -1), (3, -1, -1)),
    num_blocks=4,
    seed=3,
)


def test_graph_safe_paths_read_nothing_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model("gqa")
    tokens, positions, table = _LANE.inputs()
    p_tokens, p_table, lens, start = _CHUNK.inputs()
    kv = _random_cache(model, 4, 4, seed=0)
    with _bound(model, kv, 4, graph_safe=True):
        with _RefuseHostReads():
            model.decode_graph_safe(tokens, positions=positions, page_table=table)
            model.prefill_graph_safe(
                p_tokens, page_table=p_table, prompt_lens=lens, chunk_start=start
            )
        # The public entry points skip host validation while a capture is in progress.
        monkeypatch.setattr(model_module, "stream_capturing", lambda device: True)
        with _RefuseHostReads():
            model.decode(tokens, positions=positions, page_table=table)
            model.prefill(p_tokens, page_table=p_table, prompt_lens=lens, chunk_start=start)
        model.graph_safe = False  # the dynamic path does read values: the mode catches it
        with pytest.raises(AssertionError, match="host read"), _RefuseHostReads():
            model.decode(tokens, positions=positions, page_table=table)


def test_graph_safe_paths_compile_without_graph_breaks() -> None:
    """`fullgraph=True` refuses any data-dependent branch or shape; the dynamic path has them."""
    torch._dynamo.reset()
    model = _model("gqa")
    tokens, positions, table = _LANE.inputs()
    p_tokens, p_table, lens, start = _CHUNK.inputs()
    eager_kv = _random_cache(model, 4, 4, seed=0)
    compiled_kv = _clone(eager_kv)
    with _bound(model, eager_kv, 4, graph_safe=True):
        expected = model.decode_graph_safe(tokens, positions=positions, page_table=table)
        expected_prefill = model.prefill_graph_safe(
            p_tokens, page_table=p_table, prompt_lens=lens, chunk_start=start
        )
    with _bound(model, compiled_kv, 4, graph_safe=True):
        decode = torch.compile(model.decode_graph_safe, fullgraph=True, backend="eager")
        prefill = torch.compile(model.prefill_graph_safe, fullgraph=True, backend="eager")
        assert torch.equal(decode(tokens, positions=positions, page_table=table), expected)
        got = prefill(p_tokens, page_table=p_table, prompt_lens=lens, chunk_start=start)
        assert torch.equal(got, expected_prefill)
        model.graph_safe = False
        dynamic = torch.compile(model.decode, fullgraph=True, backend="eager")
        with pytest.raises(torch._dynamo.exc.TorchDynamoException):
            dynamic(tokens, positions=positions, page_table=table)
    torch._dynamo.reset()
    for pair_a, pair_b in zip(eager_kv, compiled_kv, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(pair_a, pair_b, strict=True))


# ---------------------------------------------------------------------------- selection rule
def test_path_selection_rule() -> None:
    args = LlamaArgs.tiny_random("gqa")
    model = DecoderModel(args)
    assert model.graph_safe is None and not model.uses_graph_safe_path()  # CPU: dynamic
    model.graph_safe = True
    assert model.uses_graph_safe_path()
    model.graph_safe = None
    model.device = torch.device("cuda", 0)  # the rule reads only the device type
    assert model.uses_graph_safe_path()
    model.graph_safe = False
    assert not model.uses_graph_safe_path()


# ----------------------------------------------------------------------------------- CUDA
def _cuda_device() -> torch.device:
    """An indexed CUDA device: the model rejects caches whose device differs from its own."""
    return torch.device("cuda", torch.cuda.current_device())


def _cuda_model(preset: str = "gqa") -> DecoderModel:
    args = LlamaArgs.tiny_random(preset)
    state = random_state_dict(args, seed=5)
    return DecoderModel.from_state_dict(args, state, device=_cuda_device())


def _to_cuda(kv: KV) -> KV:
    return [(k.to(_cuda_device()), v.to(_cuda_device())) for k, v in kv]


@needs_cuda
def test_cuda_decode_uses_the_graph_safe_path_and_never_synchronises() -> None:
    model = _cuda_model()
    assert model.uses_graph_safe_path()
    kv = _to_cuda(_random_cache(model, 4, 4, seed=0))
    model.configure_paged_attention(block_size=4, max_num_blocks=4)
    model.set_kv_cache(kv)
    tokens, positions, table = (t.to(_cuda_device()) for t in _LANE.inputs())
    p_tokens, p_table, lens, start = (t.to(_cuda_device()) for t in _CHUNK.inputs())
    model.decode_graph_safe(tokens, positions=positions, page_table=table)  # lazy init first
    model.prefill_graph_safe(p_tokens, page_table=p_table, prompt_lens=lens, chunk_start=start)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model.decode_graph_safe(tokens, positions=positions, page_table=table)
        model.prefill_graph_safe(p_tokens, page_table=p_table, prompt_lens=lens, chunk_start=start)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@needs_cuda
@pytest.mark.parametrize("operation", ["decode", "prefill"])
def test_cuda_graph_replay_equals_eager(operation: str) -> None:
    """Capture with `TorchDevice("cuda").capture`, then replay new inputs: bit-identical to eager
    on the same cache contents (eager CUDA runs the same graph-safe code)."""
    from runtime.backends.torch_device import TorchDevice

    device = TorchDevice("cuda")
    model = _cuda_model()
    host_kv = _random_cache(model, 8, 4, seed=1)
    kv = _to_cuda(host_kv)
    model.configure_paged_attention(block_size=4, max_num_blocks=8)
    model.set_kv_cache(kv)
    steps: list[tuple[torch.Tensor, ...]]
    if operation == "decode":
        inputs = [device.from_host(t) for t in _LANE.inputs()]

        def body() -> torch.Tensor:
            with torch.inference_mode():
                return model.decode(inputs[0], positions=inputs[1], page_table=inputs[2])

        steps = [
            _LANE.inputs(),
            attrs.evolve(_LANE, positions=(6, 2, -1, 3), tokens=(9, 8, 7, 6)).inputs(),
            attrs.evolve(_LANE, positions=(-1, -1, -1, -1)).inputs(),
        ]
    else:
        inputs = [device.from_host(t) for t in _CHUNK.inputs()]

        def body() -> torch.Tensor:
            with torch.inference_mode():
                return model.prefill(
                    inputs[0], page_table=inputs[1], prompt_lens=inputs[2], chunk_start=inputs[3]
                )

        steps = [
            _CHUNK.inputs(),
            attrs.evolve(_CHUNK, prompt_lens=(5, 2, 0), chunk_start=(0, 0, 0)).inputs(),
        ]
    trace = device.capture(body)
    try:
        for step in steps:
            for target, value in zip(inputs, step, strict=True):
                device.from_host(value, into=target)
            for (k, v), (hk, hv) in zip(kv, host_kv, strict=True):
                k.copy_(hk)
                v.copy_(hv)
            replayed = device.replay(trace, blocking=True).clone()
            replay_kv = [(k.clone(), v.clone()) for k, v in kv]
            for (k, v), (hk, hv) in zip(kv, host_kv, strict=True):
                k.copy_(hk)
                v.copy_(hv)
            eager = body()
            assert torch.equal(replayed, eager)
            for (k, v), (rk, rv) in zip(kv, replay_kv, strict=True):
                assert torch.equal(k, rk) and torch.equal(v, rv)
    finally:
        device.release_trace(trace)


@needs_cuda
@pytest.mark.parametrize("trace_mode", ["decode_only", "all"])
def test_cuda_executor_traced_decode_equals_eager(trace_mode: str) -> None:
    from models.decoder.executor import load_executor
    from runtime.config import WarmupConfig

    def serving(mode: str) -> Any:
        executor = load_executor(
            "tiny-random",
            device="cuda",
            trace_mode=mode,
            block_size=4,
            num_blocks=48,
            max_batch_size=4,
            max_prefill_chunk_size=32,
            max_seq_len=64,
            warmup=WarmupConfig(prefill_batch_sizes=(1, 2, 4)),
            device_sampling=False,
        )
        executor.start()
        return executor

    eager, traced = serving("none"), serving(trace_mode)
    try:
        lengths = [5, 9, 3, 6]
        width = eager.page_table_layout.prefill_width
        table = torch.full((4, width), -1, dtype=torch.int32)
        for row in range(4):
            table[row, :4] = torch.arange(row * 4, row * 4 + 4, dtype=torch.int32)
        prompts = torch.randint(3, 256, (4, 9), generator=torch.Generator().manual_seed(1))
        firsts = [
            executor.prefill_forward(
                tokens=prompts,
                page_table=table,
                prompt_lens=torch.tensor(lengths),
                empty_slots=[0, 1, 2, 3],
            )
            for executor in (eager, traced)
        ]
        assert torch.equal(firsts[0], firsts[1])
        decode_table = table[:, : eager.page_table_layout.decode_width]
        tokens = torch.tensor([11, 12, 13, 14])
        positions = torch.tensor(lengths)
        positions[2] = -1
        for step in range(3):
            outs = [
                executor.decode_forward(
                    tokens=tokens,
                    start_pos=positions + step * (positions >= 0),
                    page_table=decode_table,
                )
                for executor in (eager, traced)
            ]
            assert torch.equal(outs[0], outs[1])
            tokens = outs[0][:, 0].argmax(-1)
        assert traced.trace_compiler.replay_counts["decode"] >= 3
    finally:
        eager.close()
        traced.close()

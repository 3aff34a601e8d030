"""The composed `ModelExecutor` as a lifecycle host: phases, teaching errors, cleanup."""

from __future__ import annotations

import attrs
import pytest
import torch

from lifecycle import Phase, PhaseError, TerminalError
from runtime.backends.faults import InjectedFault
from tests.integration.executor_setup import contiguous_tables, run_prefill, tiny_executor


def test_start_reaches_serving_and_close_releases_everything() -> None:
    executor = tiny_executor()
    device = executor.device
    executor.start()
    assert executor.phase is Phase.SERVING
    # The KV cache (K and V per layer) and the device sampler's buffers, all device-owned.
    sampler_buffers = dict(executor.model.sampling.buffers)
    assert sampler_buffers and all(device.is_owned(t) for t in sampler_buffers.values())
    assert device.live_allocations == 2 * executor.model.n_layers + len(sampler_buffers)
    reached = [e.dest for e in executor.journal.entries if e.outcome.value == "ok"]
    for phase in ("CAPACITY_RESOLVED", "SEALED", "ALLOCATED", "COMPILED", "SERVING"):
        assert phase in reached
    allocate = next(
        e
        for e in executor.journal.entries
        if e.trigger == "allocate" and e.machine == "DecoderExecutor"
    )
    assert "KV" in allocate.detail and "blocks" in allocate.detail
    executor.close()
    assert executor.phase is Phase.TERMINAL
    assert device.live_allocations == 0


def test_decode_before_serving_teaches_the_next_calls() -> None:
    executor = tiny_executor()
    executor.allocate_kv_cache()
    assert executor.phase is Phase.ALLOCATED
    with pytest.raises(PhaseError) as caught:
        executor.decode_forward(
            tokens=torch.zeros(4, dtype=torch.long),
            start_pos=torch.zeros(4, dtype=torch.long),
            page_table=torch.zeros(4, 8, dtype=torch.int32),
        )
    assert str(caught.value) == (
        "DecoderExecutor: decode_forward() is not legal in ALLOCATED; it is legal in SERVING; "
        "next: start(), warmup_prefill(), warmup_decode()"
    )
    executor.close()


def test_warmup_completes_compile_phase_in_either_order() -> None:
    executor = tiny_executor()
    executor.allocate_kv_cache()
    executor.warmup_decode()
    assert executor.phase is Phase.ALLOCATED
    executor.warmup_prefill()
    assert executor.phase is Phase.COMPILED
    executor.warmup_prefill()  # idempotent, still legal
    executor.serve()
    assert executor.phase is Phase.SERVING
    executor.close()


def test_prefill_then_decode_matches_the_model() -> None:
    executor = tiny_executor(device_sampling=False)
    executor.start()
    lengths = [5, 9, 3]
    logits = run_prefill(executor, lengths)
    assert logits.shape == (3, 1, executor.model.vocab_size)
    model = executor.model
    # Same prompt through the model itself over the same cache blocks gives the same logits.
    from tests.integration.executor_setup import prompts_batch

    tokens = prompts_batch(lengths)
    width = executor.page_table_layout.prefill_width
    table = contiguous_tables(lengths, width=width)
    direct = model.prefill(
        tokens[1:2, :9],
        page_table=table[1:2],
        prompt_lens=torch.tensor([9]),
        chunk_start=torch.tensor([0]),
    )
    torch.testing.assert_close(logits[1, 0], direct[0], atol=1e-5, rtol=0)
    executor.close()


def test_terminal_is_absorbing() -> None:
    executor = tiny_executor()
    executor.close()
    with pytest.raises(TerminalError, match="DecoderExecutor is terminal"):
        executor.allocate_kv_cache()
    executor.close()


def test_kv_allocation_fault_leaves_phase_and_retry_works() -> None:
    executor = tiny_executor(faults="allocate:2")
    with pytest.raises(InjectedFault):
        executor.allocate_kv_cache()
    assert executor.phase is Phase.SEALED
    assert executor.device.live_allocations == 0
    executor.allocate_kv_cache()
    assert executor.phase is Phase.ALLOCATED
    executor.close()
    assert executor.device.live_allocations == 0


def test_failed_rollback_faults_and_close_still_releases() -> None:
    executor = tiny_executor(faults="allocate:3,deallocate:1")
    with pytest.raises(InjectedFault):
        executor.allocate_kv_cache()
    assert executor.phase is Phase.FAULTED
    with pytest.raises(PhaseError, match=r"only close\(\) is legal"):
        executor.warmup_prefill()
    executor.close()
    assert executor.phase is Phase.TERMINAL
    assert executor.device.live_allocations == 0


def test_late_capacity_shrinks_layout_and_refuses_growth_atomically() -> None:
    executor = tiny_executor(num_blocks=None)
    ceiling = executor.kv_cache_manager.config
    before = executor.page_table_layout
    other_dtype = attrs.evolve(ceiling, dtype=torch.bfloat16, num_blocks=6)
    with pytest.raises(ValueError, match="cannot replace dtype"):
        executor.configure_paged_kv_cache(other_dtype)
    assert executor.phase is Phase.CONSTRUCTED
    assert executor.page_table_layout is before
    assert executor.decode_runtime.config.page_table_layout is before
    assert executor.kv_cache_manager.config is ceiling
    executor.configure_paged_kv_cache(ceiling.with_num_blocks(6))
    assert executor.phase is Phase.CAPACITY_RESOLVED
    assert executor.page_table_layout.raw_capacity_width == 6
    assert executor.decode_runtime.config.page_table_layout is executor.page_table_layout
    assert executor.prefill_runtime.config.page_table_layout is executor.page_table_layout
    with pytest.raises(PhaseError, match="not legal in CAPACITY_RESOLVED"):
        executor.configure_paged_kv_cache(ceiling.with_num_blocks(5))
    cache = executor.allocate_kv_cache()
    assert cache[0][0].shape[0] == 6
    executor.close()

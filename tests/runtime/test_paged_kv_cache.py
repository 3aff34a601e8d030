"""PagedKVCacheManager: shapes, transactional bind, exact handles, retryable release."""

from __future__ import annotations

import pytest
import torch

from lifecycle import PhaseError, TerminalError
from runtime.backends.faults import FaultInjectingDevice, FaultPlan, InjectedFault
from runtime.backends.torch_device import TorchDevice
from runtime.config import PagedKVCacheConfig
from runtime.paged_kv_cache import KVCacheState, PagedKVCacheManager
from tests.runtime.fake_model import FakeKVModel


def make(
    *, num_blocks: int | None = 8, model: FakeKVModel | None = None, device: object = None
) -> tuple[PagedKVCacheManager, FakeKVModel, TorchDevice]:
    model = model or FakeKVModel()
    inner = TorchDevice("cpu")
    config = PagedKVCacheConfig(
        block_size=4, max_num_blocks=16, dtype=torch.float32, num_blocks=num_blocks
    )
    manager = PagedKVCacheManager(model, config, device=device or inner)  # type: ignore[arg-type]
    return manager, model, inner


def test_allocate_shapes_bind_and_release() -> None:
    manager, model, device = make()
    assert manager.state is KVCacheState.CONFIGURED
    assert manager.cache_shapes == ((8, 2, 4, 4), (8, 2, 4, 4))
    cache = manager.allocate()
    assert manager.state is KVCacheState.BOUND
    assert model.cache is cache
    assert [tuple(t.shape) for pair in cache for t in pair] == [(8, 2, 4, 4)] * 4
    assert all(t.dtype == torch.float32 and not t.any() for pair in cache for t in pair)
    assert device.live_allocations == 4
    context = manager.validate_borrowed_handle(cache)
    assert context.nbytes == 4 * 8 * 2 * 4 * 4 * 4 == manager.nbytes
    manager.release()
    assert manager.state is KVCacheState.RELEASED
    assert model.cache is None
    assert device.live_allocations == 0
    manager.release()  # idempotent
    assert manager.bound_context is None


def test_grouped_query_and_local_heads() -> None:
    model = FakeKVModel(n_kv_heads=4, head_dim=8)
    manager = PagedKVCacheManager(
        model,
        PagedKVCacheConfig(block_size=4, max_num_blocks=16, dtype=torch.float32, num_blocks=3),
        device=TorchDevice("cpu"),
        num_devices=2,
    )
    assert manager.cache_shapes[0] == (3, 2, 4, 8)


def test_exact_handle_validation() -> None:
    manager, _, _ = make()
    cache = manager.allocate()
    with pytest.raises(ValueError, match="exact manager-owned borrowed handle"):
        manager.validate_borrowed_handle([list(pair) for pair in cache])
    original = cache[0][0]
    cache[0][0] = original.clone()
    with pytest.raises(ValueError, match="exact manager-owned K/V tensors"):
        manager.validate_borrowed_handle(cache)
    cache[0][0] = original
    manager.validate_borrowed_handle(cache)


def test_validate_before_allocation_is_refused() -> None:
    manager, _, _ = make()
    with pytest.raises(RuntimeError, match="must be allocated and bound before execution"):
        manager.validate_borrowed_handle([])


def test_allocate_refusals_teach() -> None:
    manager, _, _ = make(num_blocks=None)
    assert manager.state is KVCacheState.UNRESOLVED
    assert manager.cache_shapes == ()
    with pytest.raises(PhaseError, match="must be resolved before allocation; call configure"):
        manager.allocate()
    manager.configure(manager.config.with_num_blocks(6))
    manager.allocate()
    with pytest.raises(PhaseError, match="already been allocated"):
        manager.allocate()
    manager.release()
    with pytest.raises(TerminalError, match="terminal"):
        manager.allocate()


def test_late_capacity_rules() -> None:
    manager, _, _ = make(num_blocks=None)
    with pytest.raises(ValueError, match="must be resolved"):
        manager.configure(manager.config)
    with pytest.raises(ValueError, match="cannot replace dtype"):
        manager.configure(
            PagedKVCacheConfig(block_size=4, max_num_blocks=16, dtype=torch.bfloat16, num_blocks=4)
        )
    with pytest.raises(ValueError, match="cannot replace block_size"):
        manager.configure(
            PagedKVCacheConfig(block_size=8, max_num_blocks=16, dtype=torch.float32, num_blocks=4)
        )
    with pytest.raises(ValueError, match="cannot replace memory_config"):
        manager.configure(
            PagedKVCacheConfig(
                block_size=4,
                max_num_blocks=16,
                dtype=torch.float32,
                num_blocks=4,
                memory_config="l1",
            )
        )
    with pytest.raises(ValueError, match="cannot grow max_num_blocks"):
        manager.configure(
            PagedKVCacheConfig(block_size=4, max_num_blocks=32, dtype=torch.float32, num_blocks=4)
        )
    with pytest.raises(TypeError, match="PagedKVCacheConfig"):
        manager.configure("nope")  # type: ignore[arg-type]
    assert manager.state is KVCacheState.UNRESOLVED
    manager.configure(manager.config.with_num_blocks(5))
    assert manager.config.num_blocks == 5
    with pytest.raises(PhaseError, match="can be resolved only once"):
        manager.configure(manager.config.with_num_blocks(4))


def test_model_validation() -> None:
    model = FakeKVModel()
    model.paged = None
    with pytest.raises(ValueError, match="Model layer 0 is not configured for paged attention"):
        make(model=model)
    with pytest.raises(ValueError, match="block_size 8 does not match"):
        make(model=FakeKVModel(block_size=8))
    with pytest.raises(ValueError, match="max_num_blocks 32 does not match"):
        make(model=FakeKVModel(max_num_blocks=32))
    with pytest.raises(ValueError, match="model-owned dtype"):
        make(model=FakeKVModel(dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="num_devices must be a positive integer"):
        PagedKVCacheManager(
            FakeKVModel(),
            PagedKVCacheConfig(block_size=4, max_num_blocks=16, dtype=torch.float32),
            device=TorchDevice("cpu"),
            num_devices=0,
        )
    with pytest.raises(ValueError, match="divisible by num_devices"):
        PagedKVCacheManager(
            FakeKVModel(n_kv_heads=3),
            PagedKVCacheConfig(block_size=4, max_num_blocks=16, dtype=torch.float32),
            device=TorchDevice("cpu"),
            num_devices=2,
        )


def test_mixed_layer_dtypes_are_allocated_per_layer() -> None:
    model = FakeKVModel(layer_dtypes=[torch.float32, torch.bfloat16])
    manager, _, _ = make(model=model)
    cache = manager.allocate()
    assert [pair[0].dtype for pair in cache] == [torch.float32, torch.bfloat16]


def test_vllm_cache_spec() -> None:
    manager, _, _ = make()
    manager.validate_vllm_cache_spec(block_size=4, dtype=torch.float32, num_blocks=16)
    with pytest.raises(ValueError, match="block_size 8 does not match"):
        manager.validate_vllm_cache_spec(block_size=8, dtype=torch.float32)
    with pytest.raises(TypeError, match=r"torch\.dtype"):
        manager.validate_vllm_cache_spec(block_size=4, dtype="float32")
    with pytest.raises(ValueError, match="incompatible"):
        manager.validate_vllm_cache_spec(block_size=4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="exceeds configured maximum"):
        manager.validate_vllm_cache_spec(block_size=4, dtype=torch.float32, num_blocks=17)


def test_partial_allocation_failure_rolls_back() -> None:
    inner = TorchDevice("cpu")
    device = FaultInjectingDevice(inner, FaultPlan.nth("allocate", 3))
    manager, model, _ = make(device=device)
    with pytest.raises(InjectedFault):
        manager.allocate()
    assert manager.state is KVCacheState.CONFIGURED
    assert inner.live_allocations == 0
    assert model.bind_calls == []
    manager.allocate()
    assert inner.live_allocations == 4


def test_partial_allocation_with_failed_rollback_is_retried() -> None:
    inner = TorchDevice("cpu")
    plan = FaultPlan.nth("allocate", 3) + FaultPlan.nth("deallocate", 1)
    device = FaultInjectingDevice(inner, plan)
    manager, _, _ = make(device=device)
    with pytest.raises(InjectedFault, match="allocate call #3") as caught:
        manager.allocate()
    failures = caught.value.cleanup_failures  # type: ignore[attr-defined]
    assert len(failures) == 1 and "deallocate call #1" in str(failures[0])
    assert inner.live_allocations == 1
    assert manager.owned_tensor_count == 1
    manager.allocate()  # retries the leftover first
    assert inner.live_allocations == 4
    manager.release()
    assert inner.live_allocations == 0
    assert device.deallocated_twice == 0


def test_bind_failure_unbinds_and_releases() -> None:
    manager, model, device = make()
    model.fail_bind = 1
    with pytest.raises(RuntimeError, match="injected bind failure"):
        manager.allocate()
    assert model.bind_calls[-1] is None
    assert device.live_allocations == 0
    assert manager.state is KVCacheState.CONFIGURED
    manager.allocate()
    assert manager.state is KVCacheState.BOUND


def test_bind_and_unbind_failure_stays_bound_for_release() -> None:
    manager, model, device = make()
    model.fail_bind = 1
    model.fail_unbind = 1
    with pytest.raises(RuntimeError, match="injected bind failure") as caught:
        manager.allocate()
    assert "injected unbind failure" in str(caught.value.cleanup_failures[0])  # type: ignore[attr-defined]
    assert manager.state is KVCacheState.BOUND
    assert manager.bound_context is not None or manager.owned_tensor_count == 4
    assert device.live_allocations == 4
    manager.release()
    assert device.live_allocations == 0
    assert model.cache is None


def test_release_failure_is_retryable_without_double_free() -> None:
    inner = TorchDevice("cpu")
    device = FaultInjectingDevice(
        inner, FaultPlan.nth("deallocate", 2) + FaultPlan.nth("deallocate", 4)
    )
    manager, model, _ = make(device=device)
    manager.allocate()
    with pytest.raises(RuntimeError, match="Failed to deallocate 2 paged KV cache tensor") as e:
        manager.release()
    assert len(e.value.cleanup_failures) == 2  # type: ignore[attr-defined]
    assert manager.state is KVCacheState.BOUND
    assert inner.live_allocations == 2
    assert model.cache is None
    manager.release()
    assert manager.state is KVCacheState.RELEASED
    assert inner.live_allocations == 0
    assert device.deallocated_twice == 0


def test_release_before_allocation_is_terminal() -> None:
    manager, _, device = make(num_blocks=None)
    manager.release()
    assert manager.state is KVCacheState.RELEASED
    with pytest.raises(TerminalError):
        manager.configure(manager.config.with_num_blocks(2))
    assert device.live_allocations == 0


def test_journal_records_kv_transitions() -> None:
    manager, _, _ = make()
    manager.allocate()
    manager.release()
    entries = [(e.trigger, e.source, e.dest) for e in manager._lifecycle.journal.entries]
    assert entries == [
        ("configure", "UNRESOLVED", "CONFIGURED"),
        ("allocate", "CONFIGURED", "BOUND"),
        ("release", "BOUND", "RELEASED"),
    ]
    allocate = manager._lifecycle.journal.entries[1]
    assert "4 tensors, 4096 bytes, 8 blocks" in allocate.detail

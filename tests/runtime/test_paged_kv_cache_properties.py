"""Hypothesis: the KV manager on a fault-injecting CPU device under random call sequences."""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from lifecycle import PhaseError
from runtime.backends.faults import FaultCall, FaultInjectingDevice, FaultPlan, InjectedFault
from runtime.backends.torch_device import TorchDevice
from runtime.config import PagedKVCacheConfig
from runtime.paged_kv_cache import KVCacheState, PagedKVCacheManager
from tests.runtime.fake_model import FakeKVModel


class KVManagerMachine(RuleBasedStateMachine):
    """Random configure / allocate / release with injected allocation and release failures."""

    def __init__(self) -> None:
        super().__init__()
        self.pending = {"allocate": 0, "deallocate": 0}

        def fail_next(operation: str) -> FaultPlan:
            def predicate(call: FaultCall) -> bool:
                if self.pending[operation] > 0:
                    self.pending[operation] -= 1
                    return True
                return False

            return FaultPlan.matching(operation, predicate)  # type: ignore[arg-type]

        self.inner = TorchDevice("cpu")
        self.device = FaultInjectingDevice(
            self.inner, fail_next("allocate") + fail_next("deallocate")
        )
        self.start_live = self.inner.live_allocations
        self.model = FakeKVModel(n_layers=3)
        self.manager = PagedKVCacheManager(
            self.model,
            PagedKVCacheConfig(block_size=4, max_num_blocks=16, dtype=torch.float32),
            device=self.device,
        )

    @rule(failures=st.integers(0, 3))
    def inject_allocation_failures(self, failures: int) -> None:
        self.pending["allocate"] = failures

    @rule(failures=st.integers(0, 4))
    def inject_deallocation_failures(self, failures: int) -> None:
        self.pending["deallocate"] = failures

    @rule(num_blocks=st.integers(1, 16))
    def configure(self, num_blocks: int) -> None:
        before = self.manager.state
        try:
            self.manager.configure(self.manager.config.with_num_blocks(num_blocks))
        except PhaseError:
            assert before is not KVCacheState.UNRESOLVED
            assert self.manager.state is before
        else:
            assert before is KVCacheState.UNRESOLVED
            assert self.manager.state is KVCacheState.CONFIGURED

    @rule()
    def allocate(self) -> None:
        before = self.manager.state
        try:
            cache = self.manager.allocate()
        except PhaseError:
            assert before is not KVCacheState.CONFIGURED
            assert self.manager.state is before
        except (InjectedFault, RuntimeError) as error:
            self._check_primary_with_attached(error)
            assert self.manager.state is KVCacheState.CONFIGURED
        else:
            assert self.manager.state is KVCacheState.BOUND
            assert self.model.cache is cache
            self.manager.validate_borrowed_handle(cache)
            assert self.inner.live_allocations - self.start_live == 2 * self.model.n_layers

    @rule()
    def release(self) -> None:
        try:
            self.manager.release()
        except RuntimeError as error:
            assert "Failed to deallocate" in str(error)
            failures = error.cleanup_failures  # type: ignore[attr-defined]
            assert failures and all(isinstance(f, InjectedFault) for f in failures)
            assert self.manager.state is not KVCacheState.RELEASED
        else:
            assert self.manager.state is KVCacheState.RELEASED
            assert self.inner.live_allocations == self.start_live
            assert self.model.cache is None

    def _check_primary_with_attached(self, error: BaseException) -> None:
        later = getattr(error, "cleanup_failures", ())
        assert all(isinstance(failure, InjectedFault) for failure in later)
        assert error not in later

    @invariant()
    def never_deallocated_twice(self) -> None:
        assert self.device.deallocated_twice == 0

    @invariant()
    def owned_matches_live(self) -> None:
        assert self.inner.live_allocations - self.start_live == self.manager.owned_tensor_count

    def teardown(self) -> None:
        self.pending = {"allocate": 0, "deallocate": 0}
        self.manager.release()
        assert self.inner.live_allocations == self.start_live
        assert self.device.deallocated_twice == 0


TestKVManagerProperties = KVManagerMachine.TestCase
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

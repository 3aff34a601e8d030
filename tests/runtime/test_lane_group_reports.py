"""What a lane group reports like a single executor: KV bytes, the KV memory check, its devices."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from lifecycle import Phase
from runtime.lane_group import LaneGroupExecutor
from runtime.lanes import InProcessLane, LaneFailure
from tests.runtime.lane_fakes import FakeLane


class TooBigError(ValueError):
    """Stands in for the executor's KV capacity refusal (a ValueError subclass)."""


@attrs.define
class FakeKVManager:
    bytes_per_block: int
    config: Any = None


@attrs.define
class FakeFaultyDevice:
    name: str
    attempts: dict[str, int]
    injected_total: int
    live_allocations: int = 0


class ReportingLane(FakeLane):
    """A fake lane with a KV manager, a memory limit and a fault-counting device."""

    def __init__(self, index: int, *, bytes_per_block: int, fits_blocks: int, **options: Any):
        super().__init__(index, **options)
        self.kv_cache_manager = FakeKVManager(bytes_per_block)
        self.fits_blocks = fits_blocks
        self.device = FakeFaultyDevice(
            name=f"fake:{index}",
            attempts={"allocate": 2 + index, "to_host": index},
            injected_total=index,
        )
        self.memory_checks: list[int] = []

    def check_kv_memory(self, num_blocks: int) -> None:
        self.memory_checks.append(num_blocks)
        if num_blocks > self.fits_blocks:
            raise TooBigError(f"{num_blocks} blocks do not fit; at most {self.fits_blocks} fit")


def reporting_group(fits: tuple[int, ...] = (100, 100)) -> tuple[LaneGroupExecutor, list[Any]]:
    fakes = [
        ReportingLane(i, bytes_per_block=1000 * (i + 1), fits_blocks=fit)
        for i, fit in enumerate(fits)
    ]
    group = LaneGroupExecutor([InProcessLane(f, index=i) for i, f in enumerate(fakes)])
    return group, fakes


def test_kv_cache_bytes_adds_every_lanes_pool() -> None:
    group, _ = reporting_group()
    # each lane holds its own pool of num_blocks: 1000 + 2000 bytes per block across lanes
    assert group.kv_cache_bytes(5) == 5 * 3000
    assert group.kv_cache_bytes(1) == 3000
    group.close()


def test_kv_cache_bytes_needs_every_lane_to_report() -> None:
    group, _ = fake_lanes_without_kv_manager()
    with pytest.raises(RuntimeError, match="does not report its KV bytes per block"):
        group.kv_cache_bytes(4)
    group.close()


def fake_lanes_without_kv_manager() -> tuple[LaneGroupExecutor, list[FakeLane]]:
    fakes = [FakeLane(i) for i in range(2)]
    return LaneGroupExecutor([InProcessLane(f, index=i) for i, f in enumerate(fakes)]), fakes


def test_check_kv_memory_asks_every_lane_and_passes_when_all_fit() -> None:
    group, fakes = reporting_group(fits=(100, 100))
    group.check_kv_memory(100)
    assert [f.memory_checks for f in fakes] == [[100], [100]]
    assert group.phase is Phase.CONSTRUCTED
    group.close()


def test_check_kv_memory_raises_the_lanes_own_refusal_and_changes_nothing() -> None:
    group, fakes = reporting_group(fits=(100, 10))
    with pytest.raises(TooBigError, match="at most 10 fit") as caught:
        group.check_kv_memory(50)
    assert any("DP lane 1" in note for note in getattr(caught.value, "__notes__", ()))
    assert group.phase is Phase.CONSTRUCTED  # a refusal is not a fault: the group stays usable
    assert [f.closed for f in fakes] == [0, 0]
    group.start()
    assert group.phase is Phase.SERVING
    group.close()


def test_check_kv_memory_validates_its_argument_before_any_lane_call() -> None:
    group, fakes = reporting_group()
    for bad in (0, -3, True, 2.0):
        with pytest.raises(ValueError, match="num_blocks must be a positive integer"):
            group.check_kv_memory(bad)  # type: ignore[arg-type]
    assert [f.memory_checks for f in fakes] == [[], []]
    group.close()


def test_check_kv_memory_is_skipped_by_lanes_without_it() -> None:
    group, _ = fake_lanes_without_kv_manager()
    group.check_kv_memory(1_000_000)  # nothing to check: lanes check their pools when resolving
    group.close()


def test_a_lane_failure_that_is_not_a_refusal_stays_a_lane_failure() -> None:
    group, fakes = reporting_group()

    def broken(num_blocks: int) -> None:
        raise OSError("device gone")

    fakes[0].check_kv_memory = broken  # type: ignore[method-assign]
    with pytest.raises(LaneFailure, match="DP lane 0: check_kv_memory"):
        group.check_kv_memory(4)
    group.close()


def test_device_report_sums_every_lanes_fault_counters() -> None:
    group, _ = reporting_group()
    device = group.device
    assert device.names == ("fake:0", "fake:1")
    assert device.name == "fake:0,fake:1"
    assert dict(device.attempts) == {"allocate": 2 + 3, "to_host": 0 + 1}
    assert device.injected_total == 0 + 1
    group.close()


def test_device_report_of_plain_devices_counts_nothing() -> None:
    group, _ = fake_lanes_without_kv_manager()
    device = group.device
    assert dict(device.attempts) == {}
    assert device.injected_total == 0
    assert device.live_allocations == group.live_allocations
    group.close()

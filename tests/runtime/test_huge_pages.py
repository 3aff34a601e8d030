"""Large CPU allocations (the KV cache) are advised onto transparent huge pages."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from runtime.backends import huge_pages
from runtime.backends.torch_device import TorchDevice

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="needs Linux with transparent huge pages not set to 'never' "
    "(echo madvise > /sys/kernel/mm/transparent_hugepage/enabled)",
)


def _flags_at(address: int) -> set[str]:
    """The VmFlags of the mapping that holds `address` (`hg`: advised onto huge pages)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low <= address < high
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_large_allocation_is_advised_and_keeps_its_fill() -> None:
    tensor = huge_pages.full((3, 1 << 20), 1.5, torch.float32)  # 12 MiB
    assert bool((tensor == 1.5).all())
    middle = tensor.data_ptr() + tensor.numel() * 2  # inside the aligned interior
    assert "hg" in _flags_at(middle)


def test_a_small_allocation_is_left_alone() -> None:
    tensor = torch.empty(1024)
    assert not huge_pages.advise_huge_pages(tensor)
    assert bool((huge_pages.full((1024,), 2.0, torch.bfloat16) == 2.0).all())


def test_the_cpu_device_allocates_kv_sized_tensors_on_huge_pages() -> None:
    device = TorchDevice("cpu")
    tensor = device.allocate((560, 3, 32, 64), torch.float32)  # one SmolLM2 K cache, 13.8 MB
    assert tensor.abs().sum() == 0
    assert "hg" in _flags_at(tensor.data_ptr() + tensor.numel() * 2)

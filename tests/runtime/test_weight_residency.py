"""`WeightResidency` and `match_tensors` on a small model of their own (no Llama).

Level 1 moves every weight and buffer off the device and back bit-equal; level 2 drops the
weights (zeros come back, `dropped` until a reload) but never the buffers; a failed copy on
the way leaves the model as it was; a reload source is matched whole before anything copies.
"""

from __future__ import annotations

import pytest
import torch

from runtime.backends import host_copies
from runtime.weight_reload import WeightMismatchError, match_tensors
from runtime.weight_residency import WeightResidency


class Toy:
    """Two weights (one shared under two names) and a buffer."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.w = torch.randn(4, 3, generator=generator)
        self.n = torch.randn(3, generator=generator)
        self.table = torch.arange(6.0)
        self.moved = 0

    def resident_weights(self) -> dict[str, torch.Tensor]:
        return {"w": self.w, "n": self.n, "w_again": self.w}

    def resident_buffers(self) -> dict[str, torch.Tensor]:
        return {"table": self.table}

    def weights_moved(self) -> None:
        self.moved += 1


def snapshot(toy: Toy) -> list[torch.Tensor]:
    return [toy.w.clone(), toy.n.clone(), toy.table.clone()]


def test_level_1_round_trip_is_bit_equal_and_frees_every_tensor() -> None:
    toy = Toy()
    before = snapshot(toy)
    residency = WeightResidency(toy)
    freed = residency.sleep(1)
    assert freed == (12 + 3 + 6) * 4  # the shared weight counted once
    assert toy.w.numel() == toy.n.numel() == toy.table.numel() == 0
    assert residency.asleep and residency.device_bytes() == 0
    assert residency.wake() == freed
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(toy), strict=True))
    assert not residency.dropped and toy.moved == 2


def test_level_2_drops_weights_but_keeps_buffers_until_a_reload() -> None:
    toy = Toy()
    before = snapshot(toy)
    residency = WeightResidency(toy)
    residency.sleep(2)
    residency.wake()
    assert residency.dropped
    assert torch.equal(toy.w, torch.zeros(4, 3)) and torch.equal(toy.table, before[2])
    source = {"w": before[0], "n": before[1], "w_again": before[0]}
    outcome = residency.reload(match_tensors(toy.resident_weights(), source))
    assert outcome.addresses_kept and outcome.tensors == 3
    assert not residency.dropped
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(toy), strict=True))


def test_a_failed_host_copy_leaves_the_model_awake(monkeypatch: pytest.MonkeyPatch) -> None:
    toy = Toy()
    before = snapshot(toy)
    calls: list[int] = []
    real = host_copies.host_copy

    def failing(tensor: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of pinned memory")
        return real(tensor)

    monkeypatch.setattr(host_copies, "host_copy", failing)
    residency = WeightResidency(toy)
    with pytest.raises(RuntimeError, match="pinned"):
        residency.sleep(1)
    assert not residency.asleep and toy.moved == 0
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(toy), strict=True))


def test_a_model_another_host_put_to_sleep_is_refused() -> None:
    toy = Toy()
    first, second = WeightResidency(toy), WeightResidency(toy)
    first.sleep(1)
    with pytest.raises(RuntimeError, match="another host sharing this model"):
        second.sleep(1)
    assert not second.asleep
    first.wake()
    assert toy.w.numel() == 12


@pytest.mark.parametrize(
    ("source", "match"),
    [
        ({"b": torch.zeros(2)}, r"'a' is missing from the source"),
        ({"a": torch.zeros(3), "b": torch.zeros(2)}, r"'a' is \[3\] torch.float32 in the source"),
        ({"a": torch.zeros(2, dtype=torch.float64), "b": torch.zeros(2)}, r"float64"),
        ({"a": [0.0, 0.0], "b": torch.zeros(2)}, r"'a' is a list in the source"),
        ({"a": torch.zeros(2), "b": torch.zeros(2), "c": torch.zeros(1)}, r"'c' is in the source"),
    ],
)
def test_match_tensors_names_the_first_difference(source: dict[str, object], match: str) -> None:
    resident = {"a": torch.ones(2), "b": torch.ones(2)}
    with pytest.raises(WeightMismatchError, match=match):
        match_tensors(resident, source)
    assert torch.equal(resident["a"], torch.ones(2))

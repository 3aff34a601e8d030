"""`WeightResidency`: where a model's weights and non-weight buffers are while its host sleeps.

Why a separate owner: sleep must free the device memory of every weight *and* of every buffer
the model needs that is not a weight (rotary tables), and wake must bring all of them back
bit-equal; a buffer forgotten here is the "gibberish after wake" bug. The model names its
tensors (`ResidentModel`); the storage moves, the tensor objects stay, so nothing that holds
them needs rebinding. Level 1 keeps the weights in host memory, level 2 drops them (they come
back zeroed until `reload`); buffers are kept at both levels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs
import torch

from runtime.backends import host_copies
from runtime.weight_reload import ReloadPair


class ResidentModel(Protocol):
    """What a model offers so its host can sleep and wake it."""

    def resident_weights(self) -> dict[str, torch.Tensor]:
        """Every weight tensor (the storage to move), by a stable name."""
        ...

    def resident_buffers(self) -> dict[str, torch.Tensor]:
        """Every non-weight tensor the forward reads (rotary tables), by name."""
        ...

    def weights_moved(self) -> None:
        """Forget anything that cached weight addresses (native descriptors, layer tables)."""
        ...


@attrs.frozen
class _Kept:
    """One tensor while asleep: its object, geometry and host copy (None: dropped)."""

    tensor: torch.Tensor
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    host: torch.Tensor | None


@attrs.frozen
class ReloadOutcome:
    """What an in-place reload did: tensors and bytes copied, and whether every resident
    address stayed the same (then captured traces stay valid)."""

    tensors: int
    bytes: int
    addresses_kept: bool


def _unique(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out[name] = tensor
    return out


class WeightResidency:
    """Sleeps and wakes one model's resident tensors; reloads weights in place."""

    def __init__(self, model: ResidentModel) -> None:
        self._model = model
        self._kept: dict[str, _Kept] | None = None
        self.level: int | None = None
        self.dropped = False
        """True after a level-2 sleep until a reload: the weights hold zeros, not values."""

    @property
    def asleep(self) -> bool:
        """Whether the tensors are off the device."""
        return self._kept is not None

    def _tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return _unique(self._model.resident_weights()), _unique(self._model.resident_buffers())

    def device_bytes(self) -> int:
        """Bytes the weights and buffers hold on the device now (0 while asleep)."""
        weights, buffers = self._tensors()
        return sum(host_copies.nbytes(t) for t in (*weights.values(), *buffers.values()))

    def sleep(self, level: int) -> int:
        """Move (level 1) or drop (level 2) the weights and move the buffers; bytes freed.

        Every host copy is made before any storage is released, so a failed copy leaves the
        model as it was.
        """
        assert self._kept is None, "sleep() of a residency that is already asleep"
        weights, buffers = self._tensors()
        empty = [name for name, t in (*weights.items(), *buffers.items()) if t.numel() == 0]
        if empty:
            raise RuntimeError(
                f"cannot sleep: the model's tensor {empty[0]!r} holds no storage, so another "
                "host sharing this model put it to sleep; wake that host first, or give each "
                "host its own model"
            )
        kept: dict[str, _Kept] = {}
        for name, tensor in weights.items():
            kept[name] = self._keep(tensor, host_copies.host_copy(tensor) if level == 1 else None)
        for name, tensor in buffers.items():
            kept[f"buffer:{name}"] = self._keep(tensor, host_copies.host_copy(tensor))
        freed = 0
        for item in kept.values():
            host_copies.synchronize(item.device)
            freed += host_copies.nbytes(item.tensor)
            host_copies.release_storage(item.tensor)
        self._kept, self.level = kept, level
        self._model.weights_moved()
        return freed

    @staticmethod
    def _keep(tensor: torch.Tensor, host: torch.Tensor | None) -> _Kept:
        return _Kept(tensor, tuple(tensor.shape), tensor.dtype, tensor.device, host)

    def wake(self) -> int:
        """Bring every tensor back onto the device; bytes restored.

        Device storage for all of them is made before any is installed, so a failed copy
        leaves the model asleep as it was. Dropped weights come back zeroed (`dropped`).
        """
        assert self._kept is not None, "wake() of a residency that is awake"
        staged = [
            (
                item.tensor,
                host_copies.zeros_on(item.shape, item.dtype, item.device)
                if item.host is None
                else host_copies.device_copy(item.host, item.device),
            )
            for item in self._kept.values()
        ]
        dropped = any(item.host is None for item in self._kept.values())
        for tensor, storage in staged:
            host_copies.install_storage(tensor, storage)
        self._kept = None
        self.dropped = self.dropped or dropped
        self._model.weights_moved()
        return sum(host_copies.nbytes(storage) for _, storage in staged)

    def reload(self, pairs: Sequence[ReloadPair]) -> ReloadOutcome:
        """Copy matched weights in place (`runtime.weight_reload.match_tensors` checked them)."""
        assert self._kept is None, "reload() while the weights are asleep"
        before = [pair.target.data_ptr() for pair in pairs]
        copied = 0
        for pair in pairs:
            host_copies.copy_in_place(pair.target, pair.source)
            copied += host_copies.nbytes(pair.target)
        for pair in pairs[:1]:
            host_copies.synchronize(pair.target.device)
        after = [pair.target.data_ptr() for pair in pairs]
        self.dropped = False
        self._model.weights_moved()
        return ReloadOutcome(len(pairs), copied, before == after)

"""Moving a resident tensor's storage between a device and host memory (sleep and wake).

Why here: only `runtime/backends` calls device APIs. The tensor object a model holds keeps
its identity; only its storage moves (`tensor.data = ...`), so every module that holds the
tensor sees it again after a wake. On CPU the device memory *is* host memory: the host copy is
the storage itself (no copy), and the device side is emptied. On CUDA the host copy is pinned,
so the wake copies back at full speed.
"""

from __future__ import annotations

import torch


def nbytes(tensor: torch.Tensor) -> int:
    """Bytes of the tensor's elements."""
    return tensor.numel() * tensor.element_size()


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """What sleep keeps of `tensor`: its own storage on CPU, a pinned copy of a CUDA one."""
    data = tensor.detach()
    if data.device.type == "cpu":
        return data
    host = torch.empty(data.shape, dtype=data.dtype, device="cpu", pin_memory=True)
    host.copy_(data)
    return host


def device_copy(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device` (itself on CPU; a fresh copy on CUDA)."""
    if device.type == "cpu":
        return host
    return host.to(device, copy=True)


def zeros_on(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Fresh zeroed storage for a weight whose values were dropped (sleep level 2)."""
    return torch.zeros(shape, dtype=dtype, device=device)


def release_storage(tensor: torch.Tensor) -> None:
    """Point `tensor` at empty storage, freeing its device memory once nothing else holds it."""
    tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)


def install_storage(tensor: torch.Tensor, storage: torch.Tensor) -> None:
    """Point `tensor` at `storage` (same dtype, on the device the model runs on)."""
    tensor.data = storage


def copy_in_place(target: torch.Tensor, source: torch.Tensor) -> None:
    """Overwrite `target`'s values (maybe a view of resident storage) with `source`'s."""
    with torch.no_grad():
        target.copy_(source)


def synchronize(device: torch.device) -> None:
    """Wait for queued copies on a CUDA device (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)

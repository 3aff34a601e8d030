"""Device backends: the `Device` protocol and its torch, ttnn and fault-injecting implementations.

`make_device(spec)` builds one from a CLI-style spec: ``cpu``, ``cuda``, ``cuda:N``, ``ttnn``
or ``ttnn:N``, optionally wrapped in a `FaultInjectingDevice`.
"""

from __future__ import annotations

import logging
import re

import torch

from runtime.backends.base import (
    Device,
    DeviceError,
    DeviceTensor,
    DoubleDeallocationError,
    Event,
    TraceHandle,
    TraceOutputs,
    as_torch,
)
from runtime.backends.faults import (
    FAULT_OPERATIONS,
    FaultCall,
    FaultInjectingDevice,
    FaultOperation,
    FaultPlan,
    FaultRule,
    InjectedFault,
)
from runtime.backends.torch_device import TorchDevice
from runtime.backends.ttnn_device import TTNN_INSTALL_HINT, TtnnDevice

logger = logging.getLogger(__name__)

__all__ = [
    "FAULT_OPERATIONS",
    "TTNN_INSTALL_HINT",
    "Device",
    "DeviceError",
    "DeviceTensor",
    "DoubleDeallocationError",
    "Event",
    "FaultCall",
    "FaultInjectingDevice",
    "FaultOperation",
    "FaultPlan",
    "FaultRule",
    "InjectedFault",
    "TorchDevice",
    "TraceHandle",
    "TraceOutputs",
    "TtnnDevice",
    "allocates_torch_tensors",
    "as_torch",
    "make_device",
]


def allocates_torch_tensors(device: Device) -> bool:
    """Whether `device.allocate` hands out torch tensors that torch code can compute on.

    True for the torch backend, also behind fault injection; ttnn hands out its own tensors
    (and lacks some dtypes), so torch-side helpers keep host tensors there instead.
    """
    while isinstance(device, FaultInjectingDevice):
        device = device.inner
    return isinstance(device, TorchDevice)


_SPEC = re.compile(r"^(?P<kind>cpu|cuda|ttnn)(?::(?P<index>\d+))?$")
_ALLOWED = "'cpu', 'cuda', 'cuda:N', 'ttnn' or 'ttnn:N' (N a device index >= 0)"


def make_device(spec: str, *, faults: str | FaultPlan | None = None) -> Device:
    """Build the device a spec names; `faults` (a `FaultPlan` or its spec) wraps it."""
    if not isinstance(spec, str):
        raise ValueError(f"device spec must be a string, one of {_ALLOWED}; got {spec!r}")
    match = _SPEC.match(spec.strip().lower())
    if match is None or (match["kind"] == "cpu" and match["index"] is not None):
        raise ValueError(f"unknown device spec {spec!r}; allowed: {_ALLOWED}")
    kind, index = match["kind"], match["index"]
    device: Device
    if kind == "cpu":
        device = TorchDevice("cpu")
    elif kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"device spec {spec!r} needs a CUDA GPU but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}); install a "
                "CUDA build of torch on a machine with an NVIDIA driver, or use 'cpu'"
            )
        device = TorchDevice(f"cuda:{index}" if index is not None else "cuda")
    else:
        device = TtnnDevice(int(index) if index is not None else 0)
    logger.info("using device %s for spec %r", device.name, spec)
    if faults is not None:
        device = FaultInjectingDevice(device, faults)
    return device

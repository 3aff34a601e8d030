"""TtnnDevice: the protocol-to-ttnn mapping (against a recording fake ttnn module, on any
machine), the missing-ttnn error, and host conversions with the real ttnn where installed."""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import pytest
import torch

from runtime.backends import (
    Device,
    DeviceError,
    DoubleDeallocationError,
    FaultInjectingDevice,
    FaultPlan,
    InjectedFault,
    TtnnDevice,
)
from runtime.tensor_resources import best_effort_deallocate_owned_tensors

TTNN_MISSING_REASON = (
    "ttnn is not installed: it is only installable on Python 3.10/3.12 via `pip install ttnn` "
    f"(this is Python {sys.version_info.major}.{sys.version_info.minor})"
)


class FakeTensor:
    """A device tensor of the fake ttnn: host data plus dtype/layout tags."""

    def __init__(self, data: torch.Tensor, dtype: str, layout: str, device: Any) -> None:
        self.data = data.clone()
        self.shape = tuple(data.shape)
        self.dtype = dtype
        self.layout = layout
        self.device = device
        self.deallocated = False


class FakeTtnn:
    """Records every ttnn call the backend makes; behaves like ttnn for host-visible effects."""

    bfloat16, float32, int32, uint32, uint16, uint8 = (
        "bfloat16",
        "float32",
        "int32",
        "uint32",
        "uint16",
        "uint8",
    )
    TILE_LAYOUT, ROW_MAJOR_LAYOUT = "TILE", "ROW_MAJOR"
    DRAM_MEMORY_CONFIG, L1_MEMORY_CONFIG = "DRAM", "L1"

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fail_deallocate = False
        self._next_trace = 100

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def open_device(self, **kwargs: Any) -> str:
        self.calls.append(("open_device", kwargs))
        return "fake-device"

    def close_device(self, device: Any) -> None:
        self.calls.append(("close_device", device))

    def from_torch(self, tensor: torch.Tensor, **kwargs: Any) -> FakeTensor:
        self.calls.append(("from_torch", kwargs))
        return FakeTensor(tensor, kwargs["dtype"], kwargs["layout"], kwargs.get("device"))

    def to_torch(self, tensor: FakeTensor) -> torch.Tensor:
        self.calls.append(("to_torch", tensor.shape))
        if tensor.deallocated:
            raise RuntimeError("read of a deallocated buffer")
        return tensor.data.clone()

    def copy_host_to_device_tensor(
        self, host: FakeTensor, device_tensor: FakeTensor, cq_id: int
    ) -> None:
        self.calls.append(("copy_host_to_device_tensor", cq_id))
        device_tensor.data.copy_(host.data)

    def deallocate(self, tensor: FakeTensor) -> None:
        self.calls.append(("deallocate", tensor.shape))
        if self.fail_deallocate:
            raise RuntimeError("device busy")
        tensor.deallocated = True

    def synchronize_device(self, device: Any) -> None:
        self.calls.append(("synchronize_device", device))

    def record_event(self, device: Any, cq_id: int) -> str:
        self.calls.append(("record_event", cq_id))
        return f"event-{len(self.calls)}"

    def event_synchronize(self, event: Any) -> None:
        self.calls.append(("event_synchronize", event))

    def begin_trace_capture(self, device: Any, cq_id: int) -> int:
        self.calls.append(("begin_trace_capture", cq_id))
        self._next_trace += 1
        return self._next_trace

    def end_trace_capture(self, device: Any, trace_id: int, cq_id: int) -> None:
        self.calls.append(("end_trace_capture", trace_id))

    def execute_trace(self, device: Any, trace_id: int, cq_id: int, blocking: bool) -> None:
        self.calls.append(("execute_trace", (trace_id, blocking)))

    def release_trace(self, device: Any, trace_id: int) -> None:
        self.calls.append(("release_trace", trace_id))


@pytest.fixture
def fake() -> FakeTtnn:
    return FakeTtnn()


@pytest.fixture
def device(fake: FakeTtnn) -> TtnnDevice:
    return TtnnDevice(1, ttnn_module=fake, trace_region_size=1024)


def test_opens_and_closes_its_device(fake: FakeTtnn, device: TtnnDevice) -> None:
    assert isinstance(device, Device)
    assert device.name == "ttnn:1" and device.torch_device == torch.device("cpu")
    assert fake.calls[0] == (
        "open_device",
        {"device_id": 1, "l1_small_size": 32768, "trace_region_size": 1024},
    )
    device.close()
    device.close()
    assert fake.names().count("close_device") == 1


def test_borrowed_device_is_never_closed(fake: FakeTtnn) -> None:
    device = TtnnDevice(device="opened-elsewhere", ttnn_module=fake)
    assert device.ttnn_device == "opened-elsewhere"
    device.close()
    assert "open_device" not in fake.names() and "close_device" not in fake.names()


def test_allocate_maps_dtype_layout_and_memory_config(fake: FakeTtnn, device: TtnnDevice) -> None:
    kv = device.allocate((2, 32, 32), torch.bfloat16, fill=0.0)
    table = device.allocate((4, 8), torch.int32, fill=-1)
    assert (kv.dtype, kv.layout, kv.device) == ("bfloat16", "TILE", "fake-device")
    assert (table.dtype, table.layout) == ("int32", "ROW_MAJOR")
    assert fake.calls[-1][1]["memory_config"] == "DRAM"
    assert device.live_allocations == 2 and device.is_owned(kv)
    with pytest.raises(ValueError, match=r"dtype torch.float64 has no ttnn equivalent"):
        device.allocate((1,), torch.float64)
    assert device.live_allocations == 2


def test_from_host_and_in_place_copy(fake: FakeTtnn, device: TtnnDevice) -> None:
    tokens = device.from_host(torch.zeros(1, 4, dtype=torch.int32))
    assert device.is_owned(tokens)
    assert device.from_host(torch.tensor([[1, 2, 3, 4]], dtype=torch.int32), into=tokens) is tokens
    assert "copy_host_to_device_tensor" in fake.names()
    host, event = device.to_host(tokens)
    assert event is None and host.tolist() == [[1, 2, 3, 4]]
    with pytest.raises(ValueError, match=r"host is \(2, 4\), into is \(1, 4\)"):
        device.from_host(torch.zeros(2, 4, dtype=torch.int32), into=tokens)
    with pytest.raises(DeviceError, match="is not an allocation"):
        device.from_host(torch.zeros(1), into=FakeTensor(torch.zeros(1), "float32", "TILE", None))


def test_non_blocking_read_returns_an_event(fake: FakeTtnn, device: TtnnDevice) -> None:
    t = device.allocate((2,), torch.float32, fill=3.0)
    host, event = device.to_host(t, blocking=False)
    assert host.tolist() == [3.0, 3.0]
    assert event is not None and event.device_name == "ttnn:1"
    device.event_synchronize(event)
    assert fake.names()[-2:] == ["record_event", "event_synchronize"]


def test_deallocate_double_free_and_retryable_failure(fake: FakeTtnn, device: TtnnDevice) -> None:
    t = device.allocate((2,), torch.float32)
    fake.fail_deallocate = True
    with pytest.raises(RuntimeError, match="device busy"):
        device.deallocate(t)
    assert device.is_owned(t), "a failed ttnn.deallocate keeps the tensor owned"
    fake.fail_deallocate = False
    device.deallocate(t)
    assert t.deallocated and device.live_allocations == 0
    with pytest.raises(DoubleDeallocationError, match=r"shape=\(2,\)"):
        device.deallocate(t)


def test_trace_mapping(fake: FakeTtnn, device: TtnnDevice) -> None:
    x = device.allocate((1, 4), torch.bfloat16)
    produced: list[FakeTensor] = []

    def step() -> tuple[FakeTensor, FakeTensor]:
        out = FakeTensor(torch.ones(1, 4), "bfloat16", "TILE", "fake-device")
        produced.append(out)
        return out, x

    fake.calls.clear()
    trace = device.capture(step)
    assert fake.names() == [
        "deallocate",  # the compile run's output (x is an allocation, so it is kept)
        "begin_trace_capture",
        "end_trace_capture",
        "synchronize_device",
    ]
    assert produced[0].deallocated and not produced[1].deallocated
    assert trace.outputs == (produced[1], x) and device.live_traces == 1

    assert device.replay(trace) is trace.outputs
    device.replay(trace, blocking=True)
    assert [args for name, args in fake.calls if name == "execute_trace"] == [
        (101, False),
        (101, True),
    ]

    device.release_trace(trace)
    assert fake.calls[-2:] == [("deallocate", (1, 4)), ("release_trace", 101)]
    assert produced[1].deallocated and device.is_owned(x)
    with pytest.raises(DeviceError, match="already released"):
        device.replay(trace)
    with pytest.raises(DeviceError, match="already released"):
        device.release_trace(trace)


def test_failed_capture_is_aborted(fake: FakeTtnn, device: TtnnDevice) -> None:
    runs = {"n": 0}

    def step() -> FakeTensor:
        runs["n"] += 1
        if runs["n"] == 2:
            raise RuntimeError("op not traceable")
        return FakeTensor(torch.ones(1), "float32", "TILE", "fake-device")

    with pytest.raises(RuntimeError, match="op not traceable"):
        device.capture(step)
    assert fake.names()[-2:] == ["end_trace_capture", "release_trace"]
    assert device.live_traces == 0


def test_release_trace_retries_without_double_freeing_outputs(
    fake: FakeTtnn, device: TtnnDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    outputs = [FakeTensor(torch.ones(1), "float32", "TILE", "fake-device") for _ in range(2)]
    trace = device.capture(lambda: tuple(outputs))

    def failing_release(device_: Any, trace_id: int) -> None:
        raise RuntimeError("release failed")

    monkeypatch.setattr(fake, "release_trace", failing_release)
    with pytest.raises(RuntimeError, match="release failed"):
        device.release_trace(trace)
    assert device.live_traces == 1 and not trace.released
    monkeypatch.undo()
    fake.calls.clear()
    device.release_trace(trace)
    assert fake.names() == ["release_trace"], (
        "outputs freed by the first attempt are not freed again"
    )


def test_works_under_fault_injection_and_resource_helpers(
    fake: FakeTtnn, device: TtnnDevice
) -> None:
    faulty = FaultInjectingDevice(device, FaultPlan.parse("deallocate:1"))
    tensors = [faulty.allocate((2,), torch.float32) for _ in range(2)]
    failures = best_effort_deallocate_owned_tensors(tensors, faulty)
    assert [type(f) for f in failures] == [InjectedFault]
    assert best_effort_deallocate_owned_tensors(tensors, faulty) == []
    assert device.live_allocations == 0


def test_missing_ttnn_raises_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ttnn", None)
    with pytest.raises(RuntimeError, match=r"pip install ttnn.*Python 3.10 and 3.12") as info:
        TtnnDevice()
    assert "Tenstorrent hardware" in str(info.value)


def test_argument_validation(fake: FakeTtnn) -> None:
    with pytest.raises(ValueError, match="device_id must be an int >= 0"):
        TtnnDevice(-1, ttnn_module=fake)
    with pytest.raises(ValueError, match="memory_config must be one of dram, l1"):
        TtnnDevice(ttnn_module=fake, memory_config="sram")


# --- the real ttnn (host-side conversions only; a device needs Tenstorrent hardware) --------


@pytest.mark.skipif(importlib.util.find_spec("ttnn") is None, reason=TTNN_MISSING_REASON)
def test_real_ttnn_host_conversion_round_trips() -> None:
    import ttnn

    host = torch.arange(32 * 32, dtype=torch.float32).reshape(32, 32)
    converted = ttnn.from_torch(host, dtype=ttnn.float32, layout=ttnn.ROW_MAJOR_LAYOUT)
    assert torch.equal(ttnn.to_torch(converted), host)
    tiled = ttnn.from_torch(host.to(torch.bfloat16), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT)
    assert torch.equal(ttnn.to_torch(tiled), host.to(torch.bfloat16))


def test_device_sampler_keeps_torch_buffers_on_a_ttnn_device(device: TtnnDevice) -> None:
    """The sampler is torch code: on a backend with native tensors its buffers stay torch
    tensors on the host surrogate, and the probe allocation is handed back."""
    from models.decoder.sampling import DecoderSampler, SamplerConfig

    sampler = DecoderSampler(SamplerConfig(max_batch_size=2, max_top_k=4, vocab_size=8))
    sampler.materialize(device)
    assert sampler.materialized and sampler.device == torch.device("cpu")
    assert all(isinstance(t, torch.Tensor) for t in sampler.buffers.values())
    assert device.live_allocations == 0
    sampler.release()
    assert not sampler.materialized

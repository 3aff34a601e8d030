"""TorchDevice on CPU: allocation accounting, ownership errors, copies, events and traces."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from runtime.backends import (
    Device,
    DeviceError,
    DoubleDeallocationError,
    Event,
    FaultInjectingDevice,
    TorchDevice,
    TtnnDevice,
    make_device,
)


@pytest.fixture
def device() -> TorchDevice:
    return TorchDevice("cpu")


def test_implements_the_protocol(device: TorchDevice) -> None:
    assert isinstance(device, Device)
    assert device.name == "cpu"
    assert device.torch_device == torch.device("cpu")


def test_allocation_accounting(device: TorchDevice) -> None:
    a = device.allocate((2, 3), torch.float32, fill=1.5)
    b = device.allocate([4], torch.int32, fill=-1)
    assert a.shape == (2, 3) and a.dtype == torch.float32 and bool((a == 1.5).all())
    assert b.tolist() == [-1, -1, -1, -1]
    assert device.live_allocations == 2
    assert device.live_bytes == 6 * 4 + 4 * 4
    assert device.describe_live_allocations() == [
        "Tensor(shape=(2, 3), dtype=torch.float32)",
        "Tensor(shape=(4,), dtype=torch.int32)",
    ]
    device.deallocate(a)
    assert (device.live_allocations, device.allocations_total, device.deallocations_total) == (
        1,
        2,
        1,
    )
    assert not device.is_owned(a) and device.is_owned(b)


def test_ownership_is_by_identity(device: TorchDevice) -> None:
    a = device.allocate((3,), torch.float32)
    assert device.is_owned(a)
    assert not device.is_owned(a.clone())
    assert not device.is_owned(a.view(3))
    assert not device.is_owned(None)
    assert not device.is_owned(0)


def test_double_free_names_the_shape(device: TorchDevice) -> None:
    a = device.allocate((5, 7), torch.bfloat16)
    device.deallocate(a)
    with pytest.raises(DoubleDeallocationError, match=r"shape=\(5, 7\).*already deallocated"):
        device.deallocate(a)
    assert device.deallocations_total == 1


def test_foreign_tensor_cannot_be_deallocated(device: TorchDevice) -> None:
    foreign = torch.zeros(2, 2)
    with pytest.raises(DeviceError, match=r"shape=\(2, 2\).*is not an allocation of cpu") as info:
        device.deallocate(foreign)
    assert not isinstance(info.value, DoubleDeallocationError)
    other = TorchDevice("cpu")
    t = other.allocate((1,), torch.float32)
    with pytest.raises(DeviceError, match="is not an allocation"):
        device.deallocate(t)
    assert other.is_owned(t)


@pytest.mark.parametrize("shape", [(2, -1), (True, 2), "ab", (2.0,)])
def test_allocate_rejects_bad_shapes(device: TorchDevice, shape: Any) -> None:
    with pytest.raises(ValueError, match="shape must be a sequence of non-negative ints"):
        device.allocate(shape, torch.float32)
    assert device.live_allocations == 0


def test_allocate_rejects_bad_dtype(device: TorchDevice) -> None:
    with pytest.raises(TypeError, match=r"dtype must be a torch\.dtype"):
        device.allocate((1,), "float32")  # type: ignore[arg-type]


def test_from_host_new_tensor_is_an_owned_copy(device: TorchDevice) -> None:
    host = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    t = device.from_host(host)
    assert device.is_owned(t) and t is not host
    host.zero_()
    assert t.sum().item() == 15.0, "the device copy must not alias the host tensor"


def test_from_host_into_is_in_place(device: TorchDevice) -> None:
    target = device.allocate((2, 3), torch.int64)
    result = device.from_host(torch.arange(6).reshape(2, 3), into=target)
    assert result is target
    assert target.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert device.live_allocations == 1
    device.from_host(torch.tensor([9, 9, 9]), into=target[1])  # a view of an owned tensor
    assert target.tolist() == [[0, 1, 2], [9, 9, 9]]


def test_from_host_into_mismatch_names_both_shapes(device: TorchDevice) -> None:
    target = device.allocate((2, 3), torch.float32)
    with pytest.raises(ValueError, match=r"host is \(3, 2\) torch.float32, into is \(2, 3\)"):
        device.from_host(torch.zeros(3, 2), into=target)
    with pytest.raises(ValueError, match=r"host is \(2, 3\) torch.int32"):
        device.from_host(torch.zeros(2, 3, dtype=torch.int32), into=target)


def test_from_host_into_must_be_owned(device: TorchDevice) -> None:
    with pytest.raises(DeviceError, match="is not an allocation"):
        device.from_host(torch.zeros(2), into=torch.zeros(2))
    released = device.allocate((2,), torch.float32)
    device.deallocate(released)
    with pytest.raises(DoubleDeallocationError):
        device.from_host(torch.zeros(2), into=released)


def test_from_host_into_inference_tensor(device: TorchDevice) -> None:
    with torch.inference_mode():
        target = device.allocate((2,), torch.float32)
    device.from_host(torch.ones(2), into=target)
    assert target.tolist() == [1.0, 1.0]


def test_to_host_blocking_and_non_blocking(device: TorchDevice) -> None:
    t = device.allocate((3,), torch.float32, fill=2.0)
    host, event = device.to_host(t)
    assert event is None and host.tolist() == [2.0, 2.0, 2.0]
    host2, event2 = device.to_host(t, blocking=False)
    assert isinstance(event2, Event) and event2.device_name == "cpu"
    assert device.event_completed(event2)
    device.event_synchronize(event2)
    t.fill_(5.0)
    assert host2.tolist() == [2.0, 2.0, 2.0], "to_host must copy"


def test_events_are_sequenced_and_checked(device: TorchDevice) -> None:
    first, second = device.record_event(), device.record_event()
    assert second.sequence == first.sequence + 1
    device.event_synchronize(first)
    with pytest.raises(DeviceError, match="never recorded"):
        device.event_synchronize(Event(device_name="cpu", sequence=99))
    with pytest.raises(DeviceError, match="recorded on 'cuda:0', not on 'cpu'"):
        device.event_synchronize(Event(device_name="cuda:0", sequence=1))
    device.synchronize()


# --- traces ---------------------------------------------------------------------------------


def test_cpu_trace_replay_preserves_output_identity_and_refreshes_values(
    device: TorchDevice,
) -> None:
    x = device.allocate((2, 2), torch.float32, fill=1.0)
    w = device.allocate((2, 2), torch.float32, fill=3.0)

    def step() -> tuple[torch.Tensor, list[torch.Tensor]]:
        y = x @ w
        return y, [y.sum(dim=0), x + 1]

    trace = device.capture(step)
    assert device.live_traces == 1
    y, (col, shifted) = trace.outputs
    assert y.tolist() == [[6.0, 6.0], [6.0, 6.0]]

    device.from_host(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), into=x)
    result = device.replay(trace)
    assert result is trace.outputs
    assert result[0] is y and result[1][0] is col and result[1][1] is shifted
    expected = torch.tensor([[1.0, 2.0], [3.0, 4.0]]) @ torch.full((2, 2), 3.0)
    assert torch.equal(y, expected)
    assert torch.equal(col, expected.sum(dim=0))
    assert shifted.tolist() == [[2.0, 3.0], [4.0, 5.0]]
    assert device.live_allocations == 2, "trace outputs are trace-owned, not allocations"


def test_cpu_trace_replay_matches_eager_over_many_inputs(device: TorchDevice) -> None:
    x = device.allocate((4,), torch.float32)
    trace = device.capture(lambda: torch.cumsum(x * 2, 0))
    out = trace.outputs
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        host = torch.randn(4, generator=generator)
        device.from_host(host, into=x)
        assert device.replay(trace, blocking=True) is out
        assert torch.allclose(out, torch.cumsum(host * 2, 0))


def test_capture_output_type_is_checked(device: TorchDevice) -> None:
    with pytest.raises(TypeError, match=r"outputs\[1\] is dict"):
        device.capture(lambda: (torch.zeros(1), {"a": torch.zeros(1)}))
    with pytest.raises(TypeError, match="capture expects a callable"):
        device.capture(42)  # type: ignore[arg-type]
    assert device.live_traces == 0


def test_replay_signature_cannot_change(device: TorchDevice) -> None:
    n = [2]
    trace = device.capture(lambda: torch.zeros(n[0]))
    n[0] = 3
    with pytest.raises(DeviceError, match="a trace's signature cannot change"):
        device.replay(trace)


def test_release_trace_twice_and_replay_after_release(device: TorchDevice) -> None:
    trace = device.capture(lambda: torch.ones(1))
    device.release_trace(trace)
    assert trace.released and device.live_traces == 0
    with pytest.raises(DeviceError, match="already released"):
        device.release_trace(trace)
    with pytest.raises(DeviceError, match="already released"):
        device.replay(trace)
    assert device.traces_captured_total == 1 and device.traces_released_total == 1


def test_trace_of_another_device_is_refused(device: TorchDevice) -> None:
    other = TorchDevice("cpu")
    trace = other.capture(lambda: torch.ones(1))
    with pytest.raises(DeviceError, match="not a live trace"):
        device.replay(trace)
    with pytest.raises(DeviceError, match="not a live trace"):
        device.release_trace(trace)
    other.release_trace(trace)


def test_replay_under_inference_mode_outputs(device: TorchDevice) -> None:
    x: torch.Tensor = device.allocate((2,), torch.float32, fill=1.0)

    def step() -> torch.Tensor:
        with torch.inference_mode():
            return x * 2

    trace = device.capture(step)
    device.from_host(torch.tensor([3.0, 4.0]), into=x)
    assert device.replay(trace).tolist() == [6.0, 8.0]


# --- construction and make_device -----------------------------------------------------------


@pytest.mark.parametrize("spec", ["tpu", "cuda:x", "meta"])
def test_torch_device_rejects_unknown_devices(spec: str) -> None:
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:N'"):
        TorchDevice(spec)


def test_make_device_cpu_and_faults() -> None:
    cpu = make_device(" CPU ")
    assert isinstance(cpu, TorchDevice) and cpu.name == "cpu"
    wrapped = make_device("cpu", faults="allocate:1")
    assert isinstance(wrapped, FaultInjectingDevice) and wrapped.name == "cpu"


@pytest.mark.parametrize("spec", ["", "gpu", "cpu:0", "cuda:", "cuda:-1", "ttnn:a", "cuda0"])
def test_make_device_rejects_bad_specs(spec: str) -> None:
    with pytest.raises(ValueError, match="allowed: 'cpu', 'cuda', 'cuda:N', 'ttnn' or 'ttnn:N'"):
        make_device(spec)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on CPU-only machines")
@pytest.mark.parametrize("spec", ["cuda", "cuda:1"])
def test_make_device_cuda_without_gpu_names_the_fix(spec: str) -> None:
    with pytest.raises(RuntimeError, match=r"install a CUDA build of torch.*or use 'cpu'"):
        make_device(spec)
    with pytest.raises(RuntimeError, match=r"torch\.cuda\.is_available\(\) is False"):
        TorchDevice(spec)


def test_make_device_ttnn_without_ttnn_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "ttnn", None)  # makes `import ttnn` fail everywhere
    with pytest.raises(RuntimeError, match=r"pip install ttnn.*3\.10 and 3\.12"):
        make_device("ttnn")
    assert TtnnDevice is not None


def test_as_torch_passes_torch_tensors_and_names_the_backend_otherwise() -> None:
    from runtime.backends import DeviceTensor, as_torch

    device = TorchDevice("cpu")
    tensor = device.allocate((2, 3), torch.float32)
    assert isinstance(tensor, DeviceTensor)
    assert as_torch(tensor) is tensor

    class OtherBackendTensor:
        shape = (2, 3)

    foreign = OtherBackendTensor()
    assert isinstance(foreign, DeviceTensor)
    with pytest.raises(TypeError, match=r"kv cache must be a torch\.Tensor .*OtherBackendTensor"):
        as_torch(foreign, "kv cache")
    device.deallocate(tensor)

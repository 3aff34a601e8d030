"""TorchDevice on CUDA: pinned non-blocking reads with events, and CUDA-graph traces."""

from __future__ import annotations

import pytest
import torch

from runtime.backends import DeviceError, TorchDevice, make_device

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU (torch.cuda.is_available() is False)",
    ),
]


@pytest.fixture
def device() -> TorchDevice:
    return TorchDevice("cuda")


def test_names_and_make_device(device: TorchDevice) -> None:
    index = torch.cuda.current_device()
    assert device.name == f"cuda:{index}"
    assert device.torch_device == torch.device("cuda", index)
    made = make_device(f"cuda:{index}")
    assert isinstance(made, TorchDevice) and made.name == device.name
    with pytest.raises(ValueError, match="out of range"):
        TorchDevice(f"cuda:{torch.cuda.device_count()}")


def test_allocate_and_from_host_live_on_the_gpu(device: TorchDevice) -> None:
    t = device.allocate((3, 4), torch.float16, fill=2.0)
    assert t.is_cuda and t.dtype == torch.float16
    device.from_host(torch.arange(12, dtype=torch.float16).reshape(3, 4), into=t)
    assert t.cpu().flatten().tolist() == [float(i) for i in range(12)]
    device.deallocate(t)
    assert device.live_allocations == 0


def test_non_blocking_read_is_pinned_and_event_ordered(device: TorchDevice) -> None:
    source = device.allocate((1024, 1024), torch.float32)
    for value in (1.0, 2.0, 3.0):
        source.fill_(value)  # queued on the current stream before the copy
        host, event = device.to_host(source, blocking=False)
        assert event is not None and isinstance(event.handle, torch.cuda.Event)
        assert host.device.type == "cpu" and host.is_pinned()
        device.event_synchronize(event)
        assert device.event_completed(event)
        assert bool((host == value).all())


def test_blocking_read_returns_no_event(device: TorchDevice) -> None:
    t = device.allocate((4,), torch.int32, fill=7)
    host, event = device.to_host(t)
    assert event is None and host.tolist() == [7, 7, 7, 7]


def test_recorded_events_synchronize(device: TorchDevice) -> None:
    t = device.allocate((256, 256), torch.float32, fill=1.0)
    _ = t @ t
    event = device.record_event()
    device.event_synchronize(event)
    assert device.event_completed(event)
    device.synchronize()


def test_cuda_graph_replay_equals_eager(device: TorchDevice) -> None:
    generator = torch.Generator().manual_seed(0)
    x = device.allocate((8, 16), torch.float32)
    w = device.from_host(torch.randn(16, 16, generator=generator))

    def step() -> tuple[torch.Tensor, list[torch.Tensor]]:
        hidden = torch.relu(x @ w)
        return hidden, [hidden.sum(dim=-1), hidden.argmax(dim=-1)]

    trace = device.capture(step)
    assert device.live_traces == 1
    assert isinstance(trace.handle.graph, torch.cuda.CUDAGraph)
    hidden, (total, best) = trace.outputs
    for _ in range(4):
        host = torch.randn(8, 16, generator=generator)
        device.from_host(host, into=x)
        result = device.replay(trace, blocking=True)
        assert result is trace.outputs
        assert result[0] is hidden and result[1][0] is total and result[1][1] is best
        eager_hidden, (eager_total, eager_best) = step()
        torch.testing.assert_close(hidden, eager_hidden)
        torch.testing.assert_close(total, eager_total)
        assert torch.equal(best, eager_best)
    device.release_trace(trace)
    assert device.live_traces == 0
    with pytest.raises(DeviceError, match="already released"):
        device.replay(trace)
    with pytest.raises(DeviceError, match="already released"):
        device.release_trace(trace)


def test_failed_capture_leaves_device_usable(device: TorchDevice) -> None:
    x: torch.Tensor = device.allocate((4,), torch.float32, fill=1.0)
    calls = {"n": 0}

    def failing() -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] > 1:  # warm-up succeeds, the captured run fails
            raise RuntimeError("boom inside capture")
        return x * 2

    with pytest.raises(RuntimeError, match="boom inside capture"):
        TorchDevice("cuda", graph_warmup_runs=1).capture(failing)
    trace = device.capture(lambda: x + 1)
    device.from_host(torch.full((4,), 5.0), into=x)
    assert device.replay(trace, blocking=True).tolist() == [6.0] * 4
    device.release_trace(trace)


def test_capture_output_type_is_checked_and_graph_released(device: TorchDevice) -> None:
    x = device.allocate((2,), torch.float32)
    with pytest.raises(TypeError, match="outputs is dict"):
        device.capture(lambda: {"y": x + 1})
    assert device.live_traces == 0

"""`ModelExecutor.decode_forward` checks a step once, before any device work: a refused step
runs nothing, allocates nothing and leaves the lane serving; compile_decode names bad keywords."""

from __future__ import annotations

import pytest
import torch

from lifecycle import Phase
from tests.integration.executor_setup import contiguous_tables, tiny_executor


def decode_inputs(width: int) -> dict[str, torch.Tensor]:
    return {
        "tokens": torch.tensor([3, 4, 5, 6]),
        "start_pos": torch.tensor([0, 1, -1, 2]),
        "page_table": contiguous_tables([4, 4, 4, 4], width=width),
    }


@pytest.mark.parametrize(
    ("extra", "error", "message"),
    [
        ({"read_from_device": 1}, TypeError, "read_from_device must be a bool"),
        ({"reset_batch": "yes"}, TypeError, "reset_batch must be a bool"),
        ({"tokens": torch.tensor([1, 2, 3])}, ValueError, "decode batch 3 must equal lane"),
        ({"tokens": torch.tensor([1, 300, 3, 4])}, ValueError, r"tokens row 1 is 300"),
        ({"slot_remap": [1, 0, 2, 3]}, ValueError, "slot_remap is request-owned"),
    ],
)
def test_a_refused_decode_step_runs_nothing(
    extra: dict[str, object], error: type[Exception], message: str
) -> None:
    executor = tiny_executor(device_sampling=False)
    executor.start()
    device = executor.device
    before = (device.live_allocations, executor.runtime_summary()["eager_decode_executions"])
    request = {**decode_inputs(executor.page_table_layout.decode_width), **extra}
    with pytest.raises(error, match=message):
        executor.decode_forward(**request)  # type: ignore[arg-type]
    after = (device.live_allocations, executor.runtime_summary()["eager_decode_executions"])
    assert after == before
    assert executor.phase is Phase.SERVING
    assert executor.decode_runtime.outstanding_lease_count == 0
    logits = executor.decode_forward(**decode_inputs(executor.page_table_layout.decode_width))
    assert tuple(logits.shape) == (4, 1, executor.model.vocab_size)
    executor.close()
    assert device.live_allocations == 0


def test_compile_decode_checks_the_step_and_names_a_stray_keyword() -> None:
    executor = tiny_executor(device_sampling=False)
    executor.allocate_kv_cache()
    inputs = decode_inputs(executor.page_table_layout.decode_width)
    with pytest.raises(TypeError, match="unexpected keyword argument 'seeds'"):
        executor.compile_decode(seeds=[1], **inputs)
    with pytest.raises(ValueError, match="decode batch 2 must equal lane capacity 4"):
        executor.compile_decode(**{name: value[:2] for name, value in inputs.items()})
    program = executor.compile_decode(**inputs)
    assert executor.program_compiler.is_compiled(program.signature)
    executor.close()

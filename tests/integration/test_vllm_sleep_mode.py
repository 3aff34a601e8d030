"""vLLM's sleep mode on the facade (`models.vllm_sleep`), played by `EngineDriver` as vLLM's
engine calls it: sleep, staged wake (weights, optionally reload, then the KV cache), serve.

Each of vLLM's sleep-mode bugs is a regression test here: a forward while only the weights
are awake is refused before any device work; level 2 plus a reload serves the same tokens
(rotary tables and norms survive); a second sleep is a no-op; the engine gets the new KV
handle from the wake and the old one is refused.
"""

from __future__ import annotations

import pytest
import torch

from lifecycle import Phase
from lifecycle.errors import PhaseError
from tests.integration.test_vllm_contract import NEW_TOKENS, SLOTS, tiny_driver, waves
from tests.integration.vllm_engine import EngineDriver


def _served(driver: EngineDriver) -> list[list[int]]:
    return driver.generate(waves(), max_new_tokens=NEW_TOKENS)


def _refused_forward(driver: EngineDriver) -> None:
    """A decode in the weights-only window: refused by the guard, nothing allocated."""
    model = driver.model
    before = model.device.live_allocations
    with pytest.raises(PhaseError, match=r"decode_forward\(\) is not legal in WEIGHTS_AWAKE"):
        model.decode_forward(
            tokens=torch.zeros((SLOTS, 1), dtype=torch.int32),
            page_table=torch.zeros((SLOTS, 4), dtype=torch.int32),
            start_pos=torch.zeros(SLOTS, dtype=torch.int32),
            kv_cache=driver.kv_cache,
            enable_trace=False,
        )
    assert model.device.live_allocations == before
    assert model.phase is Phase.WEIGHTS_AWAKE


@pytest.mark.parametrize(
    ("trace_mode", "level"), [("none", 1), ("decode_only", 1), ("decode_only", 2), ("all", 2)]
)
def test_sleep_and_staged_wake_serve_the_same_tokens(trace_mode: str, level: int) -> None:
    driver = tiny_driver(trace_mode=trace_mode)
    driver.start()
    model = driver.model
    before = _served(driver)
    old_handle = driver.kv_cache

    driver.sleep(level)
    assert model.is_sleeping and model.phase is Phase.SLEEPING
    assert model.executor.kv_cache is None
    driver.sleep(level)  # a second sleep is a no-op (vllm-omni#4473)
    assert model.phase is Phase.SLEEPING

    driver.wake_up(["weights"])
    assert model.is_sleeping and driver.kv_cache is old_handle  # no handle before the KV stage
    _refused_forward(driver)  # vllm#44395: no forward onto a KV cache that is still asleep
    if level == 2:
        model.reload_weights()  # the loaded weights again, from their source
    driver.wake_up(["kv_cache"])
    assert not model.is_sleeping and model.phase is Phase.SERVING
    assert driver.kv_cache is not old_handle

    assert _served(driver) == before
    model.close()
    assert model.device.live_allocations == 0


def test_wake_up_without_tags_wakes_everything_and_an_awake_wake_is_a_no_op() -> None:
    driver = tiny_driver(trace_mode="decode_only")
    driver.start()
    before = _served(driver)
    driver.wake_up()  # awake already: nothing happens
    assert driver.model.phase is Phase.SERVING
    driver.sleep(1)
    driver.wake_up()
    assert _served(driver) == before
    driver.model.close()


def test_reload_refuses_both_sources_and_other_shapes_naming_the_tensor() -> None:
    driver = tiny_driver(trace_mode="none")
    driver.start()
    model = driver.model
    driver.sleep(1)
    driver.wake_up(["weights"])
    with pytest.raises(ValueError, match="weights_iterator or weights_path, not both"):
        model.reload_weights(iter([]), "tiny-random")
    name = "model.layers.0.self_attn.o_proj.weight"
    with pytest.raises(ValueError, match=rf"{name} has shape \[3, 3\], expected \[64, 64\]"):
        model.reload_weights(iter([(name, torch.zeros(3, 3))]))
    assert model.phase is Phase.WEIGHTS_AWAKE
    driver.wake_up(["kv_cache"])
    assert model.phase is Phase.SERVING
    model.close()

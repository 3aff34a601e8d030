"""Issue 21's probe: a refused prefill on a serving lane leaves it serving, in every trace mode.

Live traces are owned, not left behind, so a clean start holds nothing and a caller error
never moves the host to FAULTED; the next valid prefill answers as a host that never saw it.
"""

from __future__ import annotations

import pytest
import torch

from lifecycle.phases import Phase
from models import load_executor
from models.executor import ModelExecutor

TRACE_MODES = ("none", "decode_only", "all")


def _served(mode: str) -> ModelExecutor:
    executor: ModelExecutor = load_executor("tiny-random", max_batch_size=2, trace_mode=mode)
    executor.start()
    return executor


def _prefill_logits(executor: ModelExecutor) -> torch.Tensor:
    output = executor.prefill_forward(
        tokens=torch.tensor([[1, 2, 3, 4]]),
        prompt_lens=[4],
        page_table=torch.tensor([[0, 1]]),
        kv_cache=None,
    )
    return output if isinstance(output, torch.Tensor) else output[0]


@pytest.mark.parametrize("mode", TRACE_MODES)
def test_a_prompt_len_beyond_the_tokens_is_refused_and_the_lane_keeps_serving(mode: str) -> None:
    probed, fresh = _served(mode), _served(mode)
    try:
        assert probed.components.held_resources() == ()
        with pytest.raises(ValueError, match="prompt_len 99"):
            probed.prefill_forward(
                tokens=torch.tensor([[1, 2, 3, 4]]),
                prompt_lens=[99],
                page_table=torch.tensor([[0, 1]]),
                kv_cache=None,
            )
        assert probed.phase is Phase.SERVING
        assert probed.components.held_resources() == ()
        assert torch.equal(_prefill_logits(probed), _prefill_logits(fresh))
    finally:
        probed.close()
        fresh.close()

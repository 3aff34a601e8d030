"""Hypothesis: the composed host on a fault-injecting device under random call orders.

Illegal calls raise `PhaseError` before any device work; after a successful `close()` no
device allocation is live and no tensor was released twice. After any call (an injected
fault included) every call the error or the host lists as the next legal ones (what
`bringup` prints) is accepted by the guards, and, with faults disarmed, succeeds.

The number of programs follows the Hypothesis profile (`HYPOTHESIS_PROFILE=thorough`: 2,012
programs of up to 30 steps, about a minute on one core).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lifecycle import Phase, PhaseError
from models.decoder.sources import load_model
from models.executor import ModelExecutor, ModelExecutorConfig
from runtime.backends.faults import FaultCall, FaultInjectingDevice, FaultPlan, InjectedFault
from runtime.backends.torch_device import TorchDevice
from runtime.config import PagedKVCacheConfig, RuntimePolicy, TraceConfig, WarmupConfig
from tests.integration.executor_setup import BLOCK, contiguous_tables, prompts_batch

_MODEL: dict[str, Any] = {}


def shared_model() -> Any:
    """One tiny model reused by every example (each executor unbinds it on close)."""
    if "model" not in _MODEL:
        model = load_model("tiny-random", with_tokenizer=False).model
        model.configure_paged_attention(block_size=BLOCK, max_num_blocks=32)
        _MODEL["model"] = model
    return _MODEL["model"]


CALLS = [
    "resolve_capacity",
    "seal",
    "allocate",
    "allocate_kv_cache",
    "warmup_prefill",
    "warmup_decode",
    "capture",
    "serve",
    "start",
    "start",
    "prefill",
    "decode",
    "prefill",
    "decode",
    "drain",
    "sleep",
    "wake",
    "close",
]


class ComposedHost(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pending = {"allocate": 0, "deallocate": 0, "from_host": 0}
        self.skip = {"allocate": 0, "deallocate": 0, "from_host": 0}

        def fail_next(operation: str) -> FaultPlan:
            def predicate(call: FaultCall) -> bool:
                if self.pending[operation] > 0:
                    if self.skip[operation] > 0:
                        self.skip[operation] -= 1
                        return False
                    self.pending[operation] -= 1
                    return True
                return False

            return FaultPlan.matching(operation, predicate)  # type: ignore[arg-type]

        self.inner = TorchDevice("cpu")
        self.device = FaultInjectingDevice(
            self.inner, fail_next("allocate") + fail_next("deallocate") + fail_next("from_host")
        )
        config = ModelExecutorConfig(
            trace=TraceConfig(mode="decode_only"),
            warmup=WarmupConfig(prefill_seq_lens=(8,), prefill_batch_sizes=(1,)),
            paged_kv_cache=PagedKVCacheConfig(
                block_size=BLOCK, max_num_blocks=32, dtype=torch.float32
            ),
            device_sampling_enabled=False,
            max_batch_size=2,
            max_prefill_chunk_size=8,
            max_seq_len=32,
            policy=RuntimePolicy.torch_default(chunk_size_multiple=BLOCK),
        )
        self.host = ModelExecutor(shared_model(), config, device=self.device)
        self.advice: tuple[str, ...] = self.host.next_calls
        self.in_hypothesis = True

    def _advise(self, error: BaseException | None) -> None:
        """What a user is told to call next: the error's list, else the phase's (bringup)."""
        if isinstance(error, PhaseError) and error.next_calls:
            self.advice = tuple(error.next_calls)
        else:
            self.advice = self.host.next_calls

    @rule(
        operation=st.sampled_from(["allocate", "deallocate", "from_host"]), count=st.integers(0, 2)
    )
    def inject(self, operation: str, count: int) -> None:
        self.pending[operation] = count

    @rule(call=st.sampled_from(CALLS))
    def phase_call(self, call: str) -> None:
        if call == "close":
            self._close()
            return
        before = self.host.phase
        attempts = dict(self.device.attempts)
        try:
            self._invoke(call)
        except PhaseError as error:
            self._advise(error)
            assert self.host.phase is before
            assert self.device.attempts == attempts, "a refused call reached the device"
        except (InjectedFault, RuntimeError) as error:
            self._advise(error)
            # A failed transition never moves forward; composite calls (start,
            # allocate_kv_cache) keep the transitions that completed before the failure.
            if call in ("start", "allocate_kv_cache", "drain", "wake"):
                assert self.host.phase not in (Phase.CLOSING, Phase.TERMINAL), (call, error)
            else:
                assert self.host.phase in (before, Phase.FAULTED), (call, error)
        else:
            self._advise(None)

    @precondition(lambda self: bool(self.advice))
    @rule(data=st.data())
    def follow_the_advice(self, data: st.DataObject) -> None:
        """A listed call, with faults disarmed, is accepted and succeeds."""
        self.follow(data.draw(st.sampled_from(self.advice), label="advised call"))

    def follow(self, call: str) -> None:
        self.pending = {"allocate": 0, "deallocate": 0, "from_host": 0}
        try:
            self._invoke(ADVISED.get(call, call))
        except Exception as error:
            raise AssertionError(
                f"{call}() was listed as legal in {self.host.phase.name} but failed: {error}"
            ) from error
        self._advise(None)

    @invariant()
    def advice_is_accepted_by_the_guards(self) -> None:
        guards = self.host.guard_table()
        for call in self.advice:
            assert call in ("close", "cleanup") or self.host.phase in guards[call], (
                f"{call}() is listed as legal in {self.host.phase.name}, but its guard "
                f"allows only {sorted(p.name for p in guards.get(call, ()))}"
            )

    def _invoke(self, call: str) -> None:
        host = self.host
        if call == "close":
            host.close()
        elif call == "configure":
            host.configure_paged_kv_cache(host.kv_cache_manager.config.with_num_blocks(16))
        elif call == "prefill":
            host.prefill_forward(
                tokens=prompts_batch([6]),
                page_table=contiguous_tables([6], width=host.page_table_layout.prefill_width),
                prompt_lens=torch.tensor([6]),
                empty_slots=[0],
            )
        elif call == "reload_weights":
            host.reload_weights(shared_model())  # its own weights: an in-place no-change
        elif call == "decode":
            host.decode_forward(
                tokens=torch.tensor([5, 6]),
                start_pos=torch.tensor([3, -1]),
                page_table=contiguous_tables([8, 8], width=host.page_table_layout.decode_width),
            )
        else:
            getattr(host, call)()

    def _close(self) -> None:
        try:
            self.host.close()
        except (InjectedFault, RuntimeError) as error:
            self._advise(error)
            assert self.host.phase is Phase.CLOSING
        else:
            self._advise(None)
            assert self.host.phase is Phase.TERMINAL
            assert self.inner.live_allocations == 0

    @invariant()
    def note_phase(self) -> None:
        if self.in_hypothesis:
            event(f"phase {self.host.phase.name}")

    @invariant()
    def never_released_twice(self) -> None:
        assert self.device.deallocated_twice == 0

    def teardown(self) -> None:
        self.pending = {"allocate": 0, "deallocate": 0, "from_host": 0}
        for _ in range(3):
            try:
                self.host.close()
                break
            except (InjectedFault, RuntimeError):
                continue
        assert self.host.phase is Phase.TERMINAL
        assert self.inner.live_allocations == 0
        assert self.inner.live_traces == 0
        assert self.device.deallocated_twice == 0


ADVISED = {
    "configure_paged_kv_cache": "configure",
    "prefill_forward": "prefill",
    "decode_forward": "decode",
}
THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
ComposedHost.TestCase.settings = settings(
    settings.default,
    max_examples=2012 if THOROUGH else settings.default.max_examples,
    stateful_step_count=30 if THOROUGH else 12,
)
TestComposedHost = ComposedHost.TestCase
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


STEPWISE = ("allocate_kv_cache", "warmup_prefill", "warmup_decode", "capture", "serve")


@pytest.mark.parametrize("path", [("start",), STEPWISE], ids=["start", "stepwise"])
@pytest.mark.parametrize("operation", ["allocate", "deallocate", "from_host"])
@pytest.mark.parametrize("skip", range(10))
def test_every_single_fault_leaves_advice_that_works(
    path: tuple[str, ...], operation: str, skip: int
) -> None:
    """The issue's case, swept: the n-th call of one device operation fails during start-up
    (one call or phase by phase, as `bringup` does), a request or close; every call then
    listed is accepted by the guards, and the first one succeeds."""
    machine = ComposedHost()
    machine.in_hypothesis = False
    machine.pending[operation], machine.skip[operation] = 1, skip
    for call in (*path, "prefill", "decode", "close"):
        machine.phase_call(call)
        machine.advice_is_accepted_by_the_guards()
        if machine.pending[operation] == 0:  # the fault fired in this call
            break
    if machine.advice:
        machine.follow(machine.advice[0])
        machine.advice_is_accepted_by_the_guards()
    machine.teardown()

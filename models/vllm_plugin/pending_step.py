"""A scheduler step whose device work is issued but whose output is not read yet.

Why: under vLLM's async scheduling the engine schedules step N+1 while step N runs, and
asks for step N's output later (`AsyncModelRunnerOutput.get_output`, from vLLM's output
thread in a multiprocess worker). The runner issues a step's facade calls, then hands back
a `PendingStep`; whoever needs the step's tokens first finishes it: vLLM's `get_output`,
or the runner itself at the start of step N+1, whose inputs are step N's tokens. Finishing
happens exactly once, under a lock, and a failure is re-raised to every caller.

Imports no vLLM (the runner registers the class as an `AsyncModelRunnerOutput`), so the
main suite tests it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

import attrs

from models.vllm_plugin.device_sampling import FacadeSampling
from models.vllm_plugin.step_samples import StepSamples


@attrs.define
class IssuedDecode:
    """A started `decode_forward`: its read (host buffers and events) or, without the
    facade's async read, its output; and how its rows are to be sampled."""

    sampling: FacadeSampling | None
    rows: list[tuple[str, int]]  # (request, output row)
    on_device: set[str]
    host: object = None
    events: list[object] | None = None
    output: object = None


@attrs.define
class IssuedStep:
    """A step's facade calls: prefill rows already collected, the decode maybe in flight."""

    req_ids: list[str]
    samples: StepSamples
    decode: IssuedDecode | None = None


Output = TypeVar("Output")


class PendingStep(Generic[Output]):
    """One issued step: finished once, then `get_output()` returns its output."""

    def __init__(self, step_index: int, finish: Callable[[], Output]) -> None:
        self.step_index = step_index
        self._finish = finish
        self._lock = threading.Lock()
        self._done = False  # set only once the output (or the failure) is there
        self._output: tuple[Output] | None = None  # (output,) once finished without error
        self._error: BaseException | None = None

    @property
    def finished(self) -> bool:
        return self._done

    def finish(self) -> bool:
        """Finish the step unless done; True when this call did it. Waits while another
        thread is finishing it, so afterwards the step's tokens are recorded."""
        with self._lock:
            if self._done:
                return False
            try:
                self._output = (self._finish(),)
            except Exception as error:
                self._error = error
            except BaseException as error:  # Ctrl-C: later callers still see a failure
                self._error = error
                raise
            finally:
                self._done = True
            return True

    def get_output(self) -> Output:
        """The step's output, finishing it first if nobody has (waits for the device)."""
        self.finish()
        if self._error is not None:
            raise RuntimeError(
                f"llm-runtime scheduler step {self.step_index} failed while reading its "
                f"output: {self._error}"
            ) from self._error
        assert self._output is not None, "a finished step has its output or its error"
        return self._output[0]

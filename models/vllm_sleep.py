"""vLLM's sleep mode on a facade: each of vLLM's calls is one guarded lifecycle call of the
facade's execution target (`LifecycleHost`: drain, sleep, staged wake, reload).

Why a mixin of its own: the facade of every family gets the same mapping, and the mapping is
where vLLM's sleep-mode bugs live (a forward in the weights-only window, a second sleep, a
partial wake that resumes onto released KV memory). Here each is the target's phase rule:
a forward before the KV stage is awake is refused by the target's guard, a second sleep is a
journaled no-op, and the KV handle the engine gets back is the one the KV stage allocated.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import torch

from lifecycle import Phase

ASLEEP = frozenset({Phase.SLEEPING, Phase.WEIGHTS_AWAKE})
READY = frozenset({Phase.COMPILED, Phase.CAPTURED})


class SleepTarget(Protocol):
    """The lifecycle calls sleep mode drives (a `ModelExecutor` or a `LaneGroupExecutor`)."""

    @property
    def phase(self) -> object: ...
    @property
    def kv_cache(self) -> object: ...

    def serve(self) -> None: ...
    def drain(self) -> None: ...
    def sleep(self, level: int = 1) -> None: ...
    def wake(self, tags: Sequence[str] | None = None) -> None: ...
    def reload_weights(self, source: object) -> None: ...


class FacadeSleepMode:
    """`sleep`, `wake_up`, `reload_weights` and `is_sleeping` over `sleep_target`."""

    @property
    def sleep_target(self) -> SleepTarget:
        raise NotImplementedError

    @property
    def weights_source(self) -> str | Path:
        """What `reload_weights()` reads when the engine names no weights (the loaded ones)."""
        raise NotImplementedError

    def _serve_if_needed(self) -> None:
        """Warmed up and not yet serving: serve (the facade serves on the engine's first
        call, a forward or a sleep)."""
        target = self.sleep_target
        if target.phase in READY:
            target.serve()

    @property
    def is_sleeping(self) -> bool:
        """Whether any stage (weights or KV cache) is asleep."""
        return self.sleep_target.phase in ASLEEP

    def sleep(self, level: int = 1) -> None:
        """Drain in-flight work, then sleep: level 1 keeps the weights in host memory, level 2
        drops them (wake the weights, then `reload_weights`). Asleep already: a no-op."""
        self._serve_if_needed()
        target = self.sleep_target
        target.drain()
        target.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> object | None:
        """Wake `tags` (`weights`, then `kv_cache`; None: both). Returns the new KV handle once
        the target serves again (the engine must use it from then on), else None."""
        target = self.sleep_target
        target.wake(None if tags is None else tuple(tags))
        return target.kv_cache if target.phase is Phase.SERVING else None

    def reload_weights(
        self,
        weights_iterator: Iterable[tuple[str, torch.Tensor]] | None = None,
        weights_path: str | None = None,
    ) -> None:
        """vLLM's `reload_weights`: from named tensors, a path, or (neither) the loaded file;
        in place, refused naming the first tensor whose name, shape or dtype differs."""
        if weights_iterator is not None and weights_path is not None:
            raise ValueError("reload_weights takes weights_iterator or weights_path, not both")
        source: object = self.weights_source if weights_path is None else weights_path
        if weights_iterator is not None:
            source = dict(weights_iterator)
        self.sleep_target.reload_weights(source)

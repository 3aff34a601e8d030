"""What the subcommands call on a loaded executor: a `ModelExecutor` or a `LaneGroupExecutor`.

`models.load_executor` returns either, so the CLI names the calls it makes once, as a
protocol; what only one of them offers (a lane's KV manager, compilers and device, a group's
per-lane batch) is read with `getattr` where it is used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from models.generation.generator import GenerationExecutor

if TYPE_CHECKING:
    from lifecycle.journal import Journal
    from lifecycle.phases import Phase
    from runtime.warmup_manifest import CoverageManifest


class CliExecutor(GenerationExecutor, Protocol):
    """The lifecycle calls, facts and reports `generate`, `bringup` and `bench` use."""

    @property
    def phase(self) -> Phase: ...

    @property
    def journal(self) -> Journal: ...

    @property
    def owner_name(self) -> str: ...

    @property
    def is_terminal(self) -> bool: ...

    @property
    def next_calls(self) -> tuple[str, ...]: ...

    @property
    def trace_mode(self) -> str: ...

    @property
    def coverage_manifest(self) -> CoverageManifest | None: ...

    def kv_cache_bytes(self, num_blocks: int) -> int: ...

    def resolve_capacity(self, num_blocks: int | None = None) -> None: ...

    def seal(self) -> None: ...

    def allocate(self) -> None: ...

    def warmup_prefill(self) -> object: ...

    def warmup_decode(self) -> object: ...

    def capture(self) -> None: ...

    def serve(self) -> None: ...

    def start(self) -> None: ...

    def drain(self) -> None: ...

    def sleep(self, level: int = 1) -> None: ...

    def wake(self, tags: Sequence[str] | None = None) -> None: ...

    def reload_weights(self, source: object) -> None: ...

    def close(self) -> None: ...

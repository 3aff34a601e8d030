"""Small host subclasses used by the lifecycle tests (no torch, no device)."""

from __future__ import annotations

from collections.abc import Sequence

from lifecycle import LifecycleHost, Phase, guarded


class Pool:
    """A fake device: counts live buffers, refuses double release, can fail on demand."""

    def __init__(self) -> None:
        self.live: set[int] = set()
        self.next_id = 0
        self.fail_allocate = 0
        self.fail_release = 0
        self.double_releases = 0

    def allocate(self) -> int:
        if self.fail_allocate:
            self.fail_allocate -= 1
            raise MemoryError("injected allocation failure")
        self.next_id += 1
        self.live.add(self.next_id)
        return self.next_id

    def release(self, handle: int) -> None:
        if handle not in self.live:
            self.double_releases += 1
            raise RuntimeError(f"buffer {handle} released twice")
        if self.fail_release:
            self.fail_release -= 1
            raise RuntimeError(f"injected release failure for buffer {handle}")
        self.live.remove(handle)


class ToyHost(LifecycleHost):
    """Allocates `buffers` buffers at allocate; traced hosts must capture before serving."""

    def __init__(self, pool: Pool, *, buffers: int = 2, traced: bool = False) -> None:
        super().__init__()
        self.pool = pool
        self.buffers = buffers
        self.traced = traced
        self.held: list[int] = []
        self.requests = 0

    def _requires_capture(self) -> bool:
        return self.traced

    def _do_allocate(self) -> str:
        created: list[int] = []
        try:
            for _ in range(self.buffers):
                created.append(self.pool.allocate())
        except BaseException as error:
            failures: list[BaseException] = []
            for handle in reversed(created):
                try:
                    self.pool.release(handle)
                except BaseException as release_error:
                    failures.append(release_error)
                    self.held.append(handle)
            if failures:
                error.cleanup_failures = tuple(failures)  # type: ignore[attr-defined]
            raise
        self.held = created
        return f"{len(created)} buffers"

    def _do_close(self) -> Sequence[BaseException]:
        failures: list[BaseException] = []
        for handle in list(self.held):
            try:
                self.pool.release(handle)
            except BaseException as error:
                failures.append(error)
            else:
                self.held.remove(handle)
        return failures

    @guarded(Phase.SERVING)
    def request(self) -> int:
        self.requests += 1
        return self.requests

    @guarded(Phase.ALLOCATED, Phase.COMPILED)
    def warm(self) -> None:
        """A guarded call legal in two phases that does not change the phase."""

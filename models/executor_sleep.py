"""The work of drain, sleep, staged wake and reload for one lane (`ModelExecutor`'s hooks).

Why a module of its own: these transitions release and rebuild the whole lane (components,
KV cache, traces, weights) and each must be transactional; keeping them beside the start-up
calls would make the executor unreadable. The KV stage of a wake runs start-up's own steps
(capacity, seal, allocate, warm up, capture) over fresh components that adopt the previous
kernel choice and derived coverage, and checks the recaptured coverage manifest against the
one served before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from lifecycle.errors import attach_cleanup_failures
from lifecycle.host import LifecycleHost
from lifecycle.machine import guarded
from lifecycle.phases import Phase
from models.lane_components import LaneCallbacks, LaneComponents
from models.progress import ProgressSink
from runtime.backends.base import Device
from runtime.backends.memory import format_bytes
from runtime.config import PageTableLayout
from runtime.json_types import JSONValue
from runtime.model_contract import PagedModel
from runtime.paged_kv_cache import KVCacheHandle
from runtime.program_compiler import CompiledProgram
from runtime.weight_reload import ReloadPair
from runtime.weight_residency import WeightResidency

logger = logging.getLogger(__name__)


def device_live_bytes(device: object) -> int | None:
    """Bytes of the device's live allocations, through fault-injecting wrappers (None: unknown)."""
    probe: object = device
    while probe is not None:
        if isinstance(getattr(type(probe), "live_bytes", None), property):
            return int(getattr(probe, "live_bytes"))  # noqa: B009
        probe = getattr(probe, "inner", None)
    return None


def programs_are_host_metadata(device: object) -> bool:
    """Whether the device's compiled programs hold no device memory (through wrappers), so a
    wake may adopt them instead of compiling every warmup case again."""
    probe: object = device
    while probe is not None:
        held = getattr(type(probe), "programs_hold_device_memory", None)
        if isinstance(held, bool):
            return not held
        probe = getattr(probe, "inner", None)
    return False


class ExecutorSleep(LifecycleHost):
    """Drain, sleep, wake and reload hooks over the lane's components and weights."""

    model: PagedModel
    device: Device
    progress: ProgressSink
    components: LaneComponents
    page_table_layout: PageTableLayout
    residency: WeightResidency | None
    kv_generation: int
    _served_manifest: JSONValue = None
    """The coverage manifest served before the last sleep (a wake must recapture the same)."""
    _kv_handle: KVCacheHandle | None
    _slept_programs: tuple[CompiledProgram, ...] = ()
    _lane_callbacks: LaneCallbacks

    # -- supplied by ModelExecutor ---------------------------------------------------------------

    def _install_components(self, components: LaneComponents) -> None:
        raise NotImplementedError

    def _release_sampling(self) -> Callable[[], object] | None:
        raise NotImplementedError

    def _warm_and_capture(self) -> None:
        raise NotImplementedError

    def _build_components(self) -> LaneComponents:
        raise NotImplementedError

    # -- drain -----------------------------------------------------------------------------------

    def _do_drain(self) -> str:
        leases = self.components.decode_runtime.outstanding_lease_count
        reads = self.components.output_reader.pending_count
        self.components.decode_runtime.drain_external_outputs()
        self.components.output_reader.drain()
        self.device.synchronize()
        return f"{leases} decode lease(s) and {reads} pending read(s) retired"

    # -- sleep -----------------------------------------------------------------------------------

    def _release_components(self) -> list[BaseException]:
        """Run the seed's cleanup order over the lane's components; collect failures."""
        failures: list[BaseException] = []
        for name, step in self.components.cleanup_steps(self._release_sampling()):
            try:
                step()
            except BaseException as error:
                logger.warning("%s: release of %s failed: %s", self.owner_name, name, error)
                failures.append(error)
        if not failures:
            self._kv_handle = None
        return failures

    def _return_weights(self) -> list[BaseException]:
        """At close: give the borrowed model back its level-1 weights (they were only lent to
        the host memory). Weights a level-2 sleep dropped stay empty: a model that silently
        computed with zeros would be worse than one that fails."""
        residency = self.residency
        if residency is None or not residency.asleep or residency.level != 1:
            return []
        try:
            residency.wake()
        except BaseException as error:
            logger.warning("%s: returning the weights failed: %s", self.owner_name, error)
            return [error]
        return []

    def _raise_release_failures(self, failures: Sequence[BaseException]) -> None:
        """Raise the first failure marked as leaving resources (the host faults)."""
        primary = failures[0]
        attach_cleanup_failures(primary, failures[1:])
        primary.resources_left = True  # type: ignore[attr-defined]
        raise primary

    def _lane_holdings(self) -> str:
        tracer = self.components.trace_compiler
        traces = 0 if tracer is None else tracer.trace_count
        programs = len(self.components.program_compiler.compiled_programs)
        kv = self.components.kv_cache_manager
        kv_bytes = kv.nbytes if kv.bound_context is not None else 0
        return f"KV {format_bytes(kv_bytes)}, {traces} trace(s), {programs} program(s)"

    def _do_sleep(self, level: int) -> str:
        before = device_live_bytes(self.device)
        held = self._lane_holdings()
        served = _manifest_json(self.components)
        if served is not None:
            self._served_manifest = served
        compiled = self.components.program_compiler.compiled_programs
        self._slept_programs = compiled if programs_are_host_metadata(self.device) else ()
        weights = 0
        if self.residency is not None and not self.residency.asleep:
            weights = self.residency.sleep(level)
        failures = self._release_components()
        if failures:
            self._raise_release_failures(failures)
        after = device_live_bytes(self.device)
        freed = "" if before is None or after is None else f"{format_bytes(before - after)} "
        kept = "kept in host memory" if level == 1 else "weights dropped, buffers kept"
        return (
            f"level {level}: released {freed}of allocations ({held}), weights and buffers "
            f"{format_bytes(weights)} ({kept}); live allocations "
            f"{self.device.live_allocations}"
        )

    # -- wake ------------------------------------------------------------------------------------

    def _do_wake_weights(self) -> str:
        if self.residency is None:
            return "the model keeps its weights resident (it names no resident tensors)"
        restored = self.residency.wake()
        state = "zeroed: reload_weights() next" if self.residency.dropped else "restored"
        return f"weights and buffers {format_bytes(restored)} {state}"

    def _do_wake_kv_cache(self) -> str:
        previous = self.components
        manifest = self._served_manifest
        fresh = self._build_components()
        fresh.warmup.adopt_derivation(previous.warmup)
        # Programs that are host metadata come back as they were: warmup's compile calls then
        # find them, and the wake runs the model only to capture traces.
        fresh.program_compiler.adopt(self._slept_programs)
        self._install_components(fresh)
        before = device_live_bytes(self.device)
        try:
            kv_config = previous.kv_cache_manager.config
            fresh.install_capacity(kv_config, self.page_table_layout, self.device)
            fresh.warmup.seal_configuration()
            self._kv_handle = fresh.kv_cache_manager.allocate()
            self.kv_generation += 1
            self._warm_and_capture()
        except BaseException as error:
            failures = self._release_components()
            if failures:
                attach_cleanup_failures(error, failures, note="rolling back wake(kv_cache)")
            raise
        after = device_live_bytes(self.device)
        restored = "" if before is None or after is None else f"{format_bytes(after - before)} "
        same = manifest is None or manifest == _manifest_json(fresh)
        coverage = "coverage manifest unchanged" if same else "coverage manifest CHANGED"
        return f"restored {restored}of allocations ({self._lane_holdings()}); {coverage}"

    def _resume_blocked(self) -> str | None:
        if self.residency is not None and self.residency.dropped:
            return (
                "sleep(level=2) dropped the weights and they hold zeros; call "
                "reload_weights(source) before serving"
            )
        return None

    @property
    def serving_blocked(self) -> str | None:
        """Why a drained lane may not serve yet, or None (what a lane group reads)."""
        return self._resume_blocked()

    # -- reload ----------------------------------------------------------------------------------

    @guarded(Phase.DRAINED, Phase.WEIGHTS_AWAKE)
    def check_reload_source(self, source: object) -> None:
        """Check `source` as `reload_weights` would, copying nothing (a lane group checks
        every lane before any lane reloads)."""
        self._prepare_reload(source)

    def _prepare_reload(self, source: object) -> object:
        pairs_of = getattr(self.model, "reload_pairs", None)
        if self.residency is None or not callable(pairs_of):
            raise TypeError(
                f"model {type(self.model).__name__} cannot reload weights: it must provide "
                "resident_weights() and reload_pairs(source)"
            )
        pairs: tuple[ReloadPair, ...] = pairs_of(source)
        return pairs

    def _do_reload_weights(self, prepared: object) -> str:
        assert self.residency is not None and isinstance(prepared, tuple)
        outcome = self.residency.reload(prepared)
        copied = f"{outcome.tensors} tensor(s), {format_bytes(outcome.bytes)} copied in place"
        if not self.components.program_compiler.trace_active:
            return f"{copied}; no traces are captured"
        if outcome.addresses_kept:
            return f"{copied}; captured traces stay valid (same device addresses)"
        failures = self._release_components()
        if failures:
            self._raise_release_failures(failures)
        self._do_wake_kv_cache()
        return f"{copied}; addresses moved, traces recaptured"


def _manifest_json(components: LaneComponents) -> JSONValue:
    manifest = components.warmup.coverage_manifest
    return None if manifest is None else manifest.to_json()

"""What a lane group reports about itself, read from its lanes' facts (never from their insides).

`LaneGroupView` is the read-only half of `runtime.lane_group.LaneGroupExecutor`: the same
facts a single lane executor offers (config, model, geometry, KV bytes, a device report),
answered for the whole group, plus the per-step host bookkeeping of its decode calls.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from runtime.config import PagedKVCacheConfig, PageTableLayout
from runtime.lanes.protocol import Lane, LaneFacts
from runtime.warmup_manifest import CoverageManifest


@attrs.frozen
class LaneModelFacts:
    """The model facts a caller (the Generator) reads, identical on every lane."""

    vocab_size: int | None
    max_seq_len: int | None
    eos_token_ids: tuple[int, ...]
    max_top_k: int | None


@attrs.frozen
class LaneGroupConfig:
    """The group's static shape, in the fields a single lane's config offers."""

    lanes: int
    per_lane_max_batch_size: int
    max_batch_size: int
    device_sampling_enabled: bool
    max_seq_len: int | None
    trace_mode: str
    max_prefill_chunk_size: int | None


@attrs.frozen
class LaneDevices:
    """The group's devices as one report, in the fields a single (fault-injecting) device
    offers: `attempts` and `injected_total` add up every lane's fault counters."""

    names: tuple[str, ...]
    live_allocations: int
    attempts: Mapping[str, int]
    injected_total: int

    @property
    def name(self) -> str:
        return ",".join(self.names)


class LaneGroupView:
    """Facts of the group's lanes; lane 0 answers for what every lane shares."""

    lanes: tuple[Lane, ...]
    per_lane_max_batch_size: int
    max_batch_size: int
    _explicit_mesh: object
    _kv_handles: list[object] | None
    decode_steps: int
    step_host_seconds: float
    step_lane_seconds: float
    step_transport_seconds: float

    @property
    def facts(self) -> tuple[LaneFacts, ...]:
        return tuple(lane.facts for lane in self.lanes)

    @property
    def executors(self) -> tuple[object, ...]:
        """Each lane's executor where it lives in this process, else the lane itself."""
        return tuple(getattr(lane, "executor", lane) for lane in self.lanes)

    @property
    def model(self) -> LaneModelFacts:
        first = self.lanes[0].facts
        return LaneModelFacts(
            vocab_size=first.vocab_size,
            max_seq_len=first.max_seq_len,
            eos_token_ids=first.eos_token_ids,
            max_top_k=first.max_top_k,
        )

    @property
    def config(self) -> LaneGroupConfig:
        first = self.lanes[0].facts
        return LaneGroupConfig(
            lanes=len(self.lanes),
            per_lane_max_batch_size=self.per_lane_max_batch_size,
            max_batch_size=self.max_batch_size,
            device_sampling_enabled=first.device_sampling_enabled,
            max_seq_len=first.max_seq_len,
            trace_mode=first.trace_mode,
            max_prefill_chunk_size=first.max_prefill_chunk_size,
        )

    @property
    def coverage_manifest(self) -> CoverageManifest | None:
        """Lane 0's coverage manifest (every lane warms the same declared coverage)."""
        return self.lanes[0].facts.coverage_manifest

    @property
    def mesh_devices(self) -> tuple[str, ...]:
        return tuple(lane.facts.device_name for lane in self.lanes)

    @property
    def mesh_device(self) -> object:
        """The explicit mesh given at construction (by identity), else the lanes' devices."""
        return self._explicit_mesh if self._explicit_mesh is not None else self.mesh_devices

    @property
    def device(self) -> LaneDevices:
        """Every lane's device in one report (fault counters summed over the lanes)."""
        facts = self.facts
        attempts: dict[str, int] = {}
        for fact in facts:
            for operation, count in fact.fault_attempts:
                attempts[operation] = attempts.get(operation, 0) + count
        return LaneDevices(
            names=tuple(f.device_name for f in facts),
            live_allocations=self.live_allocations,
            attempts=attempts,
            injected_total=sum(f.faults_injected for f in facts),
        )

    @property
    def eager_execution(self) -> tuple[str, ...]:
        return tuple("eager" for _ in self.lanes)

    @property
    def traced_prefill_execution(self) -> tuple[str, ...] | None:
        facts = self.facts
        return tuple("traced" for _ in facts) if all(f.prefill_traced for f in facts) else None

    @property
    def paged_kv_cache_config(self) -> tuple[PagedKVCacheConfig | None, ...]:
        return tuple(f.paged_kv_cache_config for f in self.facts)

    @property
    def cache_path(self) -> object:
        return getattr(self.executors[0], "cache_path", None)

    @property
    def trace_mode(self) -> str:
        return self.lanes[0].facts.trace_mode

    @property
    def block_size(self) -> int | None:
        return self.lanes[0].facts.block_size

    @property
    def num_blocks(self) -> int | None:
        """Physical KV blocks of each lane (block ids in page tables are lane-local)."""
        return self.lanes[0].facts.num_blocks

    @property
    def page_table_layout(self) -> PageTableLayout | None:
        return self.lanes[0].facts.page_table_layout

    @property
    def tokenizer(self) -> object:
        return self.lanes[0].facts.tokenizer

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.lanes[0].facts.eos_token_ids

    @property
    def kv_cache(self) -> list[object] | None:
        return self._kv_handles

    @property
    def live_allocations(self) -> int:
        """Device allocations every lane still holds (the final count after close)."""
        return sum(int(getattr(lane, "live_allocations", 0)) for lane in self.lanes)

    def kv_cache_bytes(self, num_blocks: int) -> int:
        """Bytes paged KV caches of `num_blocks` blocks take on every lane together (each lane
        holds its own pool of `num_blocks`)."""
        per_block = [f.kv_bytes_per_block for f in self.facts]
        if any(b is None for b in per_block):
            raise RuntimeError("a DP lane does not report its KV bytes per block")
        return sum(int(b or 0) for b in per_block) * num_blocks

    def runtime_summary(self) -> dict[str, int | float]:
        """The group's host bookkeeping per decode step."""
        steps = max(self.decode_steps, 1)
        return {
            "lanes": len(self.lanes),
            "decode_steps": self.decode_steps,
            "host_overhead_us_per_step": 1e6 * self.step_host_seconds / steps,
            "transport_us_per_step": 1e6 * self.step_transport_seconds / steps,
            "slowest_lane_us_per_step": 1e6 * self.step_lane_seconds / steps,
        }

    def reset_step_counters(self) -> None:
        """Start a new measurement of the per-step counters."""
        self.decode_steps = 0
        self.step_host_seconds = self.step_transport_seconds = self.step_lane_seconds = 0.0

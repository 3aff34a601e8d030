"""Exclusive physical KV allocation, binding, validation and release.

`PagedKVCacheManager` owns every K/V tensor; the model and every request only borrow them.
Its own machine (`KV_CACHE_TABLE`, below) guards each call: unresolved ->
configured -> bound -> released. Allocation and binding are transactional; release is
retryable and never frees a tensor twice.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from enum import StrEnum
from typing import Protocol, TypeAlias

import attrs
import torch

from lifecycle.errors import attach_cleanup_failures
from lifecycle.journal import Journal
from lifecycle.machine import MachineTable, StateMachine, StateSpec, TransitionSpec
from runtime.backends.base import Device, DeviceTensor
from runtime.config import PagedKVCacheConfig
from runtime.model_contract import AttentionMetadata

logger = logging.getLogger(__name__)


class KVCacheState(StrEnum):
    """`PagedKVCacheManager`: capacity resolved, then allocated and bound, then released."""

    UNRESOLVED = "unresolved"
    CONFIGURED = "configured"
    BOUND = "bound"
    RELEASED = "released"


KV_CACHE_TABLE = MachineTable(
    name="kv-cache",
    states=(
        StateSpec(KVCacheState.UNRESOLVED, "num_blocks not chosen yet", ("configure",)),
        StateSpec(KVCacheState.CONFIGURED, "capacity final; nothing allocated", ("allocate",)),
        StateSpec(KVCacheState.BOUND, "K/V tensors allocated and bound to the model", ()),
        StateSpec(
            KVCacheState.RELEASED,
            "terminal: tensors released",
            (),
            refusal="{owner} is terminal; construct a new paged KV cache manager",
        ),
    ),
    transitions=(
        TransitionSpec("configure", (KVCacheState.UNRESOLVED,), KVCacheState.CONFIGURED),
        TransitionSpec("allocate", (KVCacheState.CONFIGURED,), KVCacheState.BOUND),
        TransitionSpec(
            "release",
            (KVCacheState.UNRESOLVED, KVCacheState.CONFIGURED, KVCacheState.BOUND),
            KVCacheState.RELEASED,
        ),
    ),
    initial=KVCacheState.UNRESOLVED,
    terminal=frozenset({KVCacheState.RELEASED}),
)

CacheShape = tuple[int, int, int, int]

KVCacheHandle: TypeAlias = list[list[DeviceTensor]]
"""The borrowed handle `allocate()` returns and binds: per layer a ``[K, V]`` list."""


class KVCacheModel(Protocol):
    """What the manager asks of a model: its per-layer attention facts and a KV binding.

    `set_kv_cache` receives the manager's handle (or None to unbind); a model checks that the
    tensors are its own kind (a torch model refuses anything but its torch tensors).
    """

    def attention_metadata(self) -> Sequence[AttentionMetadata | None]:
        """One entry per layer (None: the layer has no attention config)."""
        ...

    def set_kv_cache(self, cache: Sequence[Sequence[DeviceTensor]] | None) -> None:
        """Bind the per-layer K/V tensors, or unbind with None."""
        ...


@attrs.frozen
class PagedKVCacheContext:
    """A borrowed, immutable view of the bound cache: what compile and requests check."""

    config: PagedKVCacheConfig
    tensors: tuple[tuple[DeviceTensor, DeviceTensor], ...]
    cache_shapes: tuple[CacheShape, ...]
    per_layer_dtypes: tuple[torch.dtype, ...]

    @property
    def nbytes(self) -> int:
        """Bytes held by every K and V tensor together."""
        return sum(
            2 * math.prod(shape) * _itemsize(dtype)
            for shape, dtype in zip(self.cache_shapes, self.per_layer_dtypes, strict=True)
        )


@attrs.frozen
class _LayerGeometry:
    local_kv_heads: int
    head_dim: int
    dtype: torch.dtype


@attrs.frozen
class _AllocationOutcome:
    handle: KVCacheHandle | None
    error: BaseException | None


class PagedKVCacheManager:
    """Owns the per-layer K/V tensors `[num_blocks, local_kv_heads, block_size, head_dim]`."""

    def __init__(
        self,
        model: KVCacheModel,
        config: PagedKVCacheConfig,
        *,
        device: Device,
        num_devices: int = 1,
        journal: Journal | None = None,
        owner_name: str = "PagedKVCacheManager",
    ) -> None:
        if not isinstance(config, PagedKVCacheConfig):
            raise TypeError(f"config must be a PagedKVCacheConfig, got {type(config).__name__}")
        if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices <= 0:
            raise ValueError(f"num_devices must be a positive integer, got {num_devices!r}")
        self._model = model
        self._device = device
        self._num_devices = num_devices
        self._layers = _read_layer_geometry(model, num_devices)
        _validate_against_model(model, config)
        self._config = config
        self._lifecycle: StateMachine = KV_CACHE_TABLE.build(owner=owner_name, journal=journal)
        self._owned: list[DeviceTensor] = []
        self._handle: KVCacheHandle | None = None
        self._context: PagedKVCacheContext | None = None
        self._model_bound = False
        if config.is_resolved():
            self._lifecycle.fire("configure", detail=f"{config.num_blocks} blocks at construction")

    # -- introspection ----------------------------------------------------------------------

    @property
    def state(self) -> KVCacheState:
        """Where the manager is: unresolved, configured, bound or released."""
        state = self._lifecycle.state
        assert isinstance(state, KVCacheState)
        return state

    @property
    def config(self) -> PagedKVCacheConfig:
        """The current (possibly late-resolved) configuration."""
        return self._config

    @property
    def bound_context(self) -> PagedKVCacheContext | None:
        """The borrowed context while bound, else None."""
        return self._context if self.state is KVCacheState.BOUND else None

    @property
    def num_layers(self) -> int:
        """How many layers the model declares."""
        return len(self._layers)

    @property
    def per_layer_dtypes(self) -> tuple[torch.dtype, ...]:
        """The model-owned KV dtype of each layer."""
        return tuple(layer.dtype for layer in self._layers)

    @property
    def cache_shapes(self) -> tuple[CacheShape, ...]:
        """Per-layer K (and V) shape; empty while capacity is unresolved."""
        num_blocks = self._config.num_blocks
        if num_blocks is None:
            return ()
        block = self._config.block_size
        return tuple((num_blocks, g.local_kv_heads, block, g.head_dim) for g in self._layers)

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds (or would hold once allocated); 0 while unresolved."""
        return sum(
            2 * math.prod(shape) * _itemsize(dtype)
            for shape, dtype in zip(self.cache_shapes, self.per_layer_dtypes, strict=False)
        )

    @property
    def bytes_per_block(self) -> int:
        """Bytes one KV block takes across every layer's K and V (known before resolving)."""
        block = self._config.block_size
        return sum(
            2 * g.local_kv_heads * block * g.head_dim * _itemsize(g.dtype) for g in self._layers
        )

    @property
    def owned_tensor_count(self) -> int:
        """K/V tensors still owned (including leftovers of a failed attempt)."""
        return len(self._owned)

    # -- configuration ------------------------------------------------------------------------

    def configure(self, config: PagedKVCacheConfig) -> None:
        """Resolve physical capacity late: shrink within the ceilings, never grow.

        Legal once, while unresolved. The block size, dtype and memory config cannot change
        and `max_num_blocks` cannot grow; the model's paged-attention metadata must agree.
        """
        self._lifecycle.require(
            "configure",
            frozenset({KVCacheState.UNRESOLVED}),
            reason=_configure_refusal(self.state),
        )
        if not isinstance(config, PagedKVCacheConfig):
            raise TypeError(f"config must be a PagedKVCacheConfig, got {type(config).__name__}")
        if not config.is_resolved():
            raise ValueError(
                "replacement PagedKVCacheConfig must be resolved (num_blocks set), got "
                "num_blocks=None"
            )
        current = self._config
        for field in ("dtype", "memory_config", "block_size"):
            if getattr(config, field) != getattr(current, field):
                raise ValueError(
                    f"PagedKVCacheManager cannot replace {field}: configured "
                    f"{getattr(current, field)!r}, replacement {getattr(config, field)!r}"
                )
        if config.max_num_blocks > current.max_num_blocks:
            raise ValueError(
                f"late capacity cannot grow max_num_blocks beyond the construction ceiling "
                f"{current.max_num_blocks}, got {config.max_num_blocks}"
            )
        _validate_against_model(self._model, config)

        def install() -> str:
            self._config = config
            return f"{config.num_blocks} blocks of {config.block_size} tokens"

        self._lifecycle.transact("configure", install, detail=lambda text: text)

    def validate_vllm_cache_spec(
        self, *, block_size: int, dtype: object, num_blocks: int | None = None
    ) -> None:
        """Check a server's physical cache spec against this manager before adopting it."""
        if block_size != self._config.block_size:
            raise ValueError(
                f"vLLM block_size {block_size!r} does not match the configured paged KV "
                f"block_size {self._config.block_size}"
            )
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"vLLM cache dtype must be a torch.dtype, got {dtype!r}")
        mismatched = [i for i, layer in enumerate(self._layers) if layer.dtype != dtype]
        if mismatched:
            raise ValueError(
                f"vLLM cache dtype {dtype} is incompatible with the model-owned KV dtype of "
                f"layer(s) {mismatched} ({self._layers[mismatched[0]].dtype})"
            )
        if num_blocks is not None:
            if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
                raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
            if num_blocks > self._config.max_num_blocks:
                raise ValueError(
                    f"vLLM num_blocks {num_blocks} exceeds configured maximum "
                    f"{self._config.max_num_blocks}"
                )

    # -- allocation ----------------------------------------------------------------------------

    def allocate(self) -> KVCacheHandle:
        """Allocate every K/V tensor, bind through `model.set_kv_cache`, return the handle.

        The handle is borrowed: requests must present exactly this object. A partial failure
        releases what was created (reverse order); what could not be released stays owned
        and is retried by the next `allocate()` or `release()`.
        """
        self._lifecycle.require(
            "allocate",
            frozenset({KVCacheState.CONFIGURED}),
            reason=_allocate_refusal(self.state),
        )
        outcome = self._lifecycle.transact(
            "allocate", self._allocate_and_bind, detail=self._allocation_detail
        )
        if outcome.error is not None:
            raise outcome.error
        assert outcome.handle is not None
        return outcome.handle

    def _allocation_detail(self, outcome: _AllocationOutcome) -> str:
        if outcome.error is not None:
            return f"bind failed and unbind failed; release() retries: {outcome.error}"
        shapes = self.cache_shapes
        return f"{2 * len(shapes)} tensors, {self.nbytes} bytes, {self._config.num_blocks} blocks"

    def _allocate_and_bind(self) -> _AllocationOutcome:
        self._retry_leftovers()
        created: list[DeviceTensor] = []
        try:
            for shape, geometry in zip(self.cache_shapes, self._layers, strict=True):
                created.append(self._device.allocate(shape, geometry.dtype))
                created.append(self._device.allocate(shape, geometry.dtype))
        except BaseException as error:
            self._release_partial(created, error)
            raise
        pairs = tuple((created[i], created[i + 1]) for i in range(0, len(created), 2))
        handle: KVCacheHandle = [[k, v] for k, v in pairs]
        try:
            self._model.set_kv_cache(handle)
        except BaseException as error:
            try:
                self._model.set_kv_cache(None)
            except BaseException as unbind_error:
                # The model may still reference the tensors: keep them, stay bound.
                attach_cleanup_failures(error, [unbind_error])
                self._owned = created
                self._model_bound = True
                self._handle = None
                self._context = None
                return _AllocationOutcome(handle=None, error=error)
            self._release_partial(created, error)
            raise
        self._owned = created
        self._handle = handle
        self._model_bound = True
        self._context = PagedKVCacheContext(
            config=self._config,
            tensors=pairs,
            cache_shapes=self.cache_shapes,
            per_layer_dtypes=self.per_layer_dtypes,
        )
        logger.info(
            "paged KV cache bound: %s",
            self._allocation_detail(_AllocationOutcome(handle=handle, error=None)),
        )
        return _AllocationOutcome(handle=handle, error=None)

    def _release_partial(self, created: list[DeviceTensor], primary: BaseException) -> None:
        failures: list[BaseException] = []
        for tensor in reversed(created):
            try:
                self._device.deallocate(tensor)
            except BaseException as failure:
                failures.append(failure)
                self._owned.append(tensor)
        attach_cleanup_failures(primary, failures)

    def _retry_leftovers(self) -> None:
        if not self._owned:
            return
        failures = self._deallocate_owned()
        if failures:
            error = RuntimeError(
                f"Failed to deallocate {len(failures)} paged KV cache tensor(s) left by an "
                "earlier failed allocation; release() retries them (the owning executor's "
                "close() calls it)"
            )
            attach_cleanup_failures(error, failures)
            raise error

    def _deallocate_owned(self) -> list[BaseException]:
        failures: list[BaseException] = []
        remaining: list[DeviceTensor] = []
        for tensor in self._owned:
            try:
                self._device.deallocate(tensor)
            except BaseException as failure:
                failures.append(failure)
                remaining.append(tensor)
        self._owned = remaining
        return failures

    # -- borrowing ------------------------------------------------------------------------------

    def validate_borrowed_handle(self, cache: object) -> PagedKVCacheContext:
        """Accept only the exact handle `allocate()` returned, with unchanged tensors."""
        context = self.bound_context
        if context is None or self._handle is None:
            raise RuntimeError(
                "Paged KV cache must be allocated and bound before execution; call "
                f"allocate() (manager is {self.state.value})"
            )
        if cache is not self._handle:
            raise ValueError(
                "kv_cache must be the exact manager-owned borrowed handle returned by "
                "allocate(); pass that object (or None) instead of a copy"
            )
        presented = [tensor for pair in self._handle for tensor in pair]
        expected = [tensor for pair in context.tensors for tensor in pair]
        if len(presented) != len(expected) or any(
            a is not b for a, b in zip(presented, expected, strict=False)
        ):
            raise ValueError(
                "kv_cache must contain the exact manager-owned K/V tensors; an entry of the "
                "handle was replaced"
            )
        return context

    # -- release --------------------------------------------------------------------------------

    def release(self) -> None:
        """Unbind, then deallocate every owned tensor exactly once. Idempotent, retryable."""
        if self.state is KVCacheState.RELEASED:
            return
        self._lifecycle.transact("release", self._release_all, detail=lambda text: text)

    def _release_all(self) -> str:
        count = len(self._owned)
        if self._model_bound:
            self._model.set_kv_cache(None)
            self._model_bound = False
            self._handle = None
        failures = self._deallocate_owned()
        if failures:
            error = RuntimeError(
                f"Failed to deallocate {len(failures)} paged KV cache tensor(s); call "
                "release() again to retry the remainder"
            )
            error.__cause__ = failures[0]
            attach_cleanup_failures(error, failures)
            raise error
        self._context = None
        return f"{count} tensors released"


def _configure_refusal(state: KVCacheState) -> str | None:
    if state is KVCacheState.CONFIGURED:
        return "paged KV capacity can be resolved only once"
    if state is KVCacheState.BOUND:
        return "the paged KV cache is already allocated; configure before allocate()"
    return None


def _allocate_refusal(state: KVCacheState) -> str | None:
    if state is KVCacheState.UNRESOLVED:
        return "paged KV capacity must be resolved before allocation; call configure()"
    if state is KVCacheState.BOUND:
        return "the paged KV cache has already been allocated"
    return None


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _read_layer_geometry(model: KVCacheModel, num_devices: int) -> tuple[_LayerGeometry, ...]:
    metadata_fn = getattr(model, "attention_metadata", None)
    if not callable(metadata_fn):
        raise TypeError(
            f"model {type(model).__name__} must provide attention_metadata() (see "
            "runtime.model_contract.PagedModel)"
        )
    metadata: Sequence[AttentionMetadata | None] = tuple(metadata_fn())
    declared = getattr(model, "n_layers", len(metadata))
    if declared != len(metadata):
        raise ValueError(
            f"model declares n_layers={declared} but attention_metadata() describes "
            f"{len(metadata)} layer(s)"
        )
    if not metadata:
        raise ValueError("model has no layers; attention_metadata() returned nothing")
    layers: list[_LayerGeometry] = []
    for index, layer in enumerate(metadata):
        if layer is None:
            raise ValueError(f"Model layer {index} has no attention config")
        if layer.n_local_kv_heads is not None:
            local = layer.n_local_kv_heads
        else:
            if layer.n_kv_heads <= 0 or layer.n_kv_heads % num_devices:
                raise ValueError(
                    f"layer {index}: n_kv_heads ({layer.n_kv_heads}) must be positive and "
                    f"divisible by num_devices ({num_devices})"
                )
            local = layer.n_kv_heads // num_devices
        if isinstance(local, bool) or not isinstance(local, int) or local <= 0:
            raise ValueError(f"layer {index}: local KV heads must be positive, got {local!r}")
        if isinstance(layer.head_dim, bool) or layer.head_dim <= 0:
            raise ValueError(f"layer {index}: head_dim must be positive, got {layer.head_dim!r}")
        if not isinstance(layer.kv_cache_dtype, torch.dtype):
            raise TypeError(
                f"layer {index}: kv_cache_dtype must be a torch.dtype, got {layer.kv_cache_dtype!r}"
            )
        layers.append(_LayerGeometry(local, layer.head_dim, layer.kv_cache_dtype))
    return tuple(layers)


def _validate_against_model(model: KVCacheModel, config: PagedKVCacheConfig) -> None:
    metadata = tuple(model.attention_metadata())
    for index, layer in enumerate(metadata):
        if layer is None:
            raise ValueError(f"Model layer {index} has no attention config")
        paged = layer.paged_attention_config
        if paged is None:
            raise ValueError(f"Model layer {index} is not configured for paged attention")
        if paged.block_size != config.block_size:
            raise ValueError(
                f"Model layer {index} paged block_size {paged.block_size} does not match "
                f"PagedKVCacheConfig.block_size {config.block_size}"
            )
        if paged.max_num_blocks != config.max_num_blocks:
            raise ValueError(
                f"Model layer {index} paged max_num_blocks {paged.max_num_blocks} does not "
                f"match PagedKVCacheConfig.max_num_blocks {config.max_num_blocks}"
            )
    dtypes = {layer.kv_cache_dtype for layer in metadata if layer is not None}
    if len(dtypes) == 1 and config.dtype not in dtypes:
        raise ValueError(
            f"PagedKVCacheConfig.dtype {config.dtype} does not match the model-owned dtype "
            f"{next(iter(dtypes))}"
        )

"""`BoundCache`: the per-layer K/V caches bound to a model, with their block size.

Its own module so that code which builds a scratch cache (warmup's fused-stack timing) does
not import the model.
"""

from __future__ import annotations

from typing import NamedTuple

from models.decoder.attention import LayerCache


class BoundCache(NamedTuple):
    """The bound per-layer caches and their block size: what every forward call reads."""

    layers: tuple[LayerCache, ...]
    block_size: int

    @property
    def num_blocks(self) -> int:
        return int(self.layers[0][0].shape[0])

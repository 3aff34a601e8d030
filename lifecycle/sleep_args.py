"""The arguments of `sleep()` and `wake()`, checked where they enter a host.

Why a module of its own: a host and a lane group both take these arguments, and a bad one
must be refused the same way, naming the argument, the value and what is allowed, before any
phase change or device work.
"""

from __future__ import annotations

from collections.abc import Sequence

SLEEP_LEVELS = (1, 2)
"""1: weights and buffers copied to host memory; 2: weights dropped (reload them after)."""
WAKE_TAGS = ("weights", "kv_cache")
"""The stages `wake(tags=...)` brings back, in the order they must wake."""


def check_sleep_level(level: object) -> int:
    """`level` as 1 or 2; ValueError naming the argument otherwise (bool is not a level)."""
    if isinstance(level, bool) or not isinstance(level, int) or level not in SLEEP_LEVELS:
        raise ValueError(
            f"level must be 1 (weights kept in host memory) or 2 (weights dropped; reload "
            f"them with reload_weights()), got {level!r}"
        )
    return level


def check_wake_tags(tags: object) -> tuple[str, ...]:
    """`tags` as a tuple in wake order; None means every stage."""
    if tags is None:
        return WAKE_TAGS
    if isinstance(tags, str) or not isinstance(tags, Sequence):
        raise TypeError(
            f"tags must be a sequence of stage names from {WAKE_TAGS} (e.g. ('weights',)) or "
            f"None for every stage, got {tags!r}"
        )
    unknown = [tag for tag in tags if tag not in WAKE_TAGS]
    if unknown or not tags:
        raise ValueError(f"tags must name at least one stage from {WAKE_TAGS}, got {tuple(tags)!r}")
    return tuple(tag for tag in WAKE_TAGS if tag in tags)

"""Prefill's variant of the shared bool check (its messages read "X must be bool").

`runtime.validation.require_bool` says "X must be a bool (True or False)"; the prefill
configuration and planner have always said "X must be bool", and callers match that text.
One definition here instead of a private copy per prefill module.
"""

from __future__ import annotations


def require_plain_bool(name: str, value: object) -> bool:
    """`value` if it is True or False, or TypeError naming `name` (1 and "yes" are refused)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be bool, got {type(value).__name__} {value!r}")
    return value

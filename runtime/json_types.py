"""JSON-shaped values, named once: what manifests, journals and summaries hold.

`JSONValue` is read-only (`Mapping`, `Sequence`), so a producer may return any nested
dict or list of JSON values without copying it into one exact container type; `json.dumps`
accepts every `JSONValue`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeAlias

JSONValue: TypeAlias = (
    bool | int | float | str | Sequence["JSONValue"] | Mapping[str, "JSONValue"] | None
)
"""A value `json.dumps` writes: scalars, lists and string-keyed objects of JSON values."""

JSONObject: TypeAlias = Mapping[str, JSONValue]
"""A JSON object (string keys, JSON values)."""

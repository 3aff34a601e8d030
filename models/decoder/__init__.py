"""The shared decoder every dense (and, through its layer hook, routed-expert) family runs on.

A pre-norm rotary decoder in torch with paged attention over a caller-owned KV cache:
config reading (`config`), weights from safetensors, GGUF or seeded random tensors
(`weights`, `gguf_weights`), the tokenizer, the tensor model with its kernel plan and fused
decode stack (`model`), the executor facade (`executor`) and name resolution (`sources`).
Families (`models.llama`, `models.qwen3`) bring a config class and register in
`models.families`; nothing here names a family.

Names are exported lazily: importing this package imports no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "RopeScaling": "models.decoder.config",
    "DecoderArgs": "models.decoder.config",
    "GGUFFile": "models.decoder.gguf_weights",
    "load_gguf": "models.decoder.gguf_weights",
    "DecoderModel": "models.decoder.model",
    "allocate_kv_cache": "models.decoder.reference",
    "greedy_generate": "models.decoder.reference",
    "SMOLLM2_INSTALL": "models.decoder.sources",
    "SMOLLM2_NAME": "models.decoder.sources",
    "LoadedModel": "models.decoder.sources",
    "ModelNotAvailableError": "models.decoder.sources",
    "ModelSource": "models.decoder.sources",
    "load_model": "models.decoder.sources",
    "resolve_source": "models.decoder.sources",
    "smollm2_gguf_path": "models.decoder.sources",
    "DecoderTokenizer": "models.decoder.tokenizer",
    "WeightsError": "models.decoder.weights",
    "expected_shapes": "models.decoder.weights",
    "load_safetensors": "models.decoder.weights",
    "random_state_dict": "models.decoder.weights",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'models.decoder' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = sorted(_EXPORTS)

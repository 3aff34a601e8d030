"""The reference model family: Llama-architecture decoders (Llama, SmolLM) in torch."""

from __future__ import annotations

from models.llama.config import TINY_PRESETS, LlamaArgs, RopeScaling
from models.llama.gguf_weights import GGUFFile, load_gguf
from models.llama.model import LlamaModel
from models.llama.reference import allocate_kv_cache, greedy_generate
from models.llama.sources import (
    SMOLLM2_INSTALL,
    SMOLLM2_NAME,
    LoadedModel,
    ModelNotAvailableError,
    ModelSource,
    load_model,
    resolve_source,
    smollm2_gguf_path,
)
from models.llama.tokenizer import LlamaTokenizer
from models.llama.weights import (
    WeightsError,
    expected_shapes,
    load_safetensors,
    random_state_dict,
)

__all__ = [
    "SMOLLM2_INSTALL",
    "SMOLLM2_NAME",
    "TINY_PRESETS",
    "GGUFFile",
    "LlamaArgs",
    "LlamaModel",
    "LlamaTokenizer",
    "LoadedModel",
    "ModelNotAvailableError",
    "ModelSource",
    "RopeScaling",
    "WeightsError",
    "allocate_kv_cache",
    "expected_shapes",
    "greedy_generate",
    "load_gguf",
    "load_model",
    "load_safetensors",
    "random_state_dict",
    "resolve_source",
    "smollm2_gguf_path",
]

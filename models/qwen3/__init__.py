"""The Qwen3 family (dense): the shared decoder with per-head q/k RMSNorm before rotary.

Only what is Qwen3's lives here: the config class recognising its checkpoints (HF
`model_type` `qwen3` / `Qwen3ForCausalLM`, GGUF `qwen3`), its tiny presets and its
registration (`family.FAMILY`): tensor model, loaders, executor, lanes and the vLLM facade
are shared.
"""

from __future__ import annotations

from models.qwen3.config import TINY_PRESETS, Qwen3Args

__all__ = ["TINY_PRESETS", "Qwen3Args"]

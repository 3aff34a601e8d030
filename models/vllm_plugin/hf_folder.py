"""Write any model this runtime loads (tiny-random, a GGUF) as a Hugging Face folder.

vLLM opens models as Hugging Face folders (config, safetensors, tokenizer). This writes one
with this project's own loader, so vLLM, its own CPU runner and `llm-runtime generate` all
read the same weights. No vLLM import: the main test suite checks the round trip.

A folder written from a GGUF also names that GGUF in its config (`WEIGHTS_SOURCE_KEY`): the
platform plugin then loads the GGUF itself, block weights kept (`--weights stored`), so
`vllm serve` through the plugin computes exactly what `llm-runtime generate` does, while
vLLM's own runner (plugin off) reads the dequantized safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from models.decoder.sources import load_weights
from models.vllm_facade.engine_args import WEIGHTS_SOURCE_KEY
from runtime.quant.matrix import QuantizedMatrix

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def write_hf_folder(
    model: str | Path, destination: str | Path, *, dtype: torch.dtype = torch.float32, seed: int = 0
) -> Path:
    """Write `model` (a name or path `llm-runtime` accepts) into `destination`; return it."""
    from safetensors.torch import save_file

    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {list(DTYPE_NAMES.values())}, got {dtype}")
    # A safetensors folder holds plain tensors: every block weight is dequantized.
    weights = load_weights(model, dtype=dtype, seed=seed, weights="float32")
    if weights.source.kind == "hf_dir":
        raise ValueError(f"model {str(model)!r} is already a Hugging Face folder; use it directly")
    root = Path(destination)
    root.mkdir(parents=True, exist_ok=True)
    config = {**weights.args.to_hf_config(), "torch_dtype": DTYPE_NAMES[dtype]}
    if weights.source.kind == "gguf":
        given = str(model)
        config[WEIGHTS_SOURCE_KEY] = (
            given
            if weights.source.path is None or not given.endswith(".gguf")
            else str(Path(given).resolve())
        )
    (root / "config.json").write_text(json.dumps(config, indent=2))
    state = {
        name: (value.dequantize() if isinstance(value, QuantizedMatrix) else value)
        .to(dtype)
        .contiguous()
        for name, value in weights.state.items()
    }
    save_file(state, str(root / "model.safetensors"), metadata={"format": "pt"})
    generation: dict[str, Any] = {}
    if weights.args.bos_token_id is not None:
        generation["bos_token_id"] = weights.args.bos_token_id
    if weights.args.eos_token_ids:
        generation["eos_token_id"] = list(weights.args.eos_token_ids)
    (root / "generation_config.json").write_text(json.dumps(generation, indent=2))
    tokenizer = weights.tokenizer
    if tokenizer is not None:
        tokenizer.backend.save(str(root / "tokenizer.json"))
        backend = tokenizer.backend

        def token(token_id: int | None) -> str | None:
            return None if token_id is None else backend.id_to_token(token_id)

        tok_config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": weights.args.max_seq_len,
            "bos_token": token(tokenizer.bos_token_id),
            "eos_token": token(tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None),
            "pad_token": token(tokenizer.pad_token_id),
            "add_bos_token": False,
            "clean_up_tokenization_spaces": False,
        }
        if tokenizer.chat_template:
            tok_config["chat_template"] = tokenizer.chat_template
        clean = {k: v for k, v in tok_config.items() if v is not None}
        (root / "tokenizer_config.json").write_text(json.dumps(clean, indent=2))
    return root


def main(argv: list[str] | None = None) -> int:
    """`python -m models.vllm_plugin.hf_folder MODEL DEST [--dtype bfloat16]`."""
    import argparse

    parser = argparse.ArgumentParser(description="Write a model as a Hugging Face folder.")
    parser.add_argument("model", help="smollm2-135m, tiny-random[-preset] or a .gguf file")
    parser.add_argument("destination", type=Path)
    parser.add_argument("--dtype", choices=sorted(DTYPE_NAMES.values()), default="float32")
    args = parser.parse_args(argv)
    dtype = {name: dtype for dtype, name in DTYPE_NAMES.items()}[args.dtype]
    print(write_hf_folder(args.model, args.destination, dtype=dtype))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Decode tok/s of a registered family's random-weight model: ours vs transformers, one run.

Used by `model_vs_transformers.py --family NAME`. The model is described by a HF config
(`BENCH_CONFIGS`, sized like the issue asks); random weights (`random_state_dict`) are saved
once as a safetensors folder, and both sides load that folder: ours through the registry
(no family named in code), transformers through `AutoModelForCausalLM.from_pretrained`
(which applies its own checkpoint conversions, e.g. stacking Qwen3-MoE experts). Our model
runs its warmup choices first (`choose_kernels`: projection forms and, for Qwen3-MoE, the
expert path per row bucket), as the runtime does before serving. Decode steps are timed
with the caches pre-filled with random K/V at `context` (see `model_vs_transformers`).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from models.decoder import load_model, random_state_dict
from models.families import family_for_hf_config

# About 1.0B parameters in all, 0.21B active per token (8 of 64 experts per layer), fp32:
# 8 layers, hidden 1024, 8 query heads x 128, 4 KV heads, experts of 576, vocab 32768
# (untied). `parameter_count()` / `active_parameter_count()` print the exact figures.
BENCH_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 1024,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 3072,
        "moe_intermediate_size": 576,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 32768,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "hidden_act": "silu",
        "attention_bias": False,
    }
}
BATCHES = (1, 16)
CONTEXT = 128
PREFILL_BUCKET = 64


def write_random_folder(config: dict[str, Any], folder: Path) -> Any:
    """A HF folder (`config.json`, `model.safetensors`) with seeded random weights."""
    from safetensors.torch import save_file

    args = family_for_hf_config(config).config_class.from_hf_config(config)
    state = random_state_dict(args, seed=0)
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return args


def _load_transformers(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="sdpa"
    )
    return hf.eval()


def run(
    family: str,
    interleaved: Callable[..., dict[str, dict[str, float]]],
    our_decode: Callable[..., Any],
    their_decode: Callable[..., Any],
    reps: int,
) -> dict[str, Any]:
    """Time batch 1 and 16 decode for `family`; prints one line per batch, returns the rows."""
    if family not in BENCH_CONFIGS:
        raise SystemExit(
            f"--family {family!r} has no benchmark config: allowed are {sorted(BENCH_CONFIGS)}"
        )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"bench-{family}-") as tmp:
        folder = Path(tmp)
        args = write_random_folder(BENCH_CONFIGS[family], folder)
        loaded = load_model(folder, dtype=torch.float32, with_tokenizer=False)
        hf = _load_transformers(folder)
    total = args.parameter_count()
    active = getattr(args, "active_parameter_count", args.parameter_count)()
    print(
        f"{family}: {total / 1e9:.3f}B parameters, {active / 1e9:.3f}B active per token "
        f"(fp32); loaded in {time.perf_counter() - started:.0f} s",
        flush=True,
    )
    model = loaded.model
    plan = model.choose_kernels(decode_rows=max(BATCHES), prefill_rows=PREFILL_BUCKET)
    notes = [str(n) for n in plan.get("notes", []) if isinstance(n, str)]
    results: dict[str, Any] = {
        "family": family,
        "config": BENCH_CONFIGS[family],
        "parameters": total,
        "active_parameters": active,
        "threads": torch.get_num_threads(),
        "load_average_before": os.getloadavg(),
        "kernel_plan_notes": notes,
        "decode": [],
    }
    for note in notes:
        print(f"  plan note: {note}")
    for batch in BATCHES:
        ours = our_decode(model, batch, CONTEXT)
        theirs = their_decode(hf, args, batch, CONTEXT)
        timed = interleaved(
            ours.step, theirs.step, warmup=2, reps=reps if batch == 1 else max(3, reps // 2)
        )
        model.set_kv_cache(None)
        row: dict[str, Any] = {"batch": batch, "context": CONTEXT, **timed}
        for side in ("ours", "transformers"):
            row[side]["tokens_per_s_median"] = batch / row[side]["median_s"]
        row["speedup_median"] = row["transformers"]["median_s"] / row["ours"]["median_s"]
        results["decode"].append(row)
        print(
            f"decode b={batch:>2} ctx={CONTEXT}: ours {row['ours']['tokens_per_s_median']:7.1f} "
            f"tok/s ({row['ours']['median_s'] * 1e3:.1f} ms/step) | transformers "
            f"{row['transformers']['tokens_per_s_median']:7.1f} tok/s "
            f"({row['transformers']['median_s'] * 1e3:.1f} ms/step) | "
            f"x{row['speedup_median']:.2f}",
            flush=True,
        )
    results["load_average_after"] = os.getloadavg()
    results["wall_s"] = time.perf_counter() - started
    print(
        f"threads {torch.get_num_threads()}; load average before "
        f"{results['load_average_before'][0]:.2f}, after {os.getloadavg()[0]:.2f} (another "
        "busy process on these cores stalls multi-threaded matmuls: compare runs at low load)"
    )
    return results

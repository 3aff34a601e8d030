"""SmolLM2-135M in float32 on CPU: our paged model vs transformers, same weights, same process.

Run: `python benchmarks/model_vs_transformers.py [--quick] [--json PATH]`.

`--family NAME` (e.g. `qwen3_moe`) instead builds that family's random-weight benchmark model
(`family_decode.BENCH_CONFIGS`: Qwen3-MoE of about 1B total / 0.2B active parameters) and
measures batch 1 and batch 16 decode tok/s, ours and transformers, on the same weights.

Measures decode-step latency (batch 1 and 32 at contexts 128 and 512), prefill throughput
(128 and 512 tokens) and batch-1 decode as a fraction of the memory-bandwidth limit
(weight bytes read per step / copy bandwidth of a large torch tensor copy).

Method: both models hold identical float32 weights (transformers' `LlamaForCausalLM` is
loaded from our canonical state dict). Caches are pre-filled with random K/V (decode cost does
not depend on the values) so long contexts need no slow prefill. Each decode step writes
position `context` and attends to `context + 1` keys; transformers' cache is cropped back
after every step so every sample sees the same context. Ours and transformers' samples are
interleaved so background load hits both alike; we report the median and the minimum.
Transformers' prefill is asked for the last position's logits only (`logits_to_keep=1`),
as ours computes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from models.decoder import DecoderModel, allocate_kv_cache, load_model


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(
    ours: Callable[[], Any], theirs: Callable[[], Any], *, warmup: int, reps: int
) -> dict[str, dict[str, float]]:
    for _ in range(warmup):
        ours()
        theirs()
    a: list[float] = []
    b: list[float] = []
    for _ in range(reps):
        a.append(_timed(ours))
        b.append(_timed(theirs))
    return {
        "ours": {"median_s": statistics.median(a), "min_s": min(a)},
        "transformers": {"median_s": statistics.median(b), "min_s": min(b)},
    }


def copy_bandwidth(megabytes: int = 512, reps: int = 8) -> float:
    """Bytes moved (read + write) per second by a large contiguous tensor copy (best of reps)."""
    src = torch.rand(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(reps))
    return 2 * src.numel() * 4 / best


def weight_bytes_per_decode_step(model: DecoderModel) -> int:
    """Every matrix is read once per step; the embedding lookup reads one row (tied head: the
    head reads the whole matrix, counted once)."""
    seen: dict[int, int] = {}
    for param in model.parameters():
        seen[param.data_ptr()] = param.numel() * param.element_size()
    total = sum(seen.values())
    if not model.args.tie_word_embeddings:
        embed = model.embed_tokens.weight
        total -= embed.numel() * embed.element_size()
    return total


def build_transformers(loaded: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**loaded.args.to_hf_config())
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval()
    model.load_state_dict(loaded.model.canonical_state_dict(), strict=False)
    if loaded.args.tie_word_embeddings:
        model.tie_weights()
    return model


class OurDecode:
    """Batch `b` rows at context `c`: cache pre-filled with random values."""

    def __init__(self, model: DecoderModel, batch: int, context: int, block_size: int = 16):
        blocks_per_row = (context + 1 + block_size - 1) // block_size
        total = batch * blocks_per_row
        model.set_kv_cache(None)
        model.configure_paged_attention(block_size=block_size, max_num_blocks=total)
        self.cache = allocate_kv_cache(model, total)
        for k, v in self.cache:
            k.normal_()
            v.normal_()
        model.set_kv_cache(self.cache)
        self.model = model
        self.table = torch.arange(total, dtype=torch.int32).view(batch, blocks_per_row)
        self.tokens = torch.randint(0, model.vocab_size, (batch,))
        self.positions = torch.full((batch,), context, dtype=torch.long)

    def step(self) -> torch.Tensor:
        return self.model.decode(self.tokens, positions=self.positions, page_table=self.table)


class TheirDecode:
    def __init__(self, hf: Any, args: Any, batch: int, context: int):
        from transformers import DynamicCache

        self.hf = hf
        self.cache = DynamicCache()
        shape = (batch, args.n_kv_heads, context, args.head_dim)
        for layer in range(args.n_layers):
            self.cache.update(torch.randn(shape), torch.randn(shape), layer)
        self.tokens = torch.randint(0, args.vocab_size, (batch, 1))
        self.position = torch.full((batch, 1), context, dtype=torch.long)

    @torch.inference_mode()
    def step(self) -> torch.Tensor:
        out = self.hf(
            input_ids=self.tokens,
            position_ids=self.position,
            past_key_values=self.cache,
            use_cache=True,
        )
        self.cache.crop(-1)
        return out.logits


def bench_decode(loaded: Any, hf: Any, batch: int, context: int, reps: int) -> dict[str, Any]:
    ours = OurDecode(loaded.model, batch, context)
    theirs = TheirDecode(hf, loaded.args, batch, context)
    result = interleaved(ours.step, theirs.step, warmup=2, reps=reps)
    loaded.model.set_kv_cache(None)
    return {"batch": batch, "context": context, **result}


def bench_prefill(loaded: Any, hf: Any, length: int, reps: int) -> dict[str, Any]:
    model = loaded.model
    blocks = (length + 15) // 16
    model.set_kv_cache(None)
    model.configure_paged_attention(block_size=16, max_num_blocks=blocks)
    model.set_kv_cache(allocate_kv_cache(model, blocks))
    tokens = torch.randint(0, model.vocab_size, (1, length))
    table = torch.arange(blocks, dtype=torch.int32).unsqueeze(0)

    def ours() -> torch.Tensor:
        return model.prefill(
            tokens,
            page_table=table,
            prompt_lens=torch.tensor([length]),
            chunk_start=torch.tensor([0]),
        )

    @torch.inference_mode()
    def theirs() -> Any:
        return hf(input_ids=tokens, use_cache=True, logits_to_keep=1).logits

    result = interleaved(ours, theirs, warmup=1, reps=reps)
    model.set_kv_cache(None)
    for side in result.values():
        side["tokens_per_s_median"] = length / side["median_s"]
    return {"tokens": length, **result}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument(
        "--family", help="a registered family's random benchmark model (e.g. qwen3_moe)"
    )
    options = parser.parse_args(argv)
    if options.threads:
        torch.set_num_threads(options.threads)
    reps = 5 if options.quick else 15
    if options.family:
        from benchmarks.family_decode import run

        family_results = run(options.family, interleaved, OurDecode, TheirDecode, reps)
        if options.json:
            options.json.write_text(json.dumps(family_results, indent=2))
        return 0
    started = time.perf_counter()
    loaded = load_model("smollm2-135m", dtype=torch.float32, with_tokenizer=False)
    hf = build_transformers(loaded)
    bandwidth = copy_bandwidth()
    weight_bytes = weight_bytes_per_decode_step(loaded.model)
    results: dict[str, Any] = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_average_before": os.getloadavg(),
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "weight_bytes_per_step": weight_bytes,
        "decode": [],
        "prefill": [],
    }
    for batch, context in ((1, 128), (1, 512), (32, 128), (32, 512)):
        row = bench_decode(loaded, hf, batch, context, reps if batch == 1 else max(3, reps // 3))
        results["decode"].append(row)
        print(
            f"decode b={batch:>2} ctx={context}: ours {row['ours']['median_s'] * 1e3:7.1f} ms"
            f" (min {row['ours']['min_s'] * 1e3:.1f}) | transformers "
            f"{row['transformers']['median_s'] * 1e3:7.1f} ms "
            f"(min {row['transformers']['min_s'] * 1e3:.1f})",
            flush=True,
        )
    for length in (128, 512):
        row = bench_prefill(loaded, hf, length, max(3, reps // 3))
        results["prefill"].append(row)
        print(
            f"prefill {length} tokens: ours {row['ours']['tokens_per_s_median']:7.0f} tok/s | "
            f"transformers {row['transformers']['tokens_per_s_median']:7.0f} tok/s",
            flush=True,
        )
    bound = weight_bytes / bandwidth
    for row in results["decode"]:
        if row["batch"] == 1:
            for side in ("ours", "transformers"):
                row[side]["fraction_of_bandwidth_limit_median"] = bound / row[side]["median_s"]
                row[side]["fraction_of_bandwidth_limit_best"] = bound / row[side]["min_s"]
    results["bandwidth_bound_step_s"] = bound
    results["load_average_after"] = os.getloadavg()
    results["wall_s"] = time.perf_counter() - started
    print(
        f"copy bandwidth {bandwidth / 1e9:.1f} GB/s; weights {weight_bytes / 2**20:.0f} MiB "
        f"per step -> bound {bound * 1e3:.1f} ms/step"
    )
    for row in results["decode"]:
        if row["batch"] == 1:
            ours, theirs = row["ours"], row["transformers"]
            print(
                f"batch-1 ctx {row['context']}: ours at "
                f"{ours['fraction_of_bandwidth_limit_median']:.0%} (best "
                f"{ours['fraction_of_bandwidth_limit_best']:.0%}) of the bandwidth limit, "
                f"transformers {theirs['fraction_of_bandwidth_limit_median']:.0%}"
            )
    print(f"wall {results['wall_s']:.0f} s")
    if options.json:
        options.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

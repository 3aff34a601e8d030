"""The same prompts through vLLM's own CPU runner, vLLM on this runtime, and this runtime alone.

Run (in the vLLM environment, `make vllm`; the machine is shared, so hold the bench lock):

    flock /tmp/bench.lock .venv-vllm/bin/python benchmarks/vllm_compare.py [--json OUT]

Engines, all on SmolLM2-135M float32 weights written as one Hugging Face folder by this
project's loader (so every engine reads the same tensors):

* `vllm-cpu`: `vllm.LLM` with vLLM's own CPU platform and model runner (`enforce_eager`);
* `vllm+llm-runtime`: `vllm.LLM` with this project's platform plugin (vLLM schedules, this
  runtime executes: lifecycle, paged KV cache, planner, warmup);
* `llm-runtime`: this runtime's `Generator`, the engine behind `llm-runtime generate`
  (through `benchmarks/bench_generate.py`'s runner, so EOS can be ignored);
* `vllm+llm-runtime-sync` (only when named in `--engines`): the plugin with vLLM's
  `--no-async-scheduling`, to see what async scheduling gains.

For the plugin engines the report also keeps the worker's counters (`runtime_stats`: seconds
inside the facade's prefill and decode calls, rows sampled where), which split a step's time
into the runtime's share and vLLM's (scheduler, sampler, output handling).

Threads: vLLM's CPU platform pins its worker process to the cores it does not reserve for
the scheduler process (on a 2-core machine: one core, one torch thread), for both vLLM
engines alike; `--vllm-reserved-cpus 0` (vLLM's `VLLM_CPU_NUM_OF_RESERVED_CPU`) gives the
worker every core. The table's `threads` column is each engine's torch thread count where
its model runs (asked of the vLLM worker process).

Method: random token prompts of mixed lengths (fixed seed), batch 1 and batch 32, greedy,
exactly `--new-tokens` tokens per row (EOS ignored), prefix caching off, `max_num_seqs` equal
to the batch. Each vLLM engine runs in its own fresh process (vLLM spawns its engine core).
Every configuration is warmed up once, then timed `--repeats` times for 1 and for N new
tokens; the best of each is kept. End-to-end tokens/s = batch * N / seconds(N); decode
tokens/s = batch * (N - 1) / (seconds(N) - seconds(1)): the same difference for all three
engines, so no engine's internal counters are needed. Tokens are compared across engines.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":  # direct runs: make the checkout importable
    sys.path.insert(0, str(ROOT))

MODEL = "smollm2-135m"
MAX_NUM_BATCHED_TOKENS = 2048
VLLM_CPU_KV_BYTES = 1 << 30
ENGINES = ("vllm-cpu", "vllm+llm-runtime", "llm-runtime", "vllm+llm-runtime-sync")
DEFAULT_ENGINES = ENGINES[:3]
VLLM_ENGINES = ("vllm-cpu", "vllm+llm-runtime", "vllm+llm-runtime-sync")


def _reserved_cpus(text: str) -> int:
    """`--vllm-reserved-cpus`: 0 up to one less than the cores this process may use."""
    cores = len(os.sched_getaffinity(0))
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < cores:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a core count from 0 to {cores - 1} (this machine has {cores})"
        )
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--prompt-len", default="16-256", help="LOW-HIGH token lengths")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    parser.add_argument(
        "--engines",
        default=",".join(DEFAULT_ENGINES),
        help=f"a subset of {','.join(ENGINES)}",
    )
    parser.add_argument(
        "--vllm-reserved-cpus",
        type=_reserved_cpus,
        default=None,
        help="cores vLLM keeps for its scheduler process (VLLM_CPU_NUM_OF_RESERVED_CPU; "
        "default: vLLM's choice)",
    )
    parser.add_argument("--worker", choices=VLLM_ENGINES, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--prompts", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--max-model-len", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def timed_cases(run: Any, prompts: list[list[int]], new_tokens: int, repeats: int) -> Any:
    """Warm up, then the best seconds for 1 and for `new_tokens` tokens, and the tokens."""
    run(prompts, 2)
    first: list[float] = []
    full: list[float] = []
    outputs: list[list[int]] = []
    for _ in range(repeats):
        clock = time.perf_counter()
        run(prompts, 1)
        first.append(time.perf_counter() - clock)
        clock = time.perf_counter()
        outputs = run(prompts, new_tokens)
        full.append(time.perf_counter() - clock)
    lengths = {len(o) for o in outputs}
    if lengths != {new_tokens}:
        raise RuntimeError(f"expected {new_tokens} tokens per row, got lengths {lengths}")
    return {"seconds_1": first, "seconds_n": full, "outputs": outputs}


# -- the vLLM engines (one fresh process each) -------------------------------------------------


def vllm_worker(args: argparse.Namespace) -> int:
    if args.worker == "vllm-cpu":
        os.environ["LLM_RUNTIME_VLLM_PLATFORM"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts: list[list[int]] = json.loads(args.prompts.read_text())
    options: dict[str, Any] = {
        "model": str(args.folder),
        "dtype": "float32",
        "enforce_eager": True,
        "max_num_seqs": len(prompts),
        "max_model_len": args.max_model_len,
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
        "enable_prefix_caching": False,
        "skip_tokenizer_init": True,
        "seed": 0,
    }
    if args.worker == "vllm-cpu":
        options["kv_cache_memory_bytes"] = VLLM_CPU_KV_BYTES
    if args.worker == "vllm+llm-runtime-sync":
        options["async_scheduling"] = False
    clock = time.perf_counter()
    llm = LLM(**options)
    startup = time.perf_counter() - clock
    token_prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    def run(_: list[list[int]], tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        results = llm.generate(token_prompts, params, use_tqdm=False)
        return [list(r.outputs[0].token_ids) for r in results]

    report = timed_cases(run, prompts, args.new_tokens, args.repeats)
    report["startup_seconds"] = startup
    report["async_scheduling"] = bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling)
    report["threads"] = llm.collective_rpc(_worker_threads)[0]
    if args.worker != "vllm-cpu":
        report["runtime_stats"] = llm.collective_rpc("runtime_stats")[0]
    args.out.write_text(json.dumps(report))
    return 0


def _worker_threads(worker: Any) -> int:
    """Run inside vLLM's worker process: the torch threads its model runs on."""
    import torch

    return int(torch.get_num_threads())


def run_vllm_engine(engine: str, folder: Path, prompts: list[list[int]], args: Any) -> Any:
    with tempfile.TemporaryDirectory() as scratch:
        prompt_file, out = Path(scratch) / "prompts.json", Path(scratch) / "out.json"
        prompt_file.write_text(json.dumps(prompts))
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", engine]
        command += ["--folder", str(folder), "--prompts", str(prompt_file), "--out", str(out)]
        command += ["--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]
        command += ["--max-model-len", str(args.max_model_len)]
        # The thread probe is a function sent to the worker (vLLM pickles it only when asked).
        env = {
            **os.environ,
            "VLLM_LOGGING_LEVEL": "WARNING",
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        }
        if args.vllm_reserved_cpus is not None:
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(args.vllm_reserved_cpus)
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"{engine} failed:\n{done.stderr[-5000:]}")
        return json.loads(out.read_text())


# -- this runtime alone ---------------------------------------------------------------------------


def run_runtime(prompts: list[list[int]], args: Any, config: Any) -> Any:
    import torch

    from benchmarks.bench_generate import _runtime_executor
    from models.generation.generator import GenerationParams, Generator

    batch = len(prompts)
    clock = time.perf_counter()
    executor = _runtime_executor(config, batch)
    startup = time.perf_counter() - clock
    try:
        generator = Generator(executor, enable_prefix_cache=False)

        def run(items: list[list[int]], tokens: int) -> list[list[int]]:
            params = GenerationParams(temperature=0.0, max_new_tokens=tokens, ignore_eos=True)
            return [list(c.token_ids) for c in generator.generate(items, params)]

        report = timed_cases(run, prompts, args.new_tokens, args.repeats)
        report["startup_seconds"] = startup
        report["threads"] = torch.get_num_threads()
        return report
    finally:
        executor.close()


# -- report ---------------------------------------------------------------------------------------


def rates(result: Any, batch: int, new_tokens: int) -> dict[str, float]:
    first, full = min(result["seconds_1"]), min(result["seconds_n"])
    # Load can make the 1-token run the slower one; then there is no decode rate to report.
    decode = batch * (new_tokens - 1) / (full - first) if full > first else float("nan")
    if full <= first:
        print(
            f"warning: T(1)={first:.2f} s >= T({new_tokens})={full:.2f} s at batch {batch}: "
            "the machine was busy; the decode rate is n/a, rerun on a quiet machine",
            file=sys.stderr,
        )
    return {
        "end_to_end_tokens_per_second": batch * new_tokens / full,
        "decode_tokens_per_second": decode,
        "startup_seconds": result["startup_seconds"],
        "threads": result["threads"],
    }


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of rows whose greedy tokens are identical."""
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def format_table(report: dict[str, Any]) -> str:
    lines = [
        "| batch | engine | end-to-end tok/s | decode tok/s | vs the first (e2e / decode) "
        "| same tokens as the first | threads | startup s |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in report["rows"]:
        engines = list(row["engines"])
        anchor = row["engines"][engines[0]]
        for engine in engines:
            r = row["engines"][engine]
            e2e, decode = r["end_to_end_tokens_per_second"], r["decode_tokens_per_second"]
            e2e_ratio = e2e / anchor["end_to_end_tokens_per_second"]
            decode_ratio = decode / anchor["decode_tokens_per_second"]
            lines.append(
                f"| {row['batch_size']} | {engine} | {e2e:.1f} | {decode:.1f} "
                f"| {e2e_ratio:.2f}x / {decode_ratio:.2f}x "
                f"| {row['same_tokens'][engine]:.0%} | {r['threads']} "
                f"| {r['startup_seconds']:.0f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return vllm_worker(args)
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        print("vLLM is not installed here: run `make vllm`, then this script with "
              ".venv-vllm/bin/python", file=sys.stderr)  # fmt: skip
        return 2
    from benchmarks.bench_generate import BenchConfig, make_prompts
    from models.vllm_plugin.hf_folder import write_hf_folder

    engines = [e for e in args.engines.split(",") if e]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown or not engines:
        print(f"--engines {args.engines!r}: allowed are {','.join(ENGINES)}", file=sys.stderr)
        return 2
    low, _, high = args.prompt_len.partition("-")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    config = BenchConfig(
        model=MODEL,
        batch_sizes=tuple(batches),
        prompt_len=(int(low), int(high or low)),
        new_tokens=args.new_tokens,
    )
    # The context the runtime-alone lane is built for (bench_generate's rule), for all three.
    args.max_model_len = -(-(config.prompt_len[1] + args.new_tokens) // config.block_size) * (
        config.block_size
    )
    report: dict[str, Any] = {
        "model": MODEL,
        "dtype": "float32",
        "new_tokens": args.new_tokens,
        "prompt_len": args.prompt_len,
        "repeats": args.repeats,
        "max_model_len": args.max_model_len,
        "cpu_count": os.cpu_count(),
        "vllm_reserved_cpus": args.vllm_reserved_cpus,
        "rows": [],
    }
    with tempfile.TemporaryDirectory() as scratch:
        folder = write_hf_folder(MODEL, Path(scratch) / "smollm2-hf")
        for batch in batches:
            prompts = make_prompts(config, batch, 49152)
            results = {
                engine: run_runtime(prompts, args, config)
                if engine == "llm-runtime"
                else run_vllm_engine(engine, folder, prompts, args)
                for engine in engines
            }
            anchor = results[engines[0]]["outputs"]
            row = {
                "batch_size": batch,
                "prompt_lens": [len(p) for p in prompts],
                "engines": {e: rates(r, batch, args.new_tokens) for e, r in results.items()},
                "same_tokens": {e: agreement(r["outputs"], anchor) for e, r in results.items()},
                "raw_seconds": {
                    e: {"seconds_1": r["seconds_1"], "seconds_n": r["seconds_n"]}
                    for e, r in results.items()
                },
                "async_scheduling": {
                    e: r["async_scheduling"] for e, r in results.items() if "async_scheduling" in r
                },
                "runtime_stats": {
                    e: r["runtime_stats"] for e, r in results.items() if "runtime_stats" in r
                },
            }
            report["rows"].append(row)
            print(f"batch {batch} done", file=sys.stderr, flush=True)
    print(format_table(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

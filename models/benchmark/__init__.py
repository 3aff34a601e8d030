"""Generation throughput of this runtime's `Generator` against Hugging Face transformers `generate`.

Run: `llm-runtime bench --model smollm2-135m --batch-sizes 1,8,32 --prompt-len 128
--new-tokens 64 --compare transformers [--json]` (this package is the implementation;
`python benchmarks/bench_generate.py ...` runs it with the same arguments).

Method (the same for both engines, in one process, same weights, same thread count):

* prompts are random token ids (fixed seed) of one length, or of lengths drawn uniformly from
  LOW-HIGH (`--prompt-len 32-512`); every row generates exactly `new_tokens` tokens, greedy,
  EOS ignored (ours: `ignore_eos`; transformers: `min_new_tokens = max_new_tokens`);
* two rates per engine. Decode-only: decode time excludes prompt processing and is measured
  inside one run, so load that drifts between runs cannot leak into it: ours sums the wall
  time of every decode step (block reservation, inputs, `decode_forward`, the asynchronous
  read, host work); transformers is timed by a streamer from the first generated token to
  the last (`new_tokens - 1` steps); decode tokens/s = `batch * (new_tokens - 1) / decode
  seconds`. End-to-end (the usual serving metric): `batch * new_tokens / wall seconds` of the
  whole generate call (prompt processing, every step, host work);
* ours runs on an executor whose lane has exactly `batch` slots (what one would deploy for
  that batch), warmed up on the same prompts first; transformers pads on the left with an
  attention mask and is warmed up the same way;
* with `--lanes N` (N > 1) a data-parallel lane group of N lanes x batch/N slots
  (`--lane-transport`, `--threads-per-lane T`, default 1) runs against the anchor, one lane
  of the same total batch with N*T torch threads, in the same run and alternating; the
  group's host overhead per decode step (routing, splitting, joining, transport waits not
  spent in a lane) comes from its own step counters;
* the engines alternate within every repeat (`--repeats`, default 2) and the best rate of each
  (per metric) is reported, so a burst of background load does not decide the ratio.

Modules: `config` (the run's settings and prompts), `runtime_engine` and
`transformers_engine` (one timed run of each engine), `measure` (batch sizes, repeats and
rates), `report` (the text report).
"""

from models.benchmark.config import BenchConfig, BenchUsageError, make_prompts
from models.benchmark.measure import bench_batch, bench_lanes, run_benchmark
from models.benchmark.report import format_report, format_row
from models.benchmark.runtime_engine import RunTimes, runtime_executor, runtime_run
from models.benchmark.transformers_engine import hf_run, load_transformers

__all__ = [
    "BenchConfig",
    "BenchUsageError",
    "RunTimes",
    "bench_batch",
    "bench_lanes",
    "format_report",
    "format_row",
    "hf_run",
    "load_transformers",
    "make_prompts",
    "run_benchmark",
    "runtime_executor",
    "runtime_run",
]

"""GFLOP/s of every float32 projection form warmup chooses among, per SmolLM2 projection and
row bucket, against this machine's measured peak (issue 25).

Run: `python benchmarks/gemm_candidates.py [--threads N] [--json FILE]` (about a minute).

Method: for each projection shape and row count, the forms of `models.decoder.kernels.FORMS`
that can run it (torch's `F.linear` / `mm` paths through MKL, oneDNN's packed inner product,
the native weight-streaming product) compute `x @ W^T` over one weight, best of 5 timed
rounds of 20 calls after a warm-up (the weight stays in cache: this is the arithmetic rate,
not the streaming one). The peak is the best rate of any form on a 1024 x 1024 x 1024
product. torch threads as given (default 2).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.decoder.kernels import FORMS

SHAPES = {"wqkv": (960, 576), "wo": (576, 576), "w_gate_up": (3072, 576), "w_down": (576, 1536)}
ROWS = (1, 4, 8, 32, 256)


def _seconds(call: Callable[[], object], calls: int = 20) -> float:
    call()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def _rates(out: int, fan_in: int, rows: int) -> dict[str, float]:
    weight = torch.randn(out, fan_in)
    stored = {"out_in": weight, "in_out": weight.t().contiguous()}
    x = torch.randn(rows, fan_in)
    flops = 2 * rows * out * fan_in
    return {
        name: flops / _seconds(lambda f=form: f.compute(stored[f.layout], x)) / 1e9
        for name, form in FORMS.items()
        if form.fits(rows) and form.available()
    }


def peak_rate() -> float:
    """The best GFLOP/s of any form on a 1024^3 product: this CPU's arithmetic ceiling."""
    return max(_rates(1024, 1024, 1024).values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    peak = peak_rate()
    table = {
        name: {rows: _rates(out, fan_in, rows) for rows in ROWS}
        for name, (out, fan_in) in SHAPES.items()
    }
    print(f"peak (best form, 1024^3): {peak:.0f} GFLOP/s, {args.threads} threads")
    forms = sorted({form for by_rows in table.values() for r in by_rows.values() for form in r})
    print("| projection | rows | " + " | ".join(forms) + " |")
    print("| --- | ---: |" + " ---: |" * len(forms))
    for name, by_rows in table.items():
        for rows, rates in by_rows.items():
            cells = [f"{rates[f]:.0f}" if f in rates else "-" for f in forms]
            print(f"| {name} | {rows} | " + " | ".join(cells) + " |")
    if args.json:
        report = {"peak_gflop_s": peak, "threads": args.threads, "gflop_s": table}
        Path(args.json).write_text(json.dumps(report, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

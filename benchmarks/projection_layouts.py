"""Which float32 matrix product is fastest for SmolLM2's projections at decode row counts.

Run: `python benchmarks/projection_layouts.py [--threads N]` (about 30 s). This was the
measurement behind the old fixed projection form (`torch.mm(W, x.T)`, one row padded to two);
the runtime now makes this choice itself, by measurement at warmup, per projection and row
bucket (`models.decoder.kernels`, shown by `llm-runtime bringup`). Kept to look at the forms.

Method: for each projection shape, 30 distinct random weights (one per layer, so they stream
from memory as in the model; the LM head once), products timed over all of them, best of
`--reps` after one warm-up; printed in milliseconds per decode step. Variants: `x @ W` with
W `[in, out]`; `F.linear(x, W)` with W `[out, in]`; `torch.mm(W, x.T)` with W `[out, in]`
(one row padded to two).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPES = {  # name: (in, out, how many per decode step)
    "qkv": (576, 960, 30),
    "o": (576, 576, 30),
    "gate_up": (576, 3072, 30),
    "down": (1536, 576, 30),
    "lm_head": (576, 49152, 1),
}


def _best_ms(call: Callable[[], object], reps: int) -> float:
    call()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _padded_mm(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if x.shape[0] == 1:
        return torch.mm(weight, torch.cat((x, x)).t())[:, :1].t()
    return torch.mm(weight, x.t()).t()


def _variants(
    x: torch.Tensor, rows_major: list[torch.Tensor], cols_major: list[torch.Tensor]
) -> dict[str, Callable[[], object]]:
    return {
        "x @ W[in,out]": lambda: [x @ w for w in cols_major],
        "F.linear W[out,in]": lambda: [F.linear(x, w) for w in rows_major],
        "mm(W[out,in], x.T)": lambda: [_padded_mm(w, x) for w in rows_major],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rows", default="1,2,8,32")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows_list = [int(r) for r in args.rows.split(",")]
    totals: dict[tuple[int, str], float] = {}
    for name, (fan_in, fan_out, count) in SHAPES.items():
        rows_major = [torch.randn(fan_out, fan_in) for _ in range(count)]
        cols_major = [w.t().contiguous() for w in rows_major]
        for rows in rows_list:
            x = torch.randn(rows, fan_in)
            variants = _variants(x, rows_major, cols_major)
            cells = []
            for label, call in variants.items():
                ms = _best_ms(call, args.reps)
                totals[(rows, label)] = totals.get((rows, label), 0.0) + ms
                cells.append(f"{label} {ms:7.2f}")
            print(f"{name:8s} rows {rows:3d}: " + " | ".join(cells))
    for rows in rows_list:
        cells = [f"{label} {ms:7.2f}" for (r, label), ms in totals.items() if r == rows]
        print(f"step     rows {rows:3d}: " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

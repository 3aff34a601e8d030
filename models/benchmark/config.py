"""One benchmark run's settings (checked before anything loads) and its random prompts."""

from __future__ import annotations

import random

import attrs


class BenchUsageError(ValueError):
    """A benchmark setting that cannot run (the CLI exits 2)."""


@attrs.frozen
class BenchConfig:
    """One benchmark run: which model, which batch sizes, how long the prompts and outputs."""

    model: str = "smollm2-135m"
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    prompt_len: tuple[int, int] = (128, 128)
    new_tokens: int = 64
    compare: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    weights: str = "stored"
    trace_mode: str = "none"
    block_size: int = 32
    prefill_chunk: int = 256
    seed: int = 0
    repeats: int = 2
    lanes: int = 1
    lane_transport: str = "process"
    threads_per_lane: int | None = None
    kernels: str | None = None

    def check(self) -> None:
        if not self.batch_sizes or any(b <= 0 for b in self.batch_sizes):
            raise BenchUsageError(f"--batch-sizes {self.batch_sizes} is invalid: allowed are >= 1")
        low, high = self.prompt_len
        if not 1 <= low <= high:
            raise BenchUsageError(
                f"--prompt-len {self.prompt_len} is invalid: need 1 <= LOW <= HIGH"
            )
        if self.new_tokens < 2:
            raise BenchUsageError(
                f"--new-tokens {self.new_tokens} is invalid: allowed is >= 2 (decode is "
                "measured from the second generated token)"
            )
        if self.repeats < 1:
            raise BenchUsageError(f"--repeats {self.repeats} is invalid: allowed is >= 1")
        if self.lanes < 1:
            raise BenchUsageError(f"--lanes {self.lanes} is invalid: allowed is >= 1")
        for batch in self.batch_sizes:
            if batch % self.lanes:
                raise BenchUsageError(
                    f"--batch-sizes {batch} does not split over --lanes {self.lanes}: every "
                    "batch size must be a multiple of the lane count"
                )
        if self.compare not in (None, "transformers"):
            raise BenchUsageError(f"--compare {self.compare!r} is invalid: allowed is transformers")


def make_prompts(config: BenchConfig, batch: int, vocab_size: int) -> list[list[int]]:
    """Random token-id prompts; ids from 100 up avoid the special tokens of small vocabularies."""
    rng = random.Random(config.seed * 1000 + batch)
    low, high = config.prompt_len
    first = min(100, vocab_size // 2)
    return [
        [rng.randrange(first, vocab_size) for _ in range(rng.randint(low, high))]
        for _ in range(batch)
    ]

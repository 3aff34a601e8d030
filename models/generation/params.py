"""One request's sampling and stopping parameters, and their per-row form for a device call."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import attrs

from runtime.sampling import SamplingParams

DEFAULT_MAX_NEW_TOKENS = 64
DEFAULT_TOP_K = 50
MAX_SEED = 2**64 - 1


def _stop_tuple(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, Sequence):
        return tuple(value)  # items are checked by `GenerationParams.check`
    raise TypeError(f"stop must be a string or a sequence of strings, got {type(value).__name__}")


@attrs.frozen
class GenerationParams:
    """One request's sampling and stopping parameters.

    `temperature` 0 is greedy. A stochastic request (temperature > 0) samples from its
    `top_k` highest tokens (1..the device sampler's limit, 64 for the Llama sampler) and the
    `top_p` nucleus. `seed` makes a request reproducible independently of its batch. `stop`
    strings end a completion (the text stops before the match). `ignore_eos` keeps generating
    past EOS (benchmarks use it for fixed token counts). Values are checked when a request is
    submitted, so errors can name the request.
    """

    temperature: float = 0.0
    top_k: int = DEFAULT_TOP_K
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    stop: tuple[str, ...] = attrs.field(default=(), converter=_stop_tuple)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_sampling_params(
        cls, sp: SamplingParams, *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    ) -> GenerationParams:
        """A scalar `runtime.sampling.SamplingParams` as one request's parameters."""
        temperature, top_k, top_p, seed = sp.temperature, sp.top_k, sp.top_p, sp.seed
        if (
            isinstance(temperature, tuple)
            or isinstance(top_k, tuple)
            or isinstance(top_p, tuple)
            or isinstance(seed, tuple)
        ):
            raise ValueError(
                "SamplingParams has per-row values; give one scalar SamplingParams per request "
                "(or one GenerationParams per prompt)"
            )
        # top_k=0 ("no limit") stays 0: fine for greedy, refused by `check` for sampling rows.
        return cls(
            temperature=float(temperature),
            top_k=int(top_k),
            top_p=float(top_p),
            seed=seed,
            max_new_tokens=max_new_tokens,
        )

    def check(self, where: str, *, max_top_k: int) -> None:
        """Raise ValueError naming `where` (e.g. "request 3") and the field when invalid."""

        def bad(field: str, value: object, allowed: str) -> ValueError:
            return ValueError(f"{where}: {field}={value!r} is invalid: allowed is {allowed}")

        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t < 0:
            raise bad("temperature", t, "a finite number >= 0 (0 means greedy)")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
            raise bad("top_k", k, "an int >= 0")
        if t > 0 and not 1 <= k <= max_top_k:
            raise bad("top_k", k, f"an int in [1, {max_top_k}] when temperature > 0")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 < float(p) <= 1.0:
            raise bad("top_p", p, "a number in (0, 1]")
        s = self.seed
        if s is not None and (
            isinstance(s, bool) or not isinstance(s, numbers.Integral) or not 0 <= s <= MAX_SEED
        ):
            raise bad("seed", s, f"None or an int in [0, {MAX_SEED}]")
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise bad("max_new_tokens", n, "an int >= 1")
        for stop in self.stop:
            if not isinstance(stop, str) or not stop:
                raise bad("stop", self.stop, "a sequence of non-empty strings")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", self.ignore_eos, "a bool")


def rows_sampling(rows: Sequence[GenerationParams | None]) -> SamplingParams:
    """Per-row sampling values of one device call; None rows (inactive slots) are greedy."""
    seeds = [None if p is None else p.seed for p in rows]
    return SamplingParams(
        temperature=[0.0 if p is None else float(p.temperature) for p in rows],
        top_k=[1 if p is None or p.greedy else int(p.top_k) for p in rows],
        top_p=[1.0 if p is None else float(p.top_p) for p in rows],
        seed=None if all(s is None for s in seeds) else seeds,
    )

"""Warmup coverage derived from identity: every program a lane's requests can need.

A traced lane closes the compile gate at capture, so warmup must compile every program
signature serving can ask for. Rather than listing shapes (a list drifts from the identity
rules: the Q128 last-token tile start was such a drift), this module asks the planner and the
signature functions serving itself uses (`PrefillRuntime.plan` / `identify`,
`DecodeRuntime.prepare` / `program_signature`) what they produce for every admissible
request: each prompt length 1..max_seq_len-1, uncached and behind a cached prefix, alone and
in every wave the planner forms within the lane, for each sampling recipe (none, greedy,
sampled). One representative probe is kept per distinct program signature; compiling the
probe covers the signature, so a new identity field is covered the day it is added.

The cached prefix is probed at one block: cached tokens are refreshed inputs (the chunk start),
never identity, so a longer prefix maps to a signature a one-block prefix already produced
(`tests/runtime/test_warmup_coverage.py` checks this against the planner).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Literal

import attrs
import torch

from runtime.identity import key_material_of, key_pairs_of
from runtime.sampling import PreparedSamplingParams, SamplingParams

if TYPE_CHECKING:
    from runtime.decode import DecodeRuntime
    from runtime.prefill.batch import PrefillArguments
    from runtime.prefill.request import PrefillRequest
    from runtime.prefill.runtime import PrefillRuntime

Operation = Literal["prefill", "decode"]
Recipe = Literal["none", "greedy", "sampled"]
RECIPES: tuple[Recipe, ...] = ("none", "greedy", "sampled")

GREEDY_RECIPE = SamplingParams(temperature=0.0, top_k=1, top_p=1.0)
SAMPLED_TOP_K = 32
SAMPLED_TOP_P = 0.08


def recipe_params(recipe: Recipe, rows: int, *, max_top_k: int) -> SamplingParams | None:
    """Per-row sampling parameters of a recipe (a scalar would describe one active row)."""
    if recipe == "none":
        return None
    if recipe == "greedy":
        temperature, top_k, top_p = 0.0, 1, 1.0
    else:
        temperature, top_k, top_p = 1.0, min(SAMPLED_TOP_K, max_top_k), SAMPLED_TOP_P
    return SamplingParams(
        temperature=[temperature] * rows, top_k=[top_k] * rows, top_p=[top_p] * rows
    )


@attrs.frozen
class WarmupCase:
    """One call warmup compiles: a representative request of one or more program identities.

    `batch_size` is the padded (physical) batch, `sequence_length` the invocation length of the
    first chunk (None for decode), `prompt_length` each row's prompt (cached prefix included),
    `rows` the active rows, `tile_start` the baked last-token tile (Q128 single-row argmax).
    """

    operation: Operation
    batch_size: int
    sequence_length: int | None
    sampling_path: str
    cached_tokens: int = 0
    prompt_length: int | None = None
    rows: int = 1
    tile_start: int | None = None
    recipe: Recipe = "none"

    @property
    def probe_key(self) -> tuple[int, ...]:
        """Orders cases so the sampling siblings of one probe compile next to each other."""
        return (
            self.sequence_length or 0,
            self.batch_size,
            self.cached_tokens,
            self.prompt_length or 0,
            self.rows,
        )

    def describe(self) -> str:
        """A short label for progress output and the journal."""
        if self.operation == "decode":
            return f"decode batch={self.batch_size} {self.sampling_path}"
        parts = [f"prefill batch={self.batch_size} len={self.sequence_length}"]
        if self.prompt_length is not None:
            parts.append(f"prompt={self.prompt_length}")
        if self.rows != self.batch_size:
            parts.append(f"rows={self.rows}")
        if self.cached_tokens:
            parts.append(f"cached={self.cached_tokens}")
        if self.tile_start is not None:
            parts.append(f"tile={self.tile_start}")
        parts.append(self.sampling_path)
        return " ".join(parts)

    def prefill_request(self, *, block_size: int, max_top_k: int) -> PrefillArguments:
        """The keyword arguments of `compile_prefill` for this case (zero tokens, block 0)."""
        if self.operation != "prefill" or self.prompt_length is None:
            raise ValueError(f"{self.describe()} is not a prefill case with a prompt length")
        rows, prompt = self.rows, self.prompt_length
        request: PrefillArguments = {
            "tokens": torch.zeros(rows, prompt, dtype=torch.long),
            "page_table": torch.zeros(rows, math.ceil(prompt / block_size), dtype=torch.int32),
            "prompt_lens": torch.full((rows,), prompt, dtype=torch.long),
            "empty_slots": list(range(rows)),
            "sampling_params": recipe_params(self.recipe, rows, max_top_k=max_top_k),
        }
        if self.cached_tokens:
            request["start_pos"] = torch.full((rows,), self.cached_tokens, dtype=torch.long)
        return request


@attrs.frozen
class CoverageFilter:
    """User trims of derived coverage (`WarmupConfig`), applied after derivation.

    `sequence_lengths`: invocation lengths kept (None keeps all); `batch_sizes`: padded wave
    sizes kept (single rows always stay); `batched_lengths`: invocation lengths at which waves
    are kept (None keeps all; eager lanes keep the reference's smallest bucket only).
    """

    sequence_lengths: tuple[int, ...] | None = None
    batch_sizes: tuple[int, ...] | None = None
    batched_lengths: tuple[int, ...] | None = None

    def keeps(self, padded_batch: int, length: int) -> bool:
        if self.sequence_lengths is not None and length not in self.sequence_lengths:
            return False
        if padded_batch == 1:
            return True
        if self.batch_sizes is not None and padded_batch not in self.batch_sizes:
            return False
        return self.batched_lengths is None or length in self.batched_lengths


@attrs.frozen
class _Candidate:
    """A probe for a signature; the lowest `rank` wins: fewest invocations, then fewest real
    tokens (the torch models compute real tokens only), except that a baked Q128 tile is
    primed at its tile end as the reference does (32, 64, 96, 128)."""

    case: WarmupCase
    rank: tuple[int, ...]


class _PrefillDeriver:
    """Plans probes and identifies each planned request under every recipe."""

    BLOCK_ROWS = 256
    """Single-row probes planned per planner call (the planner validates per call)."""

    def __init__(
        self, prefill: PrefillRuntime, recipes: tuple[Recipe, ...], max_top_k: int
    ) -> None:
        self._prefill = prefill
        self._recipes = recipes
        self._max_top_k = max_top_k
        self._sampling: dict[tuple[object, ...], PreparedSamplingParams | None] = {}
        self.best: dict[object, _Candidate] = {}

    def _sampling_for(
        self, recipe: Recipe, request: PrefillRequest
    ) -> PreparedSamplingParams | None:
        # The prepared sampling of a recipe depends on the request's rows, not its length.
        key = (recipe, request.kind, request.padded_batch_size, request.active_batch_size)
        if key not in self._sampling:
            raw = recipe_params(recipe, request.active_batch_size, max_top_k=self._max_top_k)
            prepared = None
            if raw is not None:
                tokens = torch.zeros(
                    request.active_batch_size, max(request.prompt_lengths), dtype=torch.long
                )
                prepared = self._prefill.prepare_request_sampling(request, raw, tokens)
            self._sampling[key] = prepared
        return self._sampling[key]

    def single_rows(self, prompts: list[int], cached: int) -> list[PrefillRequest]:
        """Plan one row per prompt length; refused rows (inadmissible) are left out."""
        planned: list[PrefillRequest] = []
        for start in range(0, len(prompts), self.BLOCK_ROWS):
            block = prompts[start : start + self.BLOCK_ROWS]
            requests: Sequence[PrefillRequest]
            try:
                requests = self._prefill.plan_single_rows(block, [cached] * len(block))
            except ValueError:
                requests = self._one_by_one(block, cached)
            for request in requests:
                self.record(request, rows=1)
            planned.extend(requests)
        return planned

    def _one_by_one(self, prompts: list[int], cached: int) -> list[PrefillRequest]:
        admitted: list[PrefillRequest] = []
        for prompt in prompts:
            try:
                admitted.extend(self._prefill.plan_single_rows([prompt], [cached]))
            except ValueError:
                continue  # the planner refuses this prompt: the lane never admits it
        return admitted

    def wave(self, prompt: int, rows: int) -> None:
        """Plan `rows` equal uncached prompts as one lane call, with and without sampling."""
        tokens = torch.zeros(rows, prompt, dtype=torch.long)
        table = torch.zeros(rows, -(-prompt // self._block), dtype=torch.int32)
        for sampled in sorted({recipe != "none" for recipe in self._recipes}):
            try:
                requests = self._prefill.plan(
                    tokens=tokens,
                    page_table=table,
                    prompt_lens=[prompt] * rows,
                    empty_slots=list(range(rows)),
                    sampled=sampled,
                )
            except ValueError:
                return
            for request in requests:
                self.record(request, rows=rows, sampled=sampled)

    @property
    def _block(self) -> int:
        block: int = self._prefill.config.page_table_layout.block_size
        return block

    def record(self, request: PrefillRequest, *, rows: int, sampled: bool | None = None) -> None:
        """Identify `request` under each recipe; keep the best probe per program signature."""
        prompt = max(request.prompt_lengths)
        tokens = sum(request.prompt_lengths) - sum(request.cached_tokens)
        invocations = len(request.chunks)
        for recipe in self._recipes:
            if sampled is not None and sampled != (recipe != "none"):
                continue
            path, signatures = self._prefill.program_signatures(
                request, self._sampling_for(recipe, request)
            )
            tile = signatures[0].last_token_tile_start
            rank = (invocations, -prompt if tile is not None else tokens, rows, prompt)
            for signature in signatures:  # frozen: equal signatures are equal keys
                current = self.best.get(signature)
                if current is not None and current.rank <= rank:
                    continue
                case = WarmupCase(
                    "prefill",
                    request.padded_batch_size,
                    request.first_chunk.chunk_size,
                    path,
                    cached_tokens=request.cached_tokens[0],
                    prompt_length=prompt,
                    rows=rows,
                    tile_start=tile,
                    recipe=recipe,
                )
                self.best[signature] = _Candidate(case, rank)


def derive_prefill_cases(
    prefill: PrefillRuntime,
    *,
    max_prompt_length: int,
    lane_batch_size: int,
    recipes: tuple[Recipe, ...],
    max_top_k: int,
    coverage: CoverageFilter = CoverageFilter(),
) -> tuple[WarmupCase, ...]:
    """One case per distinct prefill program signature the lane's requests can produce.

    Probes every prompt length `1..max_prompt_length` as a single row (uncached, and behind a
    one-block cached prefix), then every wave of 2..`widest_wave` equal rows at each padded
    length the single rows produced.
    """
    block = prefill.config.page_table_layout.block_size
    deriver = _PrefillDeriver(prefill, recipes, max_top_k)
    wave_lengths: dict[int, int] = {}
    for cached in (0, block):
        planned = deriver.single_rows(list(range(cached + 1, max_prompt_length + 1)), cached)
        if cached:
            continue
        for request in planned:
            if not request.uses_chunked_prefill:
                wave_lengths.setdefault(request.padded_sequence_length, request.prompt_lengths[0])
    for prompt in wave_lengths.values():
        for rows in range(2, widest_wave(prefill, lane_batch_size) + 1):
            deriver.wave(prompt, rows)
    return _kept(deriver.best.values(), coverage)


def widest_wave(prefill: PrefillRuntime, lane_batch_size: int) -> int:
    """The most equal rows the planner can batch into one wave in this lane.

    A bucket of more rows than the policy's largest supported prefill batch runs row by row
    (`runtime.prefill.plan._WaveRule`), and those single rows are what the single-row probes
    already planned (at a better rank), so waves past this bound add no signature. Without
    the bound a lane of N slots planned O(N^2) requests (minutes at N = 512).
    """
    supported: tuple[int, ...] = prefill.config.policy.supported_prefill_batch_sizes
    return min(lane_batch_size, max(supported))


def _kept(candidates: Iterable[_Candidate], coverage: CoverageFilter) -> tuple[WarmupCase, ...]:
    cases: dict[WarmupCase, None] = {}
    for candidate in candidates:
        case = candidate.case
        assert case.sequence_length is not None
        if coverage.keeps(case.batch_size, case.sequence_length):
            cases.setdefault(case)
    return tuple(sorted(cases, key=lambda c: (c.probe_key, c.sampling_path)))


def derive_decode_cases(
    decode: DecodeRuntime,
    *,
    lane_batch_size: int,
    page_table_width: int,
    recipes: tuple[Recipe, ...],
    max_top_k: int,
) -> tuple[WarmupCase, ...]:
    """One case per distinct decode program signature (the recipes' sampling paths)."""
    seen: dict[object, WarmupCase] = {}
    for recipe in recipes:
        prepared = decode.prepare(
            torch.zeros(lane_batch_size, dtype=torch.long),
            torch.zeros(lane_batch_size, dtype=torch.long),
            torch.zeros(lane_batch_size, page_table_width, dtype=torch.int32),
            sampling_params=recipe_params(recipe, lane_batch_size, max_top_k=max_top_k),
        )
        signature = decode.program_signature(prepared)
        seen.setdefault(
            key_material_of(signature),
            WarmupCase(
                "decode",
                lane_batch_size,
                None,
                prepared.sampling_path,
                rows=lane_batch_size,
                recipe=recipe,
            ),
        )
    return tuple(seen.values())


def identity_field_counts(signatures: Iterable[object]) -> dict[str, dict[str, int]]:
    """How many signatures carry each value of each identity field (manifest summary)."""
    counts: dict[str, dict[str, int]] = {}
    for signature in signatures:
        for name, value in key_pairs_of(signature):
            per_value = counts.setdefault(name, {})
            text = "null" if value is None else str(value)
            per_value[text] = per_value.get(text, 0) + 1
    return {name: dict(sorted(values.items())) for name, values in sorted(counts.items())}

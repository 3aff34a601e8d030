"""A transformers streamer that only records when each `generate` step's tokens arrive.

A module of its own because it subclasses transformers' `BaseStreamer`, so importing it
imports transformers: `transformers_engine` imports it only after setting transformers'
environment (offline, quiet).
"""

from __future__ import annotations

import time

import torch
from transformers.generation.streamers import BaseStreamer


class StepClock(BaseStreamer):
    """`stamps[i]`: when `generate` pushed its i-th tokens (#0 is the prompt)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        """Record the arrival time; the tokens themselves are not kept."""
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        """Nothing to flush: only arrival times are kept."""

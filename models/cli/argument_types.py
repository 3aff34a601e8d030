"""argparse `type=` parsers: each turns one flag's text into a value or says what is allowed."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `minimum`, with the allowed range in its error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(
                f"{value} is invalid: allowed is an integer >= {minimum}"
            )
        return value

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def number_between(low: float, high: float, unit: str) -> Callable[[str], float]:
    """An argparse type: a number in [`low`, `high`] `unit`, with the range in its error."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"{text} is invalid: allowed are {low:g}-{high:g} {unit}"
            )
        return value

    return parse


def writable_file(text: str) -> Path:
    """An argparse type: a file to write at the end (a report): refused at once, before the
    minutes of work that produce it, if its folder does not exist or it names a folder."""
    path = Path(text)
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: the folder {path.parent} does not exist")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder: allowed is a file path")
    return path


def temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0.0 or value == float("inf"):
        raise argparse.ArgumentTypeError(
            f"{text} is invalid: allowed is a finite number >= 0 (0 means greedy)"
        )
    return value


def top_p(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is invalid: allowed is a number in (0, 1]")
    return value


def batch_sizes(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is invalid: allowed is a comma-separated list of integers, e.g. 1,8,32"
        ) from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: every batch size must be >= 1")
    return values


def prompt_len(text: str) -> tuple[int, int]:
    low, sep, high = text.partition("-")
    try:
        bounds = (int(low), int(high) if sep else int(low))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is invalid: allowed is N or LOW-HIGH (e.g. 128 or 32-512)"
        ) from None
    if bounds[0] <= 0 or bounds[1] < bounds[0]:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: need 1 <= LOW <= HIGH")
    return bounds

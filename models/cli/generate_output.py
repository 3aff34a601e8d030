"""What `generate` prints: completions on stdout (text or JSON lines), the summary, and the
Ctrl-C and closed-pipe rules that keep every printed line whole."""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from models.cli.errors import PipeClosed
from runtime.json_types import JSONValue

if TYPE_CHECKING:
    from models.cli.executor_view import CliExecutor
    from models.generation.results import Completion
    from models.generation.stream import GenerationStream
    from models.progress import ProgressSink


@contextmanager
def sigint_held() -> Iterator[None]:
    """Hold Ctrl-C back while a line and its bookkeeping complete (delivered right after)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


class Printer:
    """stdout for completions: text or JSON lines, flushed per completion, pipe-safe."""

    KEEP = (
        "prefill_tokens",
        "decode_tokens",
        "prefill_seconds",
        "decode_seconds",
        "decode_tokens_per_second",
        "prefix_cache_hit_tokens",
        "preemptions",
    )

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.finished = 0
        self.cut_short = 0
        self.pending: list[Completion] = []

    def write(self, text: str) -> None:
        """Write and flush whole: Ctrl-C waits until the text is out (never half a line)."""
        with sigint_held():
            self._write(text)

    def _write(self, text: str) -> None:
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except BrokenPipeError as error:
            raise PipeClosed() from error

    def drain(self, stream: GenerationStream) -> int:
        """Print every completion finished so far (also after Ctrl-C); returns how many.

        Each line and its bookkeeping happen with Ctrl-C held back, so an interrupt never
        loses, halves or repeats a completion.
        """
        self.pending.extend(stream.newly_finished())
        count = 0
        while self.pending:
            with sigint_held():
                self._write(self._format(self.pending[0]))
                self.pending.pop(0)
                self.finished += 1
            count += 1
        return count

    def drain_interrupted(self, stream: GenerationStream) -> int:
        """After Ctrl-C: print what every unfinished request had generated, marked
        "interrupted" (a request that had in fact just finished counts as finished)."""
        count = 0
        for completion in stream.interrupted_completions():
            with sigint_held():
                self._write(self._format(completion))
                if completion.finish_reason == "interrupted":
                    self.cut_short += 1
                else:
                    self.finished += 1
            count += 1
        return count

    def _format(self, completion: Completion) -> str:
        if self.as_json:
            return json.dumps(completion.to_json(), ensure_ascii=False) + "\n"
        head = f"[{completion.index}] ({completion.finish_reason}, "
        return f"{head}{len(completion.token_ids)} tokens)\n{completion.text}\n"

    def summary(
        self, stream: GenerationStream, executor: CliExecutor, *, interrupted: bool
    ) -> None:
        """The run's counters: a line on stderr, or a JSON ``summary`` line on stdout."""
        stats = stream.stats
        weights = _weights_held(executor)
        if not self.as_json:
            print(
                f"{stats.decode_tokens} decode tokens in {stats.decode_seconds:.2f} s "
                f"({stats.decode_tokens_per_second:.1f} tokens/s); {stats.prefill_tokens} "
                f"prefill tokens in {stats.prefill_seconds:.2f} s; "
                f"{stats.prefix_cache_hit_tokens} prefix-cache hit tokens"
                + (f"; weights {weights}" if weights else ""),
                file=sys.stderr,
            )
            return
        summary = stats.to_json()
        out: dict[str, JSONValue] = {key: summary[key] for key in self.KEEP}
        out["phases"] = executor.journal.durations_by_dest(executor.owner_name)
        out["requests"] = stats.requests
        if weights:
            out["weights"] = weights
        out["finished"] = self.finished
        if interrupted:
            out["interrupted"] = True
            out["cut_short"] = self.cut_short
        self.write(json.dumps({"summary": out}) + "\n")


def _weights_held(executor: CliExecutor) -> str | None:
    """How the model's weights are held (`stored (...)`, `float32`), where the executor
    says (a single lane does; a lane group's lanes say it in their own journals)."""
    loaded = getattr(executor, "loaded", None)
    held = getattr(loaded, "weights", None)
    return held if isinstance(held, str) else None


def consume_streaming(stream: GenerationStream, printer: Printer) -> None:
    """One prompt: its text as it is generated."""
    for event in stream:
        if event.text_delta:
            printer.write(event.text_delta)
    printer.finished = len(stream.newly_finished())
    printer.write("\n")


def consume_finished(
    stream: GenerationStream, printer: Printer, progress: ProgressSink, total: int
) -> None:
    """Print each completion when it finishes; progress shows requests done and tokens/s."""
    with progress.step("generate", total=total) as step:
        for _ in stream:
            count = printer.drain(stream)
            if count:
                step.advance(count, stream.stats.progress_detail())
        step.advance(printer.drain(stream), stream.stats.progress_detail())

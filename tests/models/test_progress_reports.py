"""Progress for every long start-up phase: each kernel measurement, each warmup case (i of n,
with an estimate), coverage derivation and lane start-up reach the `progress=` object, and
`ConsoleProgress` prints them on a pipe."""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

import models.progress as progress_module
from models.progress import ConsoleProgress


class RecordedStep:
    def __init__(self, name: str, total: int | None, each: bool) -> None:
        self.name, self.total, self.each = name, total, each
        self.advances: list[tuple[int, str]] = []

    def advance(self, count: int = 1, detail: str = "") -> None:
        self.advances.append((count, detail))


class RecordingProgress:
    """A progress sink that keeps every call (what an API caller's own sink would see)."""

    def __init__(self) -> None:
        self.cases: list[tuple[str, int, int]] = []
        self.steps: list[RecordedStep] = []

    def __call__(self, label: str, index: int, total: int) -> None:
        self.cases.append((label, index, total))

    @contextmanager
    def step(
        self, name: str, *, total: int | None = None, each: bool = False, estimate: bool = True
    ) -> Iterator[RecordedStep]:
        step = RecordedStep(name, total, each)
        self.steps.append(step)
        yield step

    def announce(self, message: str) -> None:
        pass

    def cases_done(self) -> None:
        pass

    def named(self, prefix: str) -> list[RecordedStep]:
        return [step for step in self.steps if step.name.startswith(prefix)]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(progress_module.time, "perf_counter", fake)
    return fake


def test_a_pipe_gets_one_line_per_warmup_case_with_an_estimate(clock: FakeClock) -> None:
    stream = io.StringIO()
    console = ConsoleProgress(stream, force=True)
    for index in range(1, 5):
        console(f"decode batch=4 case{index}", index, 4)
        clock.now += 2.0  # each case takes 2 s
    console.cases_done()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "warmup decode 1/4: decode batch=4 case1"  # nothing measured yet
    assert lines[1] == "warmup decode 2/4: decode batch=4 case2; about 6.0 s left"
    assert lines[3] == "warmup decode 4/4: decode batch=4 case4; about 2.0 s left"
    assert lines[4] == "warmup decode shapes 4/4: done in 8.0 s"


def test_a_step_with_each_prints_i_of_n_at_most_once_a_second(clock: FakeClock) -> None:
    stream = io.StringIO()
    console = ConsoleProgress(stream, force=True)
    with console.step("measure kernels", total=4, each=True) as step:
        for item in range(4):
            clock.now += 0.6
            step.advance(1, f"wo rows={2**item}")
    lines = stream.getvalue().splitlines()
    # 0.6 s: too soon; 1.2 s: a line; 1.8 s: too soon after it; the 4th is the finish line.
    assert lines == [
        "measure kernels 2/4: wo rows=2; about 1.2 s left",
        "measure kernels 4/4: done in 2.4 s",
    ]
    stream = io.StringIO()
    console = ConsoleProgress(stream, force=True)
    with console.step("start 3 lane processes", total=3, each=True, estimate=False) as step:
        clock.now += 30.0
        step.advance(1, "lane 0 loaded")
    assert stream.getvalue().splitlines()[0] == "start 3 lane processes 1/3: lane 0 loaded"


def test_the_api_sink_sees_each_kernel_measurement_and_warmup_case(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import models.decoder.kernel_measure as kernels
    from models.decoder.executor import load_executor

    monkeypatch.setattr(kernels, "_MEASURED", {})  # measure here, not a plan cached earlier
    recorder = RecordingProgress()
    executor = load_executor(
        "tiny-random",
        block_size=16,
        max_prefill_chunk_size=32,
        max_batch_size=40,
        progress=recorder,
    )
    try:
        executor.start()
        plan = executor.warmup.plan(can_sample_on_device=executor.config.device_sampling_enabled)
        buckets = executor.model.kernel_plan.buckets
        projections = list(executor.model.projection_groups())
    finally:
        executor.close()
    (measure,) = recorder.named("measure kernels")
    assert measure.each and measure.total == len(projections) * len(buckets)
    details = [detail for _, detail in measure.advances]
    expected = [f"{name} rows={rows}" for name in projections for rows in buckets]
    assert len(details) == len(expected)
    # every bucket reported in order; the LM head's prefill-chunk bucket is not timed
    assert all(d.startswith(e) for d, e in zip(details, expected, strict=True))
    assert details[-1] == f"lm_head rows={buckets[-1]} not timed (one row per sequence)"
    assert recorder.named("derive warmup coverage")
    for operation, cases in (("prefill", plan.prefill), ("decode", plan.decode)):
        seen = [(i, n) for label, i, n in recorder.cases if label.startswith(operation)]
        assert seen == [(i, len(cases)) for i in range(1, len(cases) + 1)]
    assert any("batch=40" in label for label, _, _ in recorder.cases)


def test_in_process_lanes_report_each_lane_loaded() -> None:
    from models.lane_loading import load_lane_group

    recorder = RecordingProgress()
    group = load_lane_group(
        "tiny-random",
        lanes=2,
        lane_transport="inprocess",
        max_batch_size=4,
        block_size=16,
        max_prefill_chunk_size=32,
        progress=recorder,
    )
    group.close()
    (lanes,) = recorder.named("load 2 in-process lanes")
    assert lanes.total == 2
    assert lanes.advances == [(1, "lane 0 loaded"), (1, "lane 1 loaded")]

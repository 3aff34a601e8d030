"""Mermaid output, the journal, and the `llm-runtime lifecycle diagram` command."""

from __future__ import annotations

import pytest

from lifecycle import HOST_TABLE, Journal, Outcome, Phase, mermaid
from models.cli import main
from tests.lifecycle.hosts import Pool, ToyHost


def test_mermaid_lists_every_transition_and_highlights_current() -> None:
    text = mermaid(HOST_TABLE, current=Phase.ALLOCATED)
    lines = text.splitlines()
    assert lines[0] == "stateDiagram-v2"
    assert "    [*] --> CONSTRUCTED" in lines
    assert "    ALLOCATED --> COMPILED: compile" in lines
    assert "    COMPILED --> SERVING: serve" in lines
    assert "    SERVING --> FAULTED: fault" in lines
    assert "    TERMINAL --> [*]" in lines
    assert lines[-1] == "    class ALLOCATED current"
    edges = [line for line in lines if "-->" in line and "[*]" not in line]
    expected = sum(len(t.sources) for t in HOST_TABLE.transitions)
    assert len(edges) == expected


def test_mermaid_without_current_has_no_highlight() -> None:
    assert "class " not in mermaid(HOST_TABLE)


@pytest.mark.parametrize(
    ("machine", "state"),
    [
        ("host", "CONSTRUCTED"),
        ("kv-cache", "UNRESOLVED"),
        ("program-compiler", "OPEN"),
        ("trace-compiler", "REGISTERING"),
    ],
)
def test_cli_diagram(machine: str, state: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lifecycle", "diagram", "--machine", machine]) == 0
    out = capsys.readouterr().out
    assert out.startswith("stateDiagram-v2")
    assert f"class {state} current" in out


def test_cli_diagram_current_and_bad_state(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lifecycle", "diagram", "--current", "serving"]) == 0
    assert "class SERVING current" in capsys.readouterr().out
    assert main(["lifecycle", "diagram", "--current", "nope"]) == 2
    err = capsys.readouterr().err
    assert "'nope' is not a state of host" in err and "CONSTRUCTED" in err


def test_cli_rejects_unknown_machine(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lifecycle", "diagram", "--machine", "toaster"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_journal_is_append_only_snapshot() -> None:
    journal = Journal()
    first = journal.record(
        machine="m",
        trigger="t",
        source="A",
        dest="B",
        started=0.0,
        duration_s=0.5,
        outcome=Outcome.OK,
        detail="d",
    )
    snapshot = journal.entries
    journal.record(
        machine="m",
        trigger="u",
        source="B",
        dest="B",
        started=1.0,
        duration_s=0.0,
        outcome=Outcome.FAILED,
        error=ValueError("bad"),
    )
    assert snapshot == (first,)
    assert [e.sequence for e in journal] == [1, 2]
    assert journal.entries[1].error == "ValueError: bad"
    assert journal.durations_by_dest() == {"B": 0.5}
    assert "m.t: A -> B [ok] 500.000 ms (d)" in journal.format()


def test_host_journal_times_phases() -> None:
    host = ToyHost(Pool())
    host.start()
    durations = host.journal.durations_by_dest()
    assert set(durations) == {"CAPACITY_RESOLVED", "SEALED", "ALLOCATED", "COMPILED", "SERVING"}
    assert all(value >= 0.0 for value in durations.values())

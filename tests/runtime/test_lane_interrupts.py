"""A Ctrl-C that lands while a lane worker is being started is not lost.

The worker must start with SIGINT ignored (so it prints no traceback of its own), which
means the parent's disposition is SIG_IGN for that moment; the signal is blocked around it,
so it stays pending and reaches the parent when the start is over.
"""

from __future__ import annotations

import signal
import threading

import pytest

from runtime.lanes.process import _interrupts_ignored

pytestmark = pytest.mark.skipif(
    not hasattr(signal, "pthread_sigmask"), reason="needs POSIX signal masks"
)


def _interrupt() -> None:
    """SIGINT to the main thread (a process-wide one may land on another thread of pytest,
    whose masks these tests do not set)."""
    signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)


def test_a_ctrl_c_during_a_worker_start_is_delivered_after_it() -> None:
    reached_the_end = False
    with pytest.raises(KeyboardInterrupt), _interrupts_ignored():
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        _interrupt()  # a terminal's Ctrl-C, mid-start
        reached_the_end = True
    assert reached_the_end  # the start itself was not interrupted
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())


def test_a_ctrl_c_pending_before_the_start_stops_it() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    _interrupt()
    started = False
    with pytest.raises(KeyboardInterrupt), _interrupts_ignored():
        started = True
    assert not started
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())

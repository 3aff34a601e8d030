"""Shared pytest setup: Hypothesis profiles `ci` (default) and `thorough`, and Ctrl-C as a
terminal delivers it."""

from __future__ import annotations

import os
import signal

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    max_examples=500,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# A run started as a background job of a script (`make test &`) begins with SIGINT ignored,
# and an ignored signal stays ignored across exec, in every process the tests start: the
# Ctrl-C tests would then see nothing. Restore the interpreter's own handler (children get
# the default disposition back at exec, and Python installs its handler there again).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

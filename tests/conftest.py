"""Fixtures for every unit test."""

import pytest

from utils import profile


@pytest.fixture(autouse=True)
def _fresh_profiler_state():
    """Each test starts as a fresh process would: no profiler session has run yet (utils.bench refuses to time
    after one, process-wide)."""
    saved = list(profile._SESSIONS)
    profile._SESSIONS.clear()
    yield
    profile._SESSIONS[:] = saved

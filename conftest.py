"""Repository-wide pytest hooks: the CPU time budget of every notebook run by nbmake."""

from __future__ import annotations

import pytest

#: On a machine without a CUDA GPU (CI: 2 cores) every notebook must finish within this many seconds.
#: nbmake's --nbmake-timeout (set in README's test command) stops a single hanging cell sooner.
NOTEBOOK_BUDGET_S = 120


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when != "call" or item.path.suffix != ".ipynb" or not report.passed:
        return
    import torch

    if not torch.cuda.is_available() and call.duration > NOTEBOOK_BUDGET_S:
        report.outcome = "failed"
        report.longrepr = (f"{item.path.name} ran {call.duration:.0f} s on CPU; the budget is {NOTEBOOK_BUDGET_S} s: "
                           "choose smaller CPU sizes with utils.env.by_device")

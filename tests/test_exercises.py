"""The exercises: every check accepts its solution (tests/solutions), rejects the stub the notebook ships and at
least one plausible wrong answer, explains the miss, and never raises."""

from __future__ import annotations

import ast
import importlib
import inspect

import nbformat
import pytest
import torch

import utils
from tools import course
from utils import exercises


def _cases():
    """(check, solution arguments, wrong answers) for every check of every notebook's module, from the CASES of
    tests/solutions/<module>.py."""
    found = []
    for module_name in exercises.NOTEBOOK_MODULES:
        solutions = importlib.import_module(f"tests.solutions.{module_name}")
        for name, (solution, wrong) in solutions.CASES.items():
            found.append((getattr(getattr(exercises, module_name), name), solution, wrong))
    return found


CASES = _cases()
IDS = [f"{check.__module__.rsplit('.', 1)[1]}.{check.__name__}" for check, _, _ in CASES]


@pytest.mark.parametrize(("check", "solution", "wrong"), CASES, ids=IDS)
def test_check_accepts_the_solution(check, solution, wrong, capsys):
    feedback = check(*solution)
    assert feedback.status == "correct", feedback.message
    assert "✅" in capsys.readouterr().out  # the notebook shows it


@pytest.mark.parametrize(("check", "solution", "wrong"), CASES, ids=IDS)
def test_check_rejects_plausible_wrong_answers_and_says_why(check, solution, wrong):
    assert wrong, "every check needs at least one plausible wrong answer"
    for what, args, phrase in wrong:
        feedback = check(*args)
        assert feedback.status == "wrong", f"accepted an answer that {what}"
        assert phrase.lower() in feedback.message.lower(), f"{what}: the feedback does not say why: {feedback}"


@pytest.mark.parametrize(("check", "solution", "wrong"), CASES, ids=IDS)
def test_check_never_raises(check, solution, wrong):
    def broken(*args, **kwargs):
        raise ValueError("a bug in the reader's code")

    feedback = check(*[broken] * len(solution))
    assert feedback.status == "wrong" and "ValueError" in feedback.message
    feedback = check(*[None] * len(solution))  # not even a function
    assert feedback.status == "wrong"


def test_every_check_has_cases():
    checks = {(m.__name__, name) for m in (getattr(exercises, n) for n in exercises.NOTEBOOK_MODULES)
              for name, fn in inspect.getmembers(m, inspect.isfunction)
              if hasattr(fn, "__wrapped__") and fn.__module__ == m.__name__}
    covered = {(check.__module__, check.__name__) for check, _, _ in CASES}
    assert checks == covered, f"checks without CASES in tests/solutions: {checks - covered}"


# ── The stubs the notebooks ship ──────────────────────────────────────────────────────────────────────────────


def _exercise_cells(path):
    nb = nbformat.read(path, as_version=4)
    start = next(i for i, c in enumerate(nb.cells) if c.cell_type == "markdown"
                 and "## Exercises" in course.cell_source(c))
    return [course.cell_source(c) for c in nb.cells[start:] if c.cell_type == "code"]


def _check_calls(source):
    """(module, check, [names of positional arguments]) of every utils.exercises.<module>.<check>(...) call."""
    calls = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            parts, value = [node.func.attr], node.func.value
            while isinstance(value, ast.Attribute):
                parts.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name):
                dotted = [value.id, *reversed(parts)]
                if dotted[:2] == ["utils", "exercises"] and len(dotted) == 4:
                    calls.append((dotted[2], dotted[3], [a.id for a in node.args if isinstance(a, ast.Name)]))
    return calls


NOTEBOOKS_WITH_CHECKS = [p for p in course.notebooks() if any(_check_calls(s) for s in _exercise_cells(p))]


@pytest.mark.parametrize("path", NOTEBOOKS_WITH_CHECKS, ids=[p.name for p in NOTEBOOKS_WITH_CHECKS])
def test_shipped_stubs_are_not_attempted(path, capsys):
    """Run the notebook's own stub cells, then every check its check cells call: each says 'not attempted'."""
    cells = _exercise_cells(path)
    stubs = [s for s in cells if "NotImplementedError" in s and not _check_calls(s)]
    assert stubs, f"{path.name}: no stub cell (one that raises NotImplementedError) after '## Exercises'"
    namespace = {"torch": torch, "utils": utils, "math": importlib.import_module("math")}
    for source in stubs:
        exec(compile(source, f"{path.name}:stub", "exec"), namespace)
    calls = [call for s in cells for call in _check_calls(s)]
    assert calls, f"{path.name}: no check cell calls utils.exercises"
    for module, name, arg_names in calls:
        check = getattr(getattr(exercises, module), name)
        feedback = check(*[namespace[n] for n in arg_names])
        assert feedback.status == "not attempted", f"{path.name}: {module}.{name} on the shipped stub: {feedback}"


def test_check_cells_never_assert():
    for path in course.notebooks():
        for source in _exercise_cells(path):
            if _check_calls(source):
                assert "assert " not in source, f"{path.name}: an exercise check cell must never fail the run"


def test_no_host_sync_turns_a_synchronisation_error_into_feedback():
    expected = r"host wait for the GPU \(called a synchronizing CUDA operation\): keep it"
    with pytest.raises(exercises.Miss, match=expected), exercises.no_host_sync("cpu", "keep it on the device"):
        raise RuntimeError("called a synchronizing CUDA operation")
    # anything else propagates unchanged
    with pytest.raises(RuntimeError, match="another error"), exercises.no_host_sync("cpu", "keep it"):
        raise RuntimeError("another error")


def test_no_host_sync_keeps_the_debug_modes_notice_out(monkeypatch):
    """Setting sync-debug mode warns that it is a prototype: not shown, not an error under -W error, not a sync."""
    import warnings

    modes = []

    def set_mode(mode):
        modes.append(mode)
        warnings.warn("Synchronization debug mode is a prototype feature and does not yet detect all synchronizing "
                      "operations", UserWarning, stacklevel=2)

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", set_mode)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning that escapes fails the test
        with exercises.no_host_sync("cuda", "keep it"):
            pass
        with pytest.raises(exercises.Miss, match="host wait"), exercises.no_host_sync("cuda", "keep it"):
            raise RuntimeError("called a synchronizing CUDA operation")
    assert modes == ["error", "default", "error", "default"]  # set, and always reset


# ── 00 · Install check: what the checks add from the notebook's measurements ──────────────────────────────────


def test_install_check_rate_at_clock_puts_the_clock_against_the_measured_drop():
    from tests.solutions import install_check as solution

    check = exercises.install_check.rate_at_clock
    same = check(solution.rate_at_clock, burst_tflops=787.5, burst_mhz=1980.0, sustained_tflops=670.8,
                 sustained_mhz=1900.0, burst_n=8192, sustained_n=8192)
    assert same.correct and "the clock explains" in same.message
    within = check(solution.rate_at_clock, burst_tflops=787.5, burst_mhz=1980.0, sustained_tflops=670.8,
                   sustained_mhz=1755.0, burst_n=8192, sustained_n=8192)  # 698 against 671: within 5 points
    assert within.correct and "accounts for the drop" in within.message  # the notebook's own rule
    sized = check(solution.rate_at_clock, burst_tflops=5.0, burst_mhz=1590.0, sustained_tflops=4.2,
                  sustained_mhz=1200.0, burst_n=2048, sustained_n=8192)  # a T4's burst is sized down to ≤ 5 ms
    assert sized.correct and "differ by size" in sized.message and "explains" not in sized.message
    cpu = check(solution.rate_at_clock, burst_tflops=0.2, burst_mhz=None, sustained_tflops=0.2, sustained_mhz=None,
                burst_n=512, sustained_n=512)
    assert cpu.correct and cpu.message == "the rate scales with the clock."

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
from tests.solutions import device_management as dm_solution
from tests.solutions import install_check as ic_solution
from tests.solutions import training_loop as tl_solution
from tools import course
from utils import exercises

# (check, the solution's arguments, [(what the wrong answer does, its arguments, a phrase the feedback must say)])
CASES = [
    (exercises.install_check.ridge_point, [ic_solution.ridge_point], [
        ("divides TFLOP/s by GB/s", [lambda t, g: t / g], "factor of 1,000"),
        ("inverts the ratio", [lambda t, g: g * 1e9 / (t * 1e12)], "bytes per FLOP"),
    ]),
    (exercises.install_check.min_time_s, [ic_solution.min_time_s], [
        ("counts only the read", [lambda n, i, b: n * i / (b * 1e9)], "only the read"),
        ("forgets the 10⁹", [lambda n, i, b: 2 * n * i / b], "units"),
        ("ignores the element size", [lambda n, i, b: 8 * n / (b * 1e9)], "element size"),
    ]),
    (exercises.install_check.rate_at_clock, [ic_solution.rate_at_clock], [
        ("inverts the clock ratio", [lambda d, m, c: d * m / c], "upside down"),
        ("subtracts the MHz", [lambda d, m, c: d - (m - c)], "proportion"),
    ]),
    (exercises.device_management.normalise_rows, [dm_solution.normalise_rows], [
        ("hard-codes .cuda()", [lambda x: x.cuda() / x.norm(dim=1, keepdim=True)], "cuda"),
        ("normalises columns", [lambda x: x / x.norm(dim=0, keepdim=True)], "unit norm"),
        ("works in place", [lambda x: x.div_(x.norm(dim=1, keepdim=True))], "in place"),
    ]),
    (exercises.device_management.load_on_cpu, [dm_solution.load_on_cpu], [
        ("moves after loading", [lambda p: {k: v.cpu() for k, v in torch.load(p, weights_only=True).items()}],
         "map_location"),
    ]),
    (exercises.device_management.three_stage_time_s, [dm_solution.three_stage_time_s], [
        ("steady-state bound", [lambda n, a, b, c: n * max(a, b, c)], "steady-state"),
        ("serial time", [lambda n, a, b, c: n * (a + b + c)], "serial"),
    ]),
    (exercises.training_loop.correct_on_device, [tl_solution.correct_on_device], [
        ("reads the count with .item()", [lambda m, x, y: (m(x).argmax(1) == y).sum().item()], "Python int"),
        ("returns the accuracy", [lambda m, x, y: (m(x).argmax(1) == y).float().mean()], "fraction"),
        ("forgets the argmax", [lambda m, x, y: (m(x)[:, 0] > 0).long().eq(y).sum()], "correct predictions"),
    ]),
    (exercises.training_loop.checkpoint_round_trip, [tl_solution.save_checkpoint, tl_solution.load_checkpoint], [
        ("saves the model only",
         [lambda path, m, o, e: torch.save({"model": m.state_dict(), "epoch": e}, path),
          lambda path, m, o: m.load_state_dict(torch.load(path, weights_only=True)["model"]) and None or
          torch.load(path, weights_only=True)["epoch"]],
         "optimizer.state_dict()"),
        ("forgets the epoch",
         [tl_solution.save_checkpoint, lambda path, m, o: tl_solution.load_checkpoint(path, m, o) and None],
         "returns None"),
    ]),
]
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
    checks = {(m.__name__, name) for m in (exercises.install_check, exercises.device_management,
                                           exercises.training_loop)
              for name, fn in inspect.getmembers(m, inspect.isfunction) if hasattr(fn, "__wrapped__")}
    covered = {(check.__module__, check.__name__) for check, _, _ in CASES}
    assert checks == covered, f"checks without test cases: {checks - covered}"


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

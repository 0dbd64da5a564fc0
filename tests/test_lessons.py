"""A notebook is a lesson: the notebooks rewritten as lessons stay within the lesson budget (tools/lesson_budget.py,
DESIGN.md), and every notebook measures only through utils (no profiler session opened by hand, the method linked)."""

from __future__ import annotations

import re

import nbformat
import pytest

from tools import course, lesson_budget

NOTEBOOKS = course.notebooks()
IDS = [p.name for p in NOTEBOOKS]
METHOD_LINK = "README.md#how-the-course-measures"


def test_lessons_are_real_notebooks():
    assert {p.stem for p in NOTEBOOKS} >= lesson_budget.LESSONS


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.stem in lesson_budget.LESSONS],
                         ids=[p.name for p in NOTEBOOKS if p.stem in lesson_budget.LESSONS])
def test_lesson_is_within_the_budget(path):
    over = lesson_budget.over_budget(lesson_budget.measure(path))
    assert not over, f"{path.name} is over the lesson budget: {'; '.join(over)}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_no_warning_lines_in_committed_outputs(path):
    assert lesson_budget.measure(path)["⚠ lines"] == 0, "a ⚠ guard in the outputs: the protocol makes guards unneeded"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_profiler_sessions_go_through_utils(path):
    """utils.bench refuses to time after a profile only if it knows one ran: open sessions with utils.profile."""
    nb = nbformat.read(path, as_version=4)
    code = "\n".join(course.cell_source(c) for c in nb.cells if c.cell_type == "code")
    by_hand = re.findall(r"(?:torch\.profiler\.profile|(?<![\w.])profile)\(", code)
    assert not by_hand, f"{path.name} opens a profiler by hand: use utils.profile.session(...) or profile_steps"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_the_method_is_linked_not_repeated(path):
    nb = nbformat.read(path, as_version=4)
    prose = "\n".join(course.cell_source(c) for c in nb.cells if c.cell_type == "markdown")
    assert METHOD_LINK in prose, f"{path.name} should link to how the course measures ({METHOD_LINK})"


def test_budget_flags_what_is_over():
    row = {k: 0 for k in lesson_budget.BUDGET} | {"kernel lines": 0, "first output at": None}
    assert lesson_budget.over_budget(row) == []
    assert lesson_budget.over_budget(row | {"max lines": 30, "kernel lines": 30}) == ["max lines: 30 > 25"]
    assert lesson_budget.over_budget(row | {"kernel lines": 41}) == ["kernel lines: 41 > 40"]


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.stem in lesson_budget.LESSONS],
                         ids=[p.name for p in NOTEBOOKS if p.stem in lesson_budget.LESSONS])
def test_what_you_learn_has_at_most_six_bullets(path):
    title = course.cell_source(nbformat.read(path, as_version=4).cells[0])
    block = title.split("What you'll learn", 1)[1].split("\n\n", 1)[0]
    bullets = [line for line in block.splitlines() if line.startswith("- ")]
    assert 1 <= len(bullets) <= 6, f"{path.name}: 'What you'll learn' has {len(bullets)} bullets (1 to 6)"

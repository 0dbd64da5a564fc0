"""The notebooks' self-checking exercises: one module per notebook, each check a function of the reader's answer.

Each notebook has a module of checks named after its topic (``install_check.py`` for 00, ``training_loop.py`` for
02, ...); every module here is imported with the package. An exercise cell ships as a stub the reader completes
(it raises ``NotImplementedError``); the cell after it calls a check from here, e.g.
``utils.exercises.install_check.ridge_point(ridge_point)``, which prints one of

    ⏳ not attempted yet: ...            the stub still raises NotImplementedError (or returns the placeholder)
    ✅ correct: ...                     the answer passed every test the check runs
    ❌ not yet right: ...               what is wrong, e.g. "off by 1,000: TFLOP/s is 10¹², GB/s only 10⁹"

and returns the :class:`Feedback`. A check never raises and never stops the notebook: nbmake and the reference
run pass with the stubs in place. A check tests *behaviour* on cases it builds itself (known answers from an
independent source, properties the answer must have, or what PyTorch does when asked) and never re-computes
the formula the exercise text gave. Solutions live outside the notebooks, in ``tests/solutions/``; the tests
prove that every check accepts its solution and rejects the stub and at least one plausible wrong answer.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

Status = Literal["not attempted", "correct", "wrong"]
_ICONS = {"not attempted": "⏳ not attempted yet", "correct": "✅ correct", "wrong": "❌ not yet right"}


class Miss(Exception):
    """Raised inside a check with what is wrong with the answer, in words the reader can act on."""


class NotAttempted(Exception):
    """Raised inside a check when the answer is still the shipped placeholder."""


@dataclass(frozen=True)
class Feedback:
    """The outcome of one exercise check."""

    exercise: str
    status: Status
    message: str

    @property
    def correct(self) -> bool:
        return self.status == "correct"

    def __str__(self) -> str:
        return f"{_ICONS[self.status]} · {self.exercise}: {self.message}"


def exercise(title: str) -> Callable[[Callable[..., str]], Callable[..., Feedback]]:
    """Decorate a check: it returns a success message or raises :class:`Miss` / :class:`NotAttempted`; the
    decorated function prints and returns a :class:`Feedback` instead, and never raises.

    ``NotImplementedError`` from the reader's code means the stub is still there; any other exception from it
    is reported as what is wrong (its type and message), since a correct answer does not raise.
    """

    def decorate(check: Callable[..., str]) -> Callable[..., Feedback]:
        @functools.wraps(check)
        def run(*args, **kwargs) -> Feedback:
            try:
                feedback = Feedback(title, "correct", check(*args, **kwargs))
            except (NotImplementedError, NotAttempted) as err:
                detail = str(err) or "replace the `raise NotImplementedError` with your answer"
                feedback = Feedback(title, "not attempted", detail)
            except Miss as miss:
                feedback = Feedback(title, "wrong", str(miss))
            except Exception as err:  # the reader's code failed: say how, never stop the notebook
                first_line = (str(err).strip().splitlines() or [""])[0][:300]
                feedback = Feedback(title, "wrong", f"your code raised {type(err).__name__}: {first_line}")
            print(feedback)
            return feedback

        return run

    return decorate


def close(value: float, expected: float, rel: float = 1e-6) -> bool:
    """True if ``value`` is within ``rel`` (relative) of ``expected``."""
    return abs(value - expected) <= rel * abs(expected)


@contextlib.contextmanager
def no_host_sync(device, advice: str) -> Iterator[None]:
    """Run the reader's code with CUDA's sync-debug mode set to raise: a host synchronisation inside the block
    becomes a :class:`Miss` that says so, followed by ``advice``. On a CPU there is nothing to wait for."""
    import torch

    cuda = torch.device(device).type == "cuda"
    # Setting the mode warns "Synchronization debug mode is a prototype feature ...": setting and resetting it inside
    # the filter keeps that line out of the notebook, and under `-W error` it never becomes an exception either.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        except RuntimeError as err:
            if "synchronizing" in str(err) and "prototype feature" not in str(err):  # the error, not the notice
                raise Miss(f"it makes the host wait for the GPU ({str(err).splitlines()[0][:90]}): {advice}") from None
            raise
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")


def _import_notebook_modules() -> list[str]:
    """Import every notebook's module of checks (utils/exercises/<topic>.py), so that
    ``utils.exercises.<topic>.<check>`` works after ``import utils``; returns their names."""
    import importlib
    import pkgutil

    names = sorted(m.name for m in pkgutil.iter_modules(__path__))
    for name in names:
        importlib.import_module(f"{__name__}.{name}")
    return names


NOTEBOOK_MODULES = _import_notebook_modules()

__all__ = ["NOTEBOOK_MODULES", "Feedback", "Miss", "NotAttempted", "close", "exercise", *NOTEBOOK_MODULES]

"""Controls for "a function of a few parameters → a table or a plot", readable where widgets do not render.

    calculator = utils.explore.explore(
        predict,                                             # predict(batch=..., precision=...) prints its result
        {"batch": utils.explore.Slider(1, 256, value=32),
         "precision": utils.explore.Choice(["fp32", "bf16"])},
        actions={"Measure on this GPU": measure})            # expensive work: only when its button is pressed

What :func:`explore` does, in this order:

1. It calls ``fn`` once with the controls' default values, as a plain call: what that prints or plots is the
   cell's static output, the result that GitHub, nbmake and a static export show. An error there is raised, like
   any cell's.
2. In a Jupyter kernel with ``ipywidgets`` installed (JupyterLab, Notebook, VS Code, Colab), it shows the controls
   and, below them, an output area. With ``button=None`` each change of a control re-runs ``fn`` there (sliders
   and text boxes report a change when released or on Enter, not on every tick); with ``button="Run"`` only the
   button does — for work that takes more than a moment, such as a measurement. Each entry of ``actions`` adds a
   button that runs another function of the same values. An exception from a run is printed in the output area,
   where the reader can fix the value, instead of being raised from a widget callback, where nobody would see it.
3. Otherwise — ``ipywidgets`` missing, or a plain Python process or terminal IPython, which cannot draw widgets —
   it prints one line saying why there are no controls and how to get them. Nothing else changes.

A function receives the values as keyword arguments named like the controls; whatever it returns is kept in
:attr:`Explorer.result`. Tests drive an :class:`Explorer` headless: set ``explorer.controls[name].value`` and call
``explorer.buttons[label].click()``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Choice", "Explorer", "Number", "Slider", "Text", "Toggle", "explore", "widget_support"]


# ── Controls: what a parameter may take, independent of ipywidgets ──────────────────────────────────────────


@dataclass(frozen=True)
class Slider:
    """A number between ``low`` and ``high`` (integers when ``low``, ``high``, ``step`` and ``value`` all are)."""

    low: float
    high: float
    step: float | None = None
    value: float | None = None
    label: str | None = None

    def __post_init__(self) -> None:
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (self.low, self.high)):
            raise TypeError(f"Slider bounds must be numbers, got low={self.low!r}, high={self.high!r}")
        if not self.low < self.high:
            raise ValueError(f"Slider needs low < high, got low={self.low}, high={self.high}")
        if self.step is not None and not self.step > 0:
            raise ValueError(f"Slider step must be positive, got {self.step}")
        if self.value is not None and not self.low <= self.value <= self.high:
            raise ValueError(f"Slider value {self.value} is outside [{self.low}, {self.high}]")

    @property
    def integer(self) -> bool:
        return all(isinstance(v, int) for v in (self.low, self.high, self.step, self.value) if v is not None)

    @property
    def default(self) -> float:
        return self.low if self.value is None else self.value


@dataclass(frozen=True)
class Choice:
    """One of ``options``: a sequence of values (shown as ``str(value)``) or a mapping ``{label: value}``."""

    options: Sequence[Any] | Mapping[str, Any]
    value: Any = None
    label: str | None = None
    pairs: tuple[tuple[str, Any], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.options, (str, bytes)):
            raise TypeError(f"Choice options must be a sequence or a mapping of options, got the string "
                            f"{self.options!r}")
        items = self.options.items() if isinstance(self.options, Mapping) else ((str(o), o) for o in self.options)
        pairs = tuple((str(label), value) for label, value in items)
        if not pairs:
            raise ValueError("Choice needs at least one option")
        if self.value is not None and not any(v == self.value for _, v in pairs):
            raise ValueError(f"Choice value {self.value!r} is not one of the options "
                             f"{[label for label, _ in pairs]}")
        object.__setattr__(self, "pairs", pairs)

    @property
    def default(self) -> Any:
        return self.pairs[0][1] if self.value is None else self.value


@dataclass(frozen=True)
class Toggle:
    """On or off."""

    value: bool = False
    label: str | None = None

    @property
    def default(self) -> bool:
        return bool(self.value)


@dataclass(frozen=True)
class Text:
    """A line of text (a prompt, a name)."""

    value: str = ""
    label: str | None = None
    placeholder: str = ""

    @property
    def default(self) -> str:
        return self.value


@dataclass(frozen=True)
class Number:
    """Any number typed in (no bounds: ``1e-8`` or ``70000`` alike)."""

    value: float = 0.0
    label: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.value, bool) or not isinstance(self.value, (int, float)):
            raise TypeError(f"Number value must be a number, got {self.value!r}")

    @property
    def default(self) -> float:
        return float(self.value)


Control = Slider | Choice | Toggle | Text | Number


# ── Where widgets can be drawn ─────────────────────────────────────────────────────────────────────────────


def widget_support() -> str | None:
    """None when widgets can be shown here; otherwise the reason they cannot, in words."""
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return "ipywidgets is not installed (pip install ipywidgets)"
    try:
        from IPython import get_ipython
    except ImportError:
        return "this is not an IPython process"
    shell = get_ipython()
    # ipykernel's shell (Jupyter, VS Code, Colab's subclass of it) talks to a frontend that can draw widgets;
    # terminal IPython and plain Python cannot
    if shell is None or not any(cls.__name__ == "ZMQInteractiveShell" for cls in type(shell).__mro__):
        return "not running in a Jupyter kernel, so there is no frontend to draw widgets"
    return None


def _widget(name: str, control: Control):
    import ipywidgets as widgets

    description = control.label or name.replace("_", " ")
    common = {"description": description, "style": {"description_width": "initial"}}
    if isinstance(control, Slider):
        cls = widgets.IntSlider if control.integer else widgets.FloatSlider
        step = control.step if control.step is not None else (1 if control.integer else (control.high - control.low)
                                                               / 100)
        return cls(value=control.default, min=control.low, max=control.high, step=step, continuous_update=False,
                   **common)
    if isinstance(control, Choice):
        return widgets.Dropdown(options=list(control.pairs), value=control.default, **common)
    if isinstance(control, Toggle):
        return widgets.Checkbox(value=control.default, indent=False, **common)
    if isinstance(control, Text):
        return widgets.Text(value=control.default, placeholder=control.placeholder, continuous_update=False,
                            layout=widgets.Layout(width="60%"), **common)
    if isinstance(control, Number):
        return widgets.FloatText(value=control.default, **common)
    raise TypeError(f"{name}: not a control (Slider, Choice, Toggle, Text or Number): {control!r}")


# ── The explorer ──────────────────────────────────────────────────────────────────────────────────────────


class Explorer:
    """The controls of one :func:`explore` call, and what its functions last computed.

    ``controls`` maps each parameter to its widget, ``buttons`` each button's label to its widget, ``output`` is
    the area the runs write to (all empty, and ``output`` None, without widgets: then :attr:`reason` says why).
    :attr:`result` is what the last run returned, :attr:`error` the exception it raised (None if it returned).
    """

    def __init__(self, fn: Callable[..., Any], controls: Mapping[str, Control], *, button: str | None,
                 actions: Mapping[str, Callable[..., Any]]) -> None:
        self.fn, self.specs, self.actions = fn, dict(controls), dict(actions)
        self.button_label = button
        self.result: Any = None
        self.error: BaseException | None = None
        self.runs = 0
        self.reason = widget_support()
        self.controls: dict[str, Any] = {}
        self.buttons: dict[str, Any] = {}
        self.output = None
        if self.reason is None:
            self._build()

    @property
    def interactive(self) -> bool:
        return self.reason is None

    @property
    def values(self) -> dict[str, Any]:
        """The values the controls hold now (their defaults without widgets)."""
        if not self.controls:
            return {name: spec.default for name, spec in self.specs.items()}
        return {name: widget.value for name, widget in self.controls.items()}

    def _build(self) -> None:
        import ipywidgets as widgets

        self.controls = {name: _widget(name, spec) for name, spec in self.specs.items()}
        self.output = widgets.Output()
        labels = ([self.button_label] if self.button_label else []) + list(self.actions)
        for label in labels:
            self.buttons[label] = widgets.Button(description=label, button_style="primary" if label ==
                                                 self.button_label else "")
            self.buttons[label].on_click(lambda _, label=label: self.run(label))
        if self.button_label is None:  # live: every change re-runs fn
            for widget in self.controls.values():
                widget.observe(lambda _: self.run(), names="value")

    def run(self, label: str | None = None) -> Any:
        """Run ``fn`` (or the action of button ``label``) with the current values, into the output area. An
        exception is printed there and kept in :attr:`error` (see the module's docstring for why)."""
        fn = self.fn if label in (None, self.button_label) else self.actions[label]
        buttons = list(self.buttons.values())
        for b in buttons:
            b.disabled = True  # one run at a time: a second click waits for the first run to end
        try:
            if self.output is None:
                return self._call(fn)
            self.output.clear_output(wait=True)
            with self.output:
                return self._call(fn)
        finally:
            for b in buttons:
                b.disabled = False

    def _call(self, fn: Callable[..., Any]) -> Any:
        self.runs += 1
        try:
            self.result, self.error = fn(**self.values), None
        except Exception as err:  # shown to the reader; the static first call raises instead (explore())
            self.result, self.error = None, err
            print(f"⚠️ {type(err).__name__}: {err}")
        return self.result

    def display(self) -> None:
        """Show the controls, the buttons and the output area (or say why there are none)."""
        if self.reason is not None:
            print(f"(No controls here: {self.reason}. Above: the result for the default values.)")
            return
        import ipywidgets as widgets
        from IPython.display import display

        if self.button_label is not None:
            hint = (f"Above: the result for the default values. Change a value, then press {self.button_label}: "
                    "the new result appears below.")
        else:
            hint = "Above: the result for the default values. Change a value: the new result appears below." + (
                " The buttons run more with the same values." if self.buttons else "")
        rows = [widgets.HTML(f"<i>{hint}</i>"), *self.controls.values()]
        if self.buttons:
            rows.append(widgets.HBox(list(self.buttons.values())))
        display(self.static_bundle(widgets.VBox([*rows, self.output])), raw=True)

    def static_bundle(self, box: Any) -> dict[str, Any]:
        """``box``'s display data with a readable plain-text form: what a copy without a kernel shows (GitHub, a
        text export, a log) instead of the widget's repr."""
        # a Choice (a dropdown, which has options) by its label, every other control by its value
        shown = {name: w.label if hasattr(w, "options") else w.value for name, w in self.controls.items()}
        names = ", ".join(f"{name} = {value!r}" for name, value in shown.items())
        return {**box._repr_mimebundle_(),
                "text/plain": f"[controls: {names}. They run in a live Jupyter or Colab kernel; above: the result "
                              "for these defaults.]"}


def _check_parameters(fn: Callable[..., Any], names: Sequence[str], what: str) -> None:
    """A clear error now, instead of a TypeError from inside a widget callback later."""
    if not callable(fn):
        raise TypeError(f"{what} must be callable, got {type(fn).__name__}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: its call will say
    params = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    missing = [n for n in names if n not in params]
    required = [n for n, p in params.items() if p.default is inspect.Parameter.empty and n not in names
                and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    if missing or required:
        raise TypeError(f"{what} {getattr(fn, '__name__', fn)}{signature} does not match the controls {list(names)}"
                        + (f": it has no parameter {missing}" if missing else "")
                        + (f": it needs {required}, which no control gives" if required else ""))


def explore(fn: Callable[..., Any], controls: Mapping[str, Control], *, button: str | None = None,
            actions: Mapping[str, Callable[..., Any]] | None = None, show: bool = True) -> Explorer:
    """Run ``fn`` with the controls' defaults (the static result), then show controls that re-run it.

    Args:
        fn: called as ``fn(**values)``; prints or plots its result; its return value is kept.
        controls: parameter name → :class:`Slider`, :class:`Choice`, :class:`Toggle`, :class:`Text` or
            :class:`Number`.
        button: ``None`` to re-run on every change, or the label of the one button that runs ``fn``.
        actions: more buttons: label → a function of the same values (e.g. a measurement next to a prediction).
        show: display the controls (a test builds them without displaying).

    Raises:
        TypeError / ValueError: a control that is not one, or a function whose parameters do not match the
            controls (named in the message). Whatever ``fn`` raises for the default values.
    """
    actions = dict(actions or {})
    if not controls:
        raise ValueError("explore() needs at least one control")
    for name, spec in controls.items():
        if not isinstance(spec, (Slider, Choice, Toggle, Text, Number)):
            raise TypeError(f"control {name!r} must be a Slider, Choice, Toggle, Text or Number, got {spec!r}")
        if isinstance(spec, Number) and not math.isfinite(spec.default):
            raise ValueError(f"control {name!r}: the default must be finite, got {spec.default}")
    _check_parameters(fn, list(controls), "fn")
    for label, action in actions.items():
        _check_parameters(action, list(controls), f"action {label!r}")
        if label == button:
            raise ValueError(f"action {label!r} has the same label as the button")
    explorer = Explorer(fn, controls, button=button, actions=actions)
    explorer.runs = 1
    explorer.result = fn(**explorer.values)  # the static result: errors raise, as in any cell
    if show:
        explorer.display()
    return explorer

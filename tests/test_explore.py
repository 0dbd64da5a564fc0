"""utils.explore: controls are checked when built; the static call runs with the defaults; headless, the widgets are
driven like a reader would (set a value, press a button) and compute the right thing; without ipywidgets or a
kernel the plain call runs and says why there are no controls."""

import re
import sys

import IPython
import pytest

from utils import explore as ex

ipywidgets = pytest.importorskip("ipywidgets", reason="requirements.txt has ipywidgets")


@pytest.fixture
def with_widgets(monkeypatch):
    """Widgets built as in a Jupyter kernel (they need no frontend to be created and driven)."""
    monkeypatch.setattr(ex, "widget_support", lambda: None)


def memory_gb(batch, precision="fp32", checkpoint=False):
    gb = batch * {"fp32": 4, "bf16": 2}[precision] // (4 if checkpoint else 1)
    print(f"{gb} GB")
    return gb


CONTROLS = {"batch": ex.Slider(1, 256, value=32), "precision": ex.Choice(["fp32", "bf16"]),
            "checkpoint": ex.Toggle()}


# ── the controls ───────────────────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(("make", "error", "phrase"), [
    (lambda: ex.Slider(5, 5), ValueError, "low < high"),
    (lambda: ex.Slider(0, 10, value=11), ValueError, "outside [0, 10]"),
    (lambda: ex.Slider(0, 10, step=0), ValueError, "step must be positive"),
    (lambda: ex.Slider("0", 10), TypeError, "must be numbers"),
    (lambda: ex.Choice([]), ValueError, "at least one option"),
    (lambda: ex.Choice(["a", "b"], value="c"), ValueError, "'c' is not one of the options"),
    (lambda: ex.Choice("fp32"), TypeError, "the string 'fp32'"),
    (lambda: ex.Number("1.5"), TypeError, "must be a number"),
])
def test_bad_controls_say_what_is_wrong(make, error, phrase):
    with pytest.raises(error, match=phrase.replace("[", r"\[").replace("]", r"\]")):
        make()


def test_control_defaults_and_kinds():
    assert ex.Slider(1, 256, value=32).integer and ex.Slider(1, 256).default == 1
    assert not ex.Slider(0.0, 1.0).integer and not ex.Slider(1, 256, step=0.5).integer
    assert ex.Choice({"bf16 (2 bytes)": 2, "fp32 (4 bytes)": 4}).default == 2
    assert ex.Choice([8, 16], value=16).default == 16
    assert ex.Toggle(True).default is True and ex.Text("hi").default == "hi" and ex.Number(3).default == 3.0


def test_functions_that_do_not_match_the_controls_are_refused():
    with pytest.raises(TypeError, match=r"has no parameter \['checkpoint'\]"):
        ex.explore(lambda batch, precision: None, CONTROLS, show=False)
    with pytest.raises(TypeError, match=r"needs \['seq'\]"):
        ex.explore(lambda batch, precision, checkpoint, seq: None, CONTROLS, show=False)
    with pytest.raises(TypeError, match="action 'Measure'"):
        ex.explore(memory_gb, CONTROLS, actions={"Measure": lambda batch: None}, show=False)
    with pytest.raises(TypeError, match="must be a Slider"):
        ex.explore(memory_gb, {"batch": 32}, show=False)
    with pytest.raises(ValueError, match="at least one control"):
        ex.explore(memory_gb, {}, show=False)
    ex.explore(lambda **values: None, CONTROLS, show=False)  # **kwargs takes any control


# ── the static call and the fallback ─────────────────────────────────────────────────────────────────────────


def test_outside_a_kernel_the_default_result_is_printed_and_the_reason_given(capsys):
    explorer = ex.explore(memory_gb, CONTROLS)  # pytest is no Jupyter kernel
    out = capsys.readouterr().out
    assert out.startswith("128 GB") and explorer.result == 128 and explorer.runs == 1
    assert not explorer.interactive and "not running in a Jupyter kernel" in out
    assert explorer.controls == {} and explorer.output is None and explorer.values["precision"] == "fp32"


def test_without_ipywidgets_the_plain_call_still_runs(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # import ipywidgets now raises ImportError
    assert "ipywidgets is not installed" in ex.widget_support()
    explorer = ex.explore(memory_gb, CONTROLS, button="Run")
    assert explorer.result == 128 and "ipywidgets is not installed (pip install ipywidgets)" in capsys.readouterr().out


def test_an_error_for_the_defaults_fails_the_cell():
    with pytest.raises(KeyError):
        ex.explore(memory_gb, {**CONTROLS, "precision": ex.Choice(["fp8"])}, show=False)


@pytest.mark.parametrize(("shell_bases", "drawable"), [
    (("ZMQInteractiveShell",), True),           # JupyterLab, Notebook, VS Code
    (("ZMQInteractiveShell", "Shell"), True),   # Colab: google.colab._shell.Shell subclasses it
    (("TerminalInteractiveShell",), False),     # terminal IPython cannot draw widgets
])
def test_which_shells_can_draw_widgets(monkeypatch, shell_bases, drawable):
    cls = type(shell_bases[0], (), {})
    for name in shell_bases[1:]:
        cls = type(name, (cls,), {})
    monkeypatch.setattr(IPython, "get_ipython", lambda: cls())
    assert (ex.widget_support() is None) == drawable


# ── driven headless, as a reader would ─────────────────────────────────────────────────────────────────────


def test_live_controls_rerun_on_every_change(with_widgets, capsys):
    explorer = ex.explore(memory_gb, CONTROLS, show=False)
    assert explorer.interactive and isinstance(explorer.controls["batch"], ipywidgets.IntSlider)
    assert isinstance(explorer.controls["precision"], ipywidgets.Dropdown) and explorer.buttons == {}
    explorer.controls["batch"].value = 64
    assert explorer.result == 256 and explorer.runs == 2
    explorer.controls["precision"].value = "bf16"
    explorer.controls["checkpoint"].value = True
    assert explorer.result == 32 and explorer.runs == 4
    # (outside a kernel, clearing the output area prints terminal escapes: only the results are compared)
    assert re.findall(r"(\d+) GB", capsys.readouterr().out) == ["128", "256", "128", "32"]


def test_with_a_button_nothing_runs_until_it_is_pressed(with_widgets):
    measured = []
    explorer = ex.explore(memory_gb, CONTROLS, button="Run", actions={"Measure": lambda **v: measured.append(v)},
                          show=False)
    explorer.controls["batch"].value = 200
    assert explorer.runs == 1 and explorer.result == 128  # the slider alone does not run the work
    explorer.buttons["Run"].click()
    assert explorer.result == 800 and explorer.runs == 2 and not explorer.buttons["Run"].disabled
    explorer.buttons["Measure"].click()
    assert measured == [{"batch": 200, "precision": "fp32", "checkpoint": False}]


def test_an_error_in_a_run_is_shown_not_raised(with_widgets, capsys):
    def pick(word):
        if not word:
            raise ValueError("type a word first")
        return word.upper()

    explorer = ex.explore(pick, {"word": ex.Text("gpu")}, show=False)
    explorer.controls["word"].value = ""
    assert explorer.result is None and isinstance(explorer.error, ValueError)
    assert "⚠️ ValueError: type a word first" in capsys.readouterr().out
    explorer.controls["word"].value = "cuda"
    assert explorer.result == "CUDA" and explorer.error is None


def test_every_control_kind_builds_its_widget(with_widgets):
    explorer = ex.explore(lambda **values: values, {
        "steps": ex.Slider(0.0, 1.0, value=0.5), "mode": ex.Choice({"eager": 0, "compiled": 1}, value=1),
        "on": ex.Toggle(True), "prompt": ex.Text("Hello", placeholder="a prompt"), "value": ex.Number(1e-8)},
        show=False)
    kinds = {name: type(w).__name__ for name, w in explorer.controls.items()}
    assert kinds == {"steps": "FloatSlider", "mode": "Dropdown", "on": "Checkbox", "prompt": "Text",
                     "value": "FloatText"}
    assert explorer.result == {"steps": 0.5, "mode": 1, "on": True, "prompt": "Hello", "value": 1e-8}
    assert explorer.controls["mode"].label == "compiled"
    explorer.display()  # builds the layout without a frontend
    from ipywidgets import VBox

    text = explorer.static_bundle(VBox())["text/plain"]  # what a copy without a kernel shows instead of a repr
    assert text.startswith("[controls: steps = 0.5, mode = 'compiled', on = True") and "live Jupyter" in text

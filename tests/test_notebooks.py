"""Hygiene of every notebook: format, anatomy, the canonical setup cell, stamps, deprecated APIs, lint."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import warnings
from pathlib import Path

import nbformat
import pytest

from tools import course, readme_tables, reference_run
from utils.results import RUN_FIELDS, read_results_file

NOTEBOOKS = course.notebooks()
IDS = [p.name for p in NOTEBOOKS]


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks/NN_topic.ipynb found"
    stray = [p.name for p in course.NOTEBOOK_DIR.glob("*.ipynb") if not course.NOTEBOOK_NAME.match(p.name)]
    assert not stray, f"notebooks must be named NN_topic.ipynb: {stray}"


@pytest.fixture(params=NOTEBOOKS, ids=IDS)
def notebook(request):
    path = request.param
    return path, nbformat.read(path, as_version=4)


def test_valid_nbformat_and_metadata(notebook):
    path, nb = notebook
    nbformat.validate(nb)
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3", "kernelspec must be python3"
    assert nb.metadata.get("accelerator") == "GPU", "metadata.accelerator = 'GPU' makes Colab open a GPU runtime"


def test_title_cell(notebook):
    path, nb = notebook
    title = nb.cells[0]
    assert title.cell_type == "markdown", "the first cell is the title cell (markdown)"
    text = course.cell_source(title)
    number = course.number(path.stem)
    assert re.match(rf"^# {number} · \S", text), f"title must start with '# {number} · Topic'"
    assert course.colab_badge(path) in text, "the title cell needs the Colab badge pointing at this notebook"
    for part in ("What you'll learn", "Runs on", "Run time"):
        assert part in text, f"the title cell must say {part!r}"


def test_setup_cell_is_canonical(notebook):
    path, nb = notebook
    setup = nb.cells[1]
    assert setup.cell_type == "code" and course.cell_source(setup) == course.setup_cell_source(), (
        "the second cell must be the canonical setup cell: run `python -m tools.course --sync`"
    )


def test_ends_with_summary_and_self_checking_exercises(notebook):
    """Summary, then exercises that are exercises: a stub the reader completes (it raises NotImplementedError) and a
    check cell that calls utils.exercises and never fails the run (no assert)."""
    path, nb = notebook
    headings = [course.cell_source(c) for c in nb.cells if c.cell_type == "markdown"]
    assert any("## Summary" in h for h in headings), "a notebook ends with a '## Summary'"
    exercises = next((i for i, c in enumerate(nb.cells)
                      if c.cell_type == "markdown" and "## Exercises" in course.cell_source(c)), None)
    assert exercises is not None, "a notebook ends with '## Exercises'"
    code = [course.cell_source(c) for c in nb.cells[exercises:] if c.cell_type == "code"]
    assert any("raise NotImplementedError" in src for src in code), "the exercises ship as stubs (NotImplementedError)"
    checks = [src for src in code if "utils.exercises." in src]
    assert checks, "a check cell after the stubs calls utils.exercises"
    assert not any(re.search(r"^\s*assert\b", src, re.M) for src in code), "exercise cells never fail the run"


def test_outputs_are_absent_or_stamped_fresh(notebook):
    path, nb = notebook
    if not course.has_outputs(nb):
        warnings.warn(f"{path.name} has no outputs: not yet run on a GPU", stacklevel=1)
        return
    stamp = nb.metadata.get("reference_run")
    assert stamp, f"{path.name} has outputs but no reference_run stamp: clear them or run tools/reference_run"
    assert set(stamp) >= set(RUN_FIELDS), f"{path.name}: the stamp lacks {sorted(set(RUN_FIELDS) - set(stamp))}"
    assert stamp["sources_sha256"] == course.sources_sha256(nb), (
        f"{path.name}: outputs are stale (sources changed since the reference run on {stamp['date']}): "
        "re-run it on a GPU with `python -m tools.reference_run` or clear its outputs"
    )
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"{path.name}: committed outputs contain an error"


def test_stamped_figures_match_results_file(notebook):
    path, nb = notebook
    stamp = nb.metadata.get("reference_run")
    if not stamp or not course.has_outputs(nb):
        pytest.skip("not run on a GPU yet")
    from utils.env import gpu_slug

    results_file = readme_tables.RESULTS_DIR / f"{gpu_slug(stamp['gpu'])}.json"
    assert results_file.exists(), f"{results_file.name} missing: commit what the reference run wrote"
    committed = read_results_file(results_file).get(path.stem)
    assert committed is not None, f"{results_file.name} has no entry for {path.stem}: commit what the run wrote"
    assert committed["figures"] == reference_run.recorded_results(nb), (
        f"{results_file.name}[{path.stem}] differs from the figures recorded in the notebook's outputs"
    )
    assert committed["run"] == dict(stamp), f"{results_file.name}[{path.stem}]'s run record is not the notebook's stamp"


def test_run_time_line_is_the_stamps(notebook):
    """The title's Run-time line is written from the stamp (or says it is not measured yet): `tools.course --sync`."""
    path, nb = notebook
    found = course.RUN_TIME_LINE.search(course.cell_source(nb.cells[0]))
    expected = course.run_time_line(course.stamp_of(nb))
    assert found and found.group(0) == expected, (
        f"{path.name}: the Run-time line must read {expected!r}: run `python -m tools.course --sync`")


# ── Deprecated APIs ────────────────────────────────────────────────────────────────────────────────────────

DEPRECATED_MODULES = {
    "torch.cuda.amp": "use torch.amp.autocast('cuda', ...) and torch.amp.GradScaler('cuda')",
    "torch.cpu.amp": "use torch.amp.autocast('cpu', ...)",
    "torch.backends.cuda.sdp_kernel": "use torch.nn.attention.sdpa_kernel",
    "torch.autograd.Variable": "tensors are Variables since 0.4: drop the wrapper",
    "torch.set_default_tensor_type": "use torch.set_default_dtype / torch.set_default_device",
}
CHECKPOINT_FUNCS_FULL = {"torch.utils.checkpoint.checkpoint", "torch.utils.checkpoint.checkpoint_sequential"}


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def strip_magics(source: str) -> str:
    """Code without IPython magics and shell escapes, so that ast can parse it."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())


def deprecated_uses(source: str) -> list[str]:
    """Deprecated PyTorch APIs used in Python ``source``, each with what to use instead."""
    tree = ast.parse(strip_magics(source))
    aliases: dict[str, str] = {}  # local name → the full dotted name it was imported as
    used: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                used.append(a.name)
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            used.append(node.module)
            for a in node.names:
                used.append(f"{node.module}.{a.name}")
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"

    def resolve(name: str) -> str:
        head, _, rest = name.partition(".")
        full = aliases.get(head, head)
        return f"{full}.{rest}" if rest else full

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (name := _dotted(node)):
            used.append(resolve(name))
        if isinstance(node, ast.Call) and (name := _dotted(node.func)):
            full = resolve(name)
            if full in CHECKPOINT_FUNCS_FULL and not any(k.arg == "use_reentrant" for k in node.keywords):
                found.append(f"{name}(...) without use_reentrant: pass use_reentrant=False")
    for name in used:
        for bad, instead in DEPRECATED_MODULES.items():
            if name == bad or name.startswith(bad + "."):
                found.append(f"{name}: {instead}")
    return sorted(set(found))


@pytest.mark.parametrize("snippet", [
    "from torch.cuda.amp import autocast, GradScaler",
    "import torch\nscaler = torch.cuda.amp.GradScaler()",
    "from torch.cuda import amp",
    "import torch.cuda.amp",
    "with torch.backends.cuda.sdp_kernel(enable_flash=True):\n    pass",
    "from torch.utils.checkpoint import checkpoint\ny = checkpoint(f, x)",
    "import torch.utils.checkpoint as cp\ny = cp.checkpoint(f, x)",
    "import torch\ny = torch.utils.checkpoint.checkpoint(f, x)",
    "from torch.utils import checkpoint\ny = checkpoint.checkpoint_sequential(fs, 2, x)",
    "%timeit x\nfrom torch.cpu.amp import autocast",
])
def test_detector_flags_deprecated_snippets(snippet):
    assert deprecated_uses(snippet), f"not flagged: {snippet!r}"


@pytest.mark.parametrize("snippet", [
    "from torch.amp import autocast, GradScaler\nscaler = GradScaler('cuda')",
    "with torch.autocast('cuda', dtype=torch.bfloat16):\n    pass",
    "from torch.utils.checkpoint import checkpoint\ny = checkpoint(f, x, use_reentrant=False)",
    "def checkpoint(model):\n    return model\ncheckpoint(m)",
    "from torch.nn.attention import sdpa_kernel, SDPBackend",
])
def test_detector_passes_modern_snippets(snippet):
    assert deprecated_uses(snippet) == []


def _python_sources():
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        code = "\n".join(course.cell_source(c) for c in nb.cells if c.cell_type == "code")
        yield path.name, code
    for folder in ("utils", "tools"):
        for path in sorted((course.ROOT / folder).rglob("*.py")):
            yield str(path.relative_to(course.ROOT)), path.read_text()


SOURCES = list(_python_sources())


@pytest.mark.parametrize(("name", "source"), SOURCES, ids=[name for name, _ in SOURCES])
def test_no_deprecated_api(name, source):
    assert deprecated_uses(source) == [], f"{name} uses deprecated APIs"


def test_ruff_is_clean():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=course.ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_readme_tables_are_current():
    assert readme_tables.main(["--check"]) == 0, "run `python -m tools.readme_tables`"


def test_every_notebook_is_in_the_readme_registry():
    missing = [p.stem for p in NOTEBOOKS if p.stem not in readme_tables.NOTEBOOKS]
    assert not missing, f"add {missing} to tools/readme_tables.py NOTEBOOKS"


def test_setup_cell_finds_the_checkout_from_notebooks_dir(monkeypatch, capsys):
    monkeypatch.chdir(course.NOTEBOOK_DIR)
    namespace: dict = {}
    exec(compile(course.setup_cell_source(), "setup-cell", "exec"), namespace)
    assert Path(namespace["root"]) == course.ROOT
    assert "PyTorch" in capsys.readouterr().out


def test_setup_cell_outside_a_checkout_fails_clearly(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    with pytest.raises(RuntimeError, match="utils/ folder was not found"):
        exec(compile(course.setup_cell_source(), "setup-cell", "exec"), {})


def test_setup_cell_on_colab_clones_the_repository(monkeypatch, tmp_path, capsys):
    """Simulate Colab: google.colab imported, working directory /content (here tmp_path), no checkout around.

    The cell must clone REPO_URL next to the notebook and import utils from the clone.
    """
    import shutil
    import types

    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    clones = []
    real_run = subprocess.run

    def fake_run(cmd, *args, **kwargs):
        if cmd[:2] != ["git", "clone"]:  # the environment report runs tools too (nvcc, on a machine with CUDA)
            return real_run(cmd, *args, **kwargs)
        clones.append(cmd)
        target = Path(cmd[-1])
        shutil.copytree(course.ROOT / "utils", target / "utils", ignore=shutil.ignore_patterns("__pycache__"))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    # forget the already-imported utils so the cell really imports the clone's copy
    for name in [m for m in sys.modules if m == "utils" or m.startswith("utils.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "path", list(sys.path))
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != course.ROOT]

    namespace: dict = {}
    exec(compile(course.setup_cell_source(), "setup-cell", "exec"), namespace)

    expected = tmp_path / course.repo_url().rsplit("/", 1)[-1]
    assert clones == [["git", "clone", "--depth=1", course.repo_url(), str(expected)]]
    assert Path(namespace["utils"].__file__).parent == expected / "utils"
    assert sys.path[0] == str(expected)
    assert "PyTorch" in capsys.readouterr().out

    # a second run of the cell (Colab re-run) does not clone again
    exec(compile(course.setup_cell_source(), "setup-cell", "exec"), {})
    assert len(clones) == 1

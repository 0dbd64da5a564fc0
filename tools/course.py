"""The course's notebook conventions, in one place: the repository URL, the Colab badge, the setup cell, the
title cell's Run-time line and the stamp hash. Tests check every notebook against them; the reference-run tool and
the README generator use them; ``python -m tools.course --sync`` rewrites every notebook's badge, setup cell and
Run-time line to match (a fork that changed the URL in pyproject.toml then needs a new reference run: the badge
and setup cell count in the stamp's hash; the Run-time line does not, since the stamp writes it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import tomllib
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOK_NAME = re.compile(r"^(\d\d[a-z]?)_[a-z0-9_]+\.ipynb$")  # "04b_…": the second notebook of a split topic


def repo_url() -> str:
    """The repository's address, read from ``[project.urls] Repository`` in pyproject.toml (its one place)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        url = tomllib.load(f)["project"]["urls"]["Repository"]
    if not re.match(r"^https://github\.com/[\w.-]+/[\w.-]+$", url):
        raise ValueError(f"pyproject.toml: Repository must be https://github.com/OWNER/NAME, got {url!r}")
    return url


def repo_slug() -> str:
    """``OWNER/NAME`` of the repository on GitHub."""
    return repo_url().removeprefix("https://github.com/")


def notebooks() -> list[Path]:
    """The course's notebooks in reading order (``notebooks/NN_topic.ipynb``)."""
    return sorted(p for p in NOTEBOOK_DIR.glob("*.ipynb") if NOTEBOOK_NAME.match(p.name))


def number(stem: str) -> str:
    """A notebook's number as the course shows it: "04" for ``04_torch_compile``, "04b" for ``04b_…``."""
    return stem.split("_", 1)[0]


def colab_url(notebook: Path) -> str:
    """Where Colab opens this notebook straight from GitHub's main branch."""
    rel = Path(notebook).resolve().relative_to(ROOT).as_posix()
    return f"https://colab.research.google.com/github/{repo_slug()}/blob/main/{rel}"


COLAB_BADGE_IMAGE = "https://colab.research.google.com/assets/colab-badge.svg"


def colab_badge(notebook: Path) -> str:
    """The Markdown of the 'Open in Colab' badge for this notebook."""
    return f"[![Open In Colab]({COLAB_BADGE_IMAGE})]({colab_url(notebook)})"


SETUP_CELL_TEMPLATE = '''\
# Setup (the same in every notebook): put the course's `utils` on the path (on Colab: clone it), report the machine.
import subprocess
import sys
from pathlib import Path

REPO_URL = "{url}"
found = [p for p in (Path.cwd(), *Path.cwd().parents) if (p / "utils" / "__init__.py").is_file()]
root = found[0] if found else Path.cwd() / REPO_URL.rsplit("/", 1)[-1]
if not found and "google.colab" in sys.modules and not root.exists():
    subprocess.run(["git", "clone", "--depth=1", REPO_URL, str(root)], check=True, timeout=300)
if not (root / "utils").is_dir():
    raise RuntimeError(f"The course's utils/ folder was not found: open this notebook in a clone of {{REPO_URL}}")
sys.path.insert(0, str(root))
import utils

device = utils.env.get_device()
utils.env.print_report(device)'''


def setup_cell_source() -> str:
    """The canonical setup cell: the second cell of every notebook, identical everywhere."""
    return SETUP_CELL_TEMPLATE.format(url=repo_url())


def cell_source(cell) -> str:
    """A cell's source as one string (nbformat may hold it as a list of lines)."""
    src = cell["source"]
    return "".join(src) if isinstance(src, list) else src


#: The title cell's Run-time line: "**Run time:** …" up to the end of its paragraph (a hand-written one may run
#: over several lines; the one written from the stamp is one line).
RUN_TIME_LINE = re.compile(r"^\*\*Run time:\*\*[^\n]*(?:\n(?!\*\*|#|[-*+] |[ \t]*$)[^\n]*)*", re.M)
RUN_TIME_LABEL = "**Run time:**"
#: The budget every notebook keeps on a machine without a GPU (nbmake's --nbmake-timeout in CI).
CPU_BUDGET = "on a CPU-only machine it is sized to finish within 2 minutes."
RUN_TIME_UNMEASURED = f"{RUN_TIME_LABEL} not yet measured on a GPU by a reference run; {CPU_BUDGET}"


def run_time_line(stamp: dict | None) -> str:
    """The title cell's Run-time line, from a notebook's ``reference_run`` stamp (or its absence).

    "**Run time:** 2.1 min on one NVIDIA H200 with 16 CPU cores (reference run, 2026-11-28); on a CPU-only
    machine it is sized to finish within 2 minutes." Seconds under 2 minutes, minutes above; "2 × NVIDIA H200"
    for a notebook that used several GPUs; the CPU count where the stamp knows it. Without a stamp, or with one
    from before wall times were recorded: :data:`RUN_TIME_UNMEASURED`. A stamp with ``"shared_host": true`` (the
    notebook ran beside others on one host, each on its own GPU and CPU cores) says so.
    """
    if not stamp or stamp.get("wall_s") is None:
        return RUN_TIME_UNMEASURED
    seconds = float(stamp["wall_s"])
    took = f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
    gpus = int(stamp.get("gpus") or 0)
    if stamp.get("gpu") == "cpu" or gpus < 1:
        where = "a machine without a GPU"
    else:
        where = f"{gpus} × {stamp['gpu']}" if gpus > 1 else f"one {stamp['gpu']}"
    if stamp.get("cpus"):
        where += f" with {stamp['cpus']} CPU core{'s' if int(stamp['cpus']) != 1 else ''}"
    run = "reference run beside other notebooks, each on its own GPU" if stamp.get("shared_host") else "reference run"
    return f"{RUN_TIME_LABEL} {took} on {where} ({run}, {stamp['date']}); {CPU_BUDGET}"


def stamp_of(nb) -> dict | None:
    """The notebook's ``reference_run`` stamp, if it carries outputs of that run (else None)."""
    stamp = nb.get("metadata", {}).get("reference_run")
    return stamp if stamp and has_outputs(nb) else None


def with_run_time_line(title: str, line: str) -> str:
    """The title cell's text with its Run-time line (paragraph) replaced by ``line``, or ``line`` appended."""
    if RUN_TIME_LINE.search(title):
        return RUN_TIME_LINE.sub(lambda _: line, title, count=1)
    return title.rstrip("\n") + "\n" + line


def sources_sha256(nb) -> str:
    """The hash the reference-run stamp carries: every cell's type and source, in order, except the text of the
    title cell's Run-time line (kept as its label alone), which the stamp itself writes."""
    payload = [[cell["cell_type"], cell_source(cell)] for cell in nb["cells"]]
    if payload and payload[0][0] == "markdown":
        payload[0][1] = RUN_TIME_LINE.sub(lambda _: RUN_TIME_LABEL, payload[0][1], count=1)
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()


def has_outputs(nb) -> bool:
    """True if any code cell carries outputs or an execution count."""
    return any(c["cell_type"] == "code" and (c.get("outputs") or c.get("execution_count")) for c in nb["cells"])


BADGE_PATTERN = re.compile(r"\[!\[Open In Colab\]\([^)]*\)\]\([^)]*\)")


def sync_run_time_line(nb) -> bool:
    """Rewrite the title cell's Run-time line from the notebook's stamp (:func:`run_time_line`); True if it changed."""
    title = nb.cells[0]
    new_title = with_run_time_line(cell_source(title), run_time_line(stamp_of(nb)))
    changed = new_title != cell_source(title)
    if changed:
        title.source = new_title
    return changed


def sync_notebook(path: Path) -> bool:
    """Rewrite a notebook's Colab badge, Run-time line and setup cell to the canonical ones; True if anything
    changed."""
    nb = nbformat.read(path, as_version=4)
    title, setup = nb.cells[0], nb.cells[1]
    new_title = BADGE_PATTERN.sub(lambda _: colab_badge(path), cell_source(title))
    new_title = with_run_time_line(new_title, run_time_line(stamp_of(nb)))
    changed = new_title != cell_source(title) or cell_source(setup) != setup_cell_source()
    if changed:
        title.source, setup.source = new_title, setup_cell_source()
        nbformat.write(nb, path)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sync", action="store_true",
                        help="rewrite every notebook's badge, Run-time line and setup cell")
    args = parser.parse_args(argv)
    if args.sync:
        for path in notebooks():
            if sync_notebook(path):
                print(f"updated {path.relative_to(ROOT)}")
    else:
        parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The course's notebook conventions, in one place: the repository URL, the Colab badge, the setup cell and
the stamp hash. Tests check every notebook against them; the reference-run tool and the README generator use
them; ``python -m tools.course --sync`` rewrites every notebook's badge and setup cell to match (for a fork that
changed the URL in pyproject.toml — its outputs then need a new reference run).
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
NOTEBOOK_NAME = re.compile(r"^(\d\d)_[a-z0-9_]+\.ipynb$")


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


def sources_sha256(nb) -> str:
    """The hash the reference-run stamp carries: every cell's type and source, in order."""
    payload = [[cell["cell_type"], cell_source(cell)] for cell in nb["cells"]]
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()


def has_outputs(nb) -> bool:
    """True if any code cell carries outputs or an execution count."""
    return any(c["cell_type"] == "code" and (c.get("outputs") or c.get("execution_count")) for c in nb["cells"])


BADGE_PATTERN = re.compile(r"\[!\[Open In Colab\]\([^)]*\)\]\([^)]*\)")


def sync_notebook(path: Path) -> bool:
    """Rewrite a notebook's Colab badge and setup cell to the canonical ones; True if anything changed."""
    nb = nbformat.read(path, as_version=4)
    title, setup = nb.cells[0], nb.cells[1]
    new_title = BADGE_PATTERN.sub(lambda _: colab_badge(path), cell_source(title))
    changed = new_title != cell_source(title) or cell_source(setup) != setup_cell_source()
    if changed:
        title.source, setup.source = new_title, setup_cell_source()
        nbformat.write(nb, path)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sync", action="store_true", help="rewrite badges and setup cells of every notebook")
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

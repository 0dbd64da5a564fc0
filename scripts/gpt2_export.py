"""torch.export and AOTInductor on the course's GPT-2, in a process of its own: export the model, check the exported
program against eager, compile it into a ``.pt2`` package, load the package, run it, and compare its logits with the
eager model's.

    python scripts/gpt2_export.py --checkpoint DIR --device cuda --result out.json

``DIR`` holds the weights and the prompt (``utils.gpt2.save_checkpoint``). Notebook 08 runs this through
``utils.isolate.run_script`` with a deadline: AOTInductor is a prototype whose failures can be crashes (a
segmentation fault while loading or running a package) rather than exceptions, and its compile can take minutes;
in a child process neither can stop the notebook. The result JSON (written after every stage, so a crash still
leaves the stages before it): the stage reached, the seconds of each stage, the relative error of the exported
program's logits against eager (``exported_relative_error``: known before AOTInductor starts, so a crash there still
shows the export correct), the package's size in bytes, and the relative error of the package's logits against
eager (fp32).
"""

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course's utils, however this is started

import torch

from utils import gpt2
from utils.isolate import Progress


def relative_error(logits, reference):
    return ((logits - reference).norm() / reference.norm()).item()


def export_compile_load(model, prompt, package_path, progress):
    """The deployment path, one timed stage each: a graph of ATen operators with the parameters
    (torch.export), checked against eager, compiled ahead of time into a package (AOTInductor), loaded back and run."""
    with progress.timed("export"):
        exported = torch.export.export(model, (prompt,))
    with progress.timed("check the exported program"), torch.inference_mode():
        progress.data["exported_relative_error"] = relative_error(exported.module()(prompt), model(prompt))
    with progress.timed("AOTInductor compile"):
        path = torch._inductor.aoti_compile_and_package(exported, package_path=str(package_path))
    with progress.timed("load"):
        loaded = torch._inductor.aoti_load_package(path)
    with progress.timed("run"), torch.inference_mode():
        logits = loaded(prompt)
    return logits, Path(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True, help="written by utils.gpt2.save_checkpoint")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--result", type=Path, default=None, help="where the JSON goes")
    args = parser.parse_args()
    progress = Progress(args.result)
    progress.data.update(torch=torch.__version__, device=args.device)
    with progress.timed("load the checkpoint"):
        model, prompt = gpt2.load_checkpoint(args.checkpoint)
        model, prompt = model.to(args.device), prompt.to(args.device)
    work = Path(tempfile.mkdtemp(prefix="gpt2-aoti-"))
    try:
        logits, path = export_compile_load(model, prompt, work / "gpt2.pt2", progress)
        with progress.timed("check against eager"), torch.inference_mode():
            progress.data["relative_error"] = relative_error(logits, model(prompt))
        progress.data["package_bytes"] = path.stat().st_size
    finally:
        shutil.rmtree(work, ignore_errors=True)
    progress.done()


if __name__ == "__main__":
    main()

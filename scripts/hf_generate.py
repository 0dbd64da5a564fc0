"""Hugging Face ``generate`` on the course's GPT-2 weights, in a process of its own: the default (dynamic) cache and
the static cache, each checked to pick the greedy tokens, then timed whole (prefill included).

    python scripts/hf_generate.py --checkpoint DIR --new-tokens 256 --device cuda --dtype bfloat16 --result out.json

``DIR`` holds the weights and the prompt (``utils.gpt2.save_checkpoint``). With a static cache on a GPU,
``transformers`` compiles the decoding step itself, with ``torch.compile(mode="reduce-overhead")``: CUDA graph
trees, and a first call that compiles for tens of seconds. Notebook 08 runs this through
``utils.isolate.run_script`` with a deadline, so that neither a long compile nor a crash in it can stop the
notebook, and so that the graph trees do not share a process with the notebook's own CUDA graphs. The result JSON
(written after every step, so a crash or the deadline leaves what was done before): per variant, the first call's
seconds, the graphs Inductor compiled in it and those it loaded from its cache on disk, whether the tokens are the
greedy ones, and the timing of a whole generation (``utils.bench.Timing`` as a dict) — or the error that stopped it.
A two-token generation runs first, untimed, so that no variant's first call carries the process's start-up.
"""

import argparse
import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course's utils, however this is started
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the weights are in the checkpoint folder: never ask the hub

import torch
import transformers

from utils import bench, compile_cache, gpt2
from utils.isolate import Progress

VARIANTS = {"HF generate, dynamic cache": {}, "HF generate, static cache": {"cache_implementation": "static"}}


def measure(hf_model, prompt, new_tokens, options, reference, label, min_run_s, progress):
    """One variant: the first call (with whatever transformers compiles in it) and the greedy check, reported at
    once; then the timing of a whole generation."""
    def generate():
        return hf_model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=0, **options)

    row = progress.data["variants"].setdefault(label, {})
    before = compile_cache.graph_counts()
    first_s, tokens = bench.first_call(generate, device=prompt.device)
    compiled = compile_cache.graph_counts() - before
    row.update(first_call_s=first_s, graphs_compiled=compiled.compiled, graphs_loaded=compiled.loaded,
               greedy=gpt2.is_greedy(reference, tokens, prompt.shape[1]))
    progress.save()  # a timing that never ends still leaves this
    if row["greedy"]:  # a wrong answer is not worth timing: the notebook fails on it
        timing = bench.bench(generate, label=label, device=prompt.device, warmup=1, min_blocks=3,
                             min_run_time=min_run_s)
        row["timing"] = dataclasses.asdict(timing)
        progress.save()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True, help="written by utils.gpt2.save_checkpoint")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", help="of the weights: bfloat16, float16 or float32")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--min-run-s", type=float, default=0.2, help="seconds of timing per variant, at least")
    parser.add_argument("--result", type=Path, default=None, help="where the JSON goes")
    args = parser.parse_args()
    progress = Progress(args.result)
    progress.data.update(torch=torch.__version__, transformers=transformers.__version__, variants={})
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    with progress.timed("load the checkpoint"):
        reference, prompt = gpt2.load_checkpoint(args.checkpoint)
        reference, prompt = reference.to(device), prompt.to(device)  # fp32: the greedy check's reference
        hf_model = transformers.GPT2LMHeadModel.from_pretrained(args.checkpoint).to(device=device, dtype=dtype)
        hf_model.eval()
    # the process's own start-up (CUDA context, cuBLAS handles, transformers' lazy imports), untimed, so that the
    # first variant's first call does not carry it and the two first calls compare
    with progress.timed("warm-up"), torch.inference_mode():
        hf_model.generate(prompt, max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0)
    for label, options in VARIANTS.items():
        with progress.timed(label):
            try:
                measure(hf_model, prompt, args.new_tokens, options, reference, label, args.min_run_s, progress)
            except Exception as err:  # a version without the option, a failed compile: report it, go on
                first = (str(err).strip().splitlines() or [""])[0][:200]
                progress.data["variants"].setdefault(label, {})["error"] = f"{type(err).__name__}: {first}"
    progress.done()


if __name__ == "__main__":
    main()

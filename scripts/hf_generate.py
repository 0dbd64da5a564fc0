"""Hugging Face ``generate`` on the course's GPT-2 weights, in a process of its own: the default (dynamic) cache and
the static cache, and optionally one of the course's own static decoders on the same weights, each checked to pick
the greedy tokens, then timed together, whole generation (prefill included) against whole generation.

    python scripts/hf_generate.py --checkpoint DIR --new-tokens 256 --device cuda --dtype bfloat16 \
        --ours compiled --ours-label "compiled, in a CUDA graph" --result out.json

``DIR`` holds the weights and the prompt (``utils.gpt2.save_checkpoint``). With a static cache on a GPU,
``transformers`` compiles the decoding step itself, with ``torch.compile(mode="reduce-overhead")``: CUDA graph
trees, and a first call that compiles for tens of seconds. Notebook 08 runs this through
``utils.isolate.run_script`` with a deadline, so that neither a long compile nor a crash in it can stop the
notebook, and so that the graph trees do not share a process with the notebook's own CUDA graphs. ``--ours`` adds
a :class:`utils.gpt2.StaticDecoder` of the same weights ("graph": the step in a CUDA graph, eager on a CPU;
"compiled"; "triton"; "triton-pdl"), so that ours and theirs are timed in the same process, in alternating rounds
(:func:`utils.bench.compare`): the only way the two compare under the course's protocol.

The result JSON (written after every step, so a crash or the deadline leaves what was done before): per variant,
the first call's seconds, the graphs Inductor compiled in it and those it loaded from its cache on disk, whether the
tokens are the greedy ones, and its per-call times, one per alternating round (``utils.bench.Timing`` as a dict, for
``utils.bench.Comparison.from_rounds``); or the error that stopped it. The variants are timed together twice: once
before the static cache's first call, in a few rounds (``--fallback-rounds``: its compile takes minutes on a host
with few cores, and the deadline may end it), and again with it (``--rounds``); each comparison replaces the times of
the one before, so the variants that carry times were always timed in the same rounds. ``comparisons`` lists each
comparison's variants and rounds. A variant's first call and the comparison's probe call warm it up.
A two-token generation runs first, untimed, so that no variant's first call carries the process's start-up.
"""

import argparse
import copy
import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course's utils, however this is started
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the weights are in the checkpoint folder: never ask the hub

import torch
import transformers

from utils import bench, compile_cache, env, gpt2
from utils.isolate import Progress

VARIANTS = {"HF generate, dynamic cache": {}, "HF generate, static cache": {"cache_implementation": "static"}}
OURS = ("graph", "compiled", "triton", "triton-pdl")


def hf_generate(hf_model, prompt, new_tokens, options):
    def generate():
        return hf_model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=0, **options)
    return generate


def our_generate(model, prompt, new_tokens, kind):
    """One of the course's static decoders on ``model`` (16-bit, on the device), its prefill in a CUDA graph as in
    notebook 08: a generation per call."""
    fused = False
    if kind.startswith("triton"):
        from utils.gpt2_fused import FusedDecodeStep  # imports triton: only when asked

        fused = FusedDecodeStep(model, pdl=kind == "triton-pdl")
    decoder = gpt2.StaticDecoder(model, batch=1, max_len=prompt.shape[1] + new_tokens,
                                 compile_step=kind == "compiled", fused_step=fused, graph_prefill=True)
    return lambda: decoder.generate(prompt, new_tokens)


def first_call(label, build, reference, prompt, progress):
    """Build a variant (``build()`` returns its generate function), make its first call (with whatever it compiles)
    and check it, reported at once; the generate function if the tokens are greedy, else None."""
    row = progress.data["variants"].setdefault(label, {})
    try:
        generate = build()
        before = compile_cache.graph_counts()
        first_s, tokens = bench.first_call(generate, device=prompt.device)
        compiled = compile_cache.graph_counts() - before
        row.update(first_call_s=first_s, graphs_compiled=compiled.compiled, graphs_loaded=compiled.loaded,
                   greedy=gpt2.is_greedy(reference, tokens, prompt.shape[1]))
    except Exception as err:  # a version without the option, a failed compile: report it, go on
        first = (str(err).strip().splitlines() or [""])[0][:200]
        row["error"] = f"{type(err).__name__}: {first}"
    progress.save()  # a timing that never ends still leaves this
    return generate if row.get("greedy") else None  # a wrong answer is not worth timing: the notebook fails on it


def timed_together(passed, device, rounds, args, progress):
    """Time the variants that passed in ``rounds`` alternating rounds, each call waited for to its end (as a request
    would be), and report every variant's per-round times; a later comparison replaces an earlier one's. No warm-up
    calls: every variant made its first call already, and the comparison's probe call precedes the rounds."""
    with progress.timed(f"compare {len(passed)}"):
        comparison = bench.compare({label: (lambda g=g: (g(), env.synchronize(device))) for label, g in passed.items()},
                                   rounds=rounds, min_run_time=args.min_run_s, warmup=0, device=device,
                                   progress=False)
    for label, timing in comparison.timings.items():
        progress.data["variants"][label]["timing"] = dataclasses.asdict(timing)
    progress.data["comparisons"].append({"variants": list(passed), "rounds": rounds})
    progress.save()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True, help="written by utils.gpt2.save_checkpoint")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", help="of the weights: bfloat16, float16 or float32")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--ours", choices=OURS, default=None, help="also time one of the course's decoders")
    parser.add_argument("--ours-label", default=None, help="its label in the result (default: 'ours, KIND')")
    parser.add_argument("--rounds", type=int, default=6, help="alternating rounds of the comparison of all variants")
    parser.add_argument("--fallback-rounds", type=int, default=3,
                        help="rounds of the comparison before the static cache's compile (kept if a deadline ends it)")
    parser.add_argument("--min-run-s", type=float, default=0.2, help="seconds of timing in all, at least")
    parser.add_argument("--result", type=Path, default=None, help="where the JSON goes")
    args = parser.parse_args()
    progress = Progress(args.result)
    progress.data.update(torch=torch.__version__, transformers=transformers.__version__, variants={}, comparisons=[])
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    with progress.timed("load the checkpoint"):
        reference, prompt = gpt2.load_checkpoint(args.checkpoint)
        reference, prompt = reference.to(device), prompt.to(device)  # fp32: the greedy check's reference
        ours = copy.deepcopy(reference).to(dtype) if args.ours else None
        hf_model = transformers.GPT2LMHeadModel.from_pretrained(args.checkpoint).to(device=device, dtype=dtype)
        hf_model.eval()
    # the process's own start-up (CUDA context, cuBLAS handles, transformers' lazy imports), untimed, so that the
    # first variant's first call does not carry it and the first calls compare
    with progress.timed("warm-up"), torch.inference_mode():
        hf_model.generate(prompt, max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0)
    builders = {}
    if args.ours:  # first: its CUDA graph is captured before transformers builds its own graph trees
        builders[args.ours_label or f"ours, {args.ours}"] = lambda: our_generate(ours, prompt, args.new_tokens,
                                                                                 args.ours)
    for label, options in VARIANTS.items():
        builders[label] = lambda options=options: hf_generate(hf_model, prompt, args.new_tokens, options)
    passed, timed = {}, set()
    for label, build in builders.items():
        if label == "HF generate, static cache" and len(passed) >= 2:
            timed_together(passed, device, args.fallback_rounds, args, progress)  # a deadline in the compile leaves it
            timed = set(passed)
        with progress.timed(f"first call: {label}"):
            generate = first_call(label, build, reference, prompt, progress)
        if generate is not None:
            passed[label] = generate
    if len(passed) >= 2 and set(passed) != timed:
        timed_together(passed, device, args.rounds, args, progress)
    progress.done()


if __name__ == "__main__":
    main()

"""Checks for the exercises of notebook 01 · Device management."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from unittest import mock

import torch

from utils.exercises import Miss, close, exercise


@exercise("1 · Device-agnostic")
def normalise_rows(answer, *, device: torch.device | str | None = None) -> str:
    """``answer(x)`` scales every row of ``x`` to unit L2 norm and returns the result on x's own device."""
    places = [torch.device("cpu")] + ([torch.device(device)] if device is not None
                                      and torch.device(device).type != "cpu" else [])
    for place in places:
        x = torch.randn(5, 3, device=place) * 4
        original = x.clone()
        try:
            out = answer(x)
        except (AssertionError, RuntimeError) as err:
            if place.type == "cpu" and re.search(r"cuda|nvidia|driver|gpu", str(err), re.IGNORECASE):
                raise Miss(f"it fails on a CPU tensor ({type(err).__name__}: {str(err).splitlines()[0][:80]}): "
                           "a hard-coded .cuda()? Compute on x's own device instead") from None
            raise
        if out is None:
            raise NotImplementedError("normalise_rows returns None")
        if out.device != x.device:
            raise Miss(f"the result is on {out.device} but the input was on {x.device}: keep it where x lives")
        if not torch.equal(x, original):
            raise Miss("it changed its input in place: return a new tensor")
        norms = out.norm(dim=1)
        if not torch.allclose(norms, torch.ones_like(norms), atol=1e-5):
            raise Miss(f"the rows do not have unit norm (norms {[round(v, 3) for v in norms.tolist()]}): divide each "
                       "row by its own norm (dim=1, keepdim=True)")
        if not torch.allclose(out * x.norm(dim=1, keepdim=True), x, atol=1e-5):
            raise Miss("the rows changed direction: scale each row, do not change it otherwise")
    return f"unit rows, on the input's device ({', '.join(str(p) for p in places)})."


def _maps_a_gpu_checkpoint_to_cpu(map_location) -> bool:
    """Would torch.load with this map_location put a tensor saved from cuda:0 onto the CPU (on any machine)?"""
    restore = torch.serialization._get_restore_location(map_location)
    storage = torch.UntypedStorage(4)
    try:
        placed = restore(storage, "cuda:0")
    except (RuntimeError, AssertionError):
        return False  # it tried to put it on a GPU
    return placed is not None and placed.device.type == "cpu"


@exercise("2 · Portable checkpoint")
def load_on_cpu(answer, *, device: torch.device | str | None = None) -> str:
    """``answer(path)`` loads a state dict saved on any device so that every tensor lands on the CPU."""
    where = torch.device(device) if device is not None else torch.device("cpu")
    net = torch.nn.Linear(4, 3).to(where)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "net.pt"
        torch.save(net.state_dict(), path)
        calls = []
        real_load = torch.load

        def recording_load(*args, **kwargs):
            calls.append(kwargs.get("map_location", args[1] if len(args) > 1 else None))
            return real_load(*args, **kwargs)

        with mock.patch.object(torch, "load", recording_load):
            loaded = answer(path)
    if loaded is None:
        raise NotImplementedError("load_on_cpu returns None: return the loaded state dict")
    if not calls:
        raise Miss("it never called torch.load")
    tensors = dict(loaded)
    if set(tensors) != set(net.state_dict()):
        raise Miss(f"the keys differ from what was saved: {sorted(tensors)}")
    if any(t.device.type != "cpu" for t in tensors.values()):
        raise Miss(f"some tensors are still on {sorted({str(t.device) for t in tensors.values()})}")
    for name, t in net.state_dict().items():
        if not torch.equal(tensors[name], t.cpu()):
            raise Miss(f"{name} does not hold the saved values")
    if not _maps_a_gpu_checkpoint_to_cpu(calls[-1]):
        raise Miss("the tensors end up on the CPU here, but torch.load itself still restores them to the device "
                   "they were saved from: on a machine without that GPU it fails before your code moves anything. "
                   "Pass map_location")
    return "every tensor on the CPU, restored there by torch.load itself (map_location)."


@exercise("3 · Three-stage pipeline")
def three_stage_time_s(answer) -> str:
    """``answer(n_chunks, h2d_s, compute_s, d2h_s)``: the least time of one run of n chunks, each copied in,
    computed and copied out, with the three stages on separate streams (two copy engines, one compute)."""
    cases = [((1, 1.0, 2.0, 3.0), 6.0, "a single chunk (nothing can overlap)"),
             ((4, 1.0, 1.0, 1.0), 6.0, "four chunks with equal stages"),
             ((8, 1.2, 1.0, 0.5), 0.5 + 1.0 + 8 * 1.2, "eight chunks bound by the copy in")]
    for args, expected, what in cases:
        got = answer(*args)
        if got is None:
            raise NotImplementedError("three_stage_time_s returns None: return seconds")
        got = float(got)
        if close(got, expected, rel=1e-9):
            continue
        n, a, b, c = args
        if close(got, n * max(a, b, c), rel=1e-9):
            raise Miss(f"for {what}: n × the slowest stage is the steady-state bound; one run also pays to fill the "
                       "pipeline (the first chunk's earlier stages) and to drain it (the last chunk's later stages)")
        if close(got, n * (a + b + c), rel=1e-9):
            raise Miss(f"for {what}: that is the serial time, with no overlap at all")
        raise Miss(f"for {what} {args}: expected {expected:g} s, got {got:g} s")
    return "fill + (n − 1) × the slowest stage + drain, in every case."

"""The measuring and checking side of notebook 03 (mixed precision): which variants run here and why not, what a
backward pass loses to fp16's range, whether the precisions train alike, what a step keeps for backward, what the
GradScaler costs, and the scaler in a real loop (checkpoints, gradient accumulation). The subject — autocast, the
GradScaler, the training step — stays in the notebook and in :func:`utils.train.train_step`.

**Where the GradScaler checks for inf/NaN.** Not after every backward: ``scaler.unscale_(optimizer)`` divides the
gradients by the scale and records, on the device, whether any is inf or NaN (``scaler.step`` calls ``unscale_``
when you did not). ``scaler.step`` then reads that flag back to the host — a synchronisation, every step — and
skips ``optimizer.step()`` if it is set; ``scaler.update`` halves the scale after a skip and doubles it after
``growth_interval`` clean steps (2,000 by default).

**The scaler in a real loop** (:func:`scaler_in_a_loop` checks both on a small fp16 model):

* its state — the scale and the count of clean steps — belongs in a checkpoint (``scaler.state_dict()``); a run
  resumed with a fresh scaler starts again from the initial scale and ends with other weights;
* with gradient accumulation, one scaler serves every micro-batch: ``scaler.scale(loss / k).backward()`` each, then
  one ``unscale_``, clip, ``step`` and ``update``. A forgotten ``/ k`` makes the unscaled gradients k times too
  large; clipping and AdamW's first update barely depend on the size, so only the gradients themselves show it.
"""

from __future__ import annotations

import math
import tempfile
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from utils.bench import Comparison, Verdict, format_seconds
from utils.memory import format_bytes

_F16 = torch.finfo(torch.float16)
#: fp16's smallest subnormal (its tiny × eps); values at or below half of it round to zero.
FP16_SUBNORMAL = _F16.smallest_normal * _F16.eps


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def why_skipped(name: str, device: torch.device | str, caps) -> str | None:
    """Why the training variant ``name`` ("fp32", "tf32", "fp16 …", "bf16 …") does not run here, or None.

    ``caps``: :func:`utils.env.capabilities` of the device. TF32 is a mode of NVIDIA tensor cores (Ampere and newer).
    fp16 training is a GPU recipe: a CPU has no fp16 tensor cores, so its fp16 autocast is slow and not timed (the
    numerics of fp16 and the GradScaler run on a CPU too, in the lesson's other sections). bf16 needs Ampere or
    newer on a GPU; a CPU's autocast runs bf16.
    """
    device = torch.device(device)
    if device.type == "cpu" and name == "tf32":
        return "TF32 is a mode of NVIDIA tensor cores (Ampere and newer); a CPU has none"
    if device.type == "cpu" and name.startswith("fp16"):
        return "a CPU has no fp16 tensor cores: its fp16 training is slow and not timed (the numerics ran above)"
    if name == "tf32" and not caps.tf32:
        return f"{caps.name} has no TF32 tensor cores (Ampere or newer has them)"
    if name.startswith("bf16") and not caps.bf16:
        return f"{caps.name} has no native bf16 (before Ampere): fp16 + GradScaler is its mixed precision"
    return None


def module_output_dtypes(model: torch.nn.Module, run: Callable[[], object]) -> list[dict[str, str]]:
    """Table rows: the dtypes each kind of module returned while ``run()`` called ``model`` (forward hooks)."""
    seen: dict[str, set[str]] = defaultdict(set)

    def hook(module, args, out):
        out = out[0] if isinstance(out, tuple) else out
        if isinstance(out, torch.Tensor):
            seen[type(module).__name__].add(dtype_name(out.dtype))

    hooks = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return [{"module": name, "output dtype": ", ".join(sorted(dtypes))} for name, dtypes in seen.items()]


# ── What a backward pass loses to fp16's range ─────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class GradientLoss:
    """One backward pass against the fp32 reference: the share of logit gradients that are exactly 0, the share of
    parameter gradients that are 0 where fp32's are not, and the relative error of the parameter gradients."""

    name: str
    zero_logit_share: float
    lost_share: float
    relative_error: float


def gradient_losses(reference: tuple[torch.Tensor, torch.Tensor],
                    passes: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> list[GradientLoss]:
    """Each pass's (logit gradients, parameter gradients), both unscaled, against the fp32 reference's."""
    ref_logits, ref_grads = reference
    nonzero = ref_grads != 0
    out = [GradientLoss("fp32 (reference)", (ref_logits == 0).float().mean().item(), 0.0, 0.0)]
    for name, (logit_grad, grads) in passes.items():
        lost = ((grads == 0) & nonzero).sum().item() / max(nonzero.sum().item(), 1)
        error = ((grads - ref_grads).norm() / ref_grads.norm()).item()
        out.append(GradientLoss(name, (logit_grad == 0).float().mean().item(), lost, error))
    return out


def underflow_verdict(losses: Sequence[GradientLoss], *, unscaled: str = "fp16, no scaler",
                      scaled: str = "fp16 + GradScaler") -> str:
    """The table of :func:`gradient_losses` printed, then one sentence from it; checks that the scaler recovers
    what fp16 alone loses.

    Raises:
        AssertionError: when fp16 alone loses less than half the logit gradients (nothing was shown), or when the
            scaled pass does not recover them (over 1% zeros, or parameter gradients over 5% off).
    """
    from utils.plot import table

    by = {g.name: g for g in losses}
    table([{"backward pass": g.name, "logit gradients = 0": f"{g.zero_logit_share:.3%}",
            "parameter gradients lost (0, not 0 in fp32)": f"{g.lost_share:.1%}",
            "relative error vs fp32": f"{g.relative_error:.2g}"} for g in losses],
          title="One backward pass of the language model")
    lost, kept = by[unscaled], by[scaled]
    if lost.zero_logit_share <= 0.5:
        raise AssertionError(f"fp16 without a scaler rounded only {lost.zero_logit_share:.1%} of the logit "
                             "gradients to zero: the gradients are not small enough to show the effect")
    if kept.zero_logit_share >= 0.01 or kept.relative_error >= 0.05:
        raise AssertionError(f"the GradScaler did not recover the gradients: {kept.zero_logit_share:.2%} zero, "
                             f"{kept.relative_error:.1%} off")
    return (f"Without a scaler fp16 rounded {lost.zero_logit_share:.3%} of the logit gradients to zero and the "
            f"parameter gradients are {lost.relative_error:.0%} off; with the GradScaler {kept.zero_logit_share:.2%} "
            f"are zero and the parameter gradients match fp32 to {kept.relative_error:.1%}.")


def log10_histogram(values: torch.Tensor, lo: float = -14.0, hi: float = 2.0,
                    bins: int = 64) -> tuple[list[float], list[float]]:
    """(bin edges, share in % of the non-zero entries per bin) of log10|values|, computed on the device."""
    logs = values.abs()[values != 0].log10()
    counts = torch.histc(logs.float(), bins=bins, min=lo, max=hi).cpu()
    return torch.linspace(lo, hi, bins + 1).tolist(), (100 * counts / max(logs.numel(), 1)).tolist()


def plot_against_fp16(values: Mapping[str, torch.Tensor], *, title: str):
    """Histograms of log10|gradient| for each named tensor, over fp16's bands: rounds to 0, subnormal, normal."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    edges = [-14.0, 2.0]
    ax.axvspan(edges[0], math.log10(FP16_SUBNORMAL / 2), color="0.6", alpha=0.2, label="rounds to 0 in fp16")
    ax.axvspan(math.log10(FP16_SUBNORMAL / 2), math.log10(_F16.smallest_normal), color="#DD8452", alpha=0.15,
               label="fp16 subnormal (fewer significant bits)")
    ax.axvspan(math.log10(_F16.smallest_normal), math.log10(_F16.max), color="#55A868", alpha=0.15,
               label="fp16 normal range")
    highest = 0.0
    for name, tensor in values.items():
        bin_edges, share = log10_histogram(tensor, *edges)
        ax.stairs(share, bin_edges, label=name, linewidth=1.6)
        highest = max(highest, *share)
    ax.set(xlabel="|gradient| (log10)", ylabel="share of non-zero entries (%)", title=title, xlim=edges,
           ylim=(0, 1.6 * max(highest, 1.0)))  # headroom: the legend sits above the histograms, not on them
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    plt.close(fig)
    return fig


def plot_loss_scale(scales: Sequence[float], skipped: Sequence[int], *, growth_interval: int):
    """The loss scale at every step (log₂ axis), with the skipped steps marked."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.8))
    ax.step(range(len(scales)), scales, where="post", label="loss scale S at the step")
    ax.scatter(skipped, [scales[s] for s in skipped], marker="x", s=60, color="#C44E52", zorder=3,
               label="step skipped (inf/NaN in the gradients)")
    ax.set_yscale("log", base=2)
    ax.set(xlabel="training step", ylabel="loss scale S (log₂ axis)",
           title=f"GradScaler: halve and skip on inf/NaN, double after {growth_interval} clean steps")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9)
    fig.tight_layout()
    plt.close(fig)
    return fig


# ── Do the precisions train alike? ─────────────────────────────────────────────────────────────────────────


def smooth(values: Sequence[float], window: int) -> torch.Tensor:
    """Moving average over ``window`` values (the curve has len(values) − window + 1 points)."""
    kernel = torch.ones(window) / window
    return F.conv1d(torch.tensor(values, dtype=torch.float32)[None, None], kernel[None, None])[0, 0]


@dataclass(frozen=True)
class TrainAlike:
    """Loss curves of several variants against a reference, smoothed over ``window`` steps."""

    losses: dict[str, list[float]]
    reference: str
    window: int
    max_gap: float
    max_final: float

    def _final(self, name: str) -> float:
        return sum(self.losses[name][-self.window:]) / self.window

    def gap(self, name: str) -> float:
        """The largest distance (nats) between the variant's smoothed curve and the reference's."""
        return (smooth(self.losses[name], self.window) - smooth(self.losses[self.reference], self.window)).abs().max()\
            .item()

    def final_change(self, name: str) -> float:
        """The variant's final loss (mean of the last window) relative to the reference's, e.g. +0.4%."""
        return self._final(name) / self._final(self.reference) - 1

    def rows(self) -> list[dict[str, str]]:
        return [{"variant": name, "first loss": f"{losses[0]:.3f}", "final loss": f"{self._final(name):.3f}",
                 f"largest gap to {self.reference} (smoothed)": f"{self.gap(name):.3f}",
                 f"final vs {self.reference}": f"{self.final_change(name):+.2%}"}
                for name, losses in self.losses.items()]

    def check(self) -> str:
        """One sentence; raises AssertionError when a variant strays beyond the bands, and says so when there was
        no variant to compare."""
        others = [n for n in self.losses if n != self.reference]
        if not others:
            return f"Only {self.reference} trained here: nothing was compared with it."
        bad = [n for n in others if self.gap(n) >= self.max_gap or abs(self.final_change(n)) >= self.max_final]
        if bad:
            raise AssertionError(f"{', '.join(bad)} did not train like {self.reference}: "
                                 + "; ".join(f"{n}: gap {self.gap(n):.3f} nats, final {self.final_change(n):+.2%}"
                                             for n in bad))
        farthest = f"{max(self.gap(n) for n in others):.3f}"
        tied = [n for n in others if f"{self.gap(n):.3f}" == farthest]  # equal as printed: a tie, not one farthest
        names = f"{tied[0]}," if len(tied) == 1 else f"{', '.join(tied[:-1])} and {tied[-1]}, each"
        who = {1: f"{others[0]} trains", 2: "Both variants train"}.get(len(others), f"All {len(others)} variants train")
        return (f"{who} like {self.reference}: every smoothed curve stays within "
                f"{self.max_gap} nats of it (the farthest, {names} {farthest}) and every final loss "
                f"within {self.max_final:.0%}.")

    def plot(self, *, floor: float | None = None, title: str):
        from utils.plot import curves

        steps = list(range(self.window - 1, len(self.losses[self.reference])))
        return curves({n: (steps, smooth(v, self.window).tolist()) for n, v in self.losses.items()},
                      xlabel="training step", ylabel=f"loss (nats, {self.window}-step moving average)", markers=False,
                      hlines={"data entropy (lowest possible loss)": floor} if floor is not None else None,
                      title=title)


def train_alike(losses: Mapping[str, Sequence[float]], *, reference: str = "fp32", window: int | None = None,
                max_gap: float = 0.15, max_final: float = 0.03) -> TrainAlike:
    """Compare loss curves with the reference's: each smoothed curve within ``max_gap`` nats of it, each final loss
    (mean of the last window; default window a tenth of the run, at least 5) within ``max_final``.

    Raises:
        ValueError: for a missing reference or curves of different lengths.
    """
    if reference not in losses:
        raise ValueError(f"no {reference!r} curve among {list(losses)}")
    lengths = {len(v) for v in losses.values()}
    if len(lengths) != 1:
        raise ValueError(f"every curve needs the same number of steps, got {sorted(lengths)}")
    steps = lengths.pop()
    window = window or max(5, steps // 10)
    if window > steps:
        raise ValueError(f"a window of {window} needs at least as many steps, got {steps}")
    return TrainAlike({k: list(v) for k, v in losses.items()}, reference, window, max_gap, max_final)


# ── Memory: what a step keeps for backward ────────────────────────────────────────────────────────────────


def saved_activation_bytes(model: torch.nn.Module, forward: Callable[[], torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``forward()`` runs (its loss is then
    dropped), the model's parameters excluded. Counted with ``saved_tensors_hooks``, so custom autograd functions
    (the chunked loss) count too; 16-bit copies of the weights that autocast makes do count."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward()
    del loss
    return sum(saved.values())


_LOSS_OPS = ("LogSoftmaxBackward0", "NllLossBackward0")


def loss_anatomy(saved: Mapping[str, Sequence], *, top: int = 6) -> tuple[list[dict[str, str]], str]:
    """Table rows of what two runs keep for backward by operation and dtype (:func:`utils.memory.saved_tensors_by_op`
    lists, the fp32 run first), and sentences on the loss's share (log_softmax's output and nll_loss's input)."""
    from utils.memory import saved_bytes_by

    (base, base_saved), (low, low_saved) = saved.items()
    by_op = {name: saved_bytes_by(s, key="op+dtype") for name, s in saved.items()}
    keys = list(dict.fromkeys([*list(by_op[base])[:top], *list(by_op[low])[:top]]))
    rows = [{"kept for backward by": k, f"{base} run": format_bytes(by_op[base].get(k, 0)),
             f"{low} run": format_bytes(by_op[low].get(k, 0))} for k in keys]
    total = {name: sum(t.nbytes for t in s) for name, s in saved.items()}
    loss = {name: sum(t.nbytes for t in s if t.op in _LOSS_OPS) for name, s in saved.items()}
    rows.append({"kept for backward by": "everything", f"{base} run": format_bytes(total[base]),
                 f"{low} run": format_bytes(total[low])})
    rest = {name: total[name] - loss[name] for name in saved}
    more = total[low] > total[base]
    text = (f"The loss keeps {format_bytes(loss[base])} in the {base} run and {format_bytes(loss[low])} in the {low} "
            f"run: {loss[low] / max(total[low], 1):.0%} of everything the {low} run keeps. Everything but the loss: "
            f"{format_bytes(rest[base])} in {base}, {format_bytes(rest[low])} in {low} "
            f"({rest[low] / max(rest[base], 1):.0%}). In all, {low} keeps "
            + (f"{total[low] / total[base] - 1:.0%} more than {base}." if more
               else f"{1 - total[low] / max(total[base], 1):.0%} less than {base}."))
    return rows, text


# ── The chunked loss against the plain one ─────────────────────────────────────────────────────────────────


def same_gradients(model: torch.nn.Module, losses: Mapping[str, Callable[[], torch.Tensor]], *,
                   amp_dtype: torch.dtype, loss_scale: float = 1.0, tolerance: float = 2e-2) -> str:
    """Run each loss (a call that returns the loss of ``model`` on one batch) under autocast, backward at
    ``loss_scale`` (as a GradScaler would), and compare the losses and the unscaled gradients with the first one's.

    Raises:
        AssertionError: when a loss differs by more than 2e-3 or its gradients by more than ``tolerance``
            (relative norm) from the first's.
    """
    device_type = next(model.parameters()).device.type
    values, grads = {}, {}
    for name, loss_fn in losses.items():
        model.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=amp_dtype):
            loss = loss_fn()
        (loss * loss_scale).backward()
        values[name] = loss.detach().float()
        grads[name] = torch.cat([p.grad.flatten() for p in model.parameters()]) / loss_scale
    model.zero_grad(set_to_none=True)
    first, *others = losses
    parts = []
    for name in others:
        error = ((grads[name] - grads[first]).norm() / grads[first].norm()).item()
        if not error < tolerance or not torch.allclose(values[name], values[first], rtol=2e-3, atol=2e-3):
            raise AssertionError(f"{name} differs from {first}: loss {values[name].item():.5f} against "
                                 f"{values[first].item():.5f}, gradients {error:.1e} apart (relative)")
        parts.append(f"{name} {values[name].item():.5f}, gradients {error:.1e} from {first}'s (relative; within "
                     f"{tolerance:g}: checked)")
    return f"loss: {first} {values[first].item():.5f}; " + "; ".join(parts)


# ── Timing: the step table, the records, the GradScaler's cost ─────────────────────────────────────────────


def step_rows(steps: Comparison, *, tokens: int, peaks: Mapping[str, float],
              memory: Mapping[str, Mapping[str, int | None]]) -> list[dict[str, object]]:
    """The comparison's rows with tokens/s, the share of the variant's sustained matmul peak (``peaks``: TFLOP/s by
    variant) and its memory (``memory[variant]``: "peak_bytes" on a GPU, "saved_bytes")."""
    from utils.bench import percent_of, percent_text

    rows = []
    for row in steps.rows():
        name = row["variant"]
        mem = memory.get(name, {})
        rows.append(row | {"tokens/s": f"{tokens / steps.time_s(name):,.0f}",
                           "% of sustained peak": percent_text(percent_of(steps.rate(name), peaks[name]))
                           if name in peaks else "—",
                           "peak memory": format_bytes(mem["peak_bytes"]) if mem.get("peak_bytes") else "—",
                           "activations saved": format_bytes(mem["saved_bytes"]) if mem.get("saved_bytes") else "—"})
    return rows


def record_steps(steps: Comparison, names: Mapping[str, str],
                 memory: Mapping[str, Mapping[str, int | None]] | None = None) -> None:
    """Record ``step_ms_<name>`` (the comparison's time per call, with :meth:`Comparison.time_band_s` as the band)
    for each variant in ``names`` (variant → name) that the comparison timed, and ``peak_mem_gib_<name>`` (GiB, as
    the tables print memory) where ``memory`` has its peak bytes."""
    from utils import results

    for variant, name in names.items():
        if variant not in steps.timings:
            continue
        q1, q3 = steps.time_band_s(variant)
        results.record(f"step_ms_{name}", steps.time_s(variant) * 1e3, "ms", band=(q1 * 1e3, q3 * 1e3))
        peak = (memory or {}).get(variant, {}).get("peak_bytes")
        if peak:
            results.record(f"peak_mem_gib_{name}", peak / 2**30, "GiB")


#: A step's GPU work and the host's time to issue it within this factor of each other: both set the step's time.
PACE_MARGIN = 1.5
#: The GPU idle share above which a tiny step's time is taken as the host's time to issue the step.
LAUNCH_BOUND_IDLE = 0.5


def step_pace(name: str, step, tiny, *, tiny_label: str) -> str:
    """Which side set a step's time on a GPU: the GPU's work, or the host's time to issue the step's kernels.

    ``step``: the :class:`utils.profile.StepProfile` of the step (``wall_s``: its time per call from the comparison;
    ``busy_s``: its GPU work). ``tiny``: the profile of the same code on a tiny batch (``tiny_label``, e.g.
    "1 × 64 tokens"), where the GPU idles (at least :data:`LAUNCH_BOUND_IDLE` of the step). Its time per step is
    then what the host needs to issue the tiny step, which barely depends on the tensors' sizes. A full step may
    launch more kernels (cuBLAS and reductions split large work), so the tiny step's time is a lower bound on the
    host's; at the tiny step's time per kernel, the full step's kernels give an upper estimate. The GPU sets the
    step's time when its work exceeds that estimate by :data:`PACE_MARGIN`; the host does when the lower bound
    exceeds the GPU work by as much; between the two, both do, and a slower or busier CPU makes the step slower.
    That is why a 16-bit step's speed-up over a GPU-bound fp32 step changes with the host."""
    if not step.on_gpu:
        return f"{name}: on a CPU the host does the work itself; there is no GPU work to set apart."
    gpu, host = step.busy_s, tiny.wall_s
    kernels, tiny_kernels = step.kernels_per_step, tiny.kernels_per_step
    host_most = host * kernels / tiny_kernels if kernels > tiny_kernels else host  # at the tiny step's per kernel
    needs = (f"at least {format_seconds(host)} to issue it (the {tiny_label} step, GPU idle {tiny.idle_fraction:.0%}; "
             f"{tiny_kernels:.0f} kernels to this step's {kernels:.0f})" if host_most > host else
             f"about {format_seconds(host)} to issue one (the {tiny_label} step, GPU idle {tiny.idle_fraction:.0%})")
    measured = (f"{name}: GPU work {format_seconds(gpu)} of its {format_seconds(step.wall_s)} step; "
                f"the host needs {needs}")
    if tiny.idle_fraction < LAUNCH_BOUND_IDLE:
        return f"{measured}. That tiny step kept the GPU busy, so its time is not the host's alone: no split here."
    if gpu >= PACE_MARGIN * host_most:
        return f"{measured}: the GPU sets this step's time; a slower host would not change it."
    if host >= PACE_MARGIN * gpu:
        return (f"{measured}: the host sets this step's time; fewer launches (CUDA graphs, for one) can "
                "shorten it, faster kernels cannot.")
    return (f"{measured}: the two are close, so the host sets this step's time as much as the GPU; a slower or "
            "busier CPU makes it slower.")


def scaler_cost(verdict: Verdict, without, scaled, *, syncs: tuple[int, int]) -> str:
    """The GradScaler's cost at one shape: the verdict of fp16 with the scaler against fp16 without it, and — whatever
    its outcome — what the profiles measured: GPU work and GPU idle time per step without → with the scaler, and the
    host synchronisations it adds (``syncs``: per step without, with)."""
    work = f"GPU work {format_seconds(without.busy_s)} → {format_seconds(scaled.busy_s)} per step"
    idle = f"GPU idle {format_seconds(without.idle_s)} → {format_seconds(scaled.idle_s)}"
    measured = f"{work}, {idle}; host synchronisations per step {syncs[0]} → {syncs[1]}"
    return verdict.explain(faster=f"{measured} (the scaler cannot speed a step up: noise or a state change)",
                           slower=measured, same=f"{measured}: too little to show in the step",
                           inconclusive=f"{measured}: not resolved beyond the noise")


# ── The scaler in a real loop: checkpoints and gradient accumulation ───────────────────────────────────────


def _small_setup(device: torch.device, seed: int = 0):
    from utils import models

    config = models.TransformerConfig(vocab_size=64, d_model=32, nhead=2, num_layers=1, dim_feedforward=64,
                                      dropout=0.0)
    torch.manual_seed(seed)
    net = models.TransformerModel(config).to(device)
    return net, torch.optim.AdamW(net.parameters(), lr=1e-3), torch.amp.GradScaler(
        device.type, init_scale=2.0**24, growth_interval=2)


def scaler_in_a_loop(device: torch.device | str = "cpu") -> list[dict[str, object]]:
    """Check the two rules of the module docstring on a small fp16 language model and return table rows.

    1. 8 steps straight, against 4 steps, a checkpoint, a "new process" (other weights, a fresh scaler) and 4 more:
       with the scaler's state in the checkpoint the weights are bit-identical to the straight run's; without it
       the scale restarts (the row shows whether the weights still matched).
    2. 4 accumulated micro-batches with one scaler against one batch of 16: the unscaled gradients agree within
       fp16 rounding (a forgotten / k would put them k − 1 = 300% apart).

    Raises:
        AssertionError: when either rule fails.
    """
    from utils import data, train

    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(0)
    x, y = data.patterned_tokens(16, 16, 64, device=device, generator=gen)

    def steps(net, opt, scaler, n):
        for _ in range(n):
            train.train_step(net, opt, x, y, amp_dtype=torch.float16, scaler=scaler)

    net, opt, scaler = _small_setup(device)
    steps(net, opt, scaler, 8)
    straight, straight_scale = [p.detach().clone() for p in net.parameters()], scaler.get_scale()
    rows = []
    for keep in (True, False):
        net, opt, scaler = _small_setup(device)
        steps(net, opt, scaler, 4)
        path = Path(tempfile.mkdtemp()) / "checkpoint.pt"
        torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(),
                    **({"scaler": scaler.state_dict()} if keep else {})}, path)
        net, opt, scaler = _small_setup(device, seed=1)
        state = torch.load(path, map_location=device, weights_only=True)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        if keep:
            scaler.load_state_dict(state["scaler"])
        steps(net, opt, scaler, 4)
        same = all(torch.equal(p, q) for p, q in zip(net.parameters(), straight, strict=True))
        if keep and not (same and scaler.get_scale() == straight_scale):
            raise AssertionError("resumed with the scaler's state, the run differs from the straight one")
        rows.append({"check": f"resumed from a checkpoint {'with' if keep else 'without'} the scaler's state",
                     "result": f"final scale {scaler.get_scale():,.0f} (straight run {straight_scale:,.0f}); weights "
                               + ("bit-identical" if same else "differ")})
    grads = {}
    for k in (1, 4):
        net, opt, _ = _small_setup(device, seed=2)
        scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10)  # no overflow: nothing is skipped
        opt.zero_grad(set_to_none=True)
        for xb, yb in zip(x.chunk(k), y.chunk(k), strict=True):
            with torch.autocast(device.type, dtype=torch.float16):
                loss = train.lm_loss(net(xb), yb) / k  # the mean over the whole batch, in k parts
            scaler.scale(loss).backward()  # every micro-batch at the same scale
        scaler.unscale_(opt)
        grads[k] = torch.cat([p.grad.flatten() for p in net.parameters()])
    error = ((grads[4] - grads[1]).norm() / grads[1].norm()).item()
    if not (grads[1].isfinite().all() and error < 2e-2):
        raise AssertionError(f"accumulated gradients differ from the large batch's by {error:.1e}")
    rows.append({"check": "4 accumulated micro-batches, one scaler, vs one batch of 16",
                 "result": f"unscaled gradients {error:.1e} apart (relative; without the / 4: 300%)"})
    return rows


def close_to(tolerance: float) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """A ``check`` for :func:`utils.bench.sweep`: the result within ``tolerance`` of the reference (relative norm), as
    a 16-bit matmul is within rounding of an fp32 one.

    Raises (the returned check):
        AssertionError: when the relative error is larger, or not finite.
    """
    def check(actual: torch.Tensor, expected: torch.Tensor) -> None:
        error = ((actual.float() - expected.float()).norm() / expected.float().norm()).item()
        if not error <= tolerance:
            raise AssertionError(f"relative error {error:.2e} exceeds {tolerance:.0e}")

    return check


def cpu_bf16_reasons() -> dict[str, str]:
    """Reasons by outcome for bf16 against fp32 on this CPU, for :meth:`Verdict.explain`: bf16 is fast on a CPU only
    with matrix units for it (AMX tiles or AVX512-BF16), which PyTorch probes with private functions (read here
    guarded, as "unknown" where a build lacks them)."""
    probes = {"AMX": "_is_amx_tile_supported", "AVX512-BF16": "_is_avx512_bf16_supported"}
    found = {name: getattr(torch.cpu, probe, None) for name, probe in probes.items()}
    if any(probe is None for probe in found.values()):
        return {}
    units = [name for name, probe in found.items() if probe()]
    if units:
        return {"faster": f"this CPU has {' and '.join(units)} for bf16 matmuls"}
    return {"slower": "this CPU has no bf16 matrix units (AMX, AVX512-BF16): bf16 only adds conversions",
            "same": "this CPU has no bf16 matrix units (AMX, AVX512-BF16)"}

"""What notebook 08c measures around quantized inference: model sizes, bytes, the decode sweep bf16 against int8
weight-only, the accuracy a quantization costs, perplexity, torchao's status, and the fp8 recipes this GPU runs.

The subject — the per-channel int8 quantizer, the int8 linear layers, the Triton kernel that reads int8 weights,
fp8 scaling for ``torch._scaled_mm`` — is written in the notebook, where a reader edits it. This module only measures
and checks what the notebook hands it:

- :func:`gpt2_sizes` — GPT-2 124M, 355M, 774M and XL (1.5 B) as :class:`utils.gpt2.GPT2Config`, those that fit this
  GPU's memory (tiny configurations on a CPU).
- :func:`weight_bytes` — the bytes a model's tensors occupy, each tensor once (a tied weight is not counted twice);
  an int8 weight and its scales count as what they are.
- :func:`decode_sweep` — for every size: a seeded fp32 GPT-2 on the device, the variants made from its bf16 copy
  by the notebook's functions, each checked against fp32 (:func:`check_logits`, which raises when a quantization
  breaks the model), then batch-1 greedy decoding in 08's CUDA-graph decoder (:class:`utils.gpt2.StaticDecoder`),
  all variants timed together (:func:`utils.bench.compare`) against the copy bandwidth measured in the same run.
  Returns a :class:`DecodeSweep`: its table, plot, accuracy rows, memory rows and verdicts.
- :func:`check_logits` — relative error of each variant's logits against fp32, compared with bf16's own error.
- :func:`perplexity` — exp(mean negative log-likelihood) of a text, for real weights (:data:`SAMPLE_TEXT`).
- :func:`torchao_status` — torchao's ``quantize_`` and ``Int8WeightOnlyConfig`` when an importable version that
  works with this PyTorch is installed, else the reason it is skipped.
- :func:`fp8_support` — which ``torch._scaled_mm`` scaling recipes run here (per-tensor, row-wise), each with the
  reason when not.

Why int8 weight-only pays at batch 1, and when it does not: a decode step at batch 1 multiplies one vector by
every weight matrix, about 2 FLOP per weight read, so the step's time is the bytes of its weights over the memory
bandwidth plus a fixed cost per kernel. Halving the bytes halves the first part only. Where the step is mostly
kernel overhead (small models), int8 gains little; where it is mostly bytes (large models), it approaches the ratio of
the bytes. The embeddings and the tied head stay in bf16 here, so the bytes shrink by less than half.

Why the two int8 linears differ (notebook section 2): dequantize-then-matmul in eager PyTorch reads the int8 weight
(1 byte), writes a bf16 copy (2 bytes) and reads it back in the matmul (2 bytes): 5 bytes per weight against bf16's
2, so it is *slower* than bf16. torchao's int8 weight-only path computes the same thing and relies on
``torch.compile`` to fuse the conversion into the matmul. A kernel that loads the int8 weight and widens it in
registers reads 1 byte per weight: the Triton kernel of the notebook on a GPU, ATen's ``_weight_int8pack_mm`` on a CPU.
``torch._int_mm`` multiplies int8 by int8 (activations quantized too, W8A8) on tensor cores; on CUDA it needs more
than 16 rows, so it serves prefill and large batches, not batch-1 decoding.
"""

from __future__ import annotations

import copy
import functools
import gc
import inspect
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from utils import bench, gpt2
from utils.env import get_device
from utils.memory import format_bytes, track_peak
from utils.playbook import relative_error

#: A short public-domain text (Charles Darwin, *On the Origin of Species*, 1859, chapter III) for perplexity with
#: real weights: about 300 GPT-2 tokens, bundled so that no download is needed beyond the weights.
SAMPLE_TEXT = (
    "We will now discuss in a little more detail the struggle for existence. In my future work this subject shall "
    "be treated, as it well deserves, at much greater length. The elder De Candolle and Lyell have largely and "
    "philosophically shown that all organic beings are exposed to severe competition. In regard to plants, no one "
    "has treated this subject with more spirit and ability than W. Herbert, Dean of Manchester, evidently the result "
    "of his great horticultural knowledge. Nothing is easier than to admit in words the truth of the universal "
    "struggle for life, or more difficult, at least I have found it so, than constantly to bear this conclusion in "
    "mind. Yet unless it be thoroughly engrained in the mind, I am convinced that the whole economy of nature, with "
    "every fact on distribution, rarity, abundance, extinction, and variation, will be dimly seen or quite "
    "misunderstood. We behold the face of nature bright with gladness, we often see superabundance of food; we do "
    "not see, or we forget, that the birds which are idly singing round us mostly live on insects or seeds, and are "
    "thus constantly destroying life; or we forget how largely these songsters, or their eggs, or their nestlings "
    "are destroyed by birds and beasts of prey; we do not always bear in mind, that though food may be now "
    "superabundant, it is not so at all seasons of each recurring year."
)

#: GPT-2's four published sizes (the hub's names), all with GPT-2's vocabulary and context.
GPT2_CONFIGS: dict[str, gpt2.GPT2Config] = {
    "GPT-2 124M": gpt2.GPT2Config(),
    "GPT-2 medium 355M": gpt2.GPT2Config(n_embd=1024, n_layer=24, n_head=16),
    "GPT-2 large 774M": gpt2.GPT2Config(n_embd=1280, n_layer=36, n_head=20),
    "GPT-2 XL 1.5B": gpt2.GPT2Config(n_embd=1600, n_layer=48, n_head=25),
}
#: Tiny configurations of the same design for a CPU run (seconds, not minutes).
CPU_CONFIGS: dict[str, gpt2.GPT2Config] = {
    "tiny (width 64)": gpt2.GPT2Config(vocab_size=512, n_positions=128, n_embd=64, n_layer=2, n_head=4),
    "small (width 256)": gpt2.GPT2Config(vocab_size=2048, n_positions=128, n_embd=256, n_layer=4, n_head=4),
}
#: Bytes per parameter a size needs on the GPU while the sweep builds it: the fp32 model and its copy (4 + 4),
#: bf16 (2) and int8 (about 1.1), with room to spare.
BUILD_BYTES_PER_PARAM = 12


def parameter_count(config: gpt2.GPT2Config) -> int:
    """GPT-2's parameters for ``config`` (embeddings, blocks, final norm; the head is tied to the embedding)."""
    c, layers = config.n_embd, config.n_layer
    per_block = 4 * c + (3 * c * c + 3 * c) + (c * c + c) + (4 * c * c + 4 * c) + (4 * c * c + c)
    return config.vocab_size * c + config.n_positions * c + layers * per_block + 2 * c


def gpt2_sizes(device: torch.device | str | None = None, *,
               free_bytes: int | None = None) -> dict[str, gpt2.GPT2Config]:
    """The GPT-2 sizes this device can run the sweep at: on a GPU those of :data:`GPT2_CONFIGS` whose build needs
    (:data:`BUILD_BYTES_PER_PARAM` per parameter) fit in 80% of its free memory; on a CPU :data:`CPU_CONFIGS`."""
    device = get_device(device)
    if device.type != "cuda":
        return dict(CPU_CONFIGS)
    if free_bytes is None:
        free_bytes = torch.cuda.mem_get_info(device)[0]
    fits = {name: c for name, c in GPT2_CONFIGS.items()
            if parameter_count(c) * BUILD_BYTES_PER_PARAM <= 0.8 * free_bytes}
    return fits or dict(list(GPT2_CONFIGS.items())[:1])


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters and buffers, each tensor's storage once: a tied weight counts once, an int8
    weight one byte per element, its scales what they hold."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        key = (t.untyped_storage().data_ptr(), t.data_ptr(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def kv_bytes(config: gpt2.GPT2Config, context: int, itemsize: int = 2) -> int:
    """Bytes of keys and values a decode step at batch 1 reads for ``context`` earlier positions."""
    return 2 * config.n_layer * context * config.n_embd * itemsize


# ── Accuracy ────────────────────────────────────────────────────────────────────────────────────────────────


class QuantizationBrokeModel(AssertionError):
    """A quantized model's logits are so far from fp32's that the model is broken, not rounded."""


#: A variant breaks the model when its logits' relative error against fp32 exceeds this many times bf16's own,
#: and also exceeds :data:`BROKEN_FLOOR`: rounding int8 weights per channel costs a few times bf16's error; a wrong
#: scale, a transposed weight or an overflow costs orders of magnitude more.
BROKEN_FACTOR = 20.0
BROKEN_FLOOR = 0.05


@dataclass(frozen=True)
class LogitsError:
    """One variant's logits against fp32 on the same tokens."""

    variant: str
    relative_error: float  # ‖logits − fp32‖ / ‖fp32‖
    top1_agreement: float  # share of positions whose argmax equals fp32's
    baseline_error: float  # bf16's own relative error (the baseline variant's)

    @property
    def ratio(self) -> float:
        """This variant's error over the baseline's (1.0 for the baseline itself)."""
        return self.relative_error / self.baseline_error if self.baseline_error > 0 else math.inf


def check_logits(logits: Mapping[str, torch.Tensor], reference: torch.Tensor, *, baseline: str | None = None,
                 what: str = "") -> dict[str, LogitsError]:
    """Each variant's logits against the fp32 ``reference`` on the same tokens: relative error, top-1 agreement,
    and the ratio to the baseline's (first variant's: bf16's) own error.

    Raises:
        QuantizationBrokeModel: when a variant's error exceeds :data:`BROKEN_FACTOR` × the baseline's and
            :data:`BROKEN_FLOOR`, or its logits are not finite (the message names the variant and ``what``).
        ValueError: for no variants, or a baseline that is not one of them.
    """
    if not logits:
        raise ValueError("check_logits() needs at least one variant")
    baseline = baseline or next(iter(logits))
    if baseline not in logits:
        raise ValueError(f"baseline {baseline!r} is not one of {list(logits)}")
    best = reference.float().argmax(dim=-1)
    errors = {name: relative_error(x.float(), reference.float()) for name, x in logits.items()}
    out = {}
    for name, x in logits.items():
        err = errors[name]
        where = f" ({what})" if what else ""
        if not all(math.isfinite(v) for v in (err,)) or not torch.isfinite(x).all():
            raise QuantizationBrokeModel(f"{name}{where}: its logits are not finite: the quantization broke the model")
        if name != baseline and err > max(BROKEN_FACTOR * errors[baseline], BROKEN_FLOOR):
            raise QuantizationBrokeModel(
                f"{name}{where}: logits {err:.3g} relative error against fp32, {err / errors[baseline]:.0f}× "
                f"{baseline}'s {errors[baseline]:.2g}: the quantization broke the model (rounding costs a few times "
                f"{baseline}'s error; a wrong scale or layout costs this much)")
        agree = (x.float().argmax(dim=-1) == best).float().mean().item()
        out[name] = LogitsError(name, err, agree, errors[baseline])
    return out


def error_rows(errors: Mapping[str, Mapping[str, LogitsError]], baseline: str = "bf16") -> list[dict[str, object]]:
    """Table rows: per model (outer key) and variant, the relative error against fp32, its ratio to the baseline's
    (bf16's, or fp16's where the GPU has no bf16) and the top-1 agreement."""
    rows = []
    for model, by_variant in errors.items():
        for name, e in by_variant.items():
            rows.append({"model": model, "variant": name, "logits vs fp32 (relative)": f"{e.relative_error:.2e}",
                         f"× {baseline}'s error": f"{e.ratio:.2f}×", "top-1 = fp32's": f"{e.top1_agreement:.0%}"})
    return rows


def error_verdict(e: LogitsError, baseline: str = "bf16", *, of: str = "logits") -> str:
    """One sentence on a variant's error against the baseline's own, from the numbers (``of``: what was compared,
    "logits" adds how often the argmax agrees)."""
    if e.ratio <= 1.5:
        how = f"about {baseline}'s own rounding error"
    else:
        how = f"{e.ratio:.1f}× {baseline}'s own error against fp32"
    text = f"{e.variant}: {of} within {e.relative_error:.2g} of fp32 (relative), {how}"
    if of != "logits":
        return text + "."
    return (text + f"; the argmax matches fp32's at {e.top1_agreement:.0%} of positions (random weights give "
            "near-ties, so this says little offline).")


@torch.inference_mode()
def perplexity(model: torch.nn.Module, ids: torch.Tensor) -> float:
    """exp(mean negative log-likelihood) of predicting each token of ``ids`` [1, T] from the ones before it, in one
    forward pass (T ≤ the model's context). Lower is better; a broken model's is near the vocabulary size.

    Raises:
        ValueError: for fewer than 2 tokens.
    """
    if ids.dim() != 2 or ids.shape[1] < 2:
        raise ValueError(f"perplexity() needs token ids [1, T] with T >= 2, got {list(ids.shape)}")
    logits = model(ids[:, :-1]).float()
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    return math.exp(nll.item())


# ── The decode sweep ────────────────────────────────────────────────────────────────────────────────────────


@dataclass
class SizeResult:
    """One model size of :func:`decode_sweep`: the comparison and what each variant read and held."""

    name: str
    config: gpt2.GPT2Config
    params: int
    comparison: bench.Comparison
    steps: int  # decode steps per timed call
    step_bytes: dict[str, int]  # weights + KV cache read per step, per variant
    weights: dict[str, int]  # weight bytes per variant
    decode_peak: dict[str, int]  # weights + the peak a decode allocated on top (cache, graph, activations)
    errors: dict[str, LogitsError]

    def tokens_per_s(self, variant: str) -> float:
        return self.steps / self.comparison.time_s(variant)

    def pct_copy(self, variant: str) -> float | None:
        c = self.comparison
        return None if c.limit is None else 100 * c.rate(variant) / c.limit


def _count(n: float) -> str:
    """A parameter count for an axis: 82 K, 124 M, 1.56 B."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g} {suffix}"
    return f"{n:.0f}"


@dataclass
class DecodeSweep:
    """Batch-1 decoding, variant by variant and size by size (:func:`decode_sweep`)."""

    sizes: list[SizeResult]
    copy_gbps: float | None
    baseline: str
    memory_what: str = ""
    variants: list[str] = field(default_factory=list)
    decoder: str = ""  # how each variant decodes, for the table's title

    def rows(self) -> list[dict[str, object]]:
        """Per size: tokens/s, bytes per token and % of the copy-bandwidth yardstick of every variant, and each
        variant's verdict against the baseline."""
        rows = []
        for s in self.sizes:
            row: dict[str, object] = {"model": s.name}
            for v in self.variants:
                row[f"{v} tokens/s"] = f"{s.tokens_per_s(v):,.0f}"
            for v in self.variants:
                row[f"{v} bytes/token"] = format_bytes(s.step_bytes[v])
            for v in self.variants:
                pct = s.pct_copy(v)
                row[f"{v} % of copy"] = "—" if pct is None else f"{pct:.0f}%"
            for v in self.variants[1:]:
                row[f"{v} vs {self.baseline}"] = s.comparison.verdict(v).short
            rows.append(row)
        return rows

    def table(self) -> None:
        from utils.plot import format_table

        c = self.sizes[0].comparison
        print(format_table(self.rows(), title=(
            f"Batch-1 greedy decoding{f' ({self.decoder})' if self.decoder else ''}, {self.sizes[0].steps} steps per "
            f"call, each size's variants timed in "
            f"{c.rounds} alternating rounds; % of copy: bytes read per second over the copy bandwidth "
            f"({self.copy_gbps:,.0f} GB/s)" if self.copy_gbps else "")))

    def memory_rows(self) -> list[dict[str, object]]:
        rows = []
        for s in self.sizes:
            row: dict[str, object] = {"model": s.name}
            for v in self.variants:
                row[f"{v} weights"] = format_bytes(s.weights[v])
            for v in self.variants:
                row[f"{v} peak in a decode"] = format_bytes(s.decode_peak[v])
            rows.append(row)
        return rows

    def accuracy_rows(self) -> list[dict[str, object]]:
        return error_rows({s.name: s.errors for s in self.sizes}, self.baseline)

    def verdicts(self) -> list[str]:
        """Per size and variant: the verdict against the baseline, with what its fewer bytes explain of it. The
        time per token the variant saved is set against the time its fewer bytes take at the copy bandwidth: about
        equal (within 1.25×), the bytes explain the gain; 1.25× or more, the share they leave comes from elsewhere
        (the layers' kernels); far less, each variant's share of the copy bandwidth says how far below it they
        read. A null result says what the bytes would have given at that bandwidth, and how fast each variant
        read. Without a copy bandwidth only the bytes' ratio is given."""
        lines = []
        for s in self.sizes:
            for v in self.variants[1:]:
                verdict = s.comparison.verdict(v, against=self.baseline)
                lines.append(f"{s.name}: " + verdict.explain(**self._reasons(s, v)))
        return lines

    def _reasons(self, s: SizeResult, v: str) -> dict[str, str]:
        bytes_ratio = s.step_bytes[self.baseline] / s.step_bytes[v]
        fewer = f"{v} reads {bytes_ratio:.2f}× fewer bytes per token"
        if not self.copy_gbps:
            return {"faster": fewer, "same": fewer, "slower": fewer, "inconclusive": fewer}
        t_base, t_v = 1 / s.tokens_per_s(self.baseline), 1 / s.tokens_per_s(v)
        bytes_s = (s.step_bytes[self.baseline] - s.step_bytes[v]) / (self.copy_gbps * 1e9)
        at_copy = f"its {bytes_ratio:.2f}× fewer bytes take {bench.format_seconds(bytes_s)} less at the copy bandwidth"
        saved = t_base - t_v
        ratio = saved / bytes_s if bytes_s > 0 else float("inf")
        pct = {k: s.step_bytes[k] / t / (self.copy_gbps * 1e9) for k, t in ((self.baseline, t_base), (v, t_v))}
        reads = f"{v} reads at {pct[v]:.0%} of the copy bandwidth, {self.baseline} at {pct[self.baseline]:.0%}"
        if ratio >= 1.25:
            how = (f"{ratio:.1f}× what the bytes explain: {1 - 1 / ratio:.0%} of the gain comes from elsewhere (the "
                   "layers' kernels differ too; not measured apart here)")
        elif ratio > 0.8:
            how = "about what the bytes explain"
        else:
            how = f"{ratio:.0%} of what the bytes explain: {reads}"
        faster = f"it saves {bench.format_seconds(saved)} per token; {at_copy}: {how}"
        share = bytes_s / t_base
        small = f"{at_copy}, {share:.0%} of {self.baseline}'s {bench.format_seconds(t_base)} per token"
        predicted = t_base / (t_base - bytes_s) if bytes_s < t_base else float("inf")
        same = (f"{small}: a gain under the resolution even at that bandwidth" if predicted < 1.03 else
                f"{small}: {predicted:.2f}× faster had they been read at that bandwidth, which did not show: {reads}")
        return {"faster": faster, "same": same, "slower": f"{small}; its kernels' extra work cost more than that",
                "inconclusive": small}

    def plot(self, title: str = "Batch-1 decoding by model size: tokens/s (solid), % of copy bandwidth (dashed)"):
        from matplotlib.ticker import NullLocator

        from utils.plot import curves

        x = [s.params for s in self.sizes]
        right = None
        if self.copy_gbps:
            right = {f"{v}, % of copy bandwidth": (x, [s.pct_copy(v) for s in self.sizes]) for v in self.variants}
        fig = curves({f"{v}, tokens/s": (x, [s.tokens_per_s(v) for s in self.sizes]) for v in self.variants},
                     xlabel="parameters (log scale)", ylabel="tokens/s at batch 1", logx=True, logy=True,
                     right=right, right_label="% of the copy bandwidth" if right else None, legend_outside=True,
                     title=title)
        ax = fig.axes[0]
        ax.set_xticks(x, [_count(p) for p in x])  # a tick at each model's size, not at powers of ten
        ax.xaxis.set_minor_locator(NullLocator())
        return fig

    def record(self, figures: Mapping[str, tuple[str, str, str]]) -> list[str]:
        """Record figures of the size named in each spec: ``{figure: (size name, variant, quantity)}``, quantity
        "tokens_per_s", "speedup" (against the baseline, with its band) or "error_ratio" (the variant's logits
        error over the baseline's). A size this run did not reach is left out; returns the names recorded."""
        from utils import results

        done = []
        by_name = {s.name: s for s in self.sizes}
        for figure, (size, variant, quantity) in figures.items():
            s = by_name.get(size)
            if s is None:
                continue
            if quantity == "tokens_per_s":
                pct = s.pct_copy(variant)
                results.record(figure, s.tokens_per_s(variant), "tokens/s",
                               limit=None if pct is None else s.tokens_per_s(variant) * 100 / pct,
                               limit_name="copy-bandwidth yardstick" if pct is not None else None)
            elif quantity == "speedup":
                v = s.comparison.verdict(variant, against=self.baseline)
                results.record(figure, v.speedup, "x", band=v.band)
            elif quantity == "error_ratio":
                results.record(figure, s.errors[variant].ratio, "x")
            else:
                raise ValueError(f"record(): quantity is tokens_per_s, speedup or error_ratio, got {quantity!r}")
            done.append(figure)
        return done


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def decode_sweep(
    configs: Mapping[str, gpt2.GPT2Config],
    variants: Mapping[str, Callable[[torch.nn.Module], torch.nn.Module]],
    *,
    device: torch.device | str | None = None,
    copy_bw: bench.Rate | float | None = None,
    prompt_len: int = 16,
    new_tokens: int = 64,
    rounds: int | None = None,
    min_run_time: float = 1.0,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    fused_step: bool = False,
    progress: bool = True,
) -> DecodeSweep:
    """Batch-1 greedy decoding of GPT-2 at every size of ``configs``, every variant timed together per size.

    Per size: a GPT-2 with GPT-2's random initialisation (seeded) is built in fp32 on ``device``; its copy in
    ``dtype`` (bf16; fp16 on a GPU without bf16) is handed to each function of ``variants`` (the first is the
    baseline, e.g. ``{"bf16": lambda m: m, "int8": quantize}``), which returns the model to decode with. Each
    variant's logits on a random prompt are checked against fp32's (:func:`check_logits`: a broken quantization
    raises before any timing). Then each decodes in a :class:`utils.gpt2.StaticDecoder` (one CUDA graph per step on
    a GPU; ``fused_step``: of notebook 08's Triton step, :class:`utils.gpt2_fused.FusedDecodeStep`, which reads int8
    weights with their scales where a variant holds them): the first generation captures, and its peak memory on top
    of what was there is taken (:func:`utils.memory.track_peak`); the timed call rewinds to the prompt and decodes
    ``new_tokens`` (``new_tokens - 1`` steps). Bytes per step: the variant's weights (:func:`weight_bytes`) plus the
    KV cache at the average context.

    Raises:
        QuantizationBrokeModel: from :func:`check_logits`.
        ValueError: for no sizes or fewer than two variants.
    """
    if not configs or len(variants) < 2:
        raise ValueError("decode_sweep() needs at least one size and two variants (the first is the baseline)")
    device = get_device(device)
    names = list(variants)
    steps = new_tokens - 1
    context = prompt_len + new_tokens // 2
    copy_gbps = copy_bw.value if isinstance(copy_bw, bench.Rate) else copy_bw
    results = []
    items = configs.items()
    if progress:
        from tqdm.auto import tqdm

        items = tqdm(list(items), desc="model sizes", leave=False)
    for name, config in items:
        torch.manual_seed(seed)
        with torch.device(device):
            fp32 = gpt2.GPT2(config).eval()
        prompt = torch.randint(0, config.vocab_size, (1, prompt_len), device=device,
                               generator=torch.Generator(device).manual_seed(seed))
        with torch.inference_mode():
            reference = fp32(prompt)
        models = {}
        for v, make in variants.items():
            models[v] = make(copy.deepcopy(fp32).to(dtype)).eval()
        del fp32
        _free(device)
        with torch.inference_mode():
            logits = {v: m(prompt) for v, m in models.items()}
        errors = check_logits(logits, reference, baseline=names[0], what=name)
        del logits, reference
        decoders, peaks, fns = {}, {}, {}
        for v, m in models.items():
            with track_peak(device) as peak:
                decoder = gpt2.StaticDecoder(m, batch=1, max_len=prompt_len + new_tokens, fused_step=fused_step)
                decoder.generate(prompt, new_tokens)  # captures the step's graph on a GPU
            decoders[v], peaks[v] = decoder, weight_bytes(m) + peak.peak_increase_bytes
            fns[v] = (lambda d=decoder: (d.rewind(), d.decode(new_tokens)))
        weights = {v: weight_bytes(m) for v, m in models.items()}
        step_bytes = {v: weights[v] + kv_bytes(config, context) for v in names}
        comparison = bench.compare(fns, rounds=rounds, min_run_time=min_run_time, device=device,
                                   bytes_moved={v: step_bytes[v] * steps for v in names}, limit=copy_gbps,
                                   limit_name="copy bandwidth", title=f"{name}, batch-1 decoding", progress=False)
        results.append(SizeResult(name, config, gpt2.count_parameters(models[names[0]]), comparison, steps,
                                  step_bytes, weights, peaks, errors))
        del decoders, models, fns, decoder, m, peak  # the loop's names too: the last model would outlive its size
        _free(device)
    what = ("peak: weights + the most a decode (cache, graph, activations) allocated on top, from the caching "
            "allocator" if device.type == "cuda" else
            "peak: weights + the process's resident-memory peak during a decode (to the page, everything it holds)")
    decoder = ("notebook 08's Triton step" if fused_step else "eager kernels") + (
        ", one CUDA graph per step" if device.type == "cuda" else "") + f", a {prompt_len}-token prompt"
    return DecodeSweep(results, copy_gbps, names[0], what, names, decoder)


# ── torchao and fp8 ─────────────────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class Torchao:
    """torchao's weight-only int8 entry points, or why they are not usable here."""

    quantize_: Callable | None
    Int8WeightOnlyConfig: Callable[[], object] | None  # the config to pass to quantize_, called with no arguments
    version: str | None
    why_not: str | None

    @property
    def available(self) -> bool:
        return self.why_not is None


def torchao_status(device: torch.device | str | None = None, dtype: torch.dtype = torch.bfloat16) -> Torchao:
    """Import torchao's ``quantize_`` and ``Int8WeightOnlyConfig`` and try them on one small linear layer of
    ``dtype`` on ``device`` (default: :func:`utils.env.get_device`), where the notebook will use them: usable, or the
    reason it is skipped (not installed, an import error, a version that does not work with this PyTorch or here)."""
    device = get_device(device)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)  # torchao registers enums torch now handles
    try:
        import torchao
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError as err:
        why = ("torchao is not installed (pip install torchao, a version made for this PyTorch)"
               if getattr(err, "name", "") == "torchao" else f"torchao does not import here: {err}")
        return Torchao(None, None, None, why)
    except Exception as err:  # a torchao built for another PyTorch can fail in many ways at import
        return Torchao(None, None, None, f"torchao does not import with PyTorch {torch.__version__}: "
                                         f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:160]}")
    version = getattr(torchao, "__version__", "unknown")
    configs = [Int8WeightOnlyConfig]  # version 2 (an Int8Tensor) first where the config has versions: 1 is deprecated
    if "version" in inspect.signature(Int8WeightOnlyConfig).parameters:
        configs.insert(0, functools.partial(Int8WeightOnlyConfig, version=2))
    for config in configs:
        try:
            layer = torch.nn.Linear(32, 16).to(device, dtype)
            quantize_(layer, config())
            layer(torch.randn(2, 32, device=device, dtype=dtype))
            return Torchao(quantize_, config, version, None)
        except Exception as err:
            why = (f"torchao {version} does not work with PyTorch {torch.__version__} on {device.type}: "
                   f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:160]}")
    return Torchao(None, None, version, why)


def _int8_values(weight: torch.Tensor) -> torch.Tensor | None:
    """The int8 values inside a torchao weight (``Int8Tensor.qdata``; older versions' ``tensor_impl``), or None."""
    if getattr(weight, "qdata", None) is not None:
        return weight.qdata
    impl = getattr(weight, "tensor_impl", None)
    if impl is not None and hasattr(impl, "get_plain"):
        return impl.get_plain()[0]
    return None


@torch.inference_mode()
def agreement(ours: torch.nn.Module, theirs: torch.nn.Module, x: torch.Tensor, reference: torch.Tensor) -> str:
    """Two int8 quantizations of the same layer checked against each other.

    ``ours.weight`` (int8) against the int8 values inside ``theirs.weight`` (torchao's): they may differ by one step
    where the two round a scale differently (torchao maps the largest |w| to 127.5, a textbook to 127). Then
    torchao's output must be our formula — ``F.linear(x, q.to(x.dtype)) * scale + bias`` — applied to *its* int8
    values and scales (up to bf16 rounding), and the two layers' outputs must lie within twice the larger of their
    errors against the unquantized ``reference`` (two independent roundings differ by about √2 times one).

    Raises:
        AssertionError: for an int8 value more than one step away, torchao's output not being that formula, or
            outputs further apart than that.
    """
    out_ours, out_theirs = ours(x).float(), theirs(x).float()
    parts = []
    values, scale = _int8_values(theirs.weight), getattr(theirs.weight, "scale", None)
    if values is not None:
        values = values.reshape(ours.weight.shape)
        step = (ours.weight.to(torch.int16) - values.to(torch.int16)).abs()
        if step.max().item() > 1:
            raise AssertionError(f"the int8 weights differ by up to {step.max().item()} steps: not the same "
                                 "quantization")
        parts.append(f"{(step == 0).float().mean().item():.1%} of the int8 weights identical, the rest one step "
                     "apart")
        if scale is not None:
            formula = F.linear(x, values.to(x.dtype)) * scale.to(x.dtype).reshape(-1)
            formula = formula if theirs.bias is None else formula + theirs.bias
            off = relative_error(out_theirs, formula.float())
            if off > 1e-2:
                raise AssertionError(f"torchao's output is {off:.2g} from our formula on its own int8 values: it "
                                     "computes something else")
            parts.append("torchao's output is our formula on its values, " + ("exactly" if off == 0 else
                                                                             f"{off:.0e} apart"))
        else:
            parts.append("its scales are not readable in this version, so our formula on its values is not checked")
    else:
        parts.append("torchao's int8 values are not readable in this version, so only the outputs are compared")
    between = relative_error(out_ours, out_theirs)
    ours_err, theirs_err = relative_error(out_ours, reference), relative_error(out_theirs, reference)
    if between > 2 * max(ours_err, theirs_err):
        raise AssertionError(f"the outputs differ by {between:.2g}, more than twice the larger of their errors "
                             f"against the unquantized layer ({ours_err:.2g}, {theirs_err:.2g})")
    parts.append(f"the two outputs {between:.1g} apart, each {ours_err:.1g} (ours) and {theirs_err:.1g} (torchao) "
                 "from fp32")
    return "; ".join(parts)


def fp8_support(device: torch.device | str | None = None) -> dict[str, str | None]:
    """Which scaling recipes of ``torch._scaled_mm`` run here: ``{"per-tensor": None | reason, "row-wise": ...}``.

    On a GPU: fp8 tensor cores need compute capability 8.9 (Ada) or later; each recipe is then tried on a small
    product (row-wise scales need a newer GPU or PyTorch than per-tensor ones). On a CPU, PyTorch emulates fp8
    matmuls: they show the arithmetic, not a speed, so timings are skipped there (the notebook says so).
    """
    device = get_device(device)
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            reason = (f"fp8 tensor cores need compute capability 8.9 or later (Ada, Hopper, Blackwell); this GPU "
                      f"is {cap[0]}.{cap[1]}")
            return {"per-tensor": reason, "row-wise": reason}
    out: dict[str, str | None] = {}
    a = torch.randn(32, 64, device=device, dtype=torch.bfloat16)
    b = torch.randn(48, 64, device=device, dtype=torch.bfloat16)
    fp8 = torch.float8_e4m3fn
    for recipe in ("per-tensor", "row-wise"):
        try:
            if recipe == "per-tensor":
                sa = sb = torch.tensor(1.0, device=device)
            else:
                sa, sb = torch.ones(32, 1, device=device), torch.ones(1, 48, device=device)
            torch._scaled_mm(a.to(fp8), b.to(fp8).t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
            out[recipe] = None
        except Exception as err:  # a gate says why: a check in ATen, a missing kernel, an unsupported GPU
            out[recipe] = (f"torch._scaled_mm with {recipe} scales fails here: "
                           f"{(str(err).splitlines() or [type(err).__name__])[0][:160]}")
    return out


def fp8_scales_verdict(errors: Mapping[str, float]) -> str:
    """Per-tensor against row-wise scales, from their errors (:func:`fp8_error_rows`' keys "fp8, per-tensor
    scales" and "fp8, row-wise scales"): which kept the ordinary rows more precise, or that they tie (within 10%)."""
    tensor, row = errors.get("fp8, per-tensor scales"), errors.get("fp8, row-wise scales")
    if tensor is None or row is None:
        return "Only one recipe ran here, so the two cannot be compared."
    if abs(tensor / row - 1) <= 0.1:
        return (f"Per-tensor and row-wise scales tie ({tensor:.2g} and {row:.2g}): fp8's exponent absorbed the "
                "outlier.")
    better, worse = ("row-wise", "per-tensor") if row < tensor else ("per-tensor", "row-wise")
    return (f"{better.capitalize()} scales kept the ordinary rows {max(tensor, row) / min(tensor, row):.1f}× more "
            f"precise than {worse} ones ({min(tensor, row):.2g} against {max(tensor, row):.2g}).")


def fp8_error_rows(errors: Mapping[str, float], baseline: str = "bf16") -> list[dict[str, object]]:
    """Rows of relative errors against fp32, each with its ratio to the baseline's."""
    base = errors.get(baseline)
    return [{"variant": k, "relative error vs fp32": f"{e:.2e}",
             f"× {baseline}'s": f"{e / base:.1f}×" if base else "—"} for k, e in errors.items()]


# ── One layer timed: past the L2 cache, without host launch cost ────────────────────────────────────────────


def copies_past_l2(nbytes: int, device: torch.device | str | None = None, *, l2_bytes: int | None = None,
                   factor: int = 4) -> int:
    """How many copies of a layer whose weights take ``nbytes`` make the weights read per call exceed ``factor`` ×
    the GPU's L2 cache, so that a timing of them reads memory, as a model's forward does, not the L2 cache (one layer
    called again and again stays in L2 when it fits: 20 MB does, in an H100's 50 MB). 1 on a CPU."""
    device = get_device(device)
    if device.type != "cuda":
        return 1
    if l2_bytes is None:
        l2_bytes = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0
    return max(1, -(-factor * l2_bytes // max(nbytes, 1)))


def streamed_layers(layers: Mapping[str, torch.nn.Module], x: torch.Tensor, copies: int, *,
                    device: torch.device | str | None = None) -> tuple[dict[str, Callable[[], object]], str]:
    """One callable per layer for :func:`utils.bench.compare`: each applies ``copies`` copies of its layer (deep
    copies: separate weights) to ``x``. On a GPU the calls are captured in one CUDA graph per layer, so a timing
    measures the kernels, not the host's launch cost (a single layer at batch 1 takes a few microseconds, about a
    launch's cost); on a CPU they run eagerly. Returns ``(callables, how)``: ``how`` says what a call runs. When a
    layer cannot be captured (a library's layer that synchronises, say), every layer runs eagerly, and ``how``
    says so and why: the comparison stays fair."""
    device = get_device(device)
    stacks = {name: [layer] + [copy.deepcopy(layer) for _ in range(copies - 1)] for name, layer in layers.items()}

    def run(stack):
        with torch.inference_mode():
            for layer in stack:
                layer(x)

    eager = {name: (lambda stack=stack: run(stack)) for name, stack in stacks.items()}
    what = f"{copies} copies of each layer per call" if copies > 1 else "one layer per call"
    if device.type != "cuda":
        return eager, f"{what}, launched from Python"
    graphed = {}
    try:
        for name, stack in stacks.items():
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):  # compiles Triton kernels and sets up cuBLAS outside the capture
                    run(stack)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph):
                for layer in stack:
                    layer(x)
            graphed[name] = graph.replay
    except Exception as err:  # a layer that cannot be captured: time them all the same way, with launches
        torch.cuda.synchronize(device)
        return eager, (f"{what}, launched from Python: {name} could not be captured in a CUDA graph "
                       f"({type(err).__name__}: {str(err).splitlines()[0][:120]}), so host launch costs are included")
    return graphed, f"{what}, in one CUDA graph (no host launch cost)"


# ── The notebook's Triton kernel: its launch shape ─────────────────────────────────────────────────────────

#: The most int8 weights one program of the notebook's matrix-vector kernel loads per loop step (16 KB).
MAX_TILE = 16384


def matvec_blocks(n: int, k: int, device: torch.device | str | None = None, *, programs_per_sm: int = 2
                  ) -> tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps)`` for the notebook's int8 matrix-vector kernel on an [n, k] weight: the
    whole row in one tile when it fits (BLOCK_K the next power of two of k, at most :data:`MAX_TILE`), and as few
    outputs per program (BLOCK_N, a power of two from 2 to 16) as give about ``programs_per_sm`` programs per
    multiprocessor, within :data:`MAX_TILE` weights a program — the shape notebook 08's Triton step uses."""
    device = get_device(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    block_k = min(1 << max(k - 1, 1).bit_length(), MAX_TILE)
    wanted = max(1, -(-n // (programs_per_sm * sms)))
    block_n = max(2, min(1 << (wanted.bit_length() - 1), 16, MAX_TILE // block_k))
    return block_n, block_k, 8 if block_n * block_k >= 8192 else 4


# ── fp8 timed ─────────────────────────────────────────────────────────────────────────────────────────────

#: An fp8 product of random operands lies about 4% from the exact one (3 mantissa bits); more than this is a bug.
FP8_TOLERANCE = 0.1


def fp8_sweep(to_fp8: Callable, fp8_matmul: Callable, recipes: list[str], *, sizes: list[int],
              device: torch.device | str | None = None, rounds: int = 12, min_run_time: float = 1.0,
              record: Mapping[str, str] | None = None) -> bench.Sweep:
    """bf16 against fp8 products of n×n bf16 operands at every size, with the notebook's ``to_fp8(t, rowwise)``
    and ``fp8_matmul(a8, scale_a, b8, scale_b)``: the operands are converted before the timing (as a served model's
    weights are), each fp8 result checked against bf16's (relative error at most :data:`FP8_TOLERANCE`), all
    variants timed together per size (:func:`utils.bench.sweep`, TFLOP/s). ``recipes``: "per-tensor", "row-wise".
    ``record``: ``{figure: variant}``, the variant's speed-up over bf16 at the largest size, with its band.
    """
    device = get_device(device)
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def operands(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if n not in cache:
            cache.clear()
            g = torch.Generator(device).manual_seed(n)
            a = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=g)
            cache[n] = a, (torch.randn(n, n, device=device, generator=g) / math.sqrt(n)).to(torch.bfloat16)
        return cache[n]

    def bf16(n: int) -> Callable[[], torch.Tensor]:
        a, b = operands(n)
        return lambda: a @ b.T

    def fp8(rowwise: bool) -> Callable[[int], Callable[[], torch.Tensor]]:
        def make(n: int) -> Callable[[], torch.Tensor]:
            a, b = operands(n)
            (a8, sa), (b8, sb) = to_fp8(a, rowwise), to_fp8(b, rowwise)
            return lambda: fp8_matmul(a8, sa, b8, sb)
        return make

    def within(actual: torch.Tensor, expected: torch.Tensor) -> None:
        err = relative_error(actual.float(), expected.float())
        if not err <= FP8_TOLERANCE:
            raise AssertionError(f"relative error {err:.3g} against bf16's product (at most {FP8_TOLERANCE})")

    factories = {"bf16": bf16} | {f"fp8, {r} scales": fp8(r == "row-wise") for r in recipes}
    result = bench.sweep(factories, sizes, reference=lambda n: bf16(n)(), reference_variant="bf16", check=within,
                         flops=lambda n: 2 * n**3,
                         size_label="n (n×n×n product)", rounds=rounds, min_run_time=min_run_time, device=device,
                         title="bf16 against fp8 matmuls")
    if record:
        result.comparisons[-1].record({name: variant for name, variant in record.items()
                                       if variant in result.comparisons[-1].variants})
    cache.clear()
    return result


def fp8_verdicts(result: bench.Sweep, to_fp8: Callable, *, device: torch.device | str | None = None) -> list[str]:
    """At the largest size: each fp8 recipe's verdict against bf16, and what converting one activation to fp8
    costs per call (timed with :func:`utils.bench.bench`) as a share of the fp8 product it feeds."""
    device = get_device(device)
    largest, n = result.comparisons[-1], result.sizes[-1]
    lines = []
    for variant in largest.variants[1:]:
        lines.append(f"n={n}: " + largest.verdict(variant).explain(
            faster="fp8 tensor cores do more operations per cycle than bf16's",
            same="at this size the product is not bound by the tensor cores' rate",
            slower="at this size the fp8 path's fixed costs outweigh its faster arithmetic"))
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for variant in largest.variants[1:]:
        rowwise = "row-wise" in variant
        conversion = bench.bench(lambda a=a, rowwise=rowwise: to_fp8(a, rowwise), device=device, min_run_time=0.3)
        share = conversion.median_s / largest.time_s(variant)
        took = bench.format_seconds(conversion.median_s)
        counted = largest.time_s("bf16") / (largest.time_s(variant) + conversion.median_s)
        lines.append(f"{variant}: converting one {n}×{n} bf16 activation takes {took} in eager PyTorch, "
                     f"{share:.0%} of the fp8 product; counted in, fp8 would be {counted:.2f}× bf16's speed. "
                     "A served model fuses that conversion into the operation before it (not timed here)")
    return lines

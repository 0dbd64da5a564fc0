"""torch.compile measured: what it generated, what the first calls cost from cold caches, when that pays off, and
whether the compiled result matches eager.

Notebooks 04 and 04b keep the subject inline (the ``torch.compile`` calls, the compiled training step); this module
holds what measures and checks it::

    backend = utils.compile.choose_backend(caps)            # Inductor where it can generate code here, else why not
    out = utils.compile.generated(torch.compile(fn), x)     # the kernels Inductor generated, and an excerpt
    compiled = utils.compile.compile_cold({"whole step": make_step})   # each built and first called, cold
    timing = utils.bench.compare({"eager": eager} | {k: c.fn for k, c in compiled.items()})
    utils.compile.payoff(timing, compiled).table()          # compile cost and break-even, from that one comparison

**First calls.** The first call of a compiled function traces it (Dynamo), traces its backward (AOTAutograd) and
generates and compiles kernels (Inductor). In ``mode="reduce-overhead"`` the graph trees run the first call as a
warm-up, *record* the CUDA graphs on the second, and replay from the third: so :func:`compile_cold` times the
first ``calls`` (default 3) calls one by one, and what compiling added is their sum less as many steady-state
steps. A compiled optimizer may also compile its first step apart from the later ones (its state is created on the
first): the three calls cover that too.

**Cold.** Every variant is built and first called in :func:`utils.compile_cache.cold` (``keep_compiled=True``): an
empty cache directory and cleared in-memory caches, so its cost is what a first run on a new machine pays. A check
passed to :func:`compile_cold` runs inside the same block, after the timing: where it compiles the same graphs, it
loads them from that block's cache instead of compiling them again.

**Break-even.** After *n* steps eager has cost ``n · t_eager`` and a compiled variant ``cost + n · t_compiled``, so
compiling pays off after ``ceil(cost / (t_eager − t_compiled))`` steps. :class:`Payoff` takes both times from the
comparison (``Comparison.time_s``: eager's median, and for a variant the same number its verdict uses), so the
table, the verdicts and the break-even agree. A variant resolved slower never pays off; one whose verdict is "same"
or inconclusive has an *unresolved* break-even: it is printed so, and left out of the break-even plot.

**Checks.** :func:`check_outputs` compares named results (tensors, or dicts of tensors counted by their worst
entry) by relative error ‖a − b‖ / ‖b‖. In full precision the compiled result must lie within ``tolerance`` of
eager. Under 16-bit autocast eager is itself far from fp32, and a fixed tolerance between the two would sit near
the rounding; so both are measured against the same model run in fp32, and the compiled result may lie at most
``slack`` (1.5) times as far from it as eager does, plus ``floor`` (1e-3). A result that is not finite fails; a
reference that is not finite skips its row and says so; a check in which every row was skipped fails: it compared
nothing. :func:`check_training_step` and :func:`check_optimizer_step` build the cases for a training step.

**Autotuning.** ``max-autotune`` benchmarks, at compile time, Triton matmul templates against cuBLAS for every
distinct matmul shape, and configurations of the generated kernels. Inductor uses its matmul templates only on a
GPU with at least 68 SMs (its ``is_big_gpu`` rule, e.g. an RTX 3080 or larger): :func:`autotune_skip_reason` applies
that rule to the SM count the device reports. Bound the cost with
``torch._inductor.config.patch(max_autotune_gemm_backends="ATEN,TRITON", max_autotune_gemm_search_space="DEFAULT")``
and autotune a single matmul-heavy function, not a whole model: the cost grows with every distinct shape.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import re
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial

import torch

from utils.compile_cache import GraphCounts, cold, graph_counts, quiesce
from utils.env import Capabilities, get_device, synchronize

#: Inductor's ``is_big_gpu`` rule: the fewest SMs of a GPU on which it uses its Triton matmul templates.
MIN_SMS_FOR_MATMUL_TEMPLATES = 68


# ── Which backend can compile here ─────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class Backend:
    """The ``backend=`` to pass to ``torch.compile`` on this machine, and why."""

    name: str  # "inductor", or "aot_eager" where Inductor cannot generate code
    device_type: str
    reason: str

    @property
    def generates_code(self) -> bool:
        return self.name == "inductor"

    @property
    def cuda_graphs(self) -> bool:
        """Whether ``mode="reduce-overhead"`` (CUDA graphs, an Inductor mode) can run here."""
        return self.generates_code and self.device_type == "cuda"

    def __str__(self) -> str:
        return self.reason


def choose_backend(caps: Capabilities) -> Backend:
    """Inductor where it can generate code for this device: Triton kernels on a CUDA GPU that Triton supports
    (``caps.triton``: importable, compute capability 7.0 or newer), C++ kernels on a CPU with a C++ compiler on PATH
    (``caps.cxx``). Elsewhere ``"aot_eager"``: Dynamo and AOTAutograd capture the graphs, no code is generated, so the
    notebook still runs and says why it cannot show a speed-up."""
    if caps.device == "cpu":
        if caps.cxx:
            return Backend("inductor", "cpu", f"torch.compile uses Inductor here: C++ kernels built with {caps.cxx}")
        why = "no C++ compiler on PATH (Inductor builds its CPU kernels with g++ or clang)"
    else:
        if caps.triton:
            return Backend("inductor", "cuda", f"torch.compile uses Inductor here: Triton kernels for {caps.name} "
                                               f"({caps.arch})")
        why = f"Triton does not run on {caps.name} ({caps.arch}; it needs sm_70 or newer and the triton package)"
    return Backend("aot_eager", caps.device.split(":")[0],
                   f"Inductor cannot generate code here: {why}. Compiling with backend='aot_eager' instead: graphs "
                   "are captured, no kernel is generated, so expect no speed-up")


def autotune_skip_reason(caps: Capabilities) -> str | None:
    """None where ``max-autotune`` can autotune matmuls here; else why not, in a sentence.

    Inductor uses its Triton matmul templates only on GPUs with at least :data:`MIN_SMS_FOR_MATMUL_TEMPLATES` SMs
    (its private ``torch._inductor.utils.is_big_gpu``); this applies that rule to ``caps.sm_count``. Elsewhere
    ``max-autotune`` would tune only the generated kernels."""
    if caps.device == "cpu":
        return "autotuning benchmarks GPU kernels; on a CPU this notebook keeps to the default mode"
    if not caps.triton:
        return f"Triton does not run on {caps.name}, and max-autotune's candidates are Triton kernels"
    if caps.sm_count is None or caps.sm_count < MIN_SMS_FOR_MATMUL_TEMPLATES:
        return (f"{caps.name} has {caps.sm_count} SMs; Inductor uses its Triton matmul templates only from "
                f"{MIN_SMS_FOR_MATMUL_TEMPLATES} SMs up, so max-autotune would tune only the generated kernels")
    return None


# ── What Inductor generated ────────────────────────────────────────────────────────────────────────────────────

_KERNEL = re.compile(r"^(\w+) = async_compile\.(triton|cpp_pybinding|cpp)\(", re.MULTILINE)


@dataclass(frozen=True)
class Generated:
    """What a compiled call returned and the Python modules Inductor generated for it (empty for other backends)."""

    output: object
    modules: tuple[str, ...]

    @property
    def kernels(self) -> list[str]:
        """Names of the generated kernels (Triton or C++), in the order of the modules."""
        return [m.group(1) for code in self.modules for m in _KERNEL.finditer(code)]

    @property
    def language(self) -> str:
        kinds = {m.group(2) for code in self.modules for m in _KERNEL.finditer(code)}
        return "Triton" if kinds == {"triton"} else "C++" if kinds and "triton" not in kinds else "mixed"

    def excerpt(self, max_lines: int = 30, width: int = 118) -> str:
        """The first kernel's source: a Triton kernel up to a few lines after its first store, or C++'s first lines."""
        if not self.kernels:
            return "(no kernel was generated)"
        name = self.kernels[0]
        lines = next(code for code in self.modules if f"{name} = " in code).splitlines()
        start = next((i for i, line in enumerate(lines) if f"def {name}(" in line),
                     next(i for i, line in enumerate(lines) if line.startswith(f"{name} = ")))
        store = next((i for i in range(start, len(lines)) if "tl.store" in lines[i]), None)
        end = min(store + 3 if store is not None else start + max_lines, start + max_lines)
        return "\n".join(line[:width] for line in lines[start:end]) + "\n    ..."

    def __str__(self) -> str:
        if not self.modules:
            return "no code generated (a backend other than Inductor)"
        n, lines = len(self.kernels), sum(len(code.splitlines()) for code in self.modules)
        return f"{n} generated {self.language} kernel{'s' * (n != 1)} in {lines} lines of generated Python"


def generated(compiled: Callable[..., object], *args, **kwargs) -> Generated:
    """Call ``compiled(*args, **kwargs)`` and return its output with the code Inductor generated for it
    (``torch._inductor.utils.run_and_get_code``; the same code ``TORCH_LOGS="output_code"`` prints). Call it on the
    first call: a call that compiles nothing generates nothing."""
    from torch._inductor.utils import run_and_get_code

    with captured_logs():
        output, modules = run_and_get_code(compiled, *args, **kwargs)
    return Generated(output, tuple(modules))


# ── Logs ───────────────────────────────────────────────────────────────────────────────────────────────────────


@contextlib.contextmanager
def captured_logs(**artifacts: bool) -> Iterator[list[str]]:
    """Collect Dynamo's and Inductor's log messages (and the C++ extension builder's), plus artifacts such as
    ``graph_breaks=True``, ``recompiles=True``, ``perf_hints=True`` (what ``TORCH_LOGS`` would print), in a list
    instead of printing them. Each message is "[artifact or logger] text". Leaving the block resets the
    artifacts (``torch._logging.set_logs()``)."""
    messages: list[str] = []
    loggers = [logging.getLogger(name) for name in ("torch._dynamo", "torch._inductor", "torch.utils.cpp_extension")]
    saved = [(logger.handlers[:], logger.propagate) for logger in loggers]
    torch._logging.set_logs(**artifacts)
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(f"[{record.name.rsplit('__', 1)[-1]}] {record.getMessage()}")
    for logger in loggers:
        logger.handlers, logger.propagate = [handler], False
    try:
        yield messages
    finally:
        torch._logging.set_logs()  # the artifacts off again; it also resets handlers, so restore them after it
        for logger, (handlers, propagate) in zip(loggers, saved, strict=True):
            logger.handlers, logger.propagate = handlers, propagate


_ATEN_MATMULS = {"mm", "addmm", "bias_addmm", "bmm", "baddbmm"}


@dataclass
class Autotuned:
    """What max-autotune's report said: per benchmarked matmul shape, the candidate that won (the report lists the
    fastest first). Filled when :func:`quiet_autotuning` exits."""

    chosen: list[str]

    @property
    def shapes(self) -> int:
        return len(self.chosen)

    @staticmethod
    def kind(name: str) -> str:
        """'cuBLAS (ATen)', 'a Triton template' or the candidate's own name."""
        if name in _ATEN_MATMULS or name.startswith("aten"):
            return "cuBLAS (ATen)"
        if name.startswith("triton"):
            return "a Triton template"
        return name

    @property
    def backend(self) -> str:
        """The kind of kernel autotuning chose, e.g. 'cuBLAS (ATen)' or 'a Triton template' (both, 'and'-joined,
        when shapes differ), or 'not reported'."""
        kinds = list(dict.fromkeys(self.kind(name) for name in self.chosen))
        return " and ".join(kinds) if kinds else "not reported"


def _winners(report: str) -> list[str]:
    """The first candidate listed after every 'AUTOTUNE op(sizes)' header of an autotuning report."""
    chosen, waiting = [], False
    for line in report.splitlines():
        if line.startswith("AUTOTUNE "):
            waiting = True
        elif waiting and line.startswith("  ") and line.strip():
            chosen.append(line.split()[0])
            waiting = False
    return chosen


@contextlib.contextmanager
def quiet_autotuning() -> Iterator[Autotuned]:
    """Keep max-autotune's reports (a table of candidate timings per matmul shape, on stderr) and its warnings out of
    the notebook. Yields an :class:`Autotuned` that receives, on leaving, the winning candidate of every matmul shape
    it benchmarked (``.shapes``, ``.backend``)."""
    captured, logger, tuned = io.StringIO(), logging.getLogger("torch._inductor"), Autotuned([])
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(captured), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield tuned
    finally:
        logger.setLevel(level)
        tuned.chosen.extend(_winners(captured.getvalue()))


# ── Compiling variants cold, and what their first calls cost ───────────────────────────────────────────────────


def _dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@dataclass(frozen=True)
class Compiled:
    """A variant built and first called in an empty cache: the callable (still compiled) and its first calls."""

    label: str
    fn: Callable[[], object]
    call_s: tuple[float, ...]  # seconds of each first call, synchronised
    graphs: GraphCounts  # what Inductor compiled and loaded from the cache during the first calls
    dynamo_graphs: int  # graphs Dynamo captured during the first calls
    logs: tuple[str, ...] = ()  # graph breaks and Inductor's perf hints logged by the compile (TORCH_LOGS artifacts)

    @property
    def first_s(self) -> float:
        return sum(self.call_s)


def first_calls(label: str, make: Callable[[], Callable[[], object]], *, calls: int = 3,
                device: torch.device | str | None = None) -> Compiled:
    """``fn = make()``, then its first ``calls`` calls timed one by one (synchronised), in the current caches. The
    compile's log messages (graph breaks, perf hints, warnings) are kept in ``Compiled.logs``, not printed.

    Raises:
        ValueError: for fewer than 1 call.
        TypeError: if ``make()`` returns something that is not callable.
    """
    if calls < 1:
        raise ValueError(f"first_calls() needs at least 1 call, got {calls}")
    device = get_device(device)
    before, captured = graph_counts(), _dynamo_graphs()
    fn = make()
    if not callable(fn):
        raise TypeError(f"{label}: make() must return the step to call, got {type(fn).__name__}")
    times = []
    with captured_logs(graph_breaks=True, perf_hints=True) as logs:
        for _ in range(calls):
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            times.append(time.perf_counter() - start)
    return Compiled(label, fn, tuple(times), graph_counts() - before, _dynamo_graphs() - captured, tuple(logs))


def compile_cold(makers: Mapping[str, Callable[[], Callable[[], object]]], *, calls: int = 3,
                 checks: Mapping[str, Callable[[], object]] | None = None,
                 expect: str | None = None, device: torch.device | str | None = None) -> dict[str, Compiled]:
    """Build and first-call every variant, each in its own empty cache (:func:`utils.compile_cache.cold` with
    ``keep_compiled=True``, so the variants built before stay compiled), with a progress bar.

    Args:
        makers: label → a function that builds the compiled step (``torch.compile`` happens inside) and returns it.
        calls: first calls timed per variant: compile, and in ``reduce-overhead`` the CUDA graphs' warm-up,
            recording and first replay.
        checks: label → ``check()``, run in that variant's block after its first calls (so that a check that
            compiles the same graphs loads them from the block's cache), its log messages kept out of the output.
        expect: the expected wait, printed before the progress bar ("about 10–40 s per variant on a GPU"). Inductor
            compiles its kernels on the CPU cores this process may use (``utils.env.usable_cpus``): fewer cores take
            longer, so say which count the estimate assumes. The bar names the variant compiling now.

    After every variant the compile workers are shut down and the garbage collected
    (:func:`utils.compile_cache.quiesce`), so that nothing of the compiles slows what is timed next.

    Raises:
        RuntimeError: if a variant's first calls captured no graph at all (it would be timed as "compiled" while
            running eagerly).
    """
    from tqdm.auto import tqdm

    checks = checks or {}
    unknown = set(checks) - set(makers)
    if unknown:
        raise ValueError(f"compile_cold(): checks for variants that are not built: {sorted(unknown)}")
    print(f"Compiling {len(makers)} variant{'s' * (len(makers) != 1)}, each from an empty cache"
          + (f": {expect}" if expect else "") + ".")
    out: dict[str, Compiled] = {}
    bar = tqdm(makers.items(), desc="compiling, cold", total=len(makers), leave=False)
    for label, make in bar:
        bar.set_postfix_str(label)
        with cold(keep_compiled=True):
            out[label] = first_calls(label, make, calls=calls, device=device)
            if label in checks:
                with captured_logs():
                    checks[label]()
        quiesce()
        if out[label].dynamo_graphs == 0 and out[label].graphs.compiled == 0:
            raise RuntimeError(f"{label}: its first calls compiled no graph, so it would run eagerly")
    return out


# ── Compile cost and break-even, from the one comparison ───────────────────────────────────────────────────────


def _plural(unit: str) -> str:
    """'steps', 'calls', 'forward passes'."""
    return unit + ("es" if unit.endswith(("s", "sh", "ch", "x")) else "s")


@dataclass(frozen=True)
class Payoff:
    """Compiled variants' one-off cost against their steady state, both from the same comparison. Build it with
    :func:`payoff`."""

    comparison: object  # utils.bench.Comparison
    compiled: Mapping[str, Compiled]
    unit: str = "step"

    @property
    def eager_s(self) -> float:
        return self.comparison.time_s(self.comparison.baseline)

    def step_s(self, label: str) -> float:
        """The variant's step time as the comparison gives it (``Comparison.time_s``): the number its table and its
        verdict use."""
        return self.comparison.time_s(label)

    def cost_s(self, label: str) -> float:
        """What compiling added: the first calls less as many steady-state steps (never below 0)."""
        c = self.compiled[label]
        return max(c.first_s - len(c.call_s) * self.step_s(label), 0.0)

    def outcome(self, label: str) -> str:
        """The variant's verdict against eager: "faster", "slower", "same" or "inconclusive"."""
        return self.comparison.verdict(label).outcome

    def resolved(self, label: str) -> bool:
        """Whether the break-even is resolved: the variant is resolved faster (it pays off) or slower (it never
        does). A "same" or inconclusive verdict leaves it unresolved."""
        return self.outcome(label) in ("faster", "slower")

    def steps(self, label: str) -> int | None:
        """Steps after which compiling has paid for itself; None when the variant is not resolved faster."""
        if self.outcome(label) != "faster":
            return None
        return max(1, math.ceil(self.cost_s(label) / (self.eager_s - self.step_s(label))))

    def pays_off(self, label: str) -> str:
        """'1,512 steps', 'never' (resolved slower) or 'unresolved' (the verdict is "same" or inconclusive)."""
        n = self.steps(label)
        if n is not None:
            return f"{n:,} {_plural(self.unit)}"
        return "never" if self.outcome(label) == "slower" else "unresolved"

    def summary(self, label: str) -> str:
        """'compile 21.3 s from cold caches, paid off after 1,512 steps (30 s of eager work)', 'never paid off' or
        'break-even unresolved'."""
        n = self.steps(label)
        head = f"compile {self.cost_s(label):.1f} s from cold caches"
        if n is not None:
            return f"{head}, paid off after {n:,} {_plural(self.unit)} ({n * self.eager_s:,.1f} s of eager work)"
        if self.outcome(label) == "slower":
            return f"{head}, never paid off here (slower than eager)"
        return f"{head}, break-even unresolved (not resolved faster or slower than eager)"

    def explain(self, label: str) -> str:
        """The variant's line: its :meth:`summary`, and where it does not pay off, its verdict against eager."""
        line = f"{label}: {self.summary(label)}"
        if self.steps(label) is None:
            line += f" — its {self.unit} against eager: {self.comparison.verdict(label).text}"
        return line

    def rows(self) -> list[dict[str, object]]:
        from utils.bench import format_seconds, ratio_text

        rows = []
        for label, c in self.compiled.items():
            rows.append({"variant": label, f"per {self.unit}": format_seconds(self.step_s(label)),
                         "speed-up": ratio_text(self.comparison.speedup(label)),
                         "first calls": " + ".join(f"{s:.1f}" for s in c.call_s) + " s",
                         "compile (s)": f"{self.cost_s(label):.1f}", "Inductor graphs": str(c.graphs),
                         "pays off after": self.pays_off(label)})
        return rows

    def table(self, title: str | None = None) -> None:
        from utils.plot import format_table

        calls = sorted({len(c.call_s) for c in self.compiled.values()})
        counted = ("its first call less one " + self.unit if calls == [1] else
                   f"its first {calls[0]} calls less as many {_plural(self.unit)}" if len(calls) == 1 else
                   f"the first calls shown less as many {_plural(self.unit)}")
        print(format_table(self.rows(), title=f"{title or 'Compile cost and break-even'}; compile = {counted} at "
                                              "steady state, from cold caches"))

    def curves(self, max_steps: int = 2**20) -> dict[str, tuple[list[int], list[float]]]:
        """Cumulative seconds after n steps (1 … max_steps, log-spaced): eager, and each variant whose break-even is
        resolved (:meth:`resolved`), with its cost. An unresolved variant is left out: its line would cross eager's
        at a break-even the measurement does not support."""
        xs = sorted({round(2 ** (i / 4)) for i in range(4 * int(math.log2(max_steps)) + 1)})
        out = {"eager": (xs, [n * self.eager_s for n in xs])}
        for label in self.compiled:
            if self.resolved(label):
                out[label] = (xs, [self.cost_s(label) + n * self.step_s(label) for n in xs])
        return out

    def legend(self, label: str) -> str:
        """A line's name in the plot: 'model only (pays off after 2,313)', 'regional (never pays off)'."""
        if label not in self.compiled:
            return label
        n = self.steps(label)
        return f"{label} (pays off after {n:,})" if n is not None else f"{label} (never pays off)"

    def plot(self, title: str = "Cumulative time, compile included"):
        """Eager's cumulative time and each resolved variant's, compile included, on log axes, up to 64 times the
        latest break-even; a dot marks where a variant pays off, and its legend says after how many steps. None, and
        a line saying why, where no variant's break-even is resolved."""
        from utils.plot import curves

        left_out = [label for label in self.compiled if not self.resolved(label)]
        if left_out and len(left_out) == len(self.compiled):
            print(f"No plot: no break-even is resolved ({', '.join(left_out)}), so eager's line would be alone")
            return None
        if left_out:
            print(f"Not drawn (break-even unresolved): {', '.join(left_out)}")
        latest = max((self.steps(label) or 1 for label in self.compiled), default=1)
        series = self.curves(max_steps=2 ** min(max(math.ceil(math.log2(64 * latest)), 10), 24))
        fig = curves({self.legend(label): xy for label, xy in series.items()}, xlabel=_plural(self.unit),
                     ylabel="cumulative time, compile included (s)", logx=True, logy=True, markers=False,
                     legend_outside=True, title=title)
        for i, label in enumerate(series):  # curves() colours the lines C0, C1, ... in this order
            n = self.steps(label) if label in self.compiled else None
            if n is not None:
                fig.axes[0].plot([n], [self.cost_s(label) + n * self.step_s(label)], "o", color=f"C{i % 10}",
                                 markersize=6, zorder=3)
        return fig


def graphs_bound_reason(waits, verdict) -> str:
    """Why CUDA graphs gained what they did, from a profile of the step without them (``waits``, a
    :class:`utils.profile.StepProfile`) and the timed :class:`utils.bench.Verdict` of the step with them against it.

    Graphs remove only the time the GPU waits for the host, so replaying can be at most ``wall / busy`` times faster.
    The reason says that bound, and whether the timed speed-up sits within it: a band wholly above it means the
    profiled pass waited less than the timed ones, so the profile does not explain the gain."""
    from utils.bench import format_seconds

    if not waits.on_gpu:
        return "on a CPU there are no kernel launches for CUDA graphs to remove"
    bound = waits.wall_s / waits.busy_s if waits.busy_s > 0 else math.inf
    text = (f"without graphs the GPU was idle {waits.idle_fraction:.0%} of the {waits.unit} "
            f"({format_seconds(waits.idle_s)}); removing all of it gives at most {bound:.2f}×")
    if verdict.outcome == "slower":
        return f"{text}; replaying cost more host time than it removed"
    if verdict.band[0] > bound:
        return (f"{text}, yet the timed gain is above that bound: the profiled {waits.unit} waited less than the "
                "timed ones, so this profile does not explain the gain")
    if verdict.outcome == "faster":
        return f"{text}: the gain is within that bound"
    return text


def payoff(comparison, compiled: Mapping[str, Compiled], *, unit: str = "step") -> Payoff:
    """The compile cost and break-even of every compiled variant, from ``comparison`` (a
    :class:`utils.bench.Comparison` whose baseline is eager and which timed every variant of ``compiled``).

    Raises:
        KeyError: for a compiled variant the comparison did not time.
    """
    missing = [label for label in compiled if label not in comparison.variants]
    if missing:
        raise KeyError(f"payoff(): the comparison did not time {missing}")
    return Payoff(comparison, dict(compiled), unit)


# ── Checks against eager ───────────────────────────────────────────────────────────────────────────────────────

Result = torch.Tensor | Mapping[str, torch.Tensor]


def _finite(x: Result) -> bool:
    values = x.values() if isinstance(x, Mapping) else [x]
    return all(bool(torch.isfinite(t).all()) for t in values)


def _error(a: Result, b: Result) -> float:
    from utils.playbook import relative_error

    if isinstance(b, Mapping):
        return max(relative_error(a[k], b[k]) for k in b)
    return relative_error(a, b)


@dataclass(frozen=True)
class Check:
    """Rows of a check against eager, and what failed. ``compared`` counts the rows that compared something."""

    title: str
    rows: list[dict[str, object]]
    failures: list[str]
    compared: int
    note: str = ""  # what the numbers are: printed under the table

    @property
    def passed(self) -> bool:
        return not self.failures and self.compared > 0

    def summary(self) -> str:
        skipped = len(self.rows) - self.compared
        if self.compared == 0:
            return f"❌ {self.title}: every row was skipped, so nothing was compared"
        if self.failures:
            return f"❌ {self.title}: " + "; ".join(self.failures)
        return (f"✅ {self.title}: {self.compared} of {len(self.rows)} quantities compared, all within their bound"
                + (f" ({skipped} skipped: their reference is not finite)" if skipped else ""))

    def __str__(self) -> str:
        from utils.plot import format_table

        return format_table(self.rows, title=self.title) + "\n" + (f"{self.note}\n" if self.note else "") + \
            self.summary()


def check_outputs(compiled: Mapping[str, Result], eager: Mapping[str, Result],
                  fp32: Mapping[str, Result] | None = None, *, tolerance: float | Mapping[str, float] = 1e-5,
                  slack: float = 1.5, floor: float = 1e-3, title: str = "compiled against eager",
                  strict: bool = True) -> Check:
    """Compare named results of a compiled run with eager's, print the table and the outcome, and return the
    :class:`Check`.

    Without ``fp32`` (a full-precision run): each relative error must be within ``tolerance`` (a number, or one per
    name). With ``fp32`` (eager and compiled ran under 16-bit autocast, ``fp32`` is the same model in full
    precision): the compiled result may lie at most ``slack`` × as far from fp32 as eager does, plus ``floor``;
    the compiled-against-eager error is shown beside it. A compiled result that is not finite fails its row; a
    reference (eager or fp32) that is not finite skips it.

    Raises:
        AssertionError: when ``strict`` and a row failed or every row was skipped (nothing was compared).
        KeyError: for a name missing from ``eager`` or ``fp32``.
    """
    rows, failures, compared, floored = [], [], 0, []
    for name, got in compiled.items():
        ref, ref32 = eager[name], (fp32[name] if fp32 is not None else None)
        limit = tolerance[name] if isinstance(tolerance, Mapping) else tolerance
        columns = ["compiled vs eager"] + (["bound"] if ref32 is None else ["compiled vs fp32", "eager vs fp32",
                                                                           f"bound ({slack:g}× eager's + {floor:g})"])
        row: dict[str, object] = {"quantity": name} | dict.fromkeys(columns, "—")
        if not _finite(ref) or (ref32 is not None and not _finite(ref32)):
            rows.append(row | {"within": "skipped: reference not finite"})
            continue
        compared += 1
        if not _finite(got):
            rows.append(row | {"within": "❌ not finite"})
            failures.append(f"{name}: the compiled result is not finite")
            continue
        vs_eager = _error(got, ref)
        if ref32 is None:
            ok = vs_eager <= limit
            values = [f"{vs_eager:.1e}", f"{limit:.0e}"]
        else:
            vs32, eager32 = _error(got, ref32), _error(ref, ref32)
            bound = slack * eager32 + floor
            if floor > slack * eager32:
                floored.append(name)
            ok = vs32 <= bound
            values = [f"{vs_eager:.1e}", f"{vs32:.1e}", f"{eager32:.1e}", f"{bound:.1e}"]
        row |= dict(zip(columns, values, strict=True)) | {"within": "✅" if ok else "❌"}
        if not ok:
            failures.append(f"{name} differs beyond its bound")
        rows.append(row)
    note = "Errors are relative: ‖a − b‖ / ‖b‖ (the worst entry for a group of tensors)."
    if floored:
        note += (f" The bound of {', '.join(floored)} is mostly its {floor:g} floor: eager is that close to fp32 "
                 "there.")
    check = Check(title, rows, failures, compared, note)
    print(check)
    if strict and not check.passed:
        raise AssertionError(check.summary())
    return check


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every gradient by parameter name, without the ``_orig_mod.`` that compiled submodules add to the names."""
    return {n.replace("_orig_mod.", ""): p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


Fresh = Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer]]


def _is_compiled(obj: object) -> bool:
    return isinstance(obj, torch._dynamo.eval_frame.OptimizedModule) or hasattr(obj, "_torchdynamo_orig_callable")


def _reaches_compiled(fn: object, depth: int = 4) -> bool:
    """Whether ``fn`` is, or reaches through its closures, ``functools.partial`` arguments and modules' children, a
    ``torch.compile``-d function or module. Dynamo reuses the graph of an earlier copy of a model without capturing
    a new one, so a check counts this as compiled too."""
    if _is_compiled(fn):
        return True
    if isinstance(fn, torch.nn.Module):
        return any(_is_compiled(m) for m in fn.modules())
    if depth == 0:
        return False
    if isinstance(fn, partial):
        inner = [fn.func, *fn.args, *fn.keywords.values()]
    else:
        inner = [cell.cell_contents for cell in getattr(fn, "__closure__", None) or () if _cell_full(cell)]
    return any(_reaches_compiled(x, depth - 1) for x in inner if callable(x) or isinstance(x, torch.nn.Module))


def _cell_full(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:  # an empty cell
        return False
    return True


def check_training_step(make: Callable[[torch.nn.Module, torch.optim.Optimizer], Callable[[], torch.Tensor]],
                        fresh: Fresh, inputs: torch.Tensor, targets: torch.Tensor, *,
                        amp_dtype: torch.dtype | None, max_norm: float = 1.0, calls: int = 1, max_calls: int = 8,
                        title: str = "the compiled step", strict: bool = True,
                        optimizer_step: Callable[[torch.nn.Module, torch.optim.Optimizer], Callable[[], object]]
                        | None = None) -> Check:
    """One training step built by ``make(model, optimizer)`` (the compiled one) against
    ``utils.train.train_step`` (eager, the same autocast and clipping) and, under autocast, against it in fp32:
    the loss and every clipped gradient, by :func:`check_outputs`. ``fresh()`` returns a new copy of the model's
    initial weights and its optimizer; each side gets its own.

    Use a model without dropout (compiled and eager dropout draw different random numbers). With fp16 the eager
    side uses a ``GradScaler`` as the compiled one should; each side steps until its gradients are finite (a
    scaler skips an overflowing step without touching the weights), at most ``max_calls`` times. ``calls``: steps
    each side takes at least before the comparison, e.g. 3 for ``mode="reduce-overhead"``, whose CUDA graphs replay
    from the third call.

    Raises:
        AssertionError: if the compiled side neither captured a graph nor reaches a compiled function or module (it
            would compare eager with eager), or (when ``strict``) a quantity differs beyond its bound.

    ``optimizer_step``: the step's compiled clipping and optimizer update, ``optimizer_step(model, optimizer)``,
    checked afterwards by :func:`check_optimizer_step` (returned: the training step's check).
    """
    from utils.train import train_step

    def run(step: Callable[[], torch.Tensor], m: torch.nn.Module) -> dict[str, Result]:
        for i in range(max(calls, max_calls)):
            loss = step()
            grads = _grads(m)
            if i + 1 >= calls and grads and _finite(grads):
                break
        return {"loss": loss.detach().float().clone(), "clipped gradients": grads}

    m, opt = fresh()
    start = _dynamo_graphs()
    step = make(m, opt)
    compiled = run(step, m)
    captured = _dynamo_graphs() - start
    if captured == 0 and not _reaches_compiled(step):
        raise AssertionError(f"{title}: no graph was captured and the step reaches no compiled function or module, "
                             "so this would compare eager with eager")
    del m, opt, step
    results = {}
    for label, dtype in (("eager", amp_dtype), ("fp32", None))[:2 if amp_dtype is not None else 1]:
        m, opt = fresh()
        scaler = torch.amp.GradScaler(inputs.device.type) if dtype == torch.float16 else None
        results[label] = run(partial(train_step, m, opt, inputs, targets, amp_dtype=dtype, scaler=scaler,
                                     max_grad_norm=max_norm), m)
        del m, opt
    precision = f"{str(amp_dtype).removeprefix('torch.')} autocast, bounds against fp32" if amp_dtype else "fp32"
    graphs = (f"{captured} graph{'s' * (captured != 1)} captured by Dynamo" if captured else
              "graphs compiled before, reused by Dynamo")
    after = f"after {calls} steps, " if calls > 1 else ""
    check = check_outputs(compiled, results["eager"], results.get("fp32"), tolerance=1e-5, strict=strict,
                          title=f"{title} against eager ({after}{precision}; {graphs})")
    del compiled, results
    if optimizer_step is not None:
        check_optimizer_step(optimizer_step, fresh, max_norm=max_norm, strict=strict,
                             title=f"{title}: its compiled clipping and optimizer step")
    return check


def check_optimizer_step(make: Callable[[torch.nn.Module, torch.optim.Optimizer], Callable[[], object]],
                         fresh: Fresh, *, max_norm: float = 1.0, seed: int = 0,
                         title: str = "the compiled clipping and AdamW step", strict: bool = True) -> Check:
    """The compiled clipping and optimizer step, ``make(model, optimizer)()``, against eager (``clip_grad_norm_``,
    then ``optimizer.step()``), each on a copy from ``fresh()`` with the same gradients: random, scaled to
    4 × ``max_norm``, so that clipping must scale them by 1/4. Compares the clipped gradients and the optimizer's
    moments (``exp_avg``, ``exp_avg_sq``: within 1e-5) and the weight update (within 1e-2: an update is a small
    difference of two much larger fp32 weights, which rounding blurs). The title says how many graphs Dynamo
    captured for the compiled step and the norm after its clipping.

    Raises:
        AssertionError: if the compiled step captured no graph (the check would compare eager with eager), or
            (when ``strict``) a quantity differs beyond its bound.
    """
    sides, captured, grads = {}, 0, None
    for side in ("compiled", "eager"):
        m, opt = fresh()
        params = list(m.parameters())
        if grads is None:
            gen = torch.Generator().manual_seed(seed)
            grads = [torch.randn(p.shape, generator=gen).to(p.device, p.dtype) for p in params]
            norm = torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads]))
            grads = [g * (4 * max_norm / norm).to(g.device, g.dtype) for g in grads]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        before = [p.detach().clone() for p in params]
        if side == "compiled":
            start = _dynamo_graphs()
            make(m, opt)()
            captured = _dynamo_graphs() - start
            if captured == 0:
                raise AssertionError(f"{title}: no graph was compiled, so this would compare eager with eager")
        else:
            torch.nn.utils.clip_grad_norm_(params, max_norm)
            opt.step()
        names = [n.replace("_orig_mod.", "") for n, _ in m.named_parameters()]
        sides[side] = {"clipped gradients": {n: p.grad.detach().clone() for n, p in zip(names, params, strict=True)},
                       **{k: {n: opt.state[p][k] for n, p in zip(names, params, strict=True)}
                          for k in ("exp_avg", "exp_avg_sq")},
                       "weight update": {n: p.detach() - w for n, p, w in zip(names, params, before, strict=True)}}
        del m, opt
    clipped = torch.linalg.vector_norm(torch.stack([g.float().norm() for g in
                                                    sides["compiled"]["clipped gradients"].values()])).item()
    return check_outputs(sides["compiled"], sides["eager"], strict=strict,
                         tolerance={"clipped gradients": 1e-5, "exp_avg": 1e-5, "exp_avg_sq": 1e-5,
                                    "weight update": 1e-2},
                         title=f"{title} against eager ({captured} graph{'s' * (captured != 1)} captured by Dynamo; "
                               f"gradient norm {4 * max_norm:g} clipped to {clipped:.4f})")

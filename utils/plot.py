"""The few shapes in which the course shows results: a text table, a bar comparison, curves.

Every chart is titled, its axes say their units, and it carries one message. Chart functions return a closed
matplotlib Figure: make the call the last line of a cell and Jupyter shows it exactly once (an open figure would
be shown twice, once by the inline backend and once as the cell's value); ``fig.savefig`` works as usual.
matplotlib is imported on first use so that ``import utils`` stays light.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # type hints only
    from utils.env import GpuConditions


def format_table(rows: Sequence[Mapping[str, Any]], *, title: str | None = None) -> str:
    """Rows (dicts with the same keys) as an aligned text table: numeric columns right-aligned.

    Floats are shown with 4 significant digits; format them yourself where a unit or another precision fits.
    """
    if not rows:
        raise ValueError("table() needs at least one row")
    headers = list(rows[0].keys())
    for i, row in enumerate(rows):
        if list(row.keys()) != headers:
            raise ValueError(f"table(): row {i} has keys {list(row.keys())}, expected {headers}")

    def cell(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    cells = [[cell(row[h]) for h in headers] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    numeric = [all(_numeric(r[i]) for r in cells) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        padded = (v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True))
        return "  ".join(padded).rstrip()

    out = [title] if title else []
    out += [line(headers), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    return "\n".join(out)


def table(rows: Sequence[Mapping[str, Any]], *, title: str | None = None) -> None:
    """Print :func:`format_table` of the rows (returns nothing, so a notebook cell shows the table once)."""
    print(format_table(rows, title=title))


def _numeric(text: str) -> bool:
    stripped = text.replace(",", "").replace("×", "").replace("%", "").split(" ")[0]
    try:
        float(stripped)
    except ValueError:
        return False
    return True


def format_value(value: float) -> str:
    """A number as a chart label: '3,350', '42.5', '0.099'."""
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 1:
        return f"{value:.1f}"
    return f"{value:.2g}"


def _tick(value: float) -> str:
    """A value-axis tick: '15,000', '2.5', '0'."""
    return f"{value:,.0f}" if abs(value) >= 100 or value == int(value) else f"{value:g}"


def _pyplot():
    import matplotlib.pyplot as plt

    return plt


def bar(
    labels: Sequence[str],
    values: Sequence[float],
    *,
    ylabel: str,
    title: str,
    errors: Sequence[float] | Sequence[tuple[float, float]] | None = None,
    reference: float | None = None,
    reference_label: str | None = None,
    horizontal: bool = False,
    highlight: Sequence[int] = (),
    value_range: tuple[float, float] | None = None,
    log: bool = False,
):
    """Bars with their values written on them, optional error bars (e.g. IQR) and a reference line (a peak).

    ``errors`` gives one half-length per bar (drawn ± it), or one ``(below, above)`` pair per bar for asymmetric
    bars (e.g. from each median down to the first quartile and up to the third).

    ``highlight`` lists bars drawn in a second colour (e.g. "measured here" among datasheet values).
    ``value_range`` zooms the value axis (e.g. accuracies between 90 and 96%, so that differences and their error
    bars are visible); the title should say the axis does not start at zero. Horizontal bars (long labels) get at
    most five value ticks with thousands separators, and the reference line's legend below the axes, so that the
    labels leave the axes their width. ``log`` draws the value axis on a log scale, so that a bar 100× shorter than
    another stays visible (the title should say so). Returns the Figure.
    """
    if len(labels) != len(values) or (errors is not None and len(errors) != len(values)):
        raise ValueError("bar(): labels, values (and errors) must have the same length")
    if errors is not None and any(isinstance(e, (tuple, list)) for e in errors):
        if not all(isinstance(e, (tuple, list)) and len(e) == 2 for e in errors):
            raise ValueError("bar(): errors are all numbers (±) or all (below, above) pairs")
        errors = [[e[0] for e in errors], [e[1] for e in errors]]  # matplotlib's 2 × N form
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    size = (8.0, 0.5 * len(labels) + 2.2) if horizontal else (max(5.0, 1.1 * len(labels) + 2), 4.0)
    fig, ax = plt.subplots(figsize=size)
    positions = range(len(labels))
    draw = ax.barh if horizontal else ax.bar
    colors = ["#DD8452" if i in highlight else "#4C72B0" for i in positions]
    bars = draw(positions, values, color=colors, **({"xerr" if horizontal else "yerr": errors,
                                                      "capsize": 3} if errors is not None else {}))
    # each value on a white box: a reference line through it passes behind the text instead of striking it out
    ax.bar_label(bars, labels=[format_value(v) for v in values], padding=3, fontsize=9,
                 bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5})
    if horizontal:
        ax.set_yticks(list(positions), labels)
        ax.invert_yaxis()
        ax.set_xlabel(ylabel)
        ax.margins(x=0.15)
        ax.xaxis.set_major_locator(MaxNLocator(4))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _tick(v)))
    else:
        ax.set_xticks(list(positions), labels, rotation=20 if max(map(len, labels)) > 10 else 0, ha="right"
                      if max(map(len, labels)) > 10 else "center")
        ax.set_ylabel(ylabel)
        ax.margins(y=0.15)
    if reference is not None:
        (ax.axvline if horizontal else ax.axhline)(reference, color="#C44E52", linestyle="--", linewidth=1.2,
                                                   label=reference_label or f"reference {reference:.3g}")
        if horizontal:  # at the foot of the figure, under the value axis: the long bar labels take the left
            fig.legend(*ax.get_legend_handles_labels(), loc="lower center", fontsize=9, frameon=False)
        else:
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)  # outside: no overlap
    if log:
        (ax.set_xscale if horizontal else ax.set_yscale)("log")
        axis = ax.xaxis if horizontal else ax.yaxis
        axis.set_major_formatter(FuncFormatter(lambda v, _: _tick(v)))
    if value_range is not None:
        (ax.set_xlim if horizontal else ax.set_ylim)(*value_range)
    ax.set_title(title)
    ax.grid(axis="x" if horizontal else "y", alpha=0.3)
    legend_below = horizontal and reference is not None
    fig.tight_layout(rect=(0, 0.3 / size[1], 1, 1) if legend_below else None)  # 0.3 inch for the figure's legend
    plt.close(fig)
    return fig


def curves(
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    logx: bool = False,
    logy: bool = False,
    markers: bool = True,
    hlines: Mapping[str, float] | None = None,
    vlines: Mapping[str, float] | None = None,
    right: Mapping[str, tuple[Sequence[float], Sequence[float]]] | None = None,
    right_label: str | None = None,
    legend_outside: bool = False,
    xticks: Callable[[float], str] | None = None,
):
    """One line per named (x, y) series, optional log axes and labelled horizontal reference lines.

    ``vlines`` marks x positions (e.g. the batch size where a step stops being free). ``right`` draws more series
    against a second y axis on the right (another unit: ms per step beside tokens/s), dashed, labelled
    ``right_label``, on the same kind of scale as the left one. Log axes get plain tick labels
    ("2,000", "0.5"), minor ones too where a decade has fewer than three major ticks. ``legend_outside`` puts the
    legend to the right of the axes (the figure widens for it), where it cannot cover lines that fill the plot.
    ``xticks`` formats the x tick labels (e.g. ``utils.memory.format_bytes`` for sizes). Returns the Figure.
    """
    if not series:
        raise ValueError("curves() needs at least one series")
    if right and not right_label:
        raise ValueError("curves(): series on the right axis need right_label (their unit)")
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter, LogLocator

    fig, ax = plt.subplots(figsize=(10.0 if legend_outside else 7.5, 4.2))
    axes = [(ax, series, "-")] + ([(ax.twinx(), right, "--")] if right else [])
    n = 0
    for axis, group, style in axes:
        for name, (x, y) in group.items():
            if len(x) != len(y):
                raise ValueError(f"curves(): series {name!r} has {len(x)} x values and {len(y)} y values")
            axis.plot(x, y, style, marker="o" if markers else None, markersize=4, label=name, color=f"C{n % 10}")
            n += 1
        if logy:
            axis.set_yscale("log")
            axis.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _tick(v)))
            axis.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
            axis.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: _tick(v)))
    for i, (name, value) in enumerate((hlines or {}).items()):
        ax.axhline(value, linestyle="--", linewidth=1.1, color=f"C{(n + i) % 10}", label=name, zorder=1)
    for name, value in (vlines or {}).items():
        ax.axvline(value, linestyle=":", linewidth=1.3, color="0.35", label=name)
    if logx:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _tick(v)))
    if xticks is not None:
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: xticks(int(v)) if v == int(v) else xticks(v)))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if right:
        axes[1][0].set_ylabel(right_label)
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    handles = [h for axis, _, _ in axes for h in axis.get_legend_handles_labels()[0]]
    outside = {"loc": "upper left", "bbox_to_anchor": (1.12 if right else 1.01, 1.0), "frameon": False}
    ax.legend(handles, [h.get_label() for h in handles], fontsize=9, **(outside if legend_outside else {}))
    fig.tight_layout()
    plt.close(fig)
    return fig


def clock_samples(series: Mapping[str, GpuConditions], *, title: str):
    """The SM clock over time of each measurement (name → its :class:`utils.env.GpuConditions`), the GPU's maximum
    SM clock as a dashed line. Without readings it prints why and returns None; else the Figure."""
    missing = [c for c in series.values() if not c.samples]
    if missing:
        print(f"No clock plot: {missing[0]}")
        return None
    top = max(c.max_sm_clock_mhz or 0.0 for c in series.values())
    return curves({name: ([s.t_s for s in c.samples],
                          [s.sm_clock_mhz if s.sm_clock_mhz is not None else math.nan for s in c.samples])
                   for name, c in series.items()},
                  xlabel="seconds since the measurement started", ylabel="SM clock (MHz)", markers=False,
                  hlines={"maximum SM clock": top} if top else None, title=title)

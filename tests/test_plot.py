"""utils.plot: the table and chart shapes."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from utils import plot  # noqa: E402


def test_table_aligns_columns(capsys):
    rows = [{"variant": "eager", "ms": 1.23456}, {"variant": "compiled", "ms": 0.5}]
    text = plot.format_table(rows, title="T")
    lines = text.splitlines()
    assert lines[0] == "T" and lines[1].startswith("variant") and "1.235" in text
    assert lines[3] == "eager     1.235" and lines[4] == "compiled    0.5"  # text left, numbers right
    assert plot.table(rows, title="T") is None
    assert capsys.readouterr().out.strip() == text


@pytest.mark.parametrize(("value", "text"), [(3350.0, "3,350"), (42.46, "42.5"), (0.0989, "0.099"), (0.0, "0")])
def test_format_value(value, text):
    assert plot.format_value(value) == text


def test_table_rejects_ragged_rows():
    with pytest.raises(ValueError, match="row 1"):
        plot.table([{"a": 1}, {"b": 2}])
    with pytest.raises(ValueError):
        plot.table([])


def test_bar_has_title_labels_and_reference(tmp_path):
    fig = plot.bar(["eager", "fused"], [1.0, 3.0], ylabel="GB/s", title="Bandwidth", errors=[0.1, 0.2],
                   reference=4.0, reference_label="copy peak", highlight=[1])
    ax = fig.axes[0]
    assert ax.get_title() == "Bandwidth" and ax.get_ylabel() == "GB/s"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["copy peak"]
    assert ax.patches[0].get_facecolor() != ax.patches[1].get_facecolor()  # the highlighted bar stands out
    fig.savefig(tmp_path / "bar.png")
    assert (tmp_path / "bar.png").stat().st_size > 1000


def test_horizontal_bar_ticks_are_few_and_readable():
    """Long labels and a 16,000-wide axis: few ticks, with thousands separators (not '1000015000'), and the legend
    below the axes, so that nothing runs together."""
    labels = ["guide loop (autocast, inference_mode)", "static KV cache, bfloat16 weights", "compiled, in a graph"]
    fig = plot.bar(labels, [237.0, 261.0, 1698.0], ylabel="tokens/s", title="Decoding", horizontal=True,
                   reference=16381.0, reference_label="memory limit", highlight=[2])
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)  # the figure comes back closed: draw it on a canvas of its own
    canvas.draw()  # the tick labels exist from here
    ax = fig.axes[0]
    ticks = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    assert 2 <= len(ticks) <= 5 and "5,000" in ticks and "10,000" in ticks
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["memory limit"]
    renderer = canvas.get_renderer()
    legend_box = legend.get_window_extent(renderer)
    assert legend_box.y1 <= ax.get_tightbbox(renderer).y0 + 1  # under the axes and the value label, not over bars
    shown = fig.get_tightbbox(renderer)  # what Jupyter's inline backend keeps (bbox_inches="tight"), in inches
    assert shown.y0 * fig.dpi <= legend_box.y0 + 1, "the legend must not be cropped off"


def test_bar_values_sit_on_white_above_a_reference_line():
    """Notebook 05: the dashed baseline ran through the value labels of bars that end near it."""
    fig = plot.bar(["a", "b"], [6.3, 6.6], ylabel="GiB", title="t", horizontal=True, reference=6.6,
                   reference_label="baseline")
    ax = fig.axes[0]
    (line,) = [ln for ln in ax.get_lines() if ln.get_label() == "baseline"]
    values = [t for t in ax.texts if t.get_text() in ("6.3", "6.6")]
    assert len(values) == 2
    for text in values:
        box = text.get_bbox_patch()
        assert box is not None and box.get_facecolor()[:3] == (1.0, 1.0, 1.0) and box.get_alpha() in (None, 1.0)
        assert text.get_zorder() > line.get_zorder()  # drawn after the line: the white box covers it


def test_bar_draws_asymmetric_errors():
    """(below, above) pairs: each bar's error line runs from value − below to value + above, e.g. the quartiles."""
    fig = plot.bar(["a", "b"], [10.0, 20.0], ylabel="ms", title="t", errors=[(1.0, 3.0), (2.0, 0.5)])
    (container,) = [c for c in fig.axes[0].containers if hasattr(c, "lines") and c.lines[2]]
    segments = container.lines[2][0].get_segments()
    assert [(seg[0][1], seg[1][1]) for seg in segments] == [(9.0, 13.0), (18.0, 20.5)]
    symmetric = plot.bar(["a"], [10.0], ylabel="ms", title="t", errors=[2.0])
    (container,) = [c for c in symmetric.axes[0].containers if hasattr(c, "lines") and c.lines[2]]
    assert [(s[0][1], s[1][1]) for s in container.lines[2][0].get_segments()] == [(8.0, 12.0)]
    with pytest.raises(ValueError, match="pairs"):
        plot.bar(["a", "b"], [1.0, 2.0], ylabel="y", title="t", errors=[(0.1, 0.2), 0.3])


def test_bar_rejects_mismatched_lengths():
    with pytest.raises(ValueError):
        plot.bar(["a"], [1.0, 2.0], ylabel="y", title="t")


def test_curves_draws_each_series():
    fig = plot.curves({"a": ([1, 2, 4], [1, 2, 3]), "b": ([1, 2, 4], [3, 2, 1])}, xlabel="size (bytes)",
                      ylabel="GB/s", title="Sweep", logx=True, hlines={"peak": 4.0})
    ax = fig.axes[0]
    assert len(ax.get_lines()) == 3 and ax.get_xscale() == "log" and ax.get_xlabel() == "size (bytes)"
    with pytest.raises(ValueError, match="series 'c'"):
        plot.curves({"c": ([1, 2], [1])}, xlabel="x", ylabel="y", title="t")


def test_curves_legend_outside_leaves_the_axes_clear():
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    series = {f"variant {i}": ([1, 2, 4, 8], [i, i + 1, i + 2, i + 3]) for i in range(4)}
    boxes = {}
    for outside in (True, False):
        fig = plot.curves(series, xlabel="steps", ylabel="s", title="t", logx=True, legend_outside=outside)
        canvas = FigureCanvasAgg(fig)  # the figure comes back closed: draw it on a canvas of its own
        canvas.draw()
        renderer, ax = canvas.get_renderer(), fig.axes[0]
        boxes[outside] = (ax.get_legend().get_window_extent(renderer), ax.get_window_extent(renderer),
                          fig.get_tightbbox(renderer).x1 * fig.dpi)  # what Jupyter's inline backend keeps
    legend_box, axes_box, shown_x1 = boxes[True]
    assert legend_box.x0 >= axes_box.x1, "the legend must sit right of the axes, not on the lines"
    assert legend_box.x1 <= shown_x1 + 1, "the legend must not be cropped off"
    legend_box, axes_box, _ = boxes[False]
    assert axes_box.x0 <= legend_box.x0 and legend_box.x1 <= axes_box.x1  # the default stays inside


def test_curves_second_axis_and_markers():
    fig = plot.curves({"tokens/s": ([1, 2, 4, 8], [1400, 2800, 5500, 9000])}, xlabel="batch", ylabel="tokens/s",
                      title="Sweep", logx=True, logy=True, vlines={"knee": 4},
                      right={"ms per step": ([1, 2, 4, 8], [0.7, 0.7, 0.72, 0.9])}, right_label="ms per step")
    left, right = fig.axes
    assert right.get_ylabel() == "ms per step" and right.get_yscale() == "log"
    assert [line.get_label() for line in right.get_lines()] == ["ms per step"]
    assert any(line.get_label() == "knee" for line in left.get_lines())
    assert [t.get_text() for t in left.get_legend().get_texts()] == ["tokens/s", "knee", "ms per step"]
    fig.canvas.draw()
    labels = [t.get_text() for t in left.get_yticklabels(minor=True) if t.get_text()]
    assert "2,000" in labels or "5,000" in labels  # the decade 1,000-10,000 is labelled inside, not only at 10^4
    with pytest.raises(ValueError, match="right_label"):
        plot.curves({"a": ([1], [1])}, xlabel="x", ylabel="y", title="t", right={"b": ([1], [1])})

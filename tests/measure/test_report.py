"""The run report's figures (measure/report.py) as drawn: texts that do not overlap."""

from __future__ import annotations

from pathlib import Path

from adaptercl.measure import report


def test_the_drift_figure_keeps_its_title_clear_of_the_subplots(tmp_path, monkeypatch):
    """plots/drift.png: the figure's title above the subplots' titles, and no subplot (its title, tick labels) over
    another, measured on the figure as saved (its texts' boxes in display pixels)."""
    figures = []
    monkeypatch.setattr(report, "_save", lambda fig, path: figures.append(fig))
    aggregate = {"relative_delta_norm_mean": 0.01, "spectral_shift_mean": 0.02, "principal_angle_mean": 0.3}
    names = ("stage-01-arithmetic", "stage-02-mcq", "stage-03-toolcall")
    report._plot_drift({"stages": [{"name": n, "drift": {"parameter": {"aggregate": aggregate}}} for n in names]},
                       Path(tmp_path / "drift.png"))  # fmt: skip
    (fig,) = figures
    fig.draw_without_rendering()  # the layout as saved
    renderer = fig.canvas.get_renderer()
    (suptitle,) = [t for t in fig.texts if t.get_text() == fig.get_suptitle() != ""]
    title = suptitle.get_window_extent(renderer)
    boxes = [ax.get_tightbbox(renderer) for ax in fig.axes]  # each subplot with its title and tick labels
    for ax, box in zip(fig.axes, boxes):
        assert not title.overlaps(ax.title.get_window_extent(renderer)), ax.get_title()
        assert not title.overlaps(box), ax.get_title()
    for i, box in enumerate(boxes):
        for other in boxes[i + 1 :]:
            assert not box.overlaps(other)


def test_a_series_of_one_value_is_drawn_as_a_point(tmp_path, monkeypatch):
    """plots/training_curves.png: a stage that distilled on one step has one teacher_divergence value among NaNs,
    which a line alone draws as nothing; it gets a marker, and a series of neighbouring values stays a bare line."""
    nan = float("nan")
    assert report.series_style([nan, 0.3, nan]) == {"marker": "o", "markersize": 3}
    assert report.series_style([0.5]) == {"marker": "o", "markersize": 3}
    assert report.series_style([0.1, 0.2, nan, nan]) == {}
    figures = []
    monkeypatch.setattr(report, "_save", lambda fig, path: figures.append(fig))
    stages = [
        {"name": "one", "metrics": [{"step": s, "reward_mean": 0.1 * s} for s in (1, 2, 3)]},
        {"name": "two", "metrics": [{"step": 1, "reward_mean": 0.2}, {"step": 2, "reward_mean": 0.4,
                                                                       "teacher_divergence": 0.05}]},
    ]  # fmt: skip
    report._plot_training_curves({"stages": stages}, Path(tmp_path / "training_curves.png"))
    (fig,) = figures
    top, bottom = fig.axes
    assert [line.get_marker() for line in top.get_lines()] == ["None", "None"]
    (_, two) = bottom.get_lines()  # stage two's divergence: one value, at the fifth step of the run
    assert two.get_marker() == "o" and list(two.get_xdata()) == [4, 5] and two.get_ydata()[1] == 0.05

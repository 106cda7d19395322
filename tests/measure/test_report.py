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

"""The benchmarks' pictures: panels of lines drawn from their JSON-lines rows (``--plot F.png``).

matplotlib (the dev extra, not a dependency of the package) is imported only when a benchmark plots. A
benchmark groups its rows into :data:`Panels` and hands them to :func:`line_panels`; ``python -m
benchmarks.plots`` redraws the pictures of ``docs/results.md`` from the rows in ``docs/data/``.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

#: One panel's curves: label -> points ``(x, y)`` or ``(x, y, note)`` (a note is written beside its point).
Series = dict[str, list[tuple[Any, ...]]]
#: Panels by title, in the order drawn.
Panels = dict[str, Series]

MARKERS = "os^vDx<>ph*"


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files, no display)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def save_figure(fig: Any, path: str | Path, dpi: int = 80) -> None:
    """Write ``fig`` to ``path`` as a PNG of 256 colours at a modest ``dpi`` (tens of KB for the docs), and free it."""
    from PIL import Image  # noqa: PLC0415  # matplotlib's own dependency

    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=dpi, format="png")
    pyplot().close(fig)
    with Image.open(buffer) as image:
        image.convert("RGB").quantize(256).save(path, format="png", optimize=True)


def _log_axis(axis: Any) -> None:
    """Ticks of a log axis at 1, 2, 3, 5 x 10^k, written as plain numbers."""
    from matplotlib import ticker  # noqa: PLC0415

    axis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 3.0, 5.0)))
    axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(ticker.NullFormatter())


def line_panels(panels: Panels, path: str | Path, *, xlabel: str, ylabel: str, xlog: bool = False, ylog: bool = True,
                bold: str | None = None, hline: tuple[float, str] | None = None, cols: int = 4) -> None:  # fmt: skip
    """One panel per title, one line per label (the same colour and marker in every panel; a label without points
    keeps its colour but draws nothing), the legend in a cell of its own after the panels. ``bold``: the label drawn
    thick (the default policy); ``hline``: a dashed reference line ``(y, legend label)``. Axes shared, log where asked."""
    plt = pyplot()
    labels = list(dict.fromkeys(label for series in panels.values() for label in series))
    cols = min(cols, len(panels) + 1)
    rows = -(-(len(panels) + 1) // cols)
    widths = [1.0] * (cols - 1) + [0.75 if rows == 1 else 1.0]  # a row's last cell holds the legend alone
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * sum(widths), 2.9 * rows), squeeze=False, sharex=True, sharey=True,
                             gridspec_kw={"width_ratios": widths})  # fmt: skip
    cells = list(axes.flat)
    for ax, (title, series) in zip(cells, panels.items()):
        for label, points in series.items():
            if not points:
                continue
            k = labels.index(label)
            points = sorted(points, key=lambda p: p[0])
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=MARKERS[k % len(MARKERS)], color=f"C{k % 10}",
                    label=label, lw=2.5 if label == bold else 1, ms=5)  # fmt: skip
            for p in (p for p in points if len(p) > 2):
                ax.annotate(p[2], p[:2], fontsize=7, xytext=(3, 3), textcoords="offset points")
        if hline:
            ax.axhline(hline[0], color="grey", lw=0.8, ls="--", label=hline[1])
        ax.set(title=title, xlabel=xlabel, xscale="log" if xlog else "linear", yscale="log" if ylog else "linear")
        for axis in [ax.xaxis] * xlog + [ax.yaxis] * ylog:
            _log_axis(axis)
        ax.title.set_fontsize(9)
        ax.tick_params(labelbottom=True, labelleft=True)
        ax.grid(alpha=0.3, which="both")
    for ax in cells[: len(panels) : cols]:
        ax.set_ylabel(ylabel)
    handles = {h.get_label(): h for ax in cells for h in ax.get_lines()}
    for ax in cells[len(panels) :]:
        ax.axis("off")
    cells[len(panels)].legend(handles.values(), handles.keys(), loc="center", fontsize=8)
    save_figure(fig, path)

"""Writing reports: JSON, Markdown and PNG files, each atomically (a reader never sees half a file).

Used by the benchmark, the sweep, the suite, the roofline, serve-load, the training curve and the
CLI's layer tables and gate; `pyplot` gives their figures matplotlib.
"""

from __future__ import annotations

from pathlib import Path

from ..files import atomic_file, write_json_atomic, write_text_atomic


def write_report(out_dir: str | Path, stem: str, data: dict, markdown: str | None = None) -> list[Path]:
    """`<stem>.json` (and `<stem>.md` when given) in out_dir; returns the paths written."""
    out_dir = Path(out_dir)
    paths = [write_json_atomic(out_dir / f"{stem}.json", data)]
    if markdown is not None:
        paths.append(write_text_atomic(out_dir / f"{stem}.md", markdown))
    return paths


def pyplot():
    """matplotlib's pyplot, drawing into files (the Agg backend), for the reports' figures.

    Imported here, on the first figure, not at the top of the modules that plot: pyplot takes about
    half a second to import and settles the backend as it loads, a cost and a choice that every
    command drawing nothing (the CLI imports them all) would otherwise take on.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path, dpi: int = 120) -> Path:
    """Save a matplotlib figure as PNG atomically, then close it."""
    try:
        with atomic_file(path) as tmp:
            fig.savefig(tmp, dpi=dpi, format="png")
    finally:
        pyplot().close(fig)
    return Path(path)


def publish(out_dir: str | Path, stem: str, data: dict, markdown: str, plot=None) -> list[Path]:
    """Write `<stem>.json`, `<stem>.md` and, with `plot(data, path)`, `<stem>.png` into out_dir; print
    the Markdown and the paths written."""
    out_dir = Path(out_dir)
    paths = write_report(out_dir, stem, data, markdown)
    if plot is not None:
        paths.append(plot(data, out_dir / f"{stem}.png"))
    print(markdown)
    print("wrote " + ", ".join(str(p) for p in paths))
    return paths

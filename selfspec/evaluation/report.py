"""Writing reports: JSON, Markdown and PNG files, each atomically (a reader never sees half a file).

Used by the benchmark, the sweep, the training curve and the CLI's layer tables and gate.
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


def save_figure(fig, path: str | Path, dpi: int = 120) -> Path:
    """Save a matplotlib figure as PNG atomically, then close it."""
    import matplotlib.pyplot as plt

    try:
        with atomic_file(path) as tmp:
            fig.savefig(tmp, dpi=dpi, format="png")
    finally:
        plt.close(fig)
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

"""Error per record in execution order, with the tolerance line and the first divergence."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from .errors import DumpError
from .summary import Summary


def check_plot_path(path: Path) -> None:
    """Raise :class:`DumpError` now if :func:`plot_errors` could not write ``path``."""
    if path.suffix.lower() != ".png":
        raise DumpError(f"{path}: the plot is written as PNG; name the file *.png")
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise DumpError(f"{path}: plotting needs matplotlib; pip install 'h5cmp[plot]'") from exc


def plot_errors(result: pd.DataFrame, summary: Summary, path: Path) -> None:
    """Save a PNG of each pair's max relative error (log scale) in execution order; forward and
    backward records in two colours, the per-row rtol as a line, the first divergence marked."""
    check_plot_path(path)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from . import format as fmt
    rows = result.reset_index(drop=True)
    x = np.arange(len(rows))
    floor = 1e-12
    err = rows["max_rel_err"].astype(float).clip(lower=floor).fillna(floor)
    backward = rows["kind"].isin(fmt.BACKWARD_KINDS)
    fig, ax = plt.subplots(figsize=(12, 4.5))
    ax.scatter(x[~backward], err[~backward], s=10, label="forward", color="tab:blue")
    ax.scatter(x[backward], err[backward], s=10, label="backward", color="tab:orange")
    ax.step(x, rows["rtol"].astype(float).clip(lower=floor), where="mid", color="gray",
            linestyle="--", label="rtol")
    if summary.first is not None:
        i = int(rows.index[(rows["seq"] == summary.first.row["seq"])
                           & (rows["step"] == summary.first.row["step"])
                           & (rows["kind"] == summary.first.row["kind"])
                           & (rows["module"] == summary.first.row["module"])][0])
        ax.axvline(i, color="red", linewidth=1)
        ax.annotate(f"first divergence: {summary.first.row['module'] or '<root>'} "
                    f"{summary.first.row['kind']}", (i, err[i]), color="red",
                    xytext=(5, 10), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("record (execution order)")
    ax.set_ylabel("max relative error")
    ax.set_title(str(summary).splitlines()[0])
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

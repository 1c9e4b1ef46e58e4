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


def plot_heatmap(result: pd.DataFrame, path: Path, metric: str = "rel_l2_err") -> None:
    """Save a PNG heat map: modules (rows, execution order) x steps, forward and backward
    (columns), of the largest ``metric`` over the module's records there (log colour scale)."""
    check_plot_path(path)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    from . import format as fmt
    direction = result["kind"].map(lambda k: " bwd" if k in fmt.BACKWARD_KINDS else " fwd")
    rows = result.assign(key=[fmt.module_key(m, c) for m, c in zip(result["module"], result["cls"])],
                         when=result["epoch"].astype(str) + ":" + result["step"].astype(str)
                         + direction)
    order = list(dict.fromkeys(rows.sort_values(["epoch", "step", "seq"])["key"]))
    table = rows.pivot_table(index="key", columns="when", values=metric, aggfunc="max")
    columns = rows.drop_duplicates("when").sort_values(["epoch", "step", "kind"], key=lambda c: (
        c.isin(fmt.BACKWARD_KINDS) if c.name == "kind" else c))["when"]
    table = table.reindex(index=order, columns=list(columns)).clip(lower=1e-12)
    fig, ax = plt.subplots(figsize=(2 + 0.6 * table.shape[1], 1.5 + 0.22 * len(table)))
    image = ax.imshow(table.to_numpy(dtype=float), aspect="auto", cmap="magma_r",
                      norm=LogNorm(vmin=1e-12, vmax=max(1.0, float(np.nanmax(table.to_numpy())))))
    ax.set_yticks(range(len(table)), table.index, fontsize=7)
    ax.set_xticks(range(table.shape[1]), table.columns, rotation=90, fontsize=7)
    ax.set_xlabel("epoch:step, direction")
    fig.colorbar(image, ax=ax, label=f"max {metric}")
    ax.set_title(f"{metric} per module and step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

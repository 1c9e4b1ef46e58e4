"""Error per record in execution order, with the tolerance line and the first divergence."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pandas as pd

from .errors import DumpError
from .summary import Summary


def check_plot_path(path: Path) -> None:
    """Raise :class:`DumpError` now if :func:`plot_errors` could not write ``path``."""
    if path.suffix.lower() != ".png":
        raise DumpError(f"{path}: the plot is written as PNG; name the file *.png")
    if importlib.util.find_spec("matplotlib") is None:
        raise DumpError(f"{path}: plotting needs matplotlib; pip install 'h5cmp[plot]'")


def plot_errors(result: pd.DataFrame, summary: Summary, path: Path) -> None:
    """Save a PNG of each pair's tolerance ratio, max |b-a| / (atol + rtol |b|) (log scale), in
    execution order: forward and backward records in two colours, the tolerance (ratio 1) as a
    line, the first divergence marked. Points above the line are outside tolerance."""
    check_plot_path(path)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from . import format as fmt
    rows = result.reset_index(drop=True)
    x = np.arange(len(rows))
    floor = 1e-12
    err = rows["max_tol_ratio"].astype(float).clip(lower=floor, upper=1e12).fillna(floor)
    backward = rows["kind"].isin(fmt.BACKWARD_KINDS)
    fig, ax = plt.subplots(figsize=(12, 4.5))
    ax.scatter(x[~backward], err[~backward], s=10, label="forward", color="tab:blue")
    ax.scatter(x[backward], err[backward], s=10, label="backward", color="tab:orange")
    ax.axhline(1.0, color="gray", linestyle="--", label="tolerance")
    if summary.first is not None:
        i = int(rows.index[(rows["seq"] == summary.first.row["seq"])
                           & (rows["step"] == summary.first.row["step"])
                           & (rows["kind"] == summary.first.row["kind"])
                           & (rows["module"] == summary.first.row["module"])][0])
        ax.axvline(i, color="red", linewidth=1)
        ax.annotate(f"first divergence: {summary.first.row['module'] or '<root>'} "
                    f"{summary.first.row['kind']}", (i, err[i]), color="red",
                    xytext=(5, -14), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("record (execution order)")
    ax.set_ylabel("max |b-a| / (atol + rtol |b|)")
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
    fig, ax = plt.subplots(figsize=(max(6.0, 3 + 0.6 * table.shape[1]), 1.5 + 0.22 * len(table)))
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


def plot_tensor_steps(dump, module: str, kind: str, index: int, path: Path,
                      call_idx: int = 0) -> None:
    """Save a PNG following one tensor (module, call, kind, index) over a dump's steps: its
    min/max and mean ± std per step, and, where values are stored, their histograms."""
    check_plot_path(path)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .dump import load_dump
    from .errors import DumpError
    from .statistics import STAT_NAMES, stats_of_chunks
    dump = load_dump(dump)
    rows = dump.index[(dump.index["module"] == module) & (dump.index["kind"] == kind)
                      & (dump.index["index"] == index) & (dump.index["call_idx"] == call_idx)
                      & (dump.index["occurrence"] == 0)]
    if rows.empty:
        raise DumpError(f"{dump.path}: no {kind}[{index}] of module {module!r} call {call_idx}")
    labels, stats, values = [], [], []
    for r in rows.itertuples():
        step = next(s for s in dump.steps if (s.epoch, s.step, s.rank) ==
                    (r.epoch, r.step, None if pd.isna(r.rank) else r.rank))
        labels.append(f"{r.epoch}:{r.step}")
        if r.dataset:
            with step.open() as reader:
                data = reader.read(r).astype(np.float64).ravel()
            values.append(data)
            stats.append(dict(zip(STAT_NAMES, stats_of_chunks([data]))))
        else:
            values.append(None)
            stats.append({n: getattr(r, f"stat_{n}") for n in STAT_NAMES})
    frame = pd.DataFrame(stats)
    x = np.arange(len(labels))
    has_values = any(v is not None for v in values)
    fig, axes = plt.subplots(1, 2 if has_values else 1, figsize=(12 if has_values else 7, 4),
                             squeeze=False)
    ax = axes[0][0]
    ax.fill_between(x, frame["mean"] - frame["std"], frame["mean"] + frame["std"], alpha=0.3,
                    label="mean ± std")
    ax.plot(x, frame["mean"], marker="o", label="mean")
    ax.plot(x, frame["min"], linestyle="--", label="min")
    ax.plot(x, frame["max"], linestyle="--", label="max")
    ax.set_xticks(x, labels, rotation=90)
    ax.set_xlabel("epoch:step")
    ax.legend()
    ax.set_title(f"{module or '<root>'} {kind}[{index}] over steps")
    if has_values:
        hist = axes[0][1]
        for label, v in zip(labels, values):
            if v is not None:
                finite = v[np.isfinite(v)]
                hist.hist(finite, bins=50, histtype="step", label=label)
        hist.set_yscale("log")
        hist.set_title("histogram per step")
        hist.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

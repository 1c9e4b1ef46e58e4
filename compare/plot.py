"""Pictures of a comparison: added error per record, error per module and step, one tensor
over steps."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pandas as pd

from .errors import DumpError, check_writable
from .summary import Summary


def check_plot_path(path: Path) -> None:
    """Raise :class:`DumpError` now if :func:`plot_errors` could not write ``path``."""
    check_writable(path)
    if path.suffix.lower() != ".png":
        raise DumpError(f"{path}: the plot is written as PNG; name the file *.png")
    if importlib.util.find_spec("matplotlib") is None:
        raise DumpError(f"{path}: plotting needs matplotlib; pip install 'h5cmp[plot]'")


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_errors(result: pd.DataFrame, summary: Summary, path: Path) -> None:
    """Save a PNG of each record's added error against its expected level (log scale), in
    execution order: forward and backward records in two shapes, failing records red,
    inherited ones orange, step boundaries as dotted lines, the first divergence marked."""
    check_plot_path(path)
    plt = _pyplot()
    from . import format as fmt
    from . import status as st
    rows = result.reset_index(drop=True)
    x = np.arange(len(rows))
    added = rows["added_rel_error"].astype(float).to_numpy()
    expected = rows["expected_rel_error"].astype(float).to_numpy()
    positive = np.concatenate([added[(added > 0) & np.isfinite(added)],
                               expected[expected > 0]])
    low = float(positive.min()) / 3 if len(positive) else 1e-12
    high = float(positive.max()) * 3 if len(positive) else 1.0
    shown = np.clip(np.nan_to_num(added, nan=low), low, high)
    fig, ax = plt.subplots(figsize=(12, 4.8))
    ax.step(x, np.clip(np.nan_to_num(expected, nan=low), low, high), where="mid",
            color="gray", linewidth=1, label="expected added error (calibrated)")
    backward = rows["kind"].isin(fmt.BACKWARD_KINDS).to_numpy()
    colours = {"failing": "tab:red", st.INHERITED: "tab:orange", "equal or close": "tab:blue"}
    colour = np.where(rows["status"].isin(st.FAILING), colours["failing"],
                      np.where(rows["status"] == st.INHERITED, colours[st.INHERITED],
                               colours["equal or close"]))
    for mask, marker in ((~backward, "o"), (backward, "^")):
        ax.scatter(x[mask], shown[mask], s=12, c=colour[mask], marker=marker)
    for name, marker in (("forward", "o"), ("backward", "^")):
        ax.scatter([], [], marker=marker, color="gray", label=name)
    for name, c in colours.items():
        ax.scatter([], [], marker="s", color=c, label=name)
    steps = rows[["epoch", "step"]].astype(str).agg(":".join, axis=1)
    starts = np.flatnonzero(steps.ne(steps.shift()).to_numpy())
    for i in starts:
        ax.axvline(i - 0.5, color="black", linestyle=":", linewidth=0.8)
        ax.annotate(f"step {steps[i]}", (i, 1.0), xycoords=("data", "axes fraction"),
                    xytext=(3, -12), textcoords="offset points", fontsize=8)
    at = [] if summary.first is None else np.flatnonzero(np.logical_and.reduce(
        [(rows[c].fillna(-1) == (-1 if pd.isna(summary.first.row[c]) else summary.first.row[c]))
         for c in ("epoch", "step", "rank", "seq", "module", "kind", "index", "occurrence")]))
    if len(at):  # (not when the rows drawn leave it out)
        first, i = summary.first.row, int(at[0])
        ax.axvline(i, color="tab:red", linewidth=1)
        ax.annotate(f"first divergence: {first['module'] or '<root>'} {first['kind']}",
                    (i, 0.0), xycoords=("data", "axes fraction"), xytext=(4, 6),
                    textcoords="offset points", color="tab:red", fontsize=9)
    ax.set_yscale("log")
    ax.set_ylim(low, high)
    ax.set_xlabel("record (execution order)")
    ax.set_ylabel("added relative error")
    verdict = summary.verdict()
    ax.set_title(verdict if len(verdict) <= 100 else verdict[:verdict.rfind(";", 0, 100) + 1]
                 or verdict[:100], fontsize=10)
    ax.legend(loc="upper left", fontsize=8, bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_heatmap(result: pd.DataFrame, path: Path) -> None:
    """Save a PNG heat map: modules (rows, execution order) x steps, forward and backward
    (columns), of the largest relative error over the module's records there (log colour
    scale fitted to the data). Records compared by values and by statistics (an estimate) are
    drawn in separate maps."""
    check_plot_path(path)
    plt = _pyplot()
    from matplotlib.colors import LogNorm

    from . import format as fmt
    direction = result["kind"].map(lambda k: " " + fmt.direction_of(k)[:3])
    rows = result.assign(key=[fmt.module_key(m, c) for m, c in zip(result["module"], result["cls"])],
                         when=result["epoch"].astype(str) + ":" + result["step"].astype(str)
                         + direction)
    order = list(dict.fromkeys(rows.sort_values(["epoch", "step", "seq"])["key"]))
    columns = list(rows.drop_duplicates("when").sort_values(["epoch", "step", "kind"], key=lambda c: (
        c.isin(fmt.BACKWARD_KINDS) if c.name == "kind" else c))["when"])
    maps = [(title, rows[mask]) for title, mask in (
        ("relative L2 error (values)", rows["rel_l2_err"].notna()),
        ("relative error estimated from statistics", rows["rel_l2_err"].isna()
         & rows["rel_err_from_stats"].notna())) if mask.any()]
    if not maps:
        maps = [("relative error", rows)]
    fig, axes = plt.subplots(1, len(maps), squeeze=False, figsize=(
        max(6.0, 3 + 0.6 * len(columns)) * len(maps), 1.8 + 0.22 * len(order)))
    for ax, (title, part) in zip(axes[0], maps):
        table = part.pivot_table(index="key", columns="when", values="rel_error", aggfunc="max")
        table = table.reindex(index=order, columns=columns)
        values = table.to_numpy(dtype=float)
        positive = values[(values > 0) & np.isfinite(values)]
        low = float(positive.min()) if len(positive) else 1e-12
        high = max(float(positive.max()) if len(positive) else 1.0, low * 10)
        values = np.where(np.isinf(values), high, values)  # NaN/Inf where A has none: the top
        image = ax.imshow(np.where(values > 0, values, np.nan), aspect="auto", cmap="viridis",
                          norm=LogNorm(vmin=low, vmax=high))
        ax.set_yticks(range(len(table)), table.index, fontsize=7)
        ax.set_xticks(range(table.shape[1]), table.columns, rotation=90, fontsize=7)
        ax.set_xlabel("epoch:step, direction (blank: equal or not recorded)")
        ax.set_title(title, fontsize=10)
        fig.colorbar(image, ax=ax, location="right", fraction=0.05, pad=0.02, label="max rel error")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_tensor_steps(dump, module: str, kind: str, index: int, path: Path,
                      call_idx: int = 0) -> None:
    """Save a PNG following one tensor (module, call, kind, index) over a dump's steps: its
    min/max and mean ± std per step, and, where values are stored, their histograms."""
    check_plot_path(path)
    plt = _pyplot()

    from .dump import load_dump
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

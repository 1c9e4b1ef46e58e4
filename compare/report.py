"""Rendering a comparison: the text table, and exports to CSV, JSON, HTML, XLSX and PNG."""
from __future__ import annotations

import html
import importlib.util
import json
import math
from pathlib import Path
from typing import Optional

import pandas as pd

from . import format as fmt
from .errors import DumpError
from .metrics import FAILING
from .summary import Summary

TABLE_COLUMNS = ["step", "module", "kind", "dtype", "shape", "max_abs_err", "rel_l2_err",
                 "cosine", "mismatch", "status"]
EXPORT_FORMATS = (".csv", ".json", ".html", ".xlsx")


def _shape(value) -> str:
    return "x".join(map(str, value)) if isinstance(value, tuple) else "-"


def _num(value) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3g}"


def table_rows(result: pd.DataFrame, show_all: bool = False, top: Optional[int] = None) -> pd.DataFrame:
    """The rows the text table shows: failing rows in execution order (every row with
    ``show_all``), at most ``top``, formatted as strings."""
    rows = result if show_all else result[result["status"].isin(FAILING)]
    if top is not None:
        rows = rows.head(top)
    dtype = rows["dtype_a"].fillna("-")
    mixed = rows["dtype_b"].notna() & (rows["dtype_b"] != rows["dtype_a"])
    dtype = dtype.where(~mixed, dtype + "/" + rows["dtype_b"].fillna("-"))
    shape = rows["shape_a"].where(rows["shape_a"].notna(), rows["shape_b"]).map(_shape)
    return pd.DataFrame({
        "step": rows["epoch"].astype(str) + ":" + rows["step"].astype(str),
        "module": [f"{fmt.module_key(m, k)}#{c}"
                   for m, k, c in zip(rows["module"], rows["cls"], rows["call_idx"])],
        "kind": rows["kind"] + "[" + rows["index"].astype(str) + "]"
        + rows["occurrence"].map(lambda o: f"@{o}" if o else ""),
        "dtype": dtype,
        "shape": shape,
        "max_abs_err": rows["max_abs_err"].map(_num),
        "rel_l2_err": rows["rel_l2_err"].map(_num),
        "cosine": rows["cosine"].map(lambda c: "-" if pd.isna(c) else f"{c:.6f}"),
        "mismatch": [("-" if pd.isna(m) else f"{m / n:.1%}" if n else "0%")
                     for m, n in zip(rows["mismatches"], rows["numel"])],
        "status": rows["status"],
    }, columns=TABLE_COLUMNS)


def render_text(result: pd.DataFrame, summary: Summary, show_all: bool = False,
                top: Optional[int] = 20) -> str:
    """The CLI report: the table (failing rows, or all) then the summary."""
    rows = table_rows(result, show_all, top)
    shown = "all rows" if show_all else "rows outside tolerance"
    total = len(result) if show_all else int(result["status"].isin(FAILING).sum())
    parts = []
    if len(rows):
        limit = f" (first {len(rows)} of {total})" if len(rows) < total else ""
        parts.append(f"{shown} in execution order{limit}:")
        parts.append(rows.to_string(index=False))
        parts.append("")
    parts.append(str(summary))
    return "\n".join(parts)


def check_output_path(path: Path) -> None:
    """Raise :class:`DumpError` now if :func:`export` could not write ``path``."""
    suffix = path.suffix.lower()
    if suffix not in EXPORT_FORMATS:
        raise DumpError(f"{path}: unknown output format {suffix or '(none)'}; use one of "
                        f"{', '.join(EXPORT_FORMATS)}")
    if suffix == ".xlsx" and importlib.util.find_spec("openpyxl") is None:
        raise DumpError(f"{path}: writing XLSX needs openpyxl; pip install 'h5cmp[xlsx]'")


def _png_data_uri(draw) -> str:
    """Draw into a temporary PNG with ``draw(path)`` and return it as a data: URI."""
    import base64
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        png = Path(tmp) / "figure.png"
        draw(png)
        return "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()


def html_report(result: pd.DataFrame, summary: Summary, flat: pd.DataFrame) -> str:
    """A self-contained HTML page: the summary, the plots (when matplotlib is installed, as
    embedded PNGs) and the table of every pair, failing rows highlighted."""
    figures = ""
    if importlib.util.find_spec("matplotlib") is None:
        figures = "<p>(plots need matplotlib: pip install 'h5cmp[plot]')</p>"
    else:
        from .plot import plot_errors, plot_heatmap
        for title, draw in (("Error per record", lambda p: plot_errors(result, summary, p)),
                            ("Error per module and step", lambda p: plot_heatmap(result, p))):
            figures += f"<h2>{title}</h2><img alt='{title}' src='{_png_data_uri(draw)}'>"
    failing = flat["status"].isin(FAILING)
    table = flat.style.apply(
        lambda row: ["background:#fbdada" if failing[row.name] else "" for _ in row], axis=1
    ).format(precision=4, na_rep="-").hide(axis="index").to_html()
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>h5cmp report</title>"
            f"<style>body{{font-family:sans-serif}} table{{border-collapse:collapse;font-size:12px}}"
            f" td,th{{border:1px solid #ccc;padding:2px 4px}}</style></head><body>"
            f"<h1>h5cmp report</h1><pre>{html.escape(str(summary))}</pre>{figures}"
            f"<h2>Tensor pairs</h2>{table}</body></html>")


def export(result: pd.DataFrame, summary: Summary, path: Path) -> None:
    """Write ``result`` to ``path`` in the format its extension names."""
    suffix = path.suffix.lower()
    flat = result.assign(shape_a=result["shape_a"].map(_shape), shape_b=result["shape_b"].map(_shape))
    if suffix == ".csv":
        flat.to_csv(path, index=False)
    elif suffix == ".json":
        payload = {"summary": {"counts": summary.counts, "total": summary.total,
                               "first_divergence": None if summary.first is None else
                               summary.first.describe()},
                   "rows": json.loads(flat.to_json(orient="records"))}
        path.write_text(json.dumps(payload, indent=1))
    elif suffix == ".html":
        path.write_text(html_report(result, summary, flat))
    else:
        check_output_path(path)
        flat.to_excel(path, index=False)

"""Rendering a comparison: the text table, and exports to CSV, JSON, HTML and XLSX."""
from __future__ import annotations

import html
import importlib.util
import json
import math
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd

from . import format as fmt
from . import status as st
from .errors import DumpError, check_writable
from .summary import Summary

EXPORT_FORMATS = (".csv", ".json", ".html", ".xlsx")
ORDERS = ("added", "execution")  # failing rows worst first, or as they ran
# The columns a reader sees first (the HTML page can show the others).
DISPLAY_COLUMNS = ["step", "direction", "record", "dtype", "shape", "rel_error", "added",
                   "status", "reason"]


def _shape(value) -> str:
    return "x".join(map(str, value)) if isinstance(value, tuple) else "-"


def number(value, digits: int = 3) -> str:
    """``value`` with ``digits`` significant digits ("-" for missing, "inf" for infinite)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.{digits}g}"


def _added(ratio, added) -> str:
    if pd.isna(added):
        return "-"
    if not np.isfinite(ratio):
        return f"{number(added)} (new)" if added > 0 else "0"
    return f"{number(added)} ({ratio:.1f}x)"


def display_rows(result: pd.DataFrame) -> pd.DataFrame:
    """``result`` as strings in ``DISPLAY_COLUMNS``, one row per record."""
    dtype = result["dtype_a"].fillna("-")
    mixed = result["dtype_b"].notna() & (result["dtype_b"] != result["dtype_a"])
    dtype = dtype.where(~mixed, dtype + "/" + result["dtype_b"].fillna("-"))
    shape = result["shape_a"].where(result["shape_a"].notna(), result["shape_b"]).map(_shape)
    return pd.DataFrame({
        "step": [fmt.step_label(e, s, r) for e, s, r in
                 zip(result["epoch"], result["step"], result["rank"])],
        "direction": result["kind"].map(fmt.direction_of),
        "record": [fmt.record_label(*r) for r in result[
            ["module", "cls", "call_idx", "kind", "index", "occurrence"]].itertuples(index=False)],
        "dtype": dtype,
        "shape": shape,
        "rel_error": result["rel_error"].map(number),
        "added": [_added(r, a) if s != st.EQUAL else "-" for r, a, s in zip(
            result["added_ratio"], result["added_rel_error"], result["status"])],
        "status": result["status"],
        "reason": result["reason"].fillna(""),
    }, columns=DISPLAY_COLUMNS, index=result.index)


def table_rows(result: pd.DataFrame, show_all: bool = False, top: Optional[int] = None,
               order: str = "added") -> pd.DataFrame:
    """The rows the text table shows: failing rows, worst added error first (``order=
    "added"``) or in execution order; with ``show_all`` every row in execution order; at most
    ``top``."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    rows = result if show_all else result[result["status"].isin(st.FAILING)]
    if order == "added" and not show_all:
        rows = rows.sort_values(["added_ratio", "added_rel_error"], ascending=False, kind="stable",
                                na_position="last")
    if top is not None:
        rows = rows.head(top)
    return display_rows(rows).drop(columns="reason")


def render_text(result: pd.DataFrame, summary: Summary, show_all: bool = False,
                top: Optional[int] = None, order: str = "added") -> str:
    """The CLI report: the verdict and the summary, then the table (failing rows, or all)."""
    rows = table_rows(result, show_all, top, order)
    total = len(result) if show_all else int(result["status"].isin(st.FAILING).sum())
    parts = [str(summary)]
    if len(rows):
        what = ("all rows in execution order" if show_all else
                "failing rows, worst added error first" if order == "added" else
                "failing rows in execution order")
        limit = f" (first {len(rows)} of {total}; --top N for more)" if len(rows) < total else ""
        parts += ["", f"{what}{limit}:", rows.to_string(index=False)]
    return "\n".join(parts)


def check_output_path(path: Path) -> None:
    """Raise :class:`DumpError` now if :func:`export` could not write ``path``."""
    check_writable(path)
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


_PAGE_STYLE = """
body{font-family:sans-serif;margin:1.5em} pre{background:#f6f6f6;padding:.6em}
table{border-collapse:collapse;font-size:12px} td,th{border:1px solid #ccc;padding:2px 5px}
th{cursor:pointer;background:#eee;position:sticky;top:0} tr.fail td{background:#fbdada}
tr.inherited td{background:#fdf0d5} td.num{text-align:right;font-variant-numeric:tabular-nums}
.extra{display:none} body.all .extra{display:table-cell} #controls{margin:.5em 0}
"""
# Sorting (click a header; numbers by value) and filtering (text box, failing only), no library.
_PAGE_SCRIPT = """
const t=document.getElementById('pairs'),b=t.tBodies[0],rows=[...b.rows];
function val(c){const v=c.dataset.v;return v===undefined?c.textContent:parseFloat(v)}
[...t.tHead.rows[0].cells].forEach((h,i)=>h.onclick=()=>{const d=h.dataset.d=h.dataset.d==='1'?'-1':'1';
 rows.sort((x,y)=>{const a=val(x.cells[i]),c=val(y.cells[i]);return (a>c?1:a<c?-1:0)*d});
 rows.forEach(r=>b.appendChild(r))});
function filt(){const q=document.getElementById('q').value.toLowerCase(),
 f=document.getElementById('failing').checked;
 rows.forEach(r=>r.style.display=(r.textContent.toLowerCase().includes(q)&&(!f||r.classList.contains('fail')))?'':'none')}
"""


def _html_table(result: pd.DataFrame) -> str:
    shown = display_rows(result)
    extra = [c for c in result.columns if c not in ("status", "reason", "rel_error")]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in DISPLAY_COLUMNS)
    head += "".join(f"<th class='extra'>{html.escape(c)}</th>" for c in extra)
    body = []
    for (_, row), (_, raw) in zip(shown.iterrows(), result.iterrows()):
        cls = ("fail" if raw["status"] in st.FAILING else
               "inherited" if raw["status"] == st.INHERITED else "")
        cells = []
        for c in DISPLAY_COLUMNS:
            sort = raw["rel_error"] if c == "rel_error" else raw["added_ratio"] if c == "added" \
                else None
            attr = "" if sort is None or pd.isna(sort) else f" data-v='{float(sort)!r}'"
            cells.append(f"<td{attr}{' class=num' if attr else ''}>{html.escape(str(row[c]))}</td>")
        for c in extra:
            value = raw[c]
            text = _shape(value) if isinstance(value, tuple) else (
                number(value) if isinstance(value, (float, np.floating)) else str(value))
            cells.append(f"<td class='extra'>{html.escape(text)}</td>")
        body.append(f"<tr class='{cls}'>{''.join(cells)}</tr>")
    return f"<table id='pairs'><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def html_report(result: pd.DataFrame, summary: Summary) -> str:
    """A self-contained HTML page: the verdict and summary, the plots (when matplotlib is
    installed, as embedded PNGs) and the table of every pair (readable columns by default,
    all on demand; click a header to sort, type to filter)."""
    figures = ""
    if importlib.util.find_spec("matplotlib") is None:
        figures = "<p>(plots need matplotlib: pip install 'h5cmp[plot]')</p>"
    else:
        from .plot import plot_errors, plot_heatmap
        for title, draw in (("Added error per record", lambda p: plot_errors(result, summary, p)),
                            ("Error per module and step", lambda p: plot_heatmap(result, p))):
            figures += f"<h2>{title}</h2><img alt='{title}' src='{_png_data_uri(draw)}'>"
    controls = ("<div id='controls'><input id='q' placeholder='filter rows' oninput='filt()'> "
                "<label><input type='checkbox' id='failing' onchange='filt()'> failing only</label> "
                "<label><input type='checkbox' onchange=\"document.body.classList.toggle('all')\">"
                " all columns</label></div>")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>h5cmp report</title>"
            f"<style>{_PAGE_STYLE}</style></head><body><h1>h5cmp report</h1>"
            f"<p><b>{html.escape(summary.verdict())}</b></p><pre>{html.escape(str(summary))}</pre>"
            f"{figures}<h2>Tensor pairs</h2>{controls}{_html_table(result)}"
            f"<script>{_PAGE_SCRIPT}</script></body></html>")


def export(result: pd.DataFrame, summary: Summary, path: Path) -> None:
    """Write ``result`` to ``path`` in the format its extension names."""
    suffix = path.suffix.lower()
    flat = result.assign(shape_a=result["shape_a"].map(_shape), shape_b=result["shape_b"].map(_shape))
    if suffix == ".csv":
        flat.to_csv(path, index=False)
    elif suffix == ".json":
        payload = {"summary": {"verdict": summary.verdict(), "counts": summary.counts,
                               "total": summary.total,
                               "first_divergence": None if summary.first is None else
                               summary.first.describe(advise_rerun=not summary.rerun_given),
                               "arguments_differ": summary.arguments.to_dict("records"),
                               "arguments_differ_without_effect":
                                   summary.inert_arguments.to_dict("records")},
                   "rows": json.loads(flat.to_json(orient="records"))}
        path.write_text(json.dumps(payload, indent=1))
    elif suffix == ".html":
        path.write_text(html_report(result, summary))
    else:
        check_output_path(path)
        flat.to_excel(path, index=False)

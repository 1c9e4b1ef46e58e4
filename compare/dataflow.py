"""The recorded call graph of one step as Graphviz DOT: which call produced each input, and
which outputs the sums made between modules add (dashed)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Optional, Sequence

import pandas as pd

from . import format as fmt
from .dump import Dump
from .errors import DumpError
from .status import CLOSE, EQUAL, FAILING, INHERITED

_COLOURS = {EQUAL: "#b7e1a1", CLOSE: "#e2f0cb", INHERITED: "#fbd9a6", "fail": "#f4a6a6",
            None: "#e0e0e0"}


def edges(index: pd.DataFrame) -> pd.DataFrame:
    """``producer -> call`` edges of one step's index: input rows whose tensor an earlier call
    output (columns ``producer, call, index``)."""
    rows = index[(index["kind"] == fmt.INPUT) & (index["producer"] >= 0)]
    return rows[["producer", "call", "index"]].drop_duplicates().reset_index(drop=True)


def addend_edges(index: pd.DataFrame, call: str = "call", addends: str = "addends",
                 keys: Sequence[str] = ()) -> pd.DataFrame:
    """``addend -> call`` edges of the sums made between modules: one row per tensor that a
    record's tensor adds unchanged (its ``addends``; the record: an input the call consumed, or
    an output its own code made), columns ``*keys, call, kind, index`` (the record),
    ``addend_kind, addend, addend_index`` (the term: an output of call ``addend``, or its input,
    a partial sum it consumed); ``call`` and ``addends`` name those columns of ``index`` (e.g.
    ``call_a``, ``addends_a`` in pairs)."""
    named = index[index[addends].fillna("") != ""]
    columns = [*keys, call, "kind", "index"]
    terms = ["addend_kind", "addend", "addend_index"]
    rows = [(*row, *term) for *row, text in named[[*columns, addends]].itertuples(index=False)
            for term in fmt.parse_addends(text)]
    frame = pd.DataFrame(rows, columns=[*columns, *terms])
    # typed even when empty (merge keys of one kind)
    return frame.astype({**{c: index[c].dtype for c in columns}, "addend_kind": object,
                         "addend": "int64", "addend_index": "int64"})


def _call_status(result: Optional[pd.DataFrame], epoch: int, step: int) -> dict[int, str]:
    if result is None:
        return {}
    rows = result[(result["epoch"] == epoch) & (result["step"] == step)
                  & (result["kind"] == fmt.OUTPUT)]
    status = {}
    for call, group in rows.groupby("call"):
        s = set(group["status"])
        status[int(call)] = ("fail" if s & FAILING else INHERITED if INHERITED in s
                             else CLOSE if CLOSE in s else EQUAL)
    return status


def to_dot(dump: Dump, epoch: Optional[int] = None, step: Optional[int] = None,
           result: Optional[pd.DataFrame] = None) -> str:
    """DOT text of the call graph of step ``(epoch, step)`` (default: the dump's first step).
    Nodes are module calls, coloured by the compare status of their outputs when ``result``
    (from ``compare_dumps``) is given: green equal, pale green close, orange inherited, red
    failing. Edges: an output a call's input is (``in0``), and, dashed, an output added into a
    sum that a call's input (``+in0``) or its own output (``+out0``) is."""
    steps = [s for s in dump.steps if epoch is None or (s.epoch, s.step) == (epoch, step)]
    if not steps:
        raise DumpError(f"{dump.path}: no step {epoch}:{step} to draw")
    step_file = steps[0]
    index = step_file.index
    status = _call_status(result, step_file.epoch, step_file.step)
    lines = [f'digraph "{step_file.group_name}" {{', "  rankdir=TB;",
             '  node [shape=box, style=filled, fontname="Helvetica", fontsize=10];']
    calls = index.drop_duplicates("call").sort_values("call")
    for r in calls.itertuples():
        label = f"{fmt.module_key(r.module, r.cls)}#{r.call_idx}"
        lines.append(f'  c{r.call} [label="{label}", fillcolor="{_COLOURS[status.get(r.call)]}"];')
    for e in edges(index).itertuples():
        lines.append(f'  c{e.producer} -> c{e.call} [label="in{e.index}", fontsize=8];')
    for e in addend_edges(index).drop_duplicates(["addend_kind", "addend", "call"]).itertuples():
        where = "in" if e.kind == fmt.INPUT else "out"  # the sum: this call's input, or output
        lines.append(f'  c{e.addend} -> c{e.call} [label="+{where}{e.index}", fontsize=8, '
                     f'style=dashed];')
    lines.append("}")
    return "\n".join(lines)


def write_dot(text: str, path: Path) -> None:
    """Write DOT text, or render it when ``path`` ends in .png/.svg/.pdf (needs Graphviz)."""
    suffix = path.suffix.lower()
    if suffix in ("", ".dot", ".gv"):
        path.write_text(text)
        return
    if suffix not in (".png", ".svg", ".pdf"):
        raise DumpError(f"{path}: the graph is written as .dot, or rendered as .png/.svg/.pdf")
    dot = shutil.which("dot")
    if dot is None:
        raise DumpError(f"{path}: rendering needs Graphviz's `dot` on PATH; write a .dot file "
                        f"instead (or install graphviz)")
    subprocess.run([dot, f"-T{suffix[1:]}", "-o", str(path)], input=text, text=True, check=True)

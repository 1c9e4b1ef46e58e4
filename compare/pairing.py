"""Pairing: match the tensor records of two dumps by (step, module, call, kind, index)."""
from __future__ import annotations

from typing import Iterable, Optional

import pandas as pd

from . import format as fmt
from .dump import Dump

KEY = ["epoch", "step", "rank", "module", "call_idx", "kind", "index", "occurrence"]
SIDE_COLUMNS = ["seq", "call", "cls", "group", "path", "dtype", "shape", "encoding", "dataset",
                "status", "producer", *fmt.STAT_COLUMNS]


def tensor_rows(dump: Dump, steps: Optional[Iterable[str]] = None,
                modules: Optional[Iterable[str]] = None,
                kinds: Optional[Iterable[str]] = None) -> pd.DataFrame:
    """Index rows of tensors (stored, described by statistics, dropped or unsupported),
    filtered by step (``"S"`` or ``"E:S"``), module glob and kind."""
    index = dump.index
    rows = index[(index["dataset"] != "") | index["stat_nan"].notna()
                 | index["status"].isin([fmt.ST_DROPPED, fmt.ST_UNSUPPORTED])]
    if steps:
        wanted = list(steps)
        rows = rows[[_step_matches(e, s, wanted) for e, s in zip(rows["epoch"], rows["step"])]]
    if modules:
        patterns = list(modules)
        rows = rows[[fmt.module_matches(m, c, patterns) for m, c in zip(rows["module"], rows["cls"])]]
    if kinds:
        rows = rows[rows["kind"].isin(list(kinds))]
    return rows.assign(rank=rows["rank"].fillna(-1).astype(int))


def _step_matches(epoch: int, step: int, wanted: list[str]) -> bool:
    return any(w == str(step) or w == f"{epoch}:{step}" for w in wanted)


def pair_records(rows_a: pd.DataFrame, rows_b: pd.DataFrame) -> pd.DataFrame:
    """One row per key present on either side, with ``_a``/``_b`` side columns and ``side``
    (``both``, ``a_only``, ``b_only``), in execution order (step, then A's sequence, else B's)."""
    a = rows_a[KEY + SIDE_COLUMNS]
    b = rows_b[KEY + SIDE_COLUMNS]
    merged = a.merge(b, on=KEY, how="outer", suffixes=("_a", "_b"), indicator="side")
    merged["side"] = merged["side"].map({"both": "both", "left_only": "a_only",
                                         "right_only": "b_only"}).astype(str)
    merged["order"] = merged["seq_a"].fillna(merged["seq_b"])
    merged = merged.sort_values(["epoch", "step", "rank", "order"], kind="stable")
    return merged.drop(columns="order").reset_index(drop=True)

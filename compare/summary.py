"""Summary of a comparison: counts per status and the first divergence, with its origin."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pandas as pd

from compare import format as fmt

from .metrics import FAILING, STATUSES, VALUE_FAILURES

# Rows of the same call that a record's values depend on.
_UPSTREAM = {
    fmt.OUTPUT: (fmt.INPUT, fmt.PARAM),
    fmt.GRAD_INPUT: (fmt.GRAD_OUTPUT, fmt.INPUT, fmt.PARAM),
    fmt.PARAM_GRAD: (fmt.GRAD_OUTPUT, fmt.INPUT),
}
ORIGIN, INHERITED, BETWEEN_MODULES = "origin", "inherited", "between_modules"


@dataclass
class Divergence:
    """The earliest failing pair in execution order, and where its error comes from.

    ``verdict``: ``origin`` (this call's inputs agree, its result does not: the error starts
    here), ``inherited`` (an input of this call already differs), or ``between_modules`` (the
    record is itself an input or incoming gradient: the difference arose in code outside any
    hooked submodule, e.g. in ``parent``'s own forward, the loss, or the data).
    """

    row: pd.Series
    verdict: str
    upstream: pd.DataFrame
    producer: Optional[pd.DataFrame] = None  # output rows of the call that made this input

    @property
    def direction(self) -> str:
        return "backward" if self.row["kind"] in fmt.BACKWARD_KINDS else "forward"

    @property
    def parent(self) -> str:
        module = self.row["module"]
        if not module:
            return ""  # the root: its parent is whatever code calls the model
        return module.rsplit(".", 1)[0] if "." in module else "<root>"

    def describe(self) -> str:
        r = self.row
        where = (f"step {r['epoch']}:{r['step']}, {self.direction}, module "
                 f"{r['module'] or '<root>'} ({r['cls']}) call {r['call_idx']}, "
                 f"{r['kind']}[{r['index']}] {r['path']}")
        errors = (f"max_abs_err={r['max_abs_err']:.3g} rel_l2_err={r['rel_l2_err']:.3g} "
                  f"mismatches={int(r['mismatches']) if pd.notna(r['mismatches']) else 'n/a'}"
                  f"/{int(r['numel']) if pd.notna(r['numel']) else 'n/a'} status={r['status']}")
        if self.verdict == ORIGIN:
            exact = (self.upstream["status"] == "equal").all()
            why = ("it has no recorded inputs" if self.upstream.empty else
                   "its inputs are bit-identical" if exact else
                   f"its inputs agree within tolerance (largest rel_l2_err "
                   f"{self.upstream['rel_l2_err'].max():.3g})")
            because = f"the error starts in this module: {why}"
        elif self.verdict == INHERITED:
            bad = self.upstream[self.upstream["status"].isin(FAILING)]
            names = ", ".join(bad["kind"] + "[" + bad["index"].astype(str) + "]")
            because = f"inherited: its {names} already differ"
        else:
            origin = f"{self.parent}'s own code" if self.parent else "the code calling the model"
            because = (f"the difference is already in this {r['kind']}: it arose outside any hooked "
                       f"submodule (in {origin}, the loss, or the data)")
            if self.producer is not None and len(self.producer):
                p = self.producer.iloc[0]
                state = ("which matched: the change happened between the two modules"
                         if not self.producer["status"].isin(FAILING).any()
                         else "which already differed")
                because += (f"\n  {r['kind']}[{r['index']}] came from "
                            f"{fmt.module_key(p['module'], p['cls'])} (call {p['call']}), {state}")
        return f"first divergence: {where}\n  {errors}\n  {because}"


@dataclass
class Summary:
    """Counts of rows per status and the first divergence (None when every pair passes)."""

    counts: dict[str, int]
    total: int
    first: Optional[Divergence]

    @property
    def ok(self) -> bool:
        return all(self.counts[s] == 0 for s in FAILING)

    def __str__(self) -> str:
        parts = ", ".join(f"{self.counts[s]} {s}" for s in STATUSES if self.counts[s])
        head = f"{self.total} tensor pairs: {parts or 'none'}"
        if self.first is not None:
            return f"{head}\n{self.first.describe()}"
        return f"{head}\nall compared tensors agree within tolerance" if self.ok else head


def summarize(result: pd.DataFrame) -> Summary:
    """Summary of a :func:`compare.compare_dumps` result."""
    counts = {s: int((result["status"] == s).sum()) for s in STATUSES}
    failing = result[result["status"].isin(VALUE_FAILURES)]
    first = None
    if len(failing):
        row = failing.iloc[0]
        first = _diagnose(result, row)
    return Summary(counts, len(result), first)


def _diagnose(result: pd.DataFrame, row: pd.Series) -> Divergence:
    same_step = result[(result["epoch"] == row["epoch"]) & (result["step"] == row["step"])
                       & (result["rank"].fillna(-1) == (-1 if pd.isna(row["rank"]) else row["rank"]))]
    same_call = same_step[(same_step["module"] == row["module"])
                          & (same_step["call_idx"] == row["call_idx"])]
    kinds = _UPSTREAM.get(row["kind"])
    if kinds is None:
        producer = None
        if row["kind"] == fmt.INPUT and row["producer"] >= 0:
            producer = same_step[(same_step["call"] == row["producer"])
                                 & (same_step["kind"] == fmt.OUTPUT)]
        return Divergence(row, BETWEEN_MODULES, same_call.iloc[0:0], producer)
    same_pass = (same_call["occurrence"] == row["occurrence"]) | same_call["kind"].isin(
        fmt.FORWARD_KINDS)
    upstream = same_call[same_call["kind"].isin(kinds) & same_pass]
    failed = upstream["status"].isin(FAILING)
    return Divergence(row, INHERITED if failed.any() else ORIGIN, upstream)

"""Arguments: the numbers, flags and names a call was given (its non-tensor inputs), compared.

A scale, an epsilon, a dropout probability or a flag given to a module or an op is part of
what the call computes: where two runs give a call different ones (a changed config, a
refactor that drops a factor), the difference is the cause of what follows, and the tensors'
error may not show it (a 5 % change in attention's scale is within bfloat16's error figures
downstream). The dump keeps each non-tensor leaf as text (``repr``, exact for numbers; cut to
80 characters) in the index's ``value``; the inputs of the types in :data:`COMPARED` are
compared between calls whose tensor records pair (so B's renamed modules and aligned ops pair
as their tensors do): numbers by value, strings as text.

Not a difference: a float that is the same limit of each run's floating dtype (``±max``, the
smallest normal, the machine epsilon of float64, float32, float16 or bfloat16), which code
takes from the dtype it runs in (``torch.finfo(dtype).min`` as a mask's fill); two finite
floats within one rounding to the lowest precision of the call's own tensors, of the binary
formats of :mod:`compare.precision` (a value code computed from data, by ``.item()``, and
passed on; a bfloat16 call's float argument changed by less than 0.39 % is therefore not seen).
"""
from __future__ import annotations

import math
from typing import Optional

import pandas as pd

from . import format as fmt
from .dump import Dump
from .precision import BINARY_FORMATS, precision_of, rounding_of

COMPARED = ("int", "float", "bool", "str")
# each floating dtype's limits, by what they are
DTYPE_LIMITS = {value: name for form in BINARY_FORMATS.values()
                for value, name in form.limits.items()}
COLUMNS = ["epoch", "step", "rank", "seq", "module", "cls", "call_idx", "kind", "path",
           "value_a", "value_b"]


def argument_rows(index: pd.DataFrame) -> pd.DataFrame:
    """The non-tensor inputs of :data:`COMPARED` types among a dump's ``index`` rows (what a
    call returns that is no tensor, e.g. a loss as a float, is data, not an argument)."""
    rows = index[(index["dataset"] == "") & (index["index"] == -1) & (index["kind"] == fmt.INPUT)
                 & (index["status"] == fmt.ST_OK) & index["dtype"].isin(COMPARED)]
    return rows.assign(rank=rows["rank"].fillna(-1).astype(int))


def differing_arguments(a: Dump, b: Dump, pairs: pd.DataFrame) -> pd.DataFrame:
    """The arguments (:data:`COLUMNS`, A's module names) that differ between the calls of
    ``a`` and ``b`` whose tensor records ``pairs`` pairs, in execution order. Numbers are
    compared by value (``1`` is ``1.0``, ``True`` is ``1``); two finite floats within one
    rounding to the lowest precision of the call's tensors (a value computed from data, e.g. by
    ``.item()``) are the same."""
    both = pairs[pairs["side"] == "both"]
    # each call's rounding: the lowest precision of its tensors (of the formats, not float8)
    floats = both[both["dtype_a"].isin(BINARY_FORMATS) & both["dtype_b"].isin(BINARY_FORMATS)]
    call = ["epoch", "step", "rank", "call_a"]
    units = floats[call].assign(unit=[rounding_of(precision_of(a, b)).unit for a, b in
                                      zip(floats["dtype_a"], floats["dtype_b"])])
    units = units.groupby(call, as_index=False)["unit"].max()
    calls = both[["epoch", "step", "rank", "call_a", "call_b"]].drop_duplicates()
    rows_a = argument_rows(a.index).rename(columns={"call": "call_a", "value": "value_a",
                                              "dtype": "type_a"})
    rows_b = argument_rows(b.index).rename(columns={"call": "call_b", "value": "value_b",
                                              "dtype": "type_b"})
    merged = rows_a.merge(calls, on=call).merge(
        rows_b[["epoch", "step", "rank", "call_b", "kind", "path", "value_b", "type_b"]],
        on=["epoch", "step", "rank", "call_b", "kind", "path"]).merge(units, on=call, how="left")
    unit = merged["unit"].fillna(0.0)
    differ = pd.Series([not _same(*r) for r in zip(
        merged["value_a"], merged["type_a"], merged["value_b"], merged["type_b"], unit)],
        index=merged.index, dtype=bool)
    return merged[differ].sort_values(["epoch", "step", "rank", "seq"], kind="stable")[
        COLUMNS].reset_index(drop=True)


def _same(a: str, type_a: str, b: str, type_b: str, unit: float) -> bool:
    """Whether two recorded values are the same argument: equal text, equal numbers, floats
    within one rounding of ``unit``, or the same limit of each run's dtype."""
    if a == b:
        return True
    if type_a == type_b == "int":  # (exactly, beyond float's 2**53)
        return False
    x, y = parsed_number(a, type_a), parsed_number(b, type_b)
    if x is None or y is None:
        return False
    if x == y:
        return True
    return type_a == type_b == "float" and same_number(x, y, unit)


def same_number(x: float, y: float, unit: float) -> bool:
    """Whether two numbers given to a call are the same argument: equal, the same limit of
    each run's floating dtype, or finite and within one rounding of ``unit``."""
    if x == y:
        return True
    if not (math.isfinite(x) and math.isfinite(y)):
        return False
    limit = DTYPE_LIMITS.get(x)
    return (limit is not None and limit == DTYPE_LIMITS.get(y)) or \
        abs(x - y) <= unit * max(abs(x), abs(y))


def parsed_number(text: str, type_name: str) -> Optional[float]:
    """The value of a recorded int, float or bool (None for a str, or text cut short)."""
    if type_name == "bool":
        return {"True": 1.0, "False": 0.0}.get(text)
    if type_name not in ("int", "float"):
        return None
    try:
        return float(text)
    except ValueError:
        return None


def describe(row) -> str:
    """``step 0:0 attn#0/scaled_dot_product_attention#0 input kwargs['scale']: 0.25 in A,
    0.2625 in B``."""
    call = fmt.record_label(row["module"], row["cls"], row["call_idx"], row["kind"], -1)
    return (f"step {fmt.step_label(row['epoch'], row['step'], row['rank'])} "
            f"{call.rsplit(' ', 1)[0]} {row['kind']} {row['path']}: {row['value_a']} in A, "
            f"{row['value_b']} in B")

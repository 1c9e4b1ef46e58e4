"""Arguments: the numbers, flags and names a call was given (its non-tensor leaves), compared.

A scale, an epsilon, a dropout probability or a flag given to a module or an op is part of
what the call computes: where two runs give a call different ones (a changed config, a
refactor that drops a factor), the difference is the cause of what follows, and the tensors'
error may not show it (a 5 % change in attention's scale is within bfloat16's error figures
downstream). The dump keeps each non-tensor leaf as text (``repr``, exact for numbers) in the
index's ``value``; leaves of the types in :data:`COMPARED` are compared as text between calls
whose tensor records pair (so B's renamed modules and aligned ops pair as their tensors do).

Not a difference: a float that is a floating dtype's limit on both sides (``±max``, the
smallest normal, the machine epsilon of float64, float32, float16 or bfloat16), which code
takes from the dtype it runs in (``torch.finfo(dtype).min`` as a mask's fill). A float that
code computed from data (``.item()``) and passed on is compared like any other.
"""
from __future__ import annotations

import pandas as pd

from . import format as fmt
from .dump import Dump

COMPARED = ("int", "float", "bool", "str")
# (precision bits, largest exponent, smallest normal exponent) of the floating dtypes
_FORMATS = {"float64": (53, 1023, -1022), "float32": (24, 127, -126),
            "float16": (11, 15, -14), "bfloat16": (8, 127, -126)}
# each floating dtype's limits, by what they are
DTYPE_LIMITS = {value: name for bits, top, bottom in _FORMATS.values()
                for name, value in (("max", (2 - 2.0 ** (1 - bits)) * 2.0 ** top),
                                    ("-max", -(2 - 2.0 ** (1 - bits)) * 2.0 ** top),
                                    ("tiny", 2.0 ** bottom), ("-tiny", -2.0 ** bottom),
                                    ("eps", 2.0 ** (1 - bits)))}
CALL = ["epoch", "step", "rank", "call"]
COLUMNS = ["epoch", "step", "rank", "seq", "module", "cls", "call_idx", "kind", "path",
           "value_a", "value_b"]


def argument_rows(dump: Dump) -> pd.DataFrame:
    """The non-tensor leaves of :data:`COMPARED` types that ``dump`` recorded."""
    index = dump.index
    rows = index[(index["dataset"] == "") & (index["index"] == -1)
                 & (index["status"] == fmt.ST_OK) & index["dtype"].isin(COMPARED)]
    return rows.assign(rank=rows["rank"].fillna(-1).astype(int))


def differing_arguments(a: Dump, b: Dump, pairs: pd.DataFrame) -> pd.DataFrame:
    """The arguments (:data:`COLUMNS`, A's module names) that differ between the calls of
    ``a`` and ``b`` whose tensor records ``pairs`` pairs, in execution order."""
    both = pairs[pairs["side"] == "both"]
    calls = both[["epoch", "step", "rank", "call_a", "call_b"]].drop_duplicates()
    rows_a = argument_rows(a).rename(columns={"call": "call_a", "value": "value_a"})
    rows_b = argument_rows(b).rename(columns={"call": "call_b", "value": "value_b"})
    merged = rows_a.merge(calls, on=["epoch", "step", "rank", "call_a"]).merge(
        rows_b[["epoch", "step", "rank", "call_b", "kind", "path", "value_b"]],
        on=["epoch", "step", "rank", "call_b", "kind", "path"])
    differ = pd.Series([not _same(x, y) for x, y in zip(merged["value_a"], merged["value_b"])],
                       index=merged.index, dtype=bool)
    return merged[differ].sort_values(["epoch", "step", "rank", "seq"], kind="stable")[
        COLUMNS].reset_index(drop=True)


def _same(a: str, b: str) -> bool:
    """Whether two recorded values are the same argument (or the same limit of each run's
    dtype)."""
    if a == b:
        return True
    try:
        limits = DTYPE_LIMITS.get(float(a)), DTYPE_LIMITS.get(float(b))
    except ValueError:
        return False
    return limits[0] is not None and limits[0] == limits[1]


def describe(row) -> str:
    """``step 0:0 attn#0/scaled_dot_product_attention#0 input kwargs['scale']: 0.25 in A,
    0.2625 in B``."""
    call = fmt.record_label(row["module"], row["cls"], row["call_idx"], row["kind"], -1)
    return (f"step {fmt.step_label(row['epoch'], row['step'], row['rank'])} "
            f"{call.rsplit(' ', 1)[0]} {row['kind']} {row['path']}: {row['value_a']} in A, "
            f"{row['value_b']} in B")

"""Rows moved between calls: records whose shapes differ because a selection differs.

A mixture of experts runs each expert on the tokens routed to it; where the routing differs
between the runs (a top-k that rounding tips), an expert's records hold other rows and their
shapes differ, and an expert that got no token in one run is not called there. That is no
error of the expert's: the rows moved between the calls, none was lost. Taken as such where,
among the records of one kind, index and module class under one parent module (of one step and
rank) whose shapes differ or that one side lacks, every shape has the same dimensions after the
first and the first adds up to the same total on both sides.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from . import format as fmt
from . import status as st

_UNPAIRED = [st.SHAPE_MISMATCH, st.MISSING_IN_A, st.MISSING_IN_B]


def _parent(module: str) -> str:
    return module.rpartition(".")[0]


def moved_rows(frame: pd.DataFrame) -> np.ndarray:
    """Per row of a comparison, whether its shapes differ as rows moved between calls (see the
    module docstring); never for weights and their gradients."""
    candidates = (frame["status"].isin(_UNPAIRED)
                  & ~frame["kind"].isin([fmt.PARAM, fmt.PARAM_GRAD])).to_numpy()
    groups: dict[tuple, list[int]] = {}
    columns = frame.assign(rank=frame["rank"].fillna(-1))[
        ["epoch", "step", "rank", "module", "cls", "kind", "index"]][candidates]
    for pos, key in zip(np.flatnonzero(candidates), columns.itertuples(index=False, name=None)):
        epoch, step, rank, module, cls, kind, index = key
        groups.setdefault((epoch, step, rank, _parent(module), cls, kind, index), []).append(pos)
    shape_a, shape_b = frame["shape_a"].to_numpy(object), frame["shape_b"].to_numpy(object)
    out = np.zeros(len(frame), bool)
    for rows in groups.values():
        a = [tuple(shape_a[p]) for p in rows if isinstance(shape_a[p], tuple)]
        b = [tuple(shape_b[p]) for p in rows if isinstance(shape_b[p], tuple)]
        shapes = a + b
        if (a and b and all(len(s) >= 1 for s in shapes) and len({s[1:] for s in shapes}) == 1
                and sum(s[0] for s in a) == sum(s[0] for s in b)):
            out[rows] = True
    return out

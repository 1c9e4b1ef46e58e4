"""Localizing an error: accumulated vs local error per module call, from three dumps.

``reference`` is the trusted run, ``free`` the suspect run left alone, ``injected`` the suspect
run with every module's inputs (forward) or incoming gradients (backward) replaced by the
reference's (``dumper.Injector``). In the injected run a module can only be wrong by itself, so
its error there is its *local* error, judged by the same error model as any comparison: against
the typical local error of comparable records of the injected run (e.g. every bfloat16 Linear
adds about the same rounding error; a module adding 30 times that is the origin).
"""
from __future__ import annotations

from typing import Iterable, Optional

import numpy as np
import pandas as pd

from . import format as fmt
from . import status as st
from .comparison import compare_dumps
from .dump import Dump, PathLike
from .precision import rounding_of

ORIGINS_SHOWN = 10  # origins listed by describe_origins
# What a module produces, and what must have been injected for its error to be local.
PRODUCED = {fmt.OUTPUT: fmt.INPUT, fmt.GRAD_INPUT: fmt.GRAD_OUTPUT}
KEY = ["epoch", "step", "rank", "module", "cls", "call_idx", "kind", "index", "occurrence"]
CALL = ["epoch", "step", "rank", "module", "call_idx"]


def localize(reference: PathLike | Dump, free: PathLike | Dump, injected: PathLike | Dump,
             rtol: Optional[float] = None, atol: Optional[float] = None, *,
             steps: Optional[Iterable[str]] = None, modules: Optional[Iterable[str]] = None,
             free_result: Optional[pd.DataFrame] = None) -> pd.DataFrame:
    """One row per produced tensor whose upstream was injected (outputs, when inputs were;
    grad_inputs, when incoming gradients were), in execution order, with ``accumulated_*``
    (free vs reference) and ``local_*`` (injected vs reference) errors and a ``verdict``:
    ``origin`` (wrong even from the reference's inputs), ``inherited`` (wrong only in the free
    run), ``fine``. ``free_result``: ``compare_dumps(reference, free, ...)`` if already done."""
    acc = free_result if free_result is not None else compare_dumps(
        reference, free, rtol, atol, steps=steps)
    loc = compare_dumps(reference, injected, rtol, atol, steps=steps)
    local = loc[loc["kind"].isin(list(PRODUCED)) & _upstream_injected(loc)]
    cols = ["status", "rel_error", "added_ratio"]
    merged = local[KEY + ["seq"] + cols].merge(acc[KEY + cols], on=KEY, how="left",
                                              suffixes=("_local", "_accumulated"))
    merged = merged.rename(columns={f"{c}_local": f"local_{c}" for c in cols}
                           | {f"{c}_accumulated": f"accumulated_{c}" for c in cols})
    merged["verdict"] = np.where(
        merged["local_status"].isin(st.FAILING), st.ORIGIN,
        np.where(merged["accumulated_status"].isin(st.CARRYING), st.INHERITED,
                 st.FINE))
    if modules:
        patterns = list(modules)
        merged = merged[[fmt.module_matches(m, c, patterns)
                         for m, c in zip(merged["module"], merged["cls"])]]
    return merged.reset_index(drop=True)


def _upstream_injected(loc: pd.DataFrame) -> pd.Series:
    """Whether each row's call had its upstream (inputs for outputs, incoming gradients for
    grad_inputs) replaced: present, and no element further from the reference than rounding
    it to B's dtype moves it (half a unit roundoff)."""
    half_unit = loc["dtype_b"].map(lambda d: rounding_of(d).unit / 2).fillna(0.0)
    within = (loc["status"] == st.EQUAL) | (loc["max_rel_err"] <= half_unit * (1 + 1e-9))
    calls = loc.assign(rank=loc["rank"].fillna(-1), within=within)
    injected = pd.Series(False, index=loc.index)
    for produced, upstream in PRODUCED.items():
        up = calls[calls["kind"] == upstream].groupby(CALL)["within"].all()
        rows = calls[calls["kind"] == produced]
        keys = list(zip(*(rows[c] for c in CALL)))
        injected[rows.index] = [bool(up.get(k, False)) for k in keys]
    return injected


def describe_origins(frame: pd.DataFrame, shown: int = ORIGINS_SHOWN) -> str:
    """Text: how many records are origins, inherit or are fine; the origins, worst local added
    error first (at most ``shown``)."""
    origins = frame[frame["verdict"] == st.ORIGIN].sort_values(
        "local_added_ratio", ascending=False, kind="stable")
    lines = [f"{len(frame)} produced tensors with injected inputs: {len(origins)} origin, "
             f"{int((frame['verdict'] == st.INHERITED).sum())} inherited, "
             f"{int((frame['verdict'] == st.FINE).sum())} fine"]
    for r in origins.head(shown).itertuples():
        ratio = ("" if not np.isfinite(r.local_added_ratio)
                 else f", {r.local_added_ratio:.0f}x the typical local error")
        lines.append(f"  origin: step {fmt.step_label(r.epoch, r.step, r.rank)} "
                     f"{fmt.direction_of(r.kind)} "
                     f"{fmt.record_label(r.module, r.cls, r.call_idx, r.kind, r.index)} "
                     f"local rel error {r.local_rel_error:.3g}{ratio} "
                     f"(accumulated {r.accumulated_rel_error:.3g})")
    if len(origins) > shown:
        lines.append(f"  ... {len(origins) - shown} more (compare.localize gives them all)")
    return "\n".join(lines)

"""Localizing an error: accumulated vs local error per module call, from three dumps.

``reference`` is the trusted run, ``free`` the suspect run left alone, ``injected`` the suspect
run with every module's inputs (forward) or incoming gradients (backward) replaced by the
reference's (``dumper.Injector``). In the injected run a module can only be wrong by itself.
"""
from __future__ import annotations

from typing import Iterable, Optional

import pandas as pd

from . import format as fmt
from .comparison import compare_dumps
from .dump import Dump, PathLike
from .metrics import FAILING

ORIGIN, INHERITED, FINE = "origin", "inherited", "fine"
# What a module produces: its outputs (forward) and the gradients it sends back (backward).
PRODUCED = (fmt.OUTPUT, fmt.GRAD_INPUT)
KEY = ["epoch", "step", "rank", "module", "cls", "call_idx", "kind", "index"]


def localize(reference: PathLike | Dump, free: PathLike | Dump, injected: PathLike | Dump,
             rtol: Optional[float] = None, atol: Optional[float] = None, *,
             steps: Optional[Iterable[str]] = None,
             modules: Optional[Iterable[str]] = None) -> pd.DataFrame:
    """One row per produced tensor (outputs and grad_inputs), in execution order, with
    ``accumulated_*`` (free vs reference), ``local_*`` (injected vs reference) errors and a
    ``verdict``: ``origin`` (wrong even from correct inputs), ``inherited`` (wrong only in the
    free run), ``fine``."""
    kinds = list(PRODUCED)
    acc = compare_dumps(reference, free, rtol, atol, kinds=kinds, steps=steps, modules=modules)
    loc = compare_dumps(reference, injected, rtol, atol, kinds=kinds, steps=steps, modules=modules)
    cols = ["status", "rel_l2_err", "max_abs_err"]
    merged = acc[KEY + ["seq"] + cols].merge(loc[KEY + cols], on=KEY, how="left",
                                            suffixes=("_accumulated", "_local"))
    merged = merged.rename(columns={f"{c}_accumulated": f"accumulated_{c}" for c in cols}
                           | {f"{c}_local": f"local_{c}" for c in cols})
    local_bad = merged["local_status"].isin(FAILING)
    accumulated_bad = merged["accumulated_status"].isin(FAILING)
    merged["verdict"] = FINE
    merged.loc[accumulated_bad, "verdict"] = INHERITED
    merged.loc[local_bad, "verdict"] = ORIGIN
    return merged.reset_index(drop=True)


def describe_origins(frame: pd.DataFrame) -> str:
    """Text: where errors originate, then how many records inherit them."""
    origins = frame[frame["verdict"] == ORIGIN]
    lines = [f"{len(frame)} produced tensors: {len(origins)} origin, "
             f"{int((frame['verdict'] == INHERITED).sum())} inherited, "
             f"{int((frame['verdict'] == FINE).sum())} fine"]
    for r in origins.itertuples():
        direction = "backward" if r.kind == fmt.GRAD_INPUT else "forward"
        lines.append(f"  origin: step {r.epoch}:{r.step} {direction} "
                     f"{fmt.module_key(r.module, r.cls)}#{r.call_idx} {r.kind}[{r.index}] "
                     f"local rel_l2_err={r.local_rel_l2_err:.3g} "
                     f"(accumulated {r.accumulated_rel_l2_err:.3g})")
    return "\n".join(lines)

"""Module attributes a dump records as non-tensor ``param`` rows (``index`` -1): a
normalization's eps (``fmt.EPS_PATH``) and a convolution's geometry (``fmt.CONV_PATH``), per
``(epoch, step, rank, module)`` (rank -1 where not distributed): per step, as a module may
normalize by its batch's statistics in one step and not in another (a BatchNorm in training,
then in eval); and the numbers a call was given (non-tensor ``input`` rows of an ``int`` or
``float``, their ``repr`` exact, and flags, a ``bool``'s as 1 or 0), per ``(epoch, step,
rank, call)`` and path (``x * 0.5``'s ``args[1]``): by the call's own number in its run,
which pairing maps between the runs (ops aligned by name, calls made in another order)."""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import pandas as pd

from . import format as fmt
from .arguments import parsed_number


def _recorded(index: pd.DataFrame, path: str) -> dict[tuple, str]:
    """``(epoch, step, rank, module) -> value`` of a dump's index's attribute rows ``path``."""
    rows = index[(index["kind"] == fmt.PARAM) & (index["index"] < 0) & (index["path"] == path)]
    out: dict[tuple, str] = {}
    for key, value in zip(zip(rows["epoch"], rows["step"], rows["rank"].fillna(-1),
                              rows["module"]), rows["value"]):
        out.setdefault(key, value)
    return out


def recorded_eps(index: pd.DataFrame) -> dict[tuple, float]:
    """Each normalization's eps in a dump's index (a value that is not a number is left out:
    then judged at the worst eps)."""
    out = {}
    for key, value in _recorded(index, fmt.EPS_PATH).items():
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


def recorded_conv(index: pd.DataFrame) -> dict[tuple, fmt.ConvGeometry]:
    """Each convolution's geometry in a dump's index (one that does not parse is left out:
    then recomputed only where stride 1, no padding and one group fit)."""
    parsed = {key: fmt.parse_conv(value) for key, value in _recorded(index, fmt.CONV_PATH).items()}
    return {key: geometry for key, geometry in parsed.items() if geometry is not None}


def recorded_numbers(index: pd.DataFrame) -> dict[tuple, dict[str, float]]:
    """``(epoch, step, rank, call) -> {path: value}`` of the numbers each call in a dump's
    index was given (a flag's as 1.0 or 0.0)."""
    rows = index[(index["kind"] == fmt.INPUT) & (index["index"] < 0)
                 & index["dtype"].isin(["int", "float", "bool"])]
    out: dict[tuple, dict[str, float]] = {}
    for key, path, value, dtype in zip(zip(rows["epoch"], rows["step"], rows["rank"].fillna(-1),
                                           rows["call"]),
                                       rows["path"], rows["value"], rows["dtype"]):
        number = parsed_number(value, dtype)
        if number is not None:
            out.setdefault(key, {}).setdefault(path, number)
    return out


class Recorded(NamedTuple):
    """One module's recorded attributes in one step: its eps (NaN: none) and convolution
    geometry (None: none); and one call's numbers, by path."""

    eps: float
    conv: Optional[fmt.ConvGeometry]
    numbers: dict = {}


class Attributes(NamedTuple):
    """One side's recorded attributes, by ``(epoch, step, rank, module)`` (numbers: ``call``
    for ``module``)."""

    eps: dict[tuple, float]
    conv: dict[tuple, fmt.ConvGeometry]
    numbers: dict[tuple, dict[str, float]] = {}

    @classmethod
    def of(cls, index: pd.DataFrame) -> "Attributes":
        """The attributes in a dump's index."""
        return cls(recorded_eps(index), recorded_conv(index), recorded_numbers(index))

    def at(self, key: tuple, default: "Attributes", call: Optional[int] = None) -> Recorded:
        """The module's attributes at ``key``, ``default``'s where not recorded here, and
        the numbers its call ``call`` of this run was given (recorded here only: a number is
        the call's own)."""
        return Recorded(self.eps.get(key, default.eps.get(key, math.nan)),
                        self.conv.get(key, default.conv.get(key)),
                        self.numbers.get((*key[:3], call), {}))


NO_ATTRIBUTES = Attributes({}, {})  # where a side's module names are not A's (a name mapping)

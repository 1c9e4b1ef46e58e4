"""What a recomputation (:mod:`compare.formulas`) works on and gives back: a call's records
as :class:`Operands`, and the sums of one recomputation as :class:`Figures`."""
from __future__ import annotations

import math
from types import MappingProxyType
from typing import Callable, Mapping, NamedTuple, Optional, Union

import numpy as np

from . import format as fmt
from .metrics import FILLS, FILLS_FROM

# the columns of Figures.columns
RECOMPUTE_FIGURES = ("recomputed_rel_err", "recomputed_spread", "recomputed_terms",
                     "recomputed_accumulation")


class Operands(NamedTuple):
    """A call's records by kind (``input``, ``output``, ``grad_output``, ``grad_input``) and
    its parameters, float64; ``eps`` a normalization's (NaN: not recorded), ``conv`` a
    convolution's geometry (None: not recorded); ``rows``: for a gathering call, which rows
    of its weight ``weight`` holds, in increasing order (None: all of them); for an op of
    several operands, ``others`` those after the first, by position (a tensor's values, a
    number as a 0-d array; None where it was given none: an attention without a mask), and
    ``operand`` which of them the ``grad_input`` is the gradient of (0: the first);
    ``dim``: the dimension an op works over (a softmax's, a sum's; None: not given);
    ``options``: the numbers and flags an op was given, by parameter name (an attention's
    ``scale``, ``is_causal``; absent: not given)."""

    tensors: dict
    weight: Optional[np.ndarray]
    bias: Optional[np.ndarray]
    eps: float
    conv: Optional[fmt.ConvGeometry] = None
    rows: Optional[np.ndarray] = None
    others: tuple = ()
    operand: int = 0
    dim: Optional[int] = None
    options: Mapping[str, float] = MappingProxyType({})

    @property
    def other(self) -> Optional[np.ndarray]:
        """The second operand (None: none)."""
        return self.others[0] if self.others else None


class Figures:
    """Sums of one recomputation: squared difference, squared result, squared terms; and
    the number of terms an element sums. ``terms_squared``: their sum, or per element of
    the result (an array of its shape), which lets elements holding a mask's fill
    (``finfo(dtype).min``, :data:`compare.metrics.FILLS`) on either side be left out, as the
    comparison leaves them out: they would be all of the norm, and the other elements'
    error would vanish against them. Where they cannot be left out, no figures.
    ``accumulated``: for a sum whose partial sums are known (a bias's gradient), how far their
    rounding may move the result, relative to it, in units of the rounding of the lowest dtype
    the call is given (NaN: the terms' random walk, ``sqrt(K) spread`` accumulator units)."""

    def __init__(self, got: np.ndarray, want: np.ndarray,
                 terms_squared: Union[float, np.ndarray], terms: int,
                 accumulated: float = math.nan):
        self.filled, self.norm = False, float(np.square(want).sum())
        fills = np.isin(got, FILLS) | np.isin(want, FILLS) if self.norm >= FILLS_FROM else None
        if fills is not None and fills.any():
            per_element = np.shape(terms_squared) == np.shape(want)
            self.filled = not per_element
            got, want = got[~fills], want[~fills]
            terms_squared = terms_squared[~fills] if per_element else terms_squared
            self.norm = float(np.square(want).sum())
        self.diff = float(np.square(got - want).sum())
        self.terms_squared, self.terms = float(np.sum(terms_squared)), terms
        self.accumulated = accumulated

    def columns(self) -> Optional[dict]:
        """``RECOMPUTE_FIGURES`` (None where the result is zero, or it or its terms not finite,
        or it holds a mask's fill that could not be left out)."""
        if self.filled or not (self.norm > 0 and math.isfinite(self.norm)
                               and math.isfinite(self.diff)
                               and math.isfinite(self.terms_squared)):
            return None
        return {"recomputed_rel_err": math.sqrt(self.diff / self.norm),
                "recomputed_spread": math.sqrt(self.terms_squared / self.norm),
                "recomputed_terms": float(self.terms),
                "recomputed_accumulation": self.accumulated}


Formula = Callable[[str, Operands], Optional[Figures]]


def unbroadcast(values: np.ndarray, shape: tuple) -> np.ndarray:
    """``values`` summed over the axes an operand of ``shape`` was broadcast along to reach
    them (leading ones, and those where it has size 1): the gradient it gets."""
    lead = values.ndim - len(shape)
    axes = (*range(lead), *(lead + i for i, n in enumerate(shape)
                            if n == 1 and values.shape[lead + i] != 1))
    return values.sum(axis=axes).reshape(shape)

"""The error a normalization sees: its input's error relative to the input's spread.

A normalization (LayerNorm, BatchNorm, GroupNorm, a channels-first LayerNorm...) subtracts each
group's mean before it divides by the spread, so an input error that is small against the
input's values can be large against what is left after centering: a residual stream of mean
30 and spread 1 amplifies a relative error 30 times. What a normalization passes on is the
*centered* relative error ``||d_c|| / ||a_c||`` (``d = b - a``, ``_c``: each group's mean
removed), which the dump's values give exactly, without running the module; or, where more,
the root mean square of each group's own: every group is divided by its own spread, so one
of little spread passes on its error as much as any other.

Which elements form a group follows from the module's parameter length ``C`` and its input's
shape: over the last dimension when it is ``C`` (LayerNorm, RMSNorm, which does not center
and is then judged a little more loosely), and, when dimension 1 is ``C`` (channels first),
per channel over the batch and positions (BatchNorm) and per position over the channels
(a channels-first LayerNorm). The largest of these errors is taken: the looser judgement.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import pandas as pd

from . import format as fmt

LAST, CHANNEL, POSITION = "last", "channel", "position"


def normalized_sizes(pairs: pd.DataFrame) -> np.ndarray:
    """Per row of ``pairs`` (columns ``module, kind, index, shape_a``): the parameter length
    ``C`` of the normalization the row is the first input or the first incoming gradient of,
    else 0 (backward, a normalization removes each group's mean of the gradient, and its
    projection on the normalized input). A normalization is a
    module whose parameters (one row each in the dump) are all of one dimension and one
    length: LayerNorm, RMSNorm, BatchNorm, GroupNorm (not a Linear: its weight has two)."""
    params = pairs[pairs["kind"] == fmt.PARAM]
    sizes = {}
    for module, shapes in params.groupby("module")["shape_a"]:
        known = [s for s in shapes if isinstance(s, tuple)]
        if known and all(len(s) == 1 for s in known) and len({s[0] for s in known}) == 1:
            sizes[module] = known[0][0]
    first = pairs["kind"].isin([fmt.INPUT, fmt.GRAD_OUTPUT]) & (pairs["index"] == 0)
    return np.where(first, pairs["module"].map(sizes).fillna(0), 0).astype(np.int64)


def groupings(shape: tuple[int, ...], size: int) -> tuple[str, ...]:
    """The groupings a normalization with parameters of length ``size`` may use on an input of
    ``shape`` (none when neither its last nor its second dimension is ``size``)."""
    out = []
    if len(shape) >= 1 and shape[-1] == size:
        out.append(LAST)
    if len(shape) >= 2 and shape[1] == size:
        out.append(CHANNEL)
        if len(shape) > 2:
            out.append(POSITION)
    return tuple(dict.fromkeys(out))


class _Grouping:
    """Per-group sums of ``a`` and ``d`` for one grouping of a tensor's flat elements."""

    def __init__(self, kind: str, shape: tuple[int, ...]):
        numel = math.prod(shape)
        self.kind = kind
        self.last = shape[-1]
        self.channels = shape[1] if len(shape) >= 2 else 1
        self.inner = math.prod(shape[2:]) if len(shape) > 2 else 1
        groups = {LAST: numel // max(self.last, 1), CHANNEL: self.channels,
                  POSITION: numel // max(self.channels, 1)}[kind]
        self.size = numel // max(groups, 1)  # elements per group
        self.sum_a = np.zeros(groups)
        self.sum_d = np.zeros(groups)
        self.squares_a = np.zeros(groups)
        self.squares_d = np.zeros(groups)

    def ids(self, offset: int, n: int) -> np.ndarray:
        i = np.arange(offset, offset + n, dtype=np.int64)
        if self.kind == LAST:
            return i // self.last
        if self.kind == CHANNEL:
            return (i // self.inner) % self.channels
        return (i // (self.channels * self.inner)) * self.inner + i % self.inner

    def add(self, offset: int, a: np.ndarray, d: Optional[np.ndarray]) -> None:
        ids = self.ids(offset, a.size)
        groups = self.sum_a.size
        self.sum_a += np.bincount(ids, weights=a, minlength=groups)
        self.squares_a += np.bincount(ids, weights=a * a, minlength=groups)
        if d is not None:
            self.sum_d += np.bincount(ids, weights=d, minlength=groups)
            self.squares_d += np.bincount(ids, weights=d * d, minlength=groups)

    def centered_rel_error(self, ssa: float, ssd: float) -> float:
        """The centered error over all groups, or the root mean square of each group's where
        that is more (a normalization divides each group by its own spread: a group of little
        spread weighs as much as any in what it passes on)."""
        if self.size == 0 or self.sum_a.size == 0:  # an empty input: nothing to normalize
            return 0.0
        spread = ssa - float(np.dot(self.sum_a, self.sum_a)) / self.size
        error = max(ssd - float(np.dot(self.sum_d, self.sum_d)) / self.size, 0.0)
        if spread <= ssa * 1e-15:  # constant within its groups: nothing left to normalize
            return 0.0 if error == 0 else math.inf
        spreads = self.squares_a - self.sum_a ** 2 / self.size
        errors = np.maximum(self.squares_d - self.sum_d ** 2 / self.size, 0.0)
        varied = spreads > self.squares_a * 1e-12  # groups that are not constant
        per_group = float(np.mean(errors[varied] / spreads[varied])) if varied.any() else 0.0
        return math.sqrt(max(error / spread, per_group))


class Centering:
    """Accumulates, along with an :class:`~compare.metrics.ErrorAccumulator`, what
    :meth:`centered_rel_error` needs: fed the float64 values ``a`` and differences ``d`` of each
    block at its flat ``offset`` (``d`` None where the block is identical). Non-finite elements
    make it unknown (NaN)."""

    def __init__(self, shape: tuple[int, ...], size: int):
        self._groupings = [_Grouping(kind, shape) for kind in groupings(shape, size)]
        self.known = bool(self._groupings)

    def add(self, offset: int, a: np.ndarray, d: Optional[np.ndarray]) -> None:
        for grouping in self._groupings:
            grouping.add(offset, a, d)

    def forget(self) -> None:
        """Some elements were not finite: the centered error is not known."""
        self.known = False

    def centered_rel_error(self, ssa: float, ssd: float) -> float:
        """The largest centered relative error over the groupings (NaN when not known)."""
        if not self.known:
            return math.nan
        return max(g.centered_rel_error(ssa, ssd) for g in self._groupings)

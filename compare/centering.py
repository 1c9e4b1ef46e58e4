"""The error a normalization sees: its input's error relative to the input's spread.

A normalization (LayerNorm, BatchNorm, GroupNorm, a channels-first LayerNorm...) subtracts each
group's mean before it divides by the spread, so an input error that is small against the
input's values can be large against what is left after centering: a residual stream of mean
30 and spread 1 amplifies a relative error 30 times. What a normalization passes on is the
*centered* relative error ``||d_c|| / ||a_c||`` (``d = b - a``, ``_c``: each group's mean
removed), which the dump's values give exactly, without running the module; or, where more,
the root mean square of each group's own: every group is divided by its own spread, so one
of little spread passes on its error as much as any other.

Which elements form a group follows from the module's parameter length ``C`` (an op record of
a functional normalization: its weight's) and its input's shape: over the last dimension
when it is ``C`` (LayerNorm, RMSNorm, which does not center and is then judged a little more
loosely), and, when dimension 1 is ``C`` (channels first),
per channel over the batch and positions (BatchNorm) and per position over the channels
(a channels-first LayerNorm); a BatchNorm (by its class name) per channel only. The largest
of these errors is taken: the looser judgement.

**What the normalized values carry.** Dividing by the spread undoes part of that: a group's
centered values ``a_c`` become ``a_c / s`` with ``s = sqrt(||a_c||² / n + eps)``, so where the
spread dominates ``eps``, only the *direction* of ``a_c`` is left, and the part of the error
along ``a_c`` (which scales the group) cancels. The error of the normalized values,
``||b_c / s_b - a_c / s_a|| / ||a_c / s_a||``, follows from the same per-group sums and the
cross sum ``<a, d>``: the angle between ``a_c`` and ``b_c = a_c + d_c`` (exact, whatever the
error's size: in a group of two, ``b`` ordered otherwise than ``a`` flips it, an error of 2),
and the group's change of length in the share ``eps / (||a_c||² / n + eps)`` by which
``eps`` keeps it; over all groups, each weighing its normalized values' length. ``eps`` is
the module's as the dump records it (``fmt.EPS_PATH``, written since 2026-11-26), else the
largest error over those of common normalizations (``NORMALIZATION_EPS``) is taken. Over the
last dimension the uncentered values count too (RMSNorm), the larger taken. In a BatchNorm
of a batch of two at one position, what a bfloat16 input's rounding passes on is next to
nothing, not thirty times itself. A BatchNorm normalizes by its batch's statistics only in
training (else by its running ones: an affine map), which the dumper says by recording its
eps then only: without it, a BatchNorm's normalized error is not known (NaN).
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import pandas as pd

from . import format as fmt
from .precision import rounding_of

LAST, CHANNEL, POSITION = "last", "channel", "position"
# The eps of common normalizations (torch's LayerNorm and BatchNorm 1e-5, Hugging Face's 1e-12
# to 1e-3; 0: none): where a dump does not say which, the error is judged at the worst. Where
# a group's spread is not far above it, its length passes on in part, and the group weighs
# less in the whole.
NORMALIZATION_EPS = (0.0, 1e-6, 1e-5, 1e-4, 1e-3)
# class names of normalizations that divide by the root mean square only (T5's and its
# descendants' LayerNorm is one: no mean removed, no bias), and the op of one (dumper.ops)
UNCENTERED = ("RMSNorm", "RmsNorm", "T5LayerNorm", "rms_norm")
# op records (dumper.ops) of functional normalizations over the trailing dimensions: their
# weight and bias are tensor inputs after the first, not parameter rows
NORMALIZATION_OPS = ("layer_norm", "rms_norm")


def normalized_sizes(pairs: pd.DataFrame) -> np.ndarray:
    """Per row of ``pairs`` (columns ``module, cls_a, kind, index, shape_a``): the parameter
    length ``C`` of the normalization the row is the first input or the first incoming
    gradient of, else 0 (backward, a normalization removes each group's mean of the gradient,
    and its projection on the normalized input; an RMSNorm, by the class names of
    :data:`UNCENTERED`, which removes no mean forward, removes none backward either: its
    incoming gradient is not centered). A
    normalization is a module whose parameters (one row each in the dump) are all of one
    dimension and one length: LayerNorm, RMSNorm, BatchNorm, GroupNorm (not a Linear: its
    weight has two); or an op of :data:`NORMALIZATION_OPS` given a weight, whose tensor
    inputs after the first are so."""
    ops = pairs["cls_a"].isin(NORMALIZATION_OPS) & (pairs["kind"] == fmt.INPUT) & (
        pairs["index"] > 0)
    params = pairs[(pairs["kind"] == fmt.PARAM) | ops]
    sizes = {}
    for module, shapes in params.groupby("module")["shape_a"]:
        known = [s for s in shapes if isinstance(s, tuple)]
        if known and all(len(s) == 1 for s in known) and len({s[0] for s in known}) == 1:
            sizes[module] = known[0][0]
    centers = ~pairs["cls_a"].fillna("").str.contains("|".join(UNCENTERED))
    first = ((pairs["kind"] == fmt.INPUT) | ((pairs["kind"] == fmt.GRAD_OUTPUT) & centers)) \
        & (pairs["index"] == 0)
    return np.where(first, pairs["module"].map(sizes).fillna(0), 0).astype(np.int64)


# Class names of the normalizations whose groups :func:`groupings` holds (not GroupNorm's or
# InstanceNorm's, per sample; not SyncBatchNorm's, over every rank's batch; not a gated norm's,
# which normalizes its input times a gate): there the error of the normalized values is what
# passes on. These are also the classes :mod:`compare.formulas` recomputes as normalizations.
BATCH_NORM = "BatchNorm"
NORMALIZATIONS = (BATCH_NORM, "LayerNorm", "RMSNorm")
NOT_NORMALIZATIONS = ("SyncBatchNorm", "Gated")


def normalizes(frame: pd.DataFrame) -> np.ndarray:
    """Per row of a comparison (columns ``epoch, step, rank, call, cls, kind, dtype_a``):
    whether it is the one floating-point input of a call of one of ``NORMALIZATIONS`` (and
    none of ``NOT_NORMALIZATIONS``): a norm that is also given a residual or a gate
    normalizes their sum or product, not its input."""
    cls = frame["cls"].fillna("")
    named = (cls.str.contains("|".join(NORMALIZATIONS))
             & ~cls.str.contains("|".join(NOT_NORMALIZATIONS)))
    floating = (frame["kind"] == fmt.INPUT) & frame["dtype_a"].map(
        lambda dtype: rounding_of(dtype).unit > 0)
    call = [frame["epoch"], frame["step"], frame["rank"].fillna(-1), frame["call"]]
    alone = floating.groupby(call).transform("sum") == 1
    return (named & floating & alone).to_numpy(bool)


def per_channel(cls: pd.Series) -> np.ndarray:
    """Per class name, whether it is a BatchNorm's (``BatchNorm2d``, ``SyncBatchNorm``),
    which normalizes per channel."""
    return cls.fillna("").str.contains(BATCH_NORM).to_numpy(bool)


def groupings(shape: tuple[int, ...], size: int, channels: bool = False) -> tuple[str, ...]:
    """The groupings a normalization with parameters of length ``size`` may use on an input of
    ``shape`` (none when neither its last nor its second dimension is ``size``); a BatchNorm
    (``channels``) per channel only."""
    if channels:
        return (CHANNEL,) if len(shape) >= 2 and shape[1] == size else ()
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
        self.cross = np.zeros(groups)

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
            self.cross += np.bincount(ids, weights=a * d, minlength=groups)

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

    def normalized_rel_error(self, epsilons: tuple[float, ...]) -> float:
        """The error of the normalized values over all groups (see the module docstring):
        centered, and over the last dimension also uncentered, the larger; the largest over
        ``epsilons``."""
        if self.size == 0 or self.sum_a.size == 0:
            return 0.0
        n = self.size
        forms = [(self.squares_a - self.sum_a ** 2 / n, self.squares_d - self.sum_d ** 2 / n,
                  self.cross - self.sum_a * self.sum_d / n)]
        if self.kind == LAST:
            forms.append((self.squares_a, self.squares_d, self.cross))
        return _largest([_normalized_error(*form, n, self.squares_a, eps)
                         for form in forms for eps in epsilons])


def _largest(errors: list[float]) -> float:
    """The largest of ``errors``, NaN if any is NaN (not known)."""
    return math.nan if any(math.isnan(e) for e in errors) else max(errors)


def _normalized_error(aa: np.ndarray, dd: np.ndarray, ad: np.ndarray, n: int,
                      scale: np.ndarray, eps: float) -> float:
    """``||b / s_b - a / s_a|| / ||a / s_a||`` over groups, ``s = sqrt(||x||² / n + eps)``, from
    each group's ``||a||²``, ``||d||²`` and ``<a, d>`` (of the centered values or not): the
    angle that ``d`` turns ``a`` by and the change of length that ``eps`` leaves. Groups
    constant in A (``aa`` ~ 0 against ``scale``: no digits left to tell) add nothing where B's
    are constant too, and make it unknown (NaN) where not (a padding row that A holds at
    zero)."""
    varied = aa > scale * 1e-12
    if np.any(dd[~varied] > 0) or not varied.any():
        return math.nan
    aa, dd, ad = aa[varied], np.maximum(dd[varied], 0.0), ad[varied]
    along = ad / aa                                    # d = along * a + d_perp
    across = np.maximum(dd - along * ad, 0.0) / aa     # ||d_perp||² / ||a||²
    stretch = 1.0 + along                              # b = stretch * a + d_perp
    longer = 2.0 * along + along ** 2 + across         # ||b||² / ||a||² - 1
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        tangent = across / stretch ** 2                # tan² of the angle, where stretch > 0
        root = np.sqrt(1.0 + tangent)
        turned = np.where(stretch > 0, 2.0 * tangent / (root * (1.0 + root)),
                          2.0 - 2.0 * stretch / np.sqrt(1.0 + longer))  # ||unit(b) - unit(a)||²
        # q: the normalized lengths' ratio, b's over a's; a's squared, ||a||² / (||a||² / n + eps)
        q2 = eps * longer / ((1.0 + longer) * aa / n + eps)
        q = np.sqrt(1.0 + q2)
        length = aa / (aa / n + eps)
        error = np.sum(((q2 / (q + 1.0)) ** 2 + q * turned) * length) / np.sum(length)
    return math.sqrt(error) if np.isfinite(error) else math.inf


class Centering:
    """Accumulates, along with an :class:`~compare.metrics.ErrorAccumulator`, what
    :meth:`centered_rel_error` and :meth:`normalized_rel_error` need: fed the float64 values
    ``a`` and differences ``d`` of each block at its flat ``offset`` (``d`` None where the
    block is identical). Non-finite elements make both unknown (NaN)."""

    def __init__(self, shape: tuple[int, ...], size: int, channels: bool = False,
                 eps: float = math.nan):
        self._groupings = [_Grouping(kind, shape) for kind in groupings(shape, size, channels)]
        # a BatchNorm without a recorded eps may have normalized by its running statistics
        self._eps = (NORMALIZATION_EPS if not channels else ()) if math.isnan(eps) else (eps,)
        self.known = bool(self._groupings)

    def add(self, offset: int, a: np.ndarray, d: Optional[np.ndarray]) -> None:
        for grouping in self._groupings:
            grouping.add(offset, a, d)

    def forget(self) -> None:
        """Some elements were not finite: neither error is known."""
        self.known = False

    def centered_rel_error(self, ssa: float, ssd: float) -> float:
        """The largest centered relative error over the groupings (NaN when not known)."""
        if not self.known:
            return math.nan
        return max(g.centered_rel_error(ssa, ssd) for g in self._groupings)

    def normalized_rel_error(self) -> float:
        """The largest error of the normalized values over the groupings, at the module's eps
        if known, else at the worst of ``NORMALIZATION_EPS`` (NaN when not known, and for a
        BatchNorm without its eps)."""
        if not self.known or not self._eps:
            return math.nan
        return _largest([g.normalized_rel_error(self._eps) for g in self._groupings])

"""A call recomputed from its own records: what B's computation of one call added.

Where a module's class says what it computes, its output follows from its input and weights,
and the gradient it sends back from the gradient that arrives and its input:

- ``Linear``: ``y = x Wᵀ + b``, ``gx = g W``;
- a 1x1 ``Conv2d`` that keeps the spatial size (stride 1, no padding, one group): the same
  ``Linear`` on every pixel's channels;
- the elementwise activations of :data:`ELEMENTWISE` (``ReLU``, ``ReLU6``, ``SiLU``,
  ``Sigmoid``, ``Tanh``): ``y = f(x)``, ``gx = g f'(x)``.

Recomputed in float64 from B's own records of the call, the difference is what B's
computation of that call added, whatever error its operands carried: the error of a call's
own forward or backward, measured exactly where the error figures of
:mod:`compare.verdict` can only bound it (a gradient that already carries 10 % hides a 10 %
error added to it). Per ``output[0]`` and ``grad_input[0]`` record of such a call:

``recomputed_rel_err``
    ``||b - f(b's operands)|| / ||f(b's operands)||``;
``recomputed_spread``
    ``||sqrt(sum_k term_k²)|| / ||f(b's operands)||`` over the products ``term_k`` an element
    sums (1 for an elementwise function): how far rounding the operands may move the
    result, relative to it; more where the products cancel;
``recomputed_terms``
    the number of products an element sums (1 for an elementwise function).

Rounding explains :func:`allowed` of it. Where B ran on A's values (``injected``: its record
holds what B would have used), the call's operands are A's. B's weights are B's values (``params=True``), else A's
where B's are known to be the same (B ran on A's, ``injected``; or their statistics and sketch
agree to float64 rounding); calls whose weights are neither have no figures. So do calls where
A's records do not follow the formula within A's rounding (a class of that name that computes
something else; TF32 in A), records of statistics or digests, and tensors of more than
:data:`MAX_ELEMENTS` elements (memory stays bounded).
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import numpy as np
import pandas as pd

from . import format as fmt
from .dump import StepReaders, one_side, read_chunks
from .errors import DumpError
from .precision import ROUNDING, lowest, rounding_of
from .statistics import STATS_RESOLUTION

RECOMPUTE_COLUMNS = ("recomputed_rel_err", "recomputed_spread", "recomputed_terms")
MAX_ELEMENTS = 1 << 24  # per tensor: 128 MiB in float64
# Each product of operands rounded once per operand and the result once, each rounding at
# most the unit roundoff (its root mean square is u / sqrt(3)), the K products of an element
# summed in the accumulator (a random walk: sqrt(K) roundings of it): twice that.
ALLOWANCE = 2.0


def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def _silu_grad(x: np.ndarray) -> np.ndarray:
    s = _sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


# class name: (f, f') in float64
ELEMENTWISE: dict[str, tuple[Callable, Callable]] = {
    "ReLU": (lambda x: np.maximum(x, 0.0), lambda x: (x > 0).astype(np.float64)),
    "ReLU6": (lambda x: np.clip(x, 0.0, 6.0), lambda x: ((x > 0) & (x < 6)).astype(np.float64)),
    "SiLU": (lambda x: x * _sigmoid(x), _silu_grad),
    "SiLUActivation": (lambda x: x * _sigmoid(x), _silu_grad),
    "Sigmoid": (_sigmoid, lambda x: _sigmoid(x) * (1.0 - _sigmoid(x))),
    "Tanh": (np.tanh, lambda x: 1.0 - np.tanh(x) ** 2),
}
WEIGHTED = ("Linear", "Conv2d")


def allowed(unit: np.ndarray, spread: np.ndarray, terms: np.ndarray) -> np.ndarray:
    """What rounding explains of ``recomputed_rel_err`` for a call computed in a dtype of unit
    roundoff ``unit`` (accumulating in float32, or finer where the dtype is)."""
    accumulator = np.minimum(unit, ROUNDING["float32"].unit)
    return ALLOWANCE * (unit * (1.0 + 2.0 * spread) + accumulator * np.sqrt(terms) * spread)


class _Figures:
    """Sums of one recomputation: squared difference, squared result, squared terms."""

    def __init__(self, got: np.ndarray, want: np.ndarray, terms_squared: float, terms: int):
        self.diff = float(np.square(got - want).sum())
        self.norm = float(np.square(want).sum())
        self.terms_squared, self.terms = terms_squared, terms

    def columns(self) -> Optional[dict]:
        if not (self.norm > 0 and math.isfinite(self.norm) and math.isfinite(self.diff)):
            return None
        return {"recomputed_rel_err": math.sqrt(self.diff / self.norm),
                "recomputed_spread": math.sqrt(self.terms_squared / self.norm),
                "recomputed_terms": float(self.terms)}


def _as_rows(x: np.ndarray, width: int, channels_first: bool) -> np.ndarray:
    """``x`` as rows of its ``width`` features (channels of an image batch moved last)."""
    if channels_first:
        x = np.moveaxis(x, 1, -1)
    return x.reshape(-1, width)


def _weighted(cls: str, kind: str, t: dict, weight: np.ndarray, bias: Optional[np.ndarray]
              ) -> Optional[_Figures]:
    """A ``Linear``'s (or 1x1 convolution's) ``kind`` record recomputed; ``t``: the call's
    tensors by kind."""
    conv = cls == "Conv2d"
    x = t.get(fmt.INPUT)
    if conv:
        if weight.ndim != 4 or weight.shape[2:] != (1, 1) or x is None or x.ndim != 4 or \
                weight.shape[1] != x.shape[1]:
            return None
        weight = weight.reshape(weight.shape[:2])
    if weight.ndim != 2:
        return None
    out_features, in_features = weight.shape
    if kind == fmt.OUTPUT:
        y = t[fmt.OUTPUT]
        if x is None or x.shape[-1 if not conv else 1] != in_features or (
                conv and y.shape != (x.shape[0], out_features, *x.shape[2:])) or (
                not conv and y.shape != (*x.shape[:-1], out_features)):
            return None
        rows = _as_rows(x, in_features, conv)
        want = rows @ weight.T
        squared = float(np.square(rows).sum(axis=0) @ np.square(weight).sum(axis=0))
        if bias is not None:
            want += bias
            squared += len(rows) * float(np.square(bias).sum())
        return _Figures(_as_rows(y, out_features, conv), want, squared,
                        in_features + (bias is not None))
    g, gx = t[fmt.GRAD_OUTPUT], t[fmt.GRAD_INPUT]
    if (x is not None and gx.shape != x.shape) or g.ndim != gx.ndim or (
            conv and g.shape != (gx.shape[0], out_features, *gx.shape[2:])) or (
            not conv and g.shape != (*gx.shape[:-1], out_features)) or \
            gx.shape[-1 if not conv else 1] != in_features:
        return None
    rows = _as_rows(g, out_features, conv)
    squared = float(np.square(rows).sum(axis=0) @ np.square(weight).sum(axis=1))
    return _Figures(_as_rows(gx, in_features, conv), rows @ weight, squared, out_features)


def _elementwise(cls: str, kind: str, t: dict) -> Optional[_Figures]:
    f, grad = ELEMENTWISE[cls]
    x = t.get(fmt.INPUT)
    if x is None:
        return None
    if kind == fmt.OUTPUT:
        got, want = t[fmt.OUTPUT], f(x)
    else:
        got, want = t[fmt.GRAD_INPUT], t[fmt.GRAD_OUTPUT] * grad(x) if t[
            fmt.GRAD_OUTPUT].shape == x.shape else None
    if want is None or got.shape != want.shape:
        return None
    return _Figures(got, want, float(np.square(want).sum()), 1)


# the records a check reads besides its own: forward from the input, backward from the
# gradient that arrives (and the input, for an elementwise function)
NEEDS = {fmt.OUTPUT: (fmt.INPUT,), fmt.GRAD_INPUT: (fmt.GRAD_OUTPUT, fmt.INPUT)}


def recomputable(pairs: pd.DataFrame) -> pd.DataFrame:
    """The rows of calls whose class :mod:`compare.recompute` knows, on both sides, the same
    class in both, first occurrences, tensor index 0 (and the calls' weights); none put
    together from shards."""
    known = pairs["cls_a"].isin([*WEIGHTED, *ELEMENTWISE]) & (pairs["cls_a"] == pairs["cls_b"])
    data = (pairs["index"] == 0) & (pairs["occurrence"] == 0) & pairs["kind"].isin(
        [fmt.INPUT, fmt.OUTPUT, fmt.GRAD_OUTPUT, fmt.GRAD_INPUT])
    weights = (pairs["kind"] == fmt.PARAM) & pairs["path_a"].isin(["weight", "bias"])
    whole = [~pairs[f"parts_{side}"].map(lambda p: isinstance(p, tuple) and len(p) > 0)
             for side in ("a", "b")]  # not put together from shards
    return pairs[known & (pairs["side"] == "both") & (data | weights) & whole[0] & whole[1]]


def measure(pairs: pd.DataFrame, files_a: dict, files_b: dict, metrics: dict[int, dict]
            ) -> dict[int, dict]:
    """``RECOMPUTE_COLUMNS`` per ``output[0]``/``grad_input[0]`` row label of the calls
    :func:`recomputable` gives; ``metrics``: the comparison's figures by row label (whether
    B's weights are A's)."""
    out: dict[int, dict] = {}
    rows = recomputable(pairs)
    with StepReaders(files_a) as readers_a, StepReaders(files_b) as readers_b:
        for key, call in rows.groupby(["epoch", "step", "rank", "call_a"], sort=False):
            recomputed = _Call(call, {"a": readers_a, "b": readers_b}, metrics)
            for kind in (fmt.OUTPUT, fmt.GRAD_INPUT):
                try:
                    label, figures = recomputed.check(kind)
                except (KeyError, OSError, RuntimeError) as exc:  # what h5py raises on damage
                    paths = " or ".join(str(f[key[:3]].path) for f in (files_a, files_b))
                    raise DumpError(f"{paths}: cannot read a tensor ({exc}); the file is "
                                    f"damaged") from exc
                if figures is not None:
                    out[label] = figures
    return out


class _Call:
    """One call's records, read on demand from both sides."""

    def __init__(self, rows: pd.DataFrame, readers: dict[str, StepReaders],
                 metrics: dict[int, dict]):
        self.metrics, self.readers = metrics, readers
        self.cls = rows["cls_a"].iloc[0]
        self.by_kind = {k: r for k, r in rows[rows["kind"] != fmt.PARAM].groupby("kind")}
        self.params = {p: r for p, r in rows[rows["kind"] == fmt.PARAM].groupby("path_a")}
        self.cache: dict[tuple, Optional[np.ndarray]] = {}

    def check(self, kind: str) -> tuple[Optional[int], Optional[dict]]:
        if kind not in self.by_kind or (kind == fmt.GRAD_INPUT and fmt.GRAD_OUTPUT not in
                                        self.by_kind):
            return None, None
        row = self.by_kind[kind].iloc[0]
        needed = [k for k in (kind, *NEEDS[kind]) if k in self.by_kind]
        figures = {}
        for side in ("a", "b"):
            tensors = {k: self._operand(self.by_kind[k].iloc[0], side) if k != kind else
                       self._tensor(row, side) for k in needed}
            if any(v is None for v in tensors.values()):
                return None, None
            figures[side] = self._recompute(kind, tensors, side)
            if figures[side] is None:
                return None, None
        a = figures["a"]
        dtypes = [self.by_kind[k].iloc[0]["dtype_a"] for k in needed] + [
            r.iloc[0]["dtype_a"] for r in self.params.values()]
        limit = allowed(rounding_of(lowest(dtypes)).unit, a["recomputed_spread"],
                        a["recomputed_terms"])
        if not a["recomputed_rel_err"] <= limit:  # the formula does not hold in A
            return None, None
        return row.name, figures["b"]

    def _recompute(self, kind: str, tensors: dict, side: str) -> Optional[dict]:
        if self.cls in ELEMENTWISE:
            figures = _elementwise(self.cls, kind, tensors)
        else:
            weight = self._weight("weight", side)
            if weight is None or ("bias" in self.params and self._weight("bias", side) is None):
                return None
            figures = _weighted(self.cls, kind, tensors, weight, self._weight("bias", side))
        return None if figures is None else figures.columns()

    def _operand(self, row: pd.Series, side: str) -> Optional[np.ndarray]:
        """What the call computed from on ``side``: where B ran on A's values (``injected``),
        A's (its record holds what B would have used)."""
        return self._tensor(row, "a" if side == "b" and row["injected_b"] == 1 else side)

    def _weight(self, path: str, side: str) -> Optional[np.ndarray]:
        """The call's parameter ``path`` on ``side``: B's values, else A's where B's are
        known to be the same."""
        if path not in self.params:
            return None
        row = self.params[path].iloc[0]
        if side == "b" and not row["dataset_b"]:
            figures = self.metrics.get(row.name, {})
            same = row["injected_b"] == 1 or max(figures.get("stat_rel_diff", math.inf),
                                                  figures.get("rel_err_from_stats", math.inf)
                                                  ) < STATS_RESOLUTION
            side = "a" if same else side
        return self._tensor(row, side)

    def _tensor(self, row: pd.Series, side: str) -> Optional[np.ndarray]:
        """``row``'s values on ``side`` in float64, or None where it holds none to use."""
        key = (row.name, side)
        if key not in self.cache:
            self.cache[key] = None
            shape = tuple(int(n) for n in row[f"shape_{side}"])
            floating = row[f"dtype_{side}"] in ROUNDING
            if row[f"dataset_{side}"] and floating and 0 < math.prod(shape) <= MAX_ELEMENTS \
                    and row[f"digest_{side}"] == fmt.NO_DIGEST:
                reader = self.readers[side][(row["epoch"], row["step"], row["rank"])]
                ds = reader.dataset(one_side(row, side))
                values = np.concatenate(list(read_chunks(
                    ds, row[f"dtype_{side}"], row[f"encoding_{side}"], MAX_ELEMENTS,
                    int(row[f"checksum_{side}"]))))
                if not np.iscomplexobj(values):
                    values = values.astype(np.float64).reshape(shape)
                    self.cache[key] = values if np.isfinite(values).all() else None
        return self.cache[key]

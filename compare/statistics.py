"""Comparing tensors known by their statistics (statistics-mode dumps, see docs/format.md)."""
from __future__ import annotations

import functools
import math
from typing import Iterable

import numpy as np

from . import format as fmt
from .metrics import METRIC_COLUMNS
from .status import CLOSE, DIFF, EQUAL, NAN_MISMATCH
from .tolerance import Tolerance

# Statistics computed by different code (the dumper on the device, the reader from values)
# agree to float64 rounding: estimates below this are no evidence of a difference.
STATS_RESOLUTION = 1e-12
STAT_NAMES = tuple(column.removeprefix("stat_") for column in fmt.STAT_COLUMNS)

# The sketch of a tensor: SKETCH_SIZE sums of its elements with pseudo-random signs,
#   sketch_k = sum_i  R[k, i % SKETCH_COLUMNS_P] * T[k, (i // SKETCH_COLUMNS_P) % SKETCH_ROWS_Q] * x_i
# over the elements x_i in C order (float64; complex tensors by magnitude). For two tensors a and
# b, each sum of b - a has signs independent in pairs, so mean square ||b - a||^2, whatever the
# difference's shape (a drift of weights, a scale): the mean of k sums' squares is, for a
# difference spread over many elements, ||b - a||^2 times a chi-square of k degrees over k
# (sketch_bound says how far below it may fall). Row k's signs do not depend on SKETCH_SIZE:
# the 8 sums of format versions 2 to 11 are the first 8 of today's.
SKETCH_SIZE = len(fmt.SKETCH_COLUMNS)
# an estimate from a sketch falls below ||b - a|| / sketch_bound(k) once in 1 / SKETCH_MISS
SKETCH_MISS = 1e-4
SKETCH_COLUMNS_P, SKETCH_ROWS_Q = 1021, 1019  # primes: element i sits at (i // P, i % P)


def _signs(rows: int, length: int, salt: int) -> np.ndarray:
    """A fixed table of +-1 (float64) from an integer hash: the same on every machine."""
    j = np.arange(length, dtype=np.uint64)[None, :] + np.uint64(1)
    k = np.arange(rows, dtype=np.uint64)[:, None] + np.uint64(1)
    h = (j * np.uint64(0x9E3779B1) + k * np.uint64(0x85EBCA77)
         + np.uint64(salt) * np.uint64(0xC2B2AE3D)) & np.uint64(0xFFFFFFFF)
    h = ((h ^ (h >> np.uint64(15))) * np.uint64(0x2C1B3C6D)) & np.uint64(0xFFFFFFFF)
    return ((h >> np.uint64(16)) & np.uint64(1)).astype(np.float64) * 2.0 - 1.0


@functools.cache
def sketch_signs() -> tuple[np.ndarray, np.ndarray]:
    """``(R, T)``: the column signs (SKETCH_SIZE x P) and row signs (SKETCH_SIZE x Q)."""
    return _signs(SKETCH_SIZE, SKETCH_COLUMNS_P, 1), _signs(SKETCH_SIZE, SKETCH_ROWS_Q, 2)


def sketch_of_chunks(chunks: Iterable[np.ndarray]) -> tuple[float, ...]:
    """The sketch (see above) of a tensor given as consecutive flat chunks. Besides a chunk's
    float64 copy it needs SKETCH_SIZE x P sums, whatever the chunk's size: a chunk's full rows
    of P elements are multiplied by their row signs in one matrix product (as the dumper's
    ``sketch_on_device`` does), a row cut by a chunk's end is carried into the next, and the
    last partial row is multiplied by its elements' signs."""
    col_signs, row_signs = sketch_signs()
    p, q = SKETCH_COLUMNS_P, SKETCH_ROWS_Q
    by_column = np.zeros((SKETCH_SIZE, p))  # [k, c]: the sum over rows r of T[k, r % q] x[r, c]
    row, carry = 0, np.zeros(0)
    with np.errstate(all="ignore"):  # inf and NaN propagate, as in the other statistics
        for chunk in chunks:
            x = np.abs(chunk) if np.iscomplexobj(chunk) else chunk
            x = np.concatenate([carry, x.astype(np.float64, copy=False).reshape(-1)])
            rows = x.size // p
            by_column += row_signs[:, np.arange(row, row + rows) % q] @ \
                x[:rows * p].reshape(rows, p)
            row, carry = row + rows, x[rows * p:]
        total = (by_column * col_signs).sum(1)
        total += (row_signs[:, row % q, None] * col_signs[:, :carry.size]) @ carry
    return tuple(float(v) for v in total)


def sketch_sums(sketch: tuple) -> int:
    """How many sums of ``sketch`` are known: its leading ones that are not NaN, where all
    after them are (8 in a file of format versions 2 to 11, whose other columns read as
    NaN); none where a NaN sits among known sums (a tensor with NaN elements, or with both
    +Inf and -Inf, which cancel to NaN in some sums only)."""
    known = next((k for k, v in enumerate(sketch) if math.isnan(v)), len(sketch))
    return known if all(math.isnan(v) for v in sketch[known:]) else 0


def sketch_rel_error(sketch_a: tuple, sketch_b: tuple, norm_a: float) -> float:
    """``||b - a|| / ||a||`` estimated from the sums both sketches know; NaN if either knows
    none."""
    k = min(sketch_sums(sketch_a), sketch_sums(sketch_b))
    if not k:
        return math.nan
    a, b = np.asarray(sketch_a[:k], float), np.asarray(sketch_b[:k], float)
    spread = math.sqrt(float(np.mean((b - a) ** 2)))
    if not norm_a:
        return 0.0 if spread == 0 else math.inf
    return spread / norm_a


@functools.cache
def sketch_bound(sums: int) -> float:
    """How many times its estimate from ``sums`` sums of their sketches ``||b - a||`` is at
    most, but once in ``1 / SKETCH_MISS``: ``sqrt(k / q)`` with ``q`` the ``SKETCH_MISS``
    quantile of a chi-square of ``k = sums`` degrees (1.76 for 32 sums, 4.15 for 8)."""
    low, high = 0.0, float(sums)  # the quantile, by bisection of the chi-square's CDF
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if _chi_square_cdf(middle, sums) < SKETCH_MISS \
            else (low, middle)
    return math.sqrt(sums / high)


def _chi_square_cdf(x: float, degrees: int) -> float:
    """``P(X <= x)`` for a chi-square of ``degrees`` degrees: the regularized lower incomplete
    gamma function ``P(degrees / 2, x / 2)`` by its series (x below the degrees: it converges
    fast)."""
    s, z = degrees / 2, x / 2
    if z <= 0:
        return 0.0
    term = math.exp(s * math.log(z) - z - math.lgamma(s + 1))
    total, n = term, 0
    while term > 1e-17 * total:
        n += 1
        term *= z / (s + n)
        total += term
    return total


def stats_from_sums(lo: float, hi: float, total: float, sumsq: float, n: int, nan: float,
                    inf: float, zero: float) -> tuple[float, ...]:
    """``STAT_NAMES`` from min, max, float64 sums and counts: the one definition the dumper and
    the reader share. ``std`` is the population standard deviation,
    ``sqrt(max(sumsq / n - mean², 0))``; an empty tensor has NaN min/max/mean/std, norm and
    counts 0. NaNs propagate."""
    if n == 0:
        return (math.nan,) * 4 + (0.0, 0.0, 0.0, 0.0)
    mean = total / n
    return (lo, hi, mean, math.sqrt(max(sumsq / n - mean * mean, 0.0)), math.sqrt(sumsq),
            float(nan), float(inf), float(zero))


_COUNTED = fmt.STAT_COLUMNS.index("stat_nan")  # a count: set wherever statistics were computed


def described(stats: tuple) -> bool:
    """Whether a record's statistics (``fmt.STAT_COLUMNS``) were computed: NaN where not."""
    return not math.isnan(stats[_COUNTED])


def unscaled_stats(stats: tuple, sketch: tuple, grad_scale: float) -> tuple[tuple, tuple]:
    """A record's statistics and sketch without the loss scale its values carry (its index
    row's ``grad_scale``): min, max, mean, std, norm and the sketch's sums divided by it, the
    counts as they are."""
    if grad_scale == fmt.NO_GRAD_SCALE:
        return stats, sketch
    return (tuple(v / grad_scale for v in stats[:_COUNTED]) + tuple(stats[_COUNTED:]),
            tuple(v / grad_scale for v in sketch))


def stats_of_chunks(chunks: Iterable[np.ndarray]) -> tuple[float, ...]:
    """``STAT_NAMES`` of a tensor given as flat chunks, the dumper's definitions, in float64."""
    n, total, sumsq = 0, 0.0, 0.0
    lo, hi, nan, inf, zero = math.inf, -math.inf, 0, 0, 0
    for chunk in chunks:
        x = np.abs(chunk) if np.iscomplexobj(chunk) else chunk
        x = x.astype(np.float64, copy=False)
        n += x.size
        if x.size == 0:
            continue
        nan += int(np.count_nonzero(np.isnan(x)))
        inf += int(np.count_nonzero(np.isinf(x)))
        zero += int(np.count_nonzero(x == 0))
        lo = _nan_propagating(min, lo, float(np.min(x)))
        hi = _nan_propagating(max, hi, float(np.max(x)))
        with np.errstate(all="ignore"):  # inf - inf: the NaN the counts explain
            total += float(np.sum(x))
            sumsq += float(np.dot(x, x))
    return stats_from_sums(lo, hi, total, sumsq, n, nan, inf, zero)


def _nan_propagating(pick, x: float, y: float) -> float:
    return math.nan if math.isnan(x) or math.isnan(y) else pick(x, y)


def _estimate(sa: dict, sb: dict) -> float:
    """Relative L2 error estimated from statistics (see :func:`compare_stats`); 0 when they
    agree, inf when A is all zeros and B is not. Each statistic's change is taken relative to
    its own scale: an error of relative size e in every element changes each by about e."""
    if not sa["norm"] or math.isnan(sa["norm"]):
        same = all(sa[k] == sb[k] or (math.isnan(sa[k]) and math.isnan(sb[k]))
                   for k in ("min", "max", "mean", "std", "norm"))
        return 0.0 if same else math.inf
    rms = math.hypot(sa["mean"], sa["std"])  # sqrt(norm² / n), population std
    scales = {"norm": sa["norm"], "std": rms, "mean": rms, "min": max(abs(sa["min"]), rms),
              "max": max(abs(sa["max"]), rms)}
    changes = [abs(sb[k] - sa[k]) / scale for k, scale in scales.items()
               if not (math.isnan(sa[k]) or math.isnan(sb[k]))]
    return max(changes, default=0.0)


def compare_stats(a: tuple, b: tuple, tol: Tolerance, sketch_a: tuple = (),
                  sketch_b: tuple = ()) -> dict:
    """Compare two tensors known by their statistics (``STAT_NAMES`` order).

    ``nan_mismatch`` when NaN/Inf counts differ; else each of min, max, mean, std and norm must
    satisfy ``|b - a| <= atol + rtol |b|`` for ``close`` (all identical, and the sketches where
    both have one: ``equal``). Figures:
    ``stat_rel_diff``, the largest ``|b - a| / max(|a|, atol)`` over those five;
    ``norm_rel_diff``, ``| ||b|| - ||a|| | / ||a||``; and ``rel_err_from_stats``, the verdict's
    estimate of the relative L2 error: from the two sides' sketches where both have one
    (:func:`sketch_rel_error`; ``sketched`` is the number of sums both know, else 0), else
    the largest of ``norm_rel_diff``, the changes of std and mean relative to A's root mean
    square, and of min and max relative to their own size (at least the root mean square): a
    rough one, which a change that keeps those five numbers escapes. ``rel_l2_err`` itself
    cannot be known from statistics and stays NaN.
    """
    sa, sb = dict(zip(STAT_NAMES, a)), dict(zip(STAT_NAMES, b))
    values = ("min", "max", "mean", "std", "norm")
    rel, ratio, within, equal = 0.0, 0.0, True, True
    for name in values:
        x, y = sa[name], sb[name]
        if math.isnan(x) and math.isnan(y):
            continue
        diff = abs(y - x)
        equal = equal and x == y
        bound = tol.atol + tol.rtol * abs(y)
        within = within and diff <= bound
        ratio = max(ratio, diff / bound if bound > 0 else (math.inf if diff > 0 else 0.0))
        denom = max(abs(x), tol.atol)
        rel = max(rel, diff / denom if denom > 0 else (math.inf if diff > 0 else 0.0))
    norm_a = sa["norm"]
    out = {name: math.nan for name in METRIC_COLUMNS}
    out.update(nan_a=sa["nan"], nan_b=sb["nan"], inf_a=sa["inf"], inf_b=sb["inf"],
               stat_rel_diff=rel, max_tol_ratio=ratio,
               norm_rel_diff=abs(sb["norm"] - norm_a) / norm_a if norm_a else math.nan,
               rms_a=math.hypot(sa["mean"], sa["std"]),
               rel_err_from_stats=_estimate(sa, sb))
    sums = min(sketch_sums(sketch_a), sketch_sums(sketch_b))
    out["sketched"] = float(sums)
    if sums:
        out["rel_err_from_stats"] = sketch_rel_error(sketch_a, sketch_b, norm_a)
        # the same statistics, other sketches: the same values in other places (a transposed
        # weight) are not equal
        equal = equal and tuple(sketch_a[:sums]) == tuple(sketch_b[:sums])
    if (sa["nan"], sa["inf"]) != (sb["nan"], sb["inf"]):
        out["status"] = NAN_MISMATCH
    else:
        out["status"] = EQUAL if equal else CLOSE if within else DIFF
    return out

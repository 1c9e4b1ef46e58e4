"""Streaming error metrics of one tensor pair, accumulated in float64.

The status computed here is the elementwise tolerance rule's (``equal``, ``close``, ``DIFF``,
``nan_mismatch``); :mod:`compare.verdict` then judges every record with the error model.

Definitions (a = reference side A, b = side B; sums over elements finite on both sides):
  max_abs_err   max |b - a|                     mean_abs_err  mean |b - a|
  max_rel_err   max |b - a| / max(|a|, atol)    (guarded near zero; 0/0 = 0, x/0 = inf)
  rel_l2_err    ||b - a|| / ||a||               cosine        <a, b> / (||a|| ||b||)
  scale_err     <a, b - a> / <a, a>: the error along A's values (b = (1 + s) a + noise
                orthogonal to a); a scaled tensor has s, uncorrelated noise ~ rel_l2_err / sqrt(n)
  rmse          sqrt(mean |b - a|^2)          rms_a         sqrt(mean |a|^2), A's scale
  mismatches    elements with |b - a| > atol + rtol |b|, plus non-finite positions that differ
  max_tol_ratio max |b - a| / (atol + rtol |b|): above 1 is outside tolerance (inf if exact)
  sign_flips    elements positive on one side only (what a ReLU or a max decides differs)
  index_count   of an integer tensor, the most times one value occurs in A's (the rows an
                embedding's most repeated id looks up that often); NaN for floating tensors
                and for values below 0 or from MAX_COUNTED on (ids index rows from 0)
  centered_rel_err  ||d_c|| / ||a_c||, each normalization group's mean removed: the error a
                normalization fed this tensor sees (:mod:`compare.centering`; NaN unless asked)
  normalized_rel_err  the error of the normalized values (each group's centered values
                divided by their spread) that the same normalization computes from it
  reordered_rel_err  the error if B's rows (vectors along the last dimension) are A's in
                another order: each side's rows put in the order of their projection on a
                fixed random vector and paired one to one, each with the nearest free row
                of the other side within REORDER_WINDOW places of it in that order (rows
                whose projections differ by less than their rounding land in either order;
                rows left without one pair in order; the window widened 4x while that takes
                a quarter off the error, within REORDER_WORK), ||b' - a'|| / ||a|| (rows
                that match pair; unrelated rows do not; nor do rows one side holds more
                copies of). NaN unless asked for (``row``: a tensor of at least 2 rows of at
                least MIN_ROW elements, whole in one chunk of at most REORDER_ELEMENTS),
                rel_l2_err is at least REORDERED_FROM, both norms agree within NORMS_WITHIN
                and every element is finite
Non-finite elements (NaN, ±Inf) are counted per side and matched by position. Elements both
sides fill with a floating dtype's largest value of one sign (``torch.finfo(dtype).min``, an
attention mask's stand-in for -Inf, in whichever dtype each run computes it) count as
matched infinities do: they are no data, and would swamp the tensor's scale (an error added
to the unmasked entries would read as 1e-41 of it).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Iterable, Optional

import numpy as np

from .centering import Centering
from .precision import BINARY_FORMATS
from .status import CLOSE, DIFF, EQUAL, NAN_MISMATCH
from .tolerance import Tolerance

METRIC_COLUMNS = ("numel", "rms_a", "max_abs_err", "mean_abs_err", "max_rel_err", "rel_l2_err", "cosine",
                  "scale_err", "rmse", "mismatches", "mismatch_frac", "max_tol_ratio", "nan_a", "nan_b",
                  "inf_a", "inf_b", "sign_flips", "index_count", "stat_rel_diff", "norm_rel_diff",
                  "rel_err_from_stats", "sketched", "centered_rel_err", "normalized_rel_err",
                  "reordered_rel_err")
# A tensor this far off element by element, whose norm B keeps, is also compared with its
# rows paired by content (code that orders rows otherwise, e.g. tokens grouped by expert with
# an unstable sort); rows of fewer elements could pair by chance, and larger tensors would
# have to be held whole.
REORDERED_FROM = 0.5
NORMS_WITHIN = 0.1
MIN_ROW = 4
REORDER_ELEMENTS = 1 << 20
# An error this many times smaller with the rows paired: B holds A's rows in another order.
# Pairing also re-pairs rows that carry noise a little better than their own order does,
# hence the wide margin; rows reordered and rounded keep no more than rounding.
REORDERED_MARGIN = 100.0
# Rows paired with the nearest of this many rows either side of them in content order, at
# first; four times as many while that takes a quarter off, up to this many element operations.
REORDER_WINDOW = 8
REORDER_WORK = 1 << 27
ROUNDS = 16  # pairing rounds at most (each a few passes over the candidate pairs)


@functools.lru_cache(maxsize=64)
def row_probe(length: int) -> np.ndarray:
    """The fixed random vector rows of ``length`` elements are projected on to be put in
    content order."""
    return np.random.default_rng(length).standard_normal(length)


def rows_measured(shape: tuple, limit: int = REORDER_ELEMENTS) -> int:
    """Elements per row for ``reordered_rel_err`` of a tensor of ``shape`` read in chunks of
    ``limit`` elements; 0 where it is not measured."""
    n = math.prod(shape)
    row = shape[-1] if len(shape) >= 2 else 0
    return row if row >= MIN_ROW and n >= 2 * row and n <= min(limit, REORDER_ELEMENTS) else 0


def rows_in_content_order(x: np.ndarray, row: int) -> np.ndarray:
    """``x`` (flat) as rows of ``row`` elements in the order of their projection on
    :func:`row_probe`."""
    rows = x.astype(np.float64).reshape(-1, row)
    peak = float(np.abs(rows).max())  # the order does not change with it; overflow does
    return rows[np.argsort((rows / (peak or 1.0)) @ row_probe(row), kind="stable")]


def reordered_rel_err(a: np.ndarray, b: np.ndarray, row: int) -> float:
    """``reordered_rel_err`` of flat ``a`` and ``b`` (finite, the same size, a multiple of
    ``row``, ``a`` not all zero): see the module's definitions."""
    a, b = rows_in_content_order(a, row), rows_in_content_order(b, row)
    best = float(np.einsum("ij,ij->", a - b, a - b))  # in content order: one pairing too
    window = min(REORDER_WINDOW, len(a) - 1)
    while True:  # wider while that helps: many rows may lie within their rounding
        found = _paired_distance(a, b, window)
        helped, best = found <= 0.75 * best, min(best, found)
        wider = min(4 * window, len(a) - 1)
        if not helped or wider == window or (2 * wider + 1) * (
                a.size + ROUNDS * len(a)) > REORDER_WORK:
            break
        window = wider
    return math.sqrt(best) / math.sqrt(float(np.einsum("ij,ij->", a, a)))


def _paired_distance(a: np.ndarray, b: np.ndarray, window: int) -> float:
    """The sum of squared distances of rows ``a`` and ``b`` (each in content order) paired one
    to one: in at most ROUNDS rounds, each row of ``a`` left asks for its nearest free row of
    ``b`` within ``window`` places (the nearer place first among equals: rows that repeat
    pair in place), and each row of ``b`` asked takes the nearest asking; rows left over
    pair in order."""
    n = len(a)
    shifts = np.array(sorted(range(-window, window + 1), key=abs))
    partner = np.arange(n)[:, None] + shifts  # the row of b each candidate pair takes
    inside = (partner >= 0) & (partner < n)
    partner = np.where(inside, partner, 0)
    dist = np.full(partner.shape, np.inf)
    for j, shift in enumerate(shifts):
        lo, hi = max(0, -shift), min(n, n - shift)
        if lo < hi:
            d = a[lo:hi] - b[lo + shift:hi + shift]
            dist[lo:hi, j] = np.einsum("ij,ij->i", d, d)
    paired_a, free_b, total = np.zeros(n, bool), np.ones(n, bool), 0.0
    for _ in range(ROUNDS):
        open_ = np.where(inside & ~paired_a[:, None] & free_b[partner], dist, np.inf)
        choice = open_.argmin(axis=1)
        asking = np.flatnonzero(np.isfinite(open_[np.arange(n), choice]))
        if not asking.size:
            break
        wanted, how_far = partner[asking, choice[asking]], open_[asking, choice[asking]]
        order = np.lexsort((how_far, wanted))  # by row of b, the nearest asking first
        taken = np.ones(order.size, bool)
        taken[1:] = wanted[order][1:] != wanted[order][:-1]
        won = order[taken]
        paired_a[asking[won]], free_b[wanted[won]] = True, False
        total += float(how_far[won].sum())
    d = a[~paired_a] - b[free_b]
    return total + float(np.einsum("ij,ij->", d, d))


# the floating dtypes' largest values: what code fills masks with (finfo(dtype).min)
FILLS = np.array(sorted({sign * form.largest for form in BINARY_FORMATS.values()
                         for sign in (1.0, -1.0)}))
FILLS_FROM = float(np.abs(FILLS).min()) ** 2  # a block whose sum of squares may hold one
MAX_COUNTED = 1 << 21  # index_count counts values below this (8 bytes each at most: 16 MiB)
BLOCK = 1 << 15  # elements per computation block: a block's float64 buffers (5 x 256 KiB) stay
# in a core's L2 cache (2 MiB here) through the ~20 passes over it


def _sums(a: np.ndarray, b: np.ndarray) -> tuple[float, float, float]:
    """``<a, a>``, ``<b, b>``, ``<b, a>``."""
    return _dot(a, a), _dot(b, b), _dot(b, a)


def _fills(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Where both sides hold one of :data:`FILLS`, of the same sign."""
    return np.isin(a, FILLS) & np.isin(b, FILLS) & ((a > 0) == (b > 0))


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` and ``b`` (1-D, contiguous, one dtype) hold the same bits, compared as
    unsigned words of their item size."""
    size = a.dtype.itemsize
    word = np.dtype(f"u{size}") if size in (1, 2, 4, 8) else np.dtype(np.uint8)
    return bool(np.equal(a.view(word), b.view(word)).all())


def _dot(x: np.ndarray, y: np.ndarray) -> float:
    """Re <x, y> in float64. einsum, not BLAS: BLAS threads on small blocks cost more than they
    save (and fight with the prefetch thread and with --jobs processes)."""
    if np.iscomplexobj(x):
        return float(np.einsum("i,i->", np.conj(x), y).real)
    return float(np.einsum("i,i->", x, y))


def _beyond_float64(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether integer arrays hold values float64 cannot represent exactly."""
    limit = 1 << 53
    return any(x.size and (int(x.max()) >= limit or int(x.min()) <= -limit) for x in (a, b))


def _wide_dtype(x: np.ndarray) -> np.dtype:
    return np.dtype(np.complex128 if np.iscomplexobj(x) else np.float64)


class _Workspace:
    """Block buffers reused by every accumulator of the process (one per wide dtype): fresh
    arrays per block would cost a page fault per 4 KiB."""

    _cache: dict = {}

    @classmethod
    def of(cls, dtype: np.dtype) -> "_Workspace":
        ws = cls._cache.get(dtype)
        if ws is None:
            ws = cls._cache[dtype] = cls(dtype)
        return ws

    def __init__(self, dtype: np.dtype):
        self.a = np.empty(BLOCK, dtype)
        self.b = np.empty(BLOCK, dtype)
        self.d = np.empty(BLOCK, dtype)        # b - a
        self.absd = np.empty(BLOCK, np.float64)
        self.tmp = np.empty(BLOCK, np.float64)
        self.mask = np.empty(BLOCK, bool)
        self.mask_b = np.empty(BLOCK, bool)


@dataclass
class ErrorAccumulator:
    """Feed aligned flat chunks of both tensors with :meth:`update`; read :meth:`result`.
    With ``centering``, the centered relative error is accumulated too."""

    tol: Tolerance
    centering: Optional[Centering] = None
    numel: int = 0
    n_finite: int = 0
    max_abs: float = 0.0
    sum_abs: float = 0.0
    max_rel: float = 0.0
    max_tol_ratio: float = 0.0
    ssd: float = 0.0
    ssa: float = 0.0
    ssb: float = 0.0
    dot: float = 0.0
    mismatches: int = 0
    nonfinite_mismatches: int = 0
    sign_flips: int = 0
    all_equal: bool = True
    counts: dict = field(default_factory=lambda: dict(nan_a=0, nan_b=0, inf_a=0, inf_b=0))
    # elements per row where reordered_rel_err is wanted (:func:`rows_measured`), else 0
    row: int = 0
    # both sides, where the tensor is far off element by element (reordered_rel_err)
    whole: Optional[tuple[np.ndarray, np.ndarray]] = None
    # how often each of A's integer values occurs, by value (index_count); None: not counted
    counts_of: Optional[np.ndarray] = field(default_factory=lambda: np.zeros(0, np.int64))

    def update(self, a: np.ndarray, b: np.ndarray) -> None:
        """Add aligned flat chunks ``a`` and ``b`` (any numeric dtypes, same size): the
        whole tensor in one call where ``row`` is given."""
        for start in range(0, a.size, BLOCK):
            self._update_block(a[start:start + BLOCK], b[start:start + BLOCK])
        if a.size != self.numel:  # not the whole tensor after all
            self.whole = None
        elif (self.row and a.dtype.kind == b.dtype.kind == "f"
                and self.n_finite == self.numel
                and self.ssd >= REORDERED_FROM ** 2 * self.ssa > 0
                and abs(math.sqrt(self.ssb) - math.sqrt(self.ssa))
                <= NORMS_WITHIN * math.sqrt(self.ssa)):
            self.whole = (a.copy(), b.copy())

    def _update_block(self, a: np.ndarray, b: np.ndarray) -> None:
        n, offset = a.size, self.numel
        self.numel += n
        if n == 0:
            return
        self._add_values(a, b, offset)
        # values that compare equal may still differ in their bits (-0.0 and 0.0, NaN payloads)
        if self.all_equal and a.dtype == b.dtype and not _same_bits(a, b):
            self.all_equal = False

    def _add_values(self, a: np.ndarray, b: np.ndarray, offset: int) -> None:
        n = a.size
        self._count_values(a)
        if a.dtype.kind in "iu" and b.dtype.kind in "iu" and _beyond_float64(a, b):
            self._add_exact_integers(a, b)
            if self.centering is not None:
                self.centering.forget()
            return
        ws = _Workspace.of(np.result_type(_wide_dtype(a), _wide_dtype(b)))
        wa, wb = ws.a[:n], ws.b[:n]
        np.copyto(wa, a)
        np.copyto(wb, b)
        sums = _sums(wa, wb)
        if not all(map(math.isfinite, sums)):  # a NaN/Inf somewhere (or an overflow): exact path
            wa, wb, sums = self._narrowed(*self._split_nonfinite(wa, wb))
        if (a.dtype.kind == b.dtype.kind == "f" and max(sums[0], sums[1]) >= FILLS_FROM
                and (fills := _fills(wa, wb)).any()):
            wa, wb, sums = self._narrowed(wa[~fills], wb[~fills])
        n = wa.size
        if n == 0:
            return
        with np.errstate(over="ignore"):  # values near float64's limit (masks filled with its
            self._add_finite(wa, wb, ws, n, sums, offset)  # minimum) sum to infinity

    def _count_values(self, a: np.ndarray) -> None:
        """Add A's block to :attr:`counts_of` (given up for floating blocks and for values
        outside ``[0, MAX_COUNTED)``)."""
        if self.counts_of is None:
            return
        if a.dtype.kind not in "iu" or (a.size and not 0 <= a.min() <= a.max() < MAX_COUNTED):
            self.counts_of = None
            return
        found = np.bincount(a.astype(np.int64, copy=False), minlength=len(self.counts_of))
        found[:len(self.counts_of)] += self.counts_of
        self.counts_of = found

    def _narrowed(self, a: np.ndarray, b: np.ndarray) -> tuple:
        """``a``, ``b`` (what is left of a block) and their sums: the centering, which needs
        the whole block, is given up."""
        if self.centering is not None:
            self.centering.forget()
        return a, b, _sums(a, b)

    def _add_exact_integers(self, a: np.ndarray, b: np.ndarray) -> None:
        """Integers float64 cannot hold exactly (beyond 2**53): the differences in Python
        integers, element by element where they differ (2**62 and 2**62 + 1 are not equal)."""
        differ = np.flatnonzero(a != b)
        self.n_finite += a.size
        norms = [float(sum(int(v) ** 2 for v in x.tolist())) for x in (a, b)]
        self.ssa, self.ssb = self.ssa + norms[0], self.ssb + norms[1]
        self.dot += float(sum(int(x) * int(y) for x, y in zip(a.tolist(), b.tolist())))
        if not len(differ):
            return
        self.all_equal = False
        diffs = [abs(int(y) - int(x)) for x, y in zip(a[differ].tolist(), b[differ].tolist())]
        self.max_abs = max(self.max_abs, float(max(diffs)))
        self.sum_abs += float(sum(diffs))
        self.ssd += float(sum(d * d for d in diffs))
        self.mismatches += len(differ)  # integers: exact tolerance
        self.max_tol_ratio = math.inf
        self.max_rel = math.inf if any(int(a[i]) == 0 for i in differ) else max(
            self.max_rel, max(d / abs(int(a[i])) for d, i in zip(diffs, differ)))

    def _split_nonfinite(self, a: np.ndarray, b: np.ndarray):
        """Count NaN/Inf per side and non-finite positions that differ; return the finite rest."""
        nan_a, nan_b = np.isnan(a), np.isnan(b)
        self.counts["nan_a"] += int(np.count_nonzero(nan_a))
        self.counts["nan_b"] += int(np.count_nonzero(nan_b))
        self.counts["inf_a"] += int(np.count_nonzero(np.isinf(a)))
        self.counts["inf_b"] += int(np.count_nonzero(np.isinf(b)))
        finite = np.isfinite(a) & np.isfinite(b)
        same = (nan_a & nan_b) | (~nan_a & ~nan_b & (a == b))
        bad = int(np.count_nonzero(~finite & ~same))
        self.nonfinite_mismatches += bad
        self.mismatches += bad
        return a[finite], b[finite]

    def _add_finite(self, a: np.ndarray, b: np.ndarray, ws: _Workspace, n: int,
                    sums: tuple[float, float, float], offset: int) -> None:
        d, absd, tmp, mask = ws.d[:n], ws.absd[:n], ws.tmp[:n], ws.mask[:n]
        self.n_finite += n
        self.ssa += sums[0]
        self.ssb += sums[1]
        self.dot += sums[2]
        np.subtract(b, a, out=d)
        np.abs(d, out=absd)
        max_abs = float(absd.max())
        if self.centering is not None:
            if np.iscomplexobj(a):
                self.centering.forget()
            else:
                self.centering.add(offset, a, d if max_abs else None)
        if max_abs == 0:
            return  # identical block: nothing else to add
        self.all_equal = False
        self.max_abs = max(self.max_abs, max_abs)
        self.sum_abs += float(absd.sum())
        self.ssd += _dot(absd, absd)
        if not np.iscomplexobj(a):
            np.not_equal(np.greater(a, 0, out=mask), np.greater(b, 0, out=ws.mask_b[:n]),
                         out=mask)
            self.sign_flips += int(np.count_nonzero(mask))
        atol = self.tol.atol
        np.abs(b, out=tmp)                                      # mismatch: |d| > atol + rtol |b|
        np.multiply(tmp, self.tol.rtol, out=tmp)
        np.add(tmp, atol, out=tmp)
        self.mismatches += int(np.count_nonzero(np.greater(absd, tmp, out=mask)))
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.divide(absd, tmp, out=tmp)
        # fmax skips the NaNs of 0/0 (equal elements under an exact tolerance)
        largest = float(np.fmax.reduce(ratio))
        if not math.isnan(largest):
            self.max_tol_ratio = max(self.max_tol_ratio, largest)
        np.abs(a, out=tmp)                                      # relative: |d| / max(|a|, atol)
        np.maximum(tmp, atol, out=tmp)
        if atol > 0 or tmp.all():
            self.max_rel = max(self.max_rel, float(np.divide(absd, tmp, out=tmp).max()))
        else:  # exact dtypes (atol 0): 0/0 counts as 0, x/0 as inf
            zero = tmp == 0
            if np.any(absd[zero] > 0):
                self.max_rel = math.inf
            tmp[zero] = 1.0
            self.max_rel = max(self.max_rel, float(np.divide(absd, tmp, out=tmp).max()))

    def result(self) -> dict:
        """Metric columns (``METRIC_COLUMNS``) and the pair's status."""
        n = self.n_finite
        norm_a, norm_b = math.sqrt(self.ssa), math.sqrt(self.ssb)
        if norm_a == 0:
            rel_l2 = 0.0 if self.ssd == 0 else math.inf
        else:
            rel_l2 = math.sqrt(self.ssd) / norm_a
        if norm_a == 0 or norm_b == 0:
            cosine = 1.0 if norm_a == norm_b else 0.0
        else:
            cosine = self.dot / (norm_a * norm_b)
        scale = 0.0 if self.ssa == 0 else (self.dot - self.ssa) / self.ssa
        centered = normalized = math.nan
        if self.centering is not None:
            centered = self.centering.centered_rel_error(self.ssa, self.ssd)
            normalized = self.centering.normalized_rel_error()
        out = dict(
            stat_rel_diff=math.nan, norm_rel_diff=math.nan, rel_err_from_stats=math.nan,
            sketched=math.nan, centered_rel_err=centered, normalized_rel_err=normalized,
            reordered_rel_err=self._reordered_rel_err(),
            numel=self.numel,
            max_abs_err=self.max_abs,
            mean_abs_err=self.sum_abs / n if n else 0.0,
            max_rel_err=self.max_rel,
            rel_l2_err=rel_l2,
            cosine=cosine,
            scale_err=scale,
            rmse=math.sqrt(self.ssd / n) if n else 0.0,
            rms_a=math.sqrt(self.ssa / n) if n else 0.0,
            mismatches=self.mismatches,
            sign_flips=self.sign_flips,
            index_count=(math.nan if self.counts_of is None or not self.numel
                         else float(self.counts_of.max())),
            mismatch_frac=self.mismatches / self.numel if self.numel else 0.0,
            max_tol_ratio=math.inf if self.nonfinite_mismatches else self.max_tol_ratio,
            **self.counts,
        )
        if self.nonfinite_mismatches:
            status = NAN_MISMATCH
        elif self.all_equal:
            status = EQUAL
        elif self.mismatches == 0:
            status = CLOSE
        else:
            status = DIFF
        out["status"] = status
        return out

    def _reordered_rel_err(self) -> float:
        """``reordered_rel_err`` of the tensor kept in :attr:`whole`; NaN where none is."""
        if self.whole is None:
            return math.nan
        return reordered_rel_err(*self.whole, self.row)


def compare_chunks(pairs: Iterable[tuple[np.ndarray, np.ndarray]], tol: Tolerance) -> dict:
    """Metrics of a tensor pair given as aligned chunk pairs."""
    acc = ErrorAccumulator(tol)
    for a, b in pairs:
        acc.update(a, b)
    return acc.result()

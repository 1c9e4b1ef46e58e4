"""Streaming error metrics of one tensor pair, accumulated in float64.

Definitions (a = reference side A, b = side B; sums over elements finite on both sides):
  max_abs_err   max |b - a|                     mean_abs_err  mean |b - a|
  max_rel_err   max |b - a| / max(|a|, atol)    (guarded near zero; 0/0 = 0, x/0 = inf)
  rel_l2_err    ||b - a|| / ||a||               cosine        <a, b> / (||a|| ||b||)
  rmse          sqrt(mean |b - a|^2)
  mismatches    elements with |b - a| > atol + rtol |b|, plus non-finite positions that differ
Non-finite elements (NaN, ±Inf) are counted per side and matched by position.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from .tolerance import Tolerance

# Row statuses.
EQUAL, CLOSE, DIFF = "equal", "close", "DIFF"
NAN_MISMATCH, SHAPE_MISMATCH = "nan_mismatch", "shape_mismatch"
MISSING_IN_A, MISSING_IN_B = "missing_in_a", "missing_in_b"
STATUSES = (EQUAL, CLOSE, DIFF, NAN_MISMATCH, SHAPE_MISMATCH, MISSING_IN_A, MISSING_IN_B)
PASSING = frozenset({EQUAL, CLOSE})
VALUE_FAILURES = frozenset({DIFF, NAN_MISMATCH, SHAPE_MISMATCH})

METRIC_COLUMNS = ("numel", "max_abs_err", "mean_abs_err", "max_rel_err", "rel_l2_err", "cosine",
                  "rmse", "mismatches", "mismatch_frac", "nan_a", "nan_b", "inf_a", "inf_b")


def _wide(x: np.ndarray) -> np.ndarray:
    return x.astype(np.complex128 if np.iscomplexobj(x) else np.float64, copy=False)


@dataclass
class ErrorAccumulator:
    """Feed aligned flat chunks of both tensors with :meth:`update`; read :meth:`result`."""

    tol: Tolerance
    numel: int = 0
    n_finite: int = 0
    max_abs: float = 0.0
    sum_abs: float = 0.0
    max_rel: float = 0.0
    ssd: float = 0.0
    ssa: float = 0.0
    ssb: float = 0.0
    dot: float = 0.0
    mismatches: int = 0
    nonfinite_mismatches: int = 0
    all_equal: bool = True
    counts: dict = field(default_factory=lambda: dict(nan_a=0, nan_b=0, inf_a=0, inf_b=0))

    def update(self, a: np.ndarray, b: np.ndarray) -> None:
        a, b = _wide(a), _wide(b)
        self.numel += a.size
        nan_a, nan_b = np.isnan(a), np.isnan(b)
        inf_a, inf_b = np.isinf(a), np.isinf(b)
        for key, mask in (("nan_a", nan_a), ("nan_b", nan_b), ("inf_a", inf_a), ("inf_b", inf_b)):
            self.counts[key] += int(np.count_nonzero(mask))
        finite = ~(nan_a | nan_b | inf_a | inf_b)
        if not finite.all():
            same = (nan_a & nan_b) | (~nan_a & ~nan_b & (a == b))
            bad = int(np.count_nonzero(~finite & ~same))
            self.nonfinite_mismatches += bad
            self.mismatches += bad
            a, b = a[finite], b[finite]
        if a.size == 0:
            return
        self.all_equal = self.all_equal and self.nonfinite_mismatches == 0 and bool(np.all(a == b))
        diff = np.abs(b - a)
        abs_a, abs_b = np.abs(a), np.abs(b)
        self.n_finite += a.size
        self.max_abs = max(self.max_abs, float(diff.max()))
        self.sum_abs += float(diff.sum())
        denom = np.maximum(abs_a, self.tol.atol)
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(denom > 0, diff / np.where(denom > 0, denom, 1), np.where(diff > 0, np.inf, 0))
        self.max_rel = max(self.max_rel, float(rel.max()))
        self.ssd += float(np.sum(diff * diff))
        self.ssa += float(np.sum(abs_a * abs_a))
        self.ssb += float(np.sum(abs_b * abs_b))
        self.dot += float(np.sum((a * np.conj(b)).real))
        self.mismatches += int(np.count_nonzero(diff > self.tol.atol + self.tol.rtol * abs_b))

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
        out = dict(
            numel=self.numel,
            max_abs_err=self.max_abs,
            mean_abs_err=self.sum_abs / n if n else 0.0,
            max_rel_err=self.max_rel,
            rel_l2_err=rel_l2,
            cosine=cosine,
            rmse=math.sqrt(self.ssd / n) if n else 0.0,
            mismatches=self.mismatches,
            mismatch_frac=self.mismatches / self.numel if self.numel else 0.0,
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


def compare_chunks(pairs: Iterable[tuple[np.ndarray, np.ndarray]], tol: Tolerance) -> dict:
    """Metrics of a tensor pair given as aligned chunk pairs."""
    acc = ErrorAccumulator(tol)
    for a, b in pairs:
        acc.update(a, b)
    return acc.result()

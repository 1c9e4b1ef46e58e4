"""The verdict: each record's status from an error model of the two runs.

Every compared record has a relative error ``rel_error`` (``||b - a|| / ||a||``; for records
known by their statistics, an estimate from them). Its *input error* is the largest error among
the records it is computed from (:mod:`compare.sources`, earlier in execution order), and its
*added error* is what it carries beyond that, ``sqrt(max(rel_error² - input_error², 0))``.

The *expected* added error of a record is calibrated from the dump (:mod:`compare.calibration`):
what comparable records typically add, at least one rounding of the lower precision involved
at the tensor's scale; none where the same kernels ran on equal dtypes and the dump shows it.

A record is

- ``DIFF`` when ``rel_error > sqrt((gain * input_error)² + (SPREAD * expected)²)``: more than
  its inputs' error, amplified as comparable records amplify theirs (``gain``: calibrated
  between ``GAIN`` and ``EXACT_GAIN``), and its own computation explain (``EXACT_GAIN``
  where no added error is expected, and downstream of a failing record, whose consequences
  are only news when they more than double);
- ``inherited`` when not, but it carries an error from a failing (or inherited) source beyond
  what it would carry from healthy sources;
- ``close`` otherwise, ``equal`` when bit-identical.

With user-given ``rtol``/``atol`` a record within them (every element ``|b - a| <= atol +
rtol |b|``) is ``close``; outside them it is ``inherited`` when a source outside them explains
it, else ``DIFF``. Weights (``param`` records) have no sources in the step: a weight that
differs is ``inherited`` (from earlier steps), explains the error of what it feeds, and the
summary says so. Records with values that were not comparable (missing, dropped, unsupported,
different shapes) keep their status. Records that are the same tensor seen by several modules
(e.g. a container's output and its last child's) are judged once, at the first of them.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import pandas as pd

from . import format as fmt
from . import status as st
from .calibration import EXACT_GAIN, calibrate
from .precision import precision_of, rounding_of
from .sources import STEP_KEY, earlier_sources

# Errors estimated from statistics (min, max: single elements) scatter around the true one by
# a few times: records judged from them get this much more room.
STATS_GAIN = 2.0
SPREAD = 6.0    # how far above the typical added error of comparable records one may go
# Statistics computed by different code (the dumper on the device, the reader from values)
# agree to float64 rounding: estimates below this are no evidence of a difference.
STATS_RESOLUTION = 1e-12
STATS_NOTE = ("; estimated from statistics (a difference that keeps min, max, mean, std and "
              "norm cannot be seen)")


VERDICT_COLUMNS = ("rel_error", "input_rel_error", "added_rel_error", "expected_rel_error",
                   "added_ratio", "source", "same_as", "reason")
_COMPARED = frozenset({st.EQUAL, st.CLOSE, st.DIFF, st.NAN_MISMATCH})


def judge(result: pd.DataFrame, rtol: Optional[float] = None, atol: Optional[float] = None,
          same_kernels: bool = False,
          tf32: tuple[tuple[bool, bool], tuple[bool, bool]] = ((False, False), (False, False))
          ) -> pd.DataFrame:
    """``result`` (rows in execution order) with the verdict columns (``VERDICT_COLUMNS``) and
    each compared record's ``status`` set by the error model (see the module docstring).
    ``same_kernels``: both runs ran the same kernels (:func:`compare.format.same_kernels`), so
    records of equal dtypes may be bit-identical (they are expected to be if the dump shows it
    where their sources are); ``tf32``: per side, whether float32 matmuls, and convolutions,
    may have used TF32 (:func:`compare.format.tf32_allowed`)."""
    frame = result.reset_index(drop=True)
    n = len(frame)
    err = _rel_error(frame)
    stats = frame["rel_l2_err"].isna().to_numpy() & frame["rel_err_from_stats"].notna().to_numpy()
    compared = frame["status"].isin(_COMPARED).to_numpy()
    seq = frame["seq"].to_numpy(np.int64)
    sources = [s[compared[s]] for s in earlier_sources(frame)]
    alias = _alias_groups(frame, err, compared)
    first_of = {g: min(members, key=lambda i: (seq[i], i)) for g, members in alias.items()}
    group_sources = {g: np.setdiff1d(np.concatenate([sources[i] for i in members]), members)
                     for g, members in alias.items()}
    for g, members in alias.items():
        group_sources[g] = group_sources[g][seq[group_sources[g]] < seq[first_of[g]]]
    alias_of = {i: g for g, members in alias.items() for i in members}

    def sources_of(i: int) -> np.ndarray:
        return group_sources[alias_of[i]] if i in alias_of else sources[i]

    err_in = np.array([err[s].max() if len(s) else 0.0 for s in map(sources_of, range(n))])
    with np.errstate(invalid="ignore"):  # inf - inf: a non-finite record, judged apart
        added = np.sqrt(np.clip(np.nan_to_num(err ** 2 - err_in ** 2, nan=0.0), 0.0, None))
    # A discrete record (integers, bool: indices, masks, routing) flips on any error of what it
    # is decided from, and what it selects then differs arbitrarily: no bound on either.
    discrete = np.array([rounding_of(a).unit == 0 and rounding_of(b).unit == 0
                         for a, b in zip(frame["dtype_a"], frame["dtype_b"])])
    # Weights that differ explain any error of what they feed where how much the weights used
    # differ is unknown: they are known by statistics only (a drift can leave min, max, mean,
    # std and norm nearly alone), or looked up by indices (an embedding, routed experts: the
    # rows used may have drifted far more than the whole tensor).
    params = (frame["kind"] == fmt.PARAM).to_numpy()
    drifted = params & (err > 0)
    unbounded = (discrete & (err_in > 0)) | np.array(
        [bool(np.any(discrete[s] & (err[s] > 0)))
         or bool(np.any(drifted[s] & (stats[s] | np.any(discrete[s]))))
         for s in map(sources_of, range(n))])
    has_sources = np.array([len(sources_of(i)) > 0 for i in range(n)])
    repeat = np.array([i in alias_of and first_of[alias_of[i]] != i for i in range(n)])
    expected, expected_label, gain = calibrate(frame, err, err_in, added,
                                               compared & has_sources & ~repeat, same_kernels,
                                               tf32)

    user_tol = rtol is not None or atol is not None
    measured = frame["status"].to_numpy(object)  # what the metrics saw: equal, nan_mismatch...
    mismatches = frame["mismatches"].to_numpy(float)
    dtype_a, dtype_b = frame["dtype_a"].to_numpy(object), frame["dtype_b"].to_numpy(object)
    status = measured.copy()
    healthy = err.copy()         # the error a record would carry from healthy sources
    tainted = np.zeros(n, bool)  # carries an error from a failing or inherited source
    reason = np.full(n, "", object)
    source = np.full(n, "", object)
    same_as = np.full(n, "", object)
    label_of = labels(frame)
    for i in np.lexsort((seq, frame["rank"].fillna(-1), frame["step"], frame["epoch"])):
        if not compared[i]:
            continue
        s = sources_of(i)
        if len(s):
            worst = s[np.argmax(err[s])]
            source[i] = label_of[worst]
        if i in alias_of and first_of[alias_of[i]] != i:
            first = first_of[alias_of[i]]
            same_as[i] = label_of[first]
            tainted[i], healthy[i] = tainted[first] or status[first] in st.FAILING, healthy[first]
            if status[i] != st.EQUAL:
                status[i] = st.INHERITED if tainted[i] else status[first]
                reason[i] = f"the same values as {label_of[first]}" if tainted[i] else ""
            continue
        bad = s[_is_bad(status[s]) | tainted[s]] if len(s) else s
        tainted[i] = len(bad) > 0
        healthy_in = healthy[s].max() if len(s) else 0.0
        # downstream of a failing record, only more than doubling what it carries is news
        g = (EXACT_GAIN if tainted[i] else gain[i]) * (STATS_GAIN if stats[i] else 1.0)
        bound = math.inf if unbounded[i] else math.hypot(g * err_in[i], SPREAD * expected[i])
        envelope = math.hypot(healthy_in, SPREAD * expected[i])
        healthy[i] = min(err[i], envelope)
        nonfinite = measured[i] == st.NAN_MISMATCH
        if measured[i] == st.EQUAL:
            continue
        if params[i]:  # weights come from before the step: not this step's doing
            if user_tol:
                within = mismatches[i] == 0 and not nonfinite
            else:  # the same weights in two dtypes differ by one rounding
                within = err[i] <= rounding_of(precision_of(dtype_a[i], dtype_b[i])).unit
            status[i] = st.CLOSE if within else st.INHERITED
            reason[i] = "" if within else f"weights differ by {err[i]:.3g} before this step"
            continue
        if user_tol:
            within = mismatches[i] == 0 and not nonfinite
            outside_in = bad[mismatches[bad] != 0]
            explains = len(outside_in) and err[i] <= math.hypot(
                gain[i] * err[outside_in].max(), SPREAD * expected[i])
            status[i] = (st.CLOSE if within else st.INHERITED if explains
                         else measured[i])
        elif nonfinite:
            explains = any(measured[j] == st.NAN_MISMATCH or
                           (tainted[j] and not math.isfinite(err[j])) for j in bad)
            status[i] = st.INHERITED if explains else st.NAN_MISMATCH
        elif err[i] > bound:
            status[i] = st.DIFF
        elif tainted[i] and err[i] > envelope:
            status[i] = st.INHERITED
        else:
            status[i] = st.CLOSE
        if status[i] in st.FAILING:
            reason[i] = _why(err[i], err_in[i], added[i], expected[i], expected_label[i],
                             source[i], nonfinite, user_tol) + (STATS_NOTE if stats[i] else "")
        elif status[i] == st.INHERITED:
            worst_bad = bad[np.argmax(err[bad])] if len(bad) else None
            reason[i] = ("" if worst_bad is None else
                         f"carries the error of {label_of[worst_bad]} ({err[worst_bad]:.3g})")
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(expected > 0, added / expected, np.where(added > 0, np.inf, 0.0))
    numbers = {"rel_error": err, "input_rel_error": err_in, "added_rel_error": added,
               "expected_rel_error": expected, "added_ratio": ratio}
    return frame.assign(status=status, source=source, same_as=same_as, reason=reason,
                        **{k: np.where(compared, v, np.nan) for k, v in numbers.items()})


def _is_bad(statuses: np.ndarray) -> np.ndarray:
    return np.isin(statuses, list(st.FAILING | {st.INHERITED}))


def _rel_error(frame: pd.DataFrame) -> np.ndarray:
    """``rel_l2_err`` where values were compared, else the statistics' estimate; non-finite
    mismatches count as infinite error."""
    err = frame["rel_l2_err"].to_numpy(float, copy=True)
    from_stats = np.isnan(err)
    estimate = frame["rel_err_from_stats"].to_numpy(float)
    err[from_stats] = np.where(estimate < STATS_RESOLUTION, 0.0, estimate)[from_stats]
    err[frame["status"].to_numpy() == st.NAN_MISMATCH] = np.inf
    err[frame["status"].to_numpy() == st.EQUAL] = 0.0
    return np.nan_to_num(err, nan=0.0, posinf=np.inf)


def _alias_groups(frame: pd.DataFrame, err: np.ndarray, compared: np.ndarray) -> dict:
    """Rows that are evidently the same tensor seen by several records (same step, size and
    every error figure identical), as ``{group: positions}`` for groups of two or more."""
    candidates = frame[compared & (err > 0) & np.isfinite(err)]
    key = [*STEP_KEY, "numel", "rel_l2_err", "max_abs_err", "mean_abs_err", "stat_rel_diff"]
    members: dict[tuple, list[int]] = {}
    for position, figures in zip(candidates.index, candidates[key].fillna(-1).itertuples(
            index=False, name=None)):
        members.setdefault(figures, []).append(position)
    return dict(enumerate(np.array(rows) for rows in members.values() if len(rows) > 1))


def labels(frame: pd.DataFrame) -> np.ndarray:
    """:func:`compare.format.record_label` of each row."""
    columns = ["module", "cls", "call_idx", "kind", "index", "occurrence"]
    return np.array([fmt.record_label(*r) for r in frame[columns].itertuples(index=False)],
                    dtype=object)


def _why(err: float, err_in: float, added: float, expected: float, label: str, source: str,
         nonfinite: bool, user_tol: bool) -> str:
    if nonfinite:
        return ("NaN/Inf at other places than in A, and none of its sources has that"
                + (f" (largest source: {source})" if source else ""))
    if user_tol:
        return (f"outside the given tolerance, with sources within it (rel error {err:.3g}, "
                f"inputs {err_in:.3g})")
    inputs = f"its inputs carry {err_in:.3g} ({source})" if source else "it has no recorded inputs"
    if expected > 0:
        return (f"added rel error {added:.3g} = {added / expected:.0f}x the {label} "
                f"({expected:.2g}); {inputs}")
    return f"added rel error {added:.3g} where {label[len('none: '):]}; {inputs}"

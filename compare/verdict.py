"""The verdict: each record's status from an error model of the two runs.

Every compared record has a relative error ``rel_error`` (``||b - a|| / ||a||``; for records
known by their statistics, an estimate from them). Its *input error* is the largest error among
the records it is computed from (:mod:`compare.sources`, earlier in execution order), and its
*added error* is what it carries beyond that, ``sqrt(max(rel_error² - input_error², 0))``.

The *expected* added error of a record is calibrated from the dump: the typical (lower-quartile)
added error of comparable records (same direction, kind, module class and the dtypes it was computed in; the
whole direction and dtype pair when fewer than ``MIN_GROUP`` are comparable), at least the
rounding of the lower precision involved at the tensor's scale. Records computed in the same
dtype on both sides by the same kernels (same device type, torch and TF32 settings, on the CPU
or deterministic), or of a dtype pair whose records are mostly bit-identical where their
sources are, expect no added error at all: any difference there is a divergence.

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
from typing import NamedTuple, Optional

import numpy as np
import pandas as pd

from . import format as fmt
from . import status as st
from .sources import STEP_KEY, earlier_sources, parent_calls

# How much a record may amplify the relative error of its sources without being blamed: where
# added errors are calibrated (their typical size includes each kind of record's usual
# amplification), and where none is expected (amplification is all there is to allow for).
GAIN, EXACT_GAIN = 1.1, 2.0
# Errors estimated from statistics (min, max: single elements) scatter around the true one by
# a few times: records judged from them get this much more room.
STATS_GAIN = 2.0
SPREAD = 6.0    # how far above the typical added error of comparable records one may go
MIN_GROUP = 5   # comparable records needed to calibrate a group of its own
TYPICAL_QUANTILE = 0.25  # of the added errors of comparable records: the expected level
EXACT_SHARE = 0.5  # share of bit-identical records (with identical sources) for an exact pair
# Statistics computed by different code (the dumper on the device, the reader from values)
# agree to float64 rounding: estimates below this are no evidence of a difference.
STATS_RESOLUTION = 1e-12
STATS_NOTE = ("; estimated from statistics (a difference that keeps min, max, mean, std and "
              "norm cannot be seen)")


class Rounding(NamedTuple):
    """What one rounding to a floating-point dtype may add: relatively (the unit roundoff) and,
    near zero, absolutely (half the smallest subnormal)."""

    unit: float
    underflow: float


ROUNDING = {
    "float64": Rounding(2.0 ** -53, 2.0 ** -1075), "float32": Rounding(2.0 ** -24, 2.0 ** -150),
    "float16": Rounding(2.0 ** -11, 2.0 ** -25), "bfloat16": Rounding(2.0 ** -8, 2.0 ** -134),
    "float8_e4m3fn": Rounding(2.0 ** -4, 2.0 ** -10), "float8_e4m3fnuz": Rounding(2.0 ** -4, 2.0 ** -11),
    "float8_e5m2": Rounding(2.0 ** -3, 2.0 ** -17), "float8_e5m2fnuz": Rounding(2.0 ** -3, 2.0 ** -18),
    "float8_e8m0fnu": Rounding(1.0, 2.0 ** -128), "float4_e2m1fn_x2": Rounding(2.0 ** -2, 2.0 ** -2),
}
ROUNDING.update({"complex128": ROUNDING["float64"], "complex64": ROUNDING["float32"],
                 "complex32": ROUNDING["float16"],
                 # float32 matmuls and convolutions on CUDA with TF32 allowed: 10-bit mantissas
                 "tensorfloat32": Rounding(2.0 ** -11, 2.0 ** -150)})
# Modules whose float32 computation TF32 may touch: those owning a weight matrix (matmuls) or a
# weight of more dimensions (convolutions; batched experts), and cuDNN's RNNs.
RNN_CLASSES = r"LSTM|GRU|RNN"
EXACT_DTYPE = Rounding(0.0, 0.0)  # integers, bool


VERDICT_COLUMNS = ("rel_error", "input_rel_error", "added_rel_error", "expected_rel_error",
                   "added_ratio", "source", "same_as", "reason")
_COMPARED = frozenset({st.EQUAL, st.CLOSE, st.DIFF, st.NAN_MISMATCH})


def rounding_of(dtype: str) -> Rounding:
    return ROUNDING.get(dtype, EXACT_DTYPE)


def precision_of(dtype_a: str, dtype_b: str) -> str:
    """The lower precision of a pair (the one whose rounding dominates), e.g. ``bfloat16``."""
    return dtype_a if rounding_of(dtype_a).unit >= rounding_of(dtype_b).unit else dtype_b


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
    expected, expected_label, gain = _expected(frame, err, err_in, added,
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
            outside_in = bad[~_within_user(frame, bad)] if len(bad) else bad
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


def _within_user(frame: pd.DataFrame, rows: np.ndarray) -> np.ndarray:
    return (frame["mismatches"].to_numpy()[rows] == 0)


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


EXACT_LABEL = "none: records of these dtypes are bit-identical in this dump"


def _lowest(dtypes) -> str:
    return max(dtypes, key=lambda d: rounding_of(d).unit)


def _weighted(frame: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """Per row, whether its module owns a parameter of 2 dimensions (a matmul's weight; cuDNN
    RNNs count as convolutions) or of more (a convolution's, or batched experts')."""
    params = frame[frame["kind"] == fmt.PARAM]
    dims = params["shape_a"].where(params["shape_a"].notna(), params["shape_b"]).map(
        lambda s: len(s) if isinstance(s, tuple) else 0)
    most = dims.groupby(params["module"]).max()
    ndim = frame["module"].map(most).fillna(0)
    rnn = frame["cls"].fillna("").str.contains(RNN_CLASSES, regex=True)
    return (ndim == 2) & ~rnn, (ndim > 2) | (rnn & (ndim >= 2))


def _computed_in(frame: pd.DataFrame, tf32: tuple[tuple[bool, bool], tuple[bool, bool]]
                 ) -> tuple[pd.Series, pd.Series]:
    """The dtype each record was computed in, per side: its own, or lower where its call
    evidently computes in a lower precision: its children output it (a container of bfloat16
    layers, or of experts whose matmuls it does itself), or, for a gradient, the call output it
    (autocast computes the gradient of a float32 input of a bfloat16 matmul in bfloat16, then
    casts it); a gradient arriving at an output, its consumers' lowest; an input made by its
    parent's own code, the parent's lowest. Where ``tf32`` allows it, float32 matmul and
    convolution modules compute in ``tensorfloat32``."""
    sides = [frame["dtype_a"].fillna(""), frame["dtype_b"].fillna("")]
    frame = frame.assign(rank=frame["rank"].fillna(-1))
    outputs = frame[frame["kind"] == fmt.OUTPUT]
    keys = list(zip(frame["epoch"], frame["step"], frame["rank"], frame["call"]))
    consumers: dict[tuple, list[tuple]] = {}  # call -> the calls its outputs were input to
    for key, kind, producer in zip(keys, frame["kind"], frame["producer"]):
        if kind == fmt.INPUT and producer >= 0:
            consumers.setdefault((*key[:3], producer), []).append(key)
    parents: dict[tuple, Optional[tuple]] = {}
    for (epoch, step, rank), calls in frame.groupby(STEP_KEY):
        for call, parent in parent_calls(calls.drop_duplicates("call")).items():
            parents[(epoch, step, rank, call)] = (
                None if parent is None else (epoch, step, rank, parent))
    matmul, conv = _weighted(frame)
    for side, column in enumerate(("dtype_a", "dtype_b")):
        own = sides[side]
        uses_tf32 = (matmul & tf32[side][0]) | (conv & tf32[side][1])
        own = own.where(~(uses_tf32 & (own == "float32")), "tensorfloat32")
        tf32_calls = {k for k, used in zip(keys, uses_tf32) if used}
        own_out = {}  # lowest output dtype of each call
        for key, out in zip(keys, own.where(frame["kind"] == fmt.OUTPUT, "")):
            if out:
                own_out[key] = _lowest([out] + ([own_out[key]] if key in own_out else []))
        inner: dict[tuple, str] = {}  # lowest output dtype of a call's descendants
        for key in sorted(parents, reverse=True):  # children before their parents
            low = [d for d in (own_out.get(key, ""), inner.get(key, "")) if d]
            up = parents[key]
            if up is not None and low:
                inner[up] = _lowest(low + ([inner[up]] if up in inner else []))
        lowered = []
        for key, kind, producer, dtype in zip(keys, frame["kind"], frame["producer"], own):
            candidates = [dtype, inner.get(key, "")]
            if kind in fmt.BACKWARD_KINDS:
                candidates.append(own_out.get(key, ""))
            if kind == fmt.GRAD_OUTPUT:  # made by its consumers' backward
                candidates += [d for c in consumers.get(key, ()) for d in
                               (own_out.get(c, ""), inner.get(c, ""))]
            if kind == fmt.INPUT and producer < 0 and parents.get(key) is not None:
                candidates.append(inner.get(parents[key], ""))  # the parent's own matmuls too
                if parents[key] in tf32_calls and dtype == "float32":
                    candidates.append("tensorfloat32")
            lowered.append(_lowest([d for d in candidates if d]) if dtype else dtype)
        sides[side] = pd.Series(lowered, frame.index)
    return sides[0], sides[1]


class Expectation(NamedTuple):
    """Per row: the expected added error, what it was calibrated on, and the gain allowed."""

    level: np.ndarray
    label: np.ndarray
    gain: np.ndarray


def _expected(frame: pd.DataFrame, err: np.ndarray, err_in: np.ndarray, added: np.ndarray,
              calibrating: np.ndarray, same_kernels: bool,
              tf32: tuple[tuple[bool, bool], tuple[bool, bool]]) -> Expectation:
    """Calibrate, per group of comparable records, the expected added error (see the module
    docstring) and the gain: how much such records amplify an error they receive (the upper
    quartile of ``rel_error / input_rel_error`` where the input's error dominates, at least 1,
    times ``GAIN``, at most ``EXACT_GAIN``; ``EXACT_GAIN`` where no error is expected)."""
    direction = np.where(frame["kind"].isin(list(fmt.BACKWARD_KINDS)), "backward", "forward")
    dtype_a, dtype_b = _computed_in(frame, tf32)
    pair = dtype_a + "/" + dtype_b
    pool_key = pd.Series(direction, index=frame.index) + " " + pair + " " + frame["kind"]
    group_key = pool_key + " " + frame["cls"].fillna("")
    scale = frame["rms_a"].to_numpy(float)
    out = Expectation(np.zeros(len(frame)), np.full(len(frame), "", object),
                      np.full(len(frame), GAIN))
    added_s = pd.Series(added)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = pd.Series(np.where((err_in > 0) & (added <= err_in), err / err_in, np.nan))
    for _, rows in pair.groupby(pair).groups.items():
        rows = rows.to_numpy()
        low_a, low_b = dtype_a[rows[0]], dtype_b[rows[0]]
        precision = precision_of(low_a, low_b)
        if low_a == low_b and same_kernels and _mostly_exact(err, err_in, rows[calibrating[rows]]):
            out.label[rows], out.gain[rows] = EXACT_LABEL, EXACT_GAIN
            continue
        rounding = rounding_of(precision)  # one rounding, at least, where kernels differ
        with np.errstate(divide="ignore", invalid="ignore"):
            floor = np.hypot(rounding.unit, np.where(
                scale[rows] > 0, rounding.underflow / scale[rows], 0.0))
        for _, prows in pool_key[rows].groupby(pool_key[rows]).groups.items():
            prows = prows.to_numpy()
            pool = added_s[prows[calibrating[prows]]]
            pool = pool[pool > 0]
            pool_level = _typical(pool) if len(pool) >= MIN_GROUP else 0.0
            for _, grows in group_key[prows].groupby(group_key[prows]).groups.items():
                grows = grows.to_numpy()
                members = added_s[grows[calibrating[grows]]]
                members = members[members > 0]
                own = len(members) >= MIN_GROUP
                what = (f"{frame.at[grows[0], 'cls']} {frame.at[grows[0], 'kind']} records"
                        if own else f"{frame.at[grows[0], 'kind']} records")
                out.level[grows] = _typical(members) if own else pool_level
                out.label[grows] = f"typical {precision} added error of {what} in this dump"
                gains = ratio[grows[calibrating[grows]]].dropna()
                if len(gains) >= MIN_GROUP:  # their amplification, with GAIN's margin
                    out.gain[grows] = min(max(float(gains.quantile(0.75)), 1.0) * GAIN,
                                          EXACT_GAIN)
        at_floor = out.level[rows] < floor
        out.level[rows[at_floor]] = floor[at_floor]
        out.label[rows[at_floor]] = f"{precision} rounding at this tensor's scale"
    return out


def _typical(added: pd.Series) -> float:
    """The typical added error of comparable records: their lower quartile. Where one large
    error runs through most of a small model, what its consequences seem to add (its
    amplification fluctuating) contaminates the upper half; the lower quartile still shows the
    records' own rounding, which varies little between healthy records of one kind."""
    return float(added.quantile(TYPICAL_QUANTILE))


def _mostly_exact(err: np.ndarray, err_in: np.ndarray, rows: np.ndarray) -> bool:
    """Whether most records whose sources are bit-identical are bit-identical too."""
    clean = rows[err_in[rows] == 0]
    return len(clean) > 0 and float(np.mean(err[clean] == 0)) >= EXACT_SHARE


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

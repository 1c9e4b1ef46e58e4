"""Calibration: the added error, and the gain, that comparable records of a dump show.

Records are comparable when they have the same direction (forward or backward), kind, maker
(the code that computed them, :func:`compare.sources.makers`: a module's class for what it
computes, the consumers' classes or the parent's own code for a gradient arriving at an output)
and the dtypes they were computed in (:func:`compare.precision.computed_in`). A record's
expected added error is the lower quartile of the added errors of comparable records of other
modules (a shared module's other calls left out; an added error that amplifying its record's
input error, or an output's sources' errors summed, by ``GAIN`` explains only where it is below the
others' typical: :func:`_typical_of_others`; of all records of that kind and dtype pair when,
the record included, fewer than ``MIN_GROUP`` are comparable), each counted in roundings of
the lower precision at its own scale (``hypot(unit, underflow / rms)``, the rms a side held its
values at, loss scale included: where float16 gradients underflow, a tensor of rms 5e-8 rounds
to 60 % of itself, one of 2e-5 to 0.2 %), at least one such rounding. Where both runs ran the
same kernels on equal dtypes and the dump shows bit-identical records where their sources are,
none is expected.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import numpy as np
import pandas as pd

from . import format as fmt
from .precision import (one_rounding, precision_of, rounding_of, stored_scale,
                        underflow_at_scale)
from .sources import STEP_KEY, makers

# How much a record may amplify the relative error of its sources without being blamed: where
# added errors are calibrated (their typical size includes each kind of record's usual
# amplification), and where none is expected (amplification is all there is to allow for).
GAIN, EXACT_GAIN = 1.1, 2.0
MAX_GAIN = 4.0  # the most amplification calibrated for a kind of record
MIN_GROUP = 5   # comparable records, the record included, to calibrate a group of its own
TYPICAL_QUANTILE = 0.25  # of the added errors of comparable records: the expected level
EXACT_SHARE = 0.5  # share of bit-identical records (with identical sources) for an exact pair
EXACT_LABEL = "none: records of these dtypes are bit-identical in this dump"


class Expectation(NamedTuple):
    """Per row: the expected added error, what it was calibrated on, and the gain allowed; the
    ratio of a rounding's relative part to the whole rounding the level is counted in
    (``unit / hypot(unit, underflow)``, 1 where the level is a relative rounding itself), and
    that rounding's underflow at the row's scale (:func:`compare.precision.one_rounding`; 0
    where records are expected bit-identical)."""

    level: np.ndarray
    label: np.ndarray
    gain: np.ndarray
    relative: np.ndarray
    underflow: np.ndarray


def calibrate(frame: pd.DataFrame, err: np.ndarray, err_in: np.ndarray, summed_in: np.ndarray,
              added: np.ndarray, calibrating: np.ndarray, same_kernels: bool,
              computed: tuple[pd.Series, pd.Series]) -> Expectation:
    """Per row, the expected added error of its group of comparable records (see the module
    docstring), and the gain allowed: how much such records amplify an error they receive (the
    upper quartile of ``rel_error / input_rel_error`` where the input's error dominates, at
    least 1, times ``GAIN``, at most ``MAX_GAIN``; at least ``EXACT_GAIN`` where no error is
    expected: amplification is then all there is to allow for). ``summed_in``: at least
    ``err_in``, an output's sources' errors summed (``Evidence.summed_in``: what a product of
    them carries); ``computed``: the dtype each record was computed in, per side
    (:func:`compare.precision.computed_in`)."""
    direction = np.where(frame["kind"].isin(list(fmt.BACKWARD_KINDS)), "backward", "forward")
    dtype_a, dtype_b = computed
    pair = dtype_a + "/" + dtype_b
    pool_key = pd.Series(direction, index=frame.index) + " " + pair + " " + frame["kind"]
    maker = makers(frame)
    module = frame["module"].to_numpy(object)
    group_key = pool_key + " " + maker
    # added errors in roundings at each record's own scale (where they underflow, a float16
    # gradient of 5e-8 rounds to 60 % of itself, one of 2e-5 to 0.2 %): comparable records add
    # alike in those units, not in absolute terms
    stored = {side: stored_scale(frame, side) for side in ("a", "b")}
    rounding, unit, underflow = (np.ones(len(frame)), np.ones(len(frame)),
                                 np.zeros(len(frame)))
    for _, rows in pair.groupby(pair).groups.items():
        rows = rows.to_numpy()
        low = {"a": dtype_a[rows[0]], "b": dtype_b[rows[0]]}
        sides = [(rounding_of(low[side]).underflow, stored[side][rows]) for side in low]
        unit[rows] = rounding_of(precision_of(low["a"], low["b"])).unit
        rounding[rows] = one_rounding(unit[rows], sides)
        underflow[rows] = underflow_at_scale(sides)
    with np.errstate(divide="ignore", invalid="ignore"):
        relative = np.where(rounding > 0, unit / rounding, 1.0)
    out = Expectation(np.zeros(len(frame)), np.full(len(frame), "", object),
                      np.full(len(frame), GAIN), relative, underflow)
    # where amplification by GAIN explains a record's error, its added error only bounds what
    # it adds (ALBERT's GELU passes on a 3 % error planted upstream 1.026 times: it "adds" 0.7 %),
    # and so where its sources' errors summed do: a product of two functions of its input (a
    # fused gated MLP, Mixtral's experts) carries both (twice a 0.1 % planted upstream, which
    # then set the level every float32 output was judged by, 2e-4, and hid the plant)
    with np.errstate(divide="ignore", invalid="ignore"):
        added_s = pd.Series(added / rounding)
    bounded = ~(err > GAIN * summed_in)
    fans = fan_in_out(frame)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = pd.Series(np.where((err_in > 0) & (added <= err_in), err / err_in, np.nan))
    for _, rows in pair.groupby(pair).groups.items():
        rows = rows.to_numpy()
        low_a, low_b = dtype_a[rows[0]], dtype_b[rows[0]]
        precision = precision_of(low_a, low_b)
        exact = low_a == low_b and same_kernels and _mostly_exact(
            err, err_in, rows[calibrating[rows]])
        for _, prows in pool_key[rows].groupby(pool_key[rows]).groups.items():
            prows = prows.to_numpy()
            pool = _members(added_s, prows[calibrating[prows]])
            for _, grows in group_key[prows].groupby(group_key[prows]).groups.items():
                grows = grows.to_numpy()
                gains = ratio[grows[calibrating[grows]]]
                gains = gains[np.isfinite(gains)]
                if len(gains) >= MIN_GROUP:  # their amplification, with GAIN's margin
                    out.gain[grows] = min(max(float(gains.quantile(0.75)), 1.0) * GAIN,
                                          MAX_GAIN)
                members = _members(added_s, grows[calibrating[grows]])
                level, others = _typical_of_others(members, bounded, grows, module)
                own = others >= MIN_GROUP - 1
                if not own.all():  # the kind's records of every maker, for the others
                    pooled, in_pool = _typical_of_others(pool, bounded, grows[~own], module)
                    level[~own] = np.where(in_pool >= MIN_GROUP - 1, pooled, 0.0)
                kind = frame.at[grows[0], "kind"]
                what = {True: f"{kind} records made by {maker[grows[0]]}",
                        False: f"{kind} records"}
                out.level[grows] = rounding[grows] * (0.0 if exact else level)
                out.label[grows] = (EXACT_LABEL if exact else [
                    f"typical {precision} added error of {what[o]} in this dump" for o in own])
        if exact:
            out.gain[rows] = np.maximum(out.gain[rows], EXACT_GAIN)
            out.underflow[rows] = 0.0
            continue
        _at_least_one_rounding(out, rows, rounding[rows], precision)
        _at_least_a_sums_rounding(out, rows, frame, precision)
        _at_least_a_products_rounding(out, rows, frame, precision, fans)
    _a_seed_rounds_once(out, frame)
    return out


def _a_seed_rounds_once(out: Expectation, frame: pd.DataFrame) -> None:
    """The gradient arriving at a scalar output of the model (the root's, path ``""``) that A
    holds at 1 or ``1 / k`` (unscaled: the seed of ``backward()``, or of a loss divided by k
    micro-batches) is what the code that calls ``backward()`` makes of one number, not the
    model's kernels: a rounding of its own dtype at most (a loss gradient 10 % off passed for
    bfloat16 rounding: 0.1 against a typical 0.021). Any other value may depend on the
    forward values (a batch of one's ``2 (y - t)``, which cancels), and keeps its level, as
    a record where none is expected (an exact pair) keeps none."""
    rms = frame["rms_a"].to_numpy(float)
    with np.errstate(divide="ignore", invalid="ignore"):  # (0 and NaN: no k, no seed)
        k = np.round(1.0 / rms)
        seed = (k >= 1) & (rms * k == 1.0)
    seeds = np.flatnonzero(((frame["kind"] == fmt.GRAD_OUTPUT) & (frame["module"] == "")
                            & (frame["numel"] == 1)).to_numpy() & seed)
    for i in seeds:
        precision = precision_of(frame.at[i, "dtype_a"], frame.at[i, "dtype_b"])
        unit = rounding_of(precision).unit
        if out.level[i] > unit:
            out.level[i], out.relative[i], out.underflow[i] = unit, 1.0, 0.0
            out.label[i] = f"{precision} rounding of the gradient a scalar output receives"


def _at_least_a_sums_rounding(out: Expectation, rows: np.ndarray, frame: pd.DataFrame,
                              precision: str) -> None:
    """A parameter's gradient sums its module's incoming gradient over every position (a
    bias's, over the batch and the sequence): a running sum of K terms rounds K times, and
    for terms of one sign its relative error grows as ``sqrt(K / 3)`` roundings of the
    accumulator (float32 for 16-bit dtypes; Higham's estimate for recursive summation), more
    than a matrix product's blocked sums show. K is the positions of the incoming gradient
    whose last dimension is the parameter's first (a Linear's, a normalization's), summed
    over the module's calls; no floor where none is."""
    grads = rows[(frame["kind"].to_numpy(object)[rows] == fmt.PARAM_GRAD)]
    if not len(grads):
        return
    keyed = frame.assign(rank=frame["rank"].fillna(-1))
    incoming = keyed[keyed["kind"] == fmt.GRAD_OUTPUT]
    incoming = incoming.assign(last=incoming["shape_a"].map(
        lambda s: s[-1] if isinstance(s, tuple) and s else -1))
    positions = (incoming["numel"] / incoming["last"].where(incoming["last"] > 0)).rename("k")
    per_output = incoming.assign(k=positions).groupby(
        [*STEP_KEY, "module", "index", "last"])["k"].sum()
    for i in grads:
        row = keyed.iloc[i]
        shape = row["shape_a"] if isinstance(row["shape_a"], tuple) else ()
        if not shape:
            continue
        try:
            sums = per_output.loc[(row["epoch"], row["step"], row["rank"], row["module"])]
        except KeyError:
            continue
        matching = sums[sums.index.get_level_values("last") == shape[0]]
        if matching.empty:
            continue
        k = float(matching.max())
        _at_least(out, i, _sum_rounding(precision, k),
                  f"{precision} rounding of a sum over {k:.0f} positions")


def _at_least_a_products_rounding(out: Expectation, rows: np.ndarray, frame: pd.DataFrame,
                                  precision: str, fans: dict[tuple, tuple[int, int]]) -> None:
    """A module whose weight multiplies its input (a Linear, a convolution: :func:`fan_in_out`)
    sums K products into each element of its output (K its fan-in) and of the gradient it
    sends back for its input (its fan-out); a sum of K terms of either sign rounds to about
    ``sqrt(K / 3)`` roundings of the accumulator at its result's scale, as a parameter's
    gradient does (:func:`_at_least_a_sums_rounding`), whatever order the two runs' kernels
    add in. Only above the records' calibrated level: a module of the largest fan-in in a
    model is no outlier among its smaller peers for the length of its sums. ``fans``:
    :func:`fan_in_out` of ``frame``."""
    kinds = frame["kind"].to_numpy(object)[rows]
    made = rows[((kinds == fmt.OUTPUT) | (kinds == fmt.GRAD_INPUT))
                & (frame["index"].to_numpy()[rows] == 0)]
    if not len(made) or not fans:
        return
    keys = frame.loc[made, [*STEP_KEY, "module", "call_idx"]].assign(
        rank=lambda f: f["rank"].fillna(-1))
    for i, key, kind in zip(made, keys.itertuples(index=False, name=None),
                            frame["kind"].to_numpy(object)[made]):
        fan = fans.get(key)
        if fan is None:
            continue
        k = fan[0] if kind == fmt.OUTPUT else fan[1]
        _at_least(out, i, _sum_rounding(precision, k),
                  f"{precision} rounding of sums of {k} products")


def _sum_rounding(precision: str, k: float) -> float:
    """What a running sum of ``k`` terms computed in ``precision`` rounds, relatively, by
    Higham's estimate: ``sqrt(k / 3)`` units of its accumulator (float32 for 16-bit dtypes)."""
    accumulator = min(rounding_of(precision).unit, rounding_of("float32").unit)
    return accumulator * math.sqrt(max(k, 1.0) / 3.0)


def _at_least(out: Expectation, i: int, floor: float, label: str) -> None:
    """Raise row ``i``'s expected added error to ``floor``, a relative rounding (saying why),
    where it is lower."""
    if out.level[i] < floor:
        out.level[i] = floor
        out.label[i] = label
        out.relative[i] = 1.0


def fan_in_out(frame: pd.DataFrame) -> dict[tuple, tuple[int, int]]:
    """Per call (``STEP_KEY`` with rank -1 for none, module, call_idx) of a module whose first
    parameter multiplies its first input, a floating one (not an Embedding's indices):
    (fan-in, fan-out), the products summed into each element of its output and of its
    input's gradient. Told by shapes, not class names: a
    matrix (out, in) with the input's last dimension ``in`` (a Linear: in, out); a kernel
    (out, in / groups, *window) with the input's channels (dimension 1) a multiple of its
    second dimension (a convolution: in / groups x window, out / groups x window). A
    transposed convolution's kernel (in, out / groups, ...) matches only by chance, where its
    channels agree."""
    keyed = frame.assign(rank=frame["rank"].fillna(-1))
    call = [*STEP_KEY, "module", "call_idx"]
    weights = keyed[(keyed["kind"] == fmt.PARAM) & (keyed["index"] == 0)]
    inputs = keyed[(keyed["kind"] == fmt.INPUT) & (keyed["index"] == 0)  # (not an index)
                   & keyed["dtype_a"].fillna("").str.contains("float")]
    if weights.empty or inputs.empty:
        return {}
    shapes = inputs[call + ["shape_a"]].merge(
        weights[[*STEP_KEY, "module", "shape_a"]].drop_duplicates([*STEP_KEY, "module"]),
        on=[*STEP_KEY, "module"], suffixes=("_x", "_w"))
    fans = {}
    for row in shapes.itertuples(index=False):
        x, w = row.shape_a_x, row.shape_a_w
        if (not (isinstance(x, tuple) and isinstance(w, tuple)) or len(w) < 2 or 0 in w
                or 0 in x):  # (an empty input sums nothing)
            continue
        window = math.prod(w[2:])
        if len(w) == 2 and x and x[-1] == w[1]:
            fans[tuple(getattr(row, c) for c in call)] = (w[1], w[0])
        elif len(w) > 2 and len(x) > 2 and x[1] % w[1] == 0 and w[0] % (x[1] // w[1]) == 0:
            groups = x[1] // w[1]
            fans[tuple(getattr(row, c) for c in call)] = (w[1] * window,
                                                          w[0] // groups * window)
    return fans


def _at_least_one_rounding(out: Expectation, rows: np.ndarray, floor: np.ndarray,
                           precision: str) -> None:
    """Where kernels differ, at least one rounding of the precision may be added (``floor``,
    per row of ``rows``: :func:`compare.precision.one_rounding`)."""
    at_floor = out.level[rows] < floor
    out.level[rows[at_floor]] = floor[at_floor]
    out.label[rows[at_floor]] = f"{precision} rounding at this tensor's scale"


def _typical_of_others(members: pd.Series, bounded: np.ndarray, rows: np.ndarray,
                       module: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``rows``, the typical added error of the ``members`` (indexed by row: the
    positive finite added errors, in roundings) of other modules than the row's, and how many
    members it was taken from (0 and 0 where none tell). A record is judged against the
    others, not against itself (in a group of five, one planted error raised the lower
    quartile it was judged by 6-fold), nor against other calls of its module (``module``: each
    row's path; a layer shared by every depth, as ALBERT's, repeats one computation, and an
    error in it, in each of its calls, set the level it was judged by).

    A member that is ``bounded`` (per row of the frame: amplifying its input's error, or an
    output's sources' errors summed, by ``GAIN`` explains its error) only bounds what its
    record adds: it tells only where it is at most the lower quartile of the others'
    unbounded members (the record adds no more than that, below the typical). A bound above it says nothing (ALBERT's GELU passes on a 0.1 %
    error planted upstream 1.026 times and so "adds" 0.02 %); dropping the low ones too
    raised the level of a T5 value projection's gradient and hid a 10 % error planted in it.
    Where no other module's member is unbounded, none tells.

    The typical is the lower quartile (linear interpolation, as ``Series.quantile``): where
    one large error runs through most of a small model, what its consequences seem to add (its
    amplification fluctuating) contaminates the upper half; the lower quartile still shows the
    records' own rounding, which varies little between healthy records of one kind."""
    values = members.to_numpy(float)
    of = module[members.index.to_numpy()]  # each member's path
    is_bound = bounded[members.index.to_numpy()]
    path = module[rows]
    level, count = np.zeros(len(rows)), np.zeros(len(rows), int)
    own = pd.Series(of, dtype=object).value_counts().reindex(path).fillna(0).to_numpy(int)
    simple = own <= 1  # a module of one member at most: in one pass for every such row
    if simple.any():
        level[simple], count[simple] = _typical_without_one(values, is_bound, of, path[simple])
    for each in pd.unique(path[~simple]):  # a module called several times: a pass per module
        others = of != each
        free = values[others & ~is_bound]
        if not len(free):
            continue
        at = path == each
        told = values[others & (~is_bound | (values <= np.quantile(free, TYPICAL_QUANTILE)))]
        level[at], count[at] = np.quantile(told, TYPICAL_QUANTILE), len(told)
    return level, count


def _typical_without_one(values: np.ndarray, is_bound: np.ndarray, of: np.ndarray,
                         paths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_typical_of_others` for rows (of ``paths``) whose module has one member at most,
    vectorised on the sorted members (``values``, ``is_bound`` and ``of``, each member's
    path): the row's own member, where it has one, is skipped by position."""
    n, free = len(values), np.flatnonzero(~is_bound)
    if not len(free):
        return np.zeros(len(paths)), np.zeros(len(paths), int)
    by_all = np.argsort(values, kind="stable")
    by_free = free[np.argsort(values[free], kind="stable")]
    all_sorted, free_sorted, nf = values[by_all], values[by_free], len(free)
    at_all, at_free = np.empty(n, int), np.full(n, nf)
    at_all[by_all], at_free[by_free] = np.arange(n), np.arange(nf)
    member = pd.Series(np.arange(n), index=of)
    j = member[~member.index.duplicated()].reindex(paths).fillna(-1).to_numpy(int)
    has = j >= 0
    skip_all = np.where(has, at_all[j], n)  # the own member's sorted position (none: past)
    skip_free = np.where(has, at_free[j], nf)
    own_value = np.where(has, values[j], np.inf)
    m_free = nf - (skip_free < nf)

    def skipping(ordered: np.ndarray, skip: np.ndarray, k: np.ndarray) -> np.ndarray:
        return ordered[np.clip(k + (k >= skip), 0, len(ordered) - 1)]

    q = _interpolated(lambda k: skipping(free_sorted, skip_free, k), m_free)
    # the members told, sorted: the others at most q (bounded or not), then the free above it
    at_most = np.searchsorted(all_sorted, q, side="right") - (has & (own_value <= q))
    above = np.searchsorted(free_sorted, q, side="right")
    told = m_free + at_most - (above - ((skip_free < nf) & (own_value <= q)))

    def kth_told(k: np.ndarray) -> np.ndarray:
        past = above + k - at_most
        past = past + ((skip_free >= above) & (past >= skip_free))
        return np.where(k < at_most, skipping(all_sorted, skip_all, k),
                        free_sorted[np.clip(past, 0, nf - 1)])

    level = _interpolated(kth_told, told)
    return np.where(m_free > 0, level, 0.0), np.where(m_free > 0, told, 0)


def _interpolated(kth: Callable[[np.ndarray], np.ndarray], m: np.ndarray) -> np.ndarray:
    """Per row, the ``TYPICAL_QUANTILE`` of ``m`` sorted values whose k-th is ``kth(k)``, by
    linear interpolation as ``np.quantile`` computes it (its rounding too)."""
    position = TYPICAL_QUANTILE * np.maximum(m - 1, 0)
    low = np.floor(position).astype(int)
    t = position - low
    a, b = kth(low), kth(np.minimum(low + 1, np.maximum(m - 1, 0)))
    diff = b - a
    return np.where(t >= 0.5, b - diff * (1 - t), a + diff * t)


def _members(added: pd.Series, rows: np.ndarray) -> pd.Series:
    """The added errors of ``rows`` that can calibrate: positive and finite."""
    values = added[rows]
    return values[(values > 0) & np.isfinite(values)]


def _mostly_exact(err: np.ndarray, err_in: np.ndarray, rows: np.ndarray) -> bool:
    """Whether most records whose sources are bit-identical are bit-identical too."""
    clean = rows[err_in[rows] == 0]
    return len(clean) > 0 and float(np.mean(err[clean] == 0)) >= EXACT_SHARE

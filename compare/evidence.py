"""What each record of a comparison carries, as arrays: its error, its sources, the error
they give it, and what holds without a bound.

The numbers :mod:`compare.verdict` judges by, computed once from the rows before any record is
judged; the rules they follow, and why, are stated in that module's docstring (and in
docs/format.md). Names the verdict uses: :class:`Evidence` (``err``, ``err_in``, ``added``,
``sources``, ``unbounded``, the transit and recomputation figures)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from . import format as fmt
from . import status as st
from .centering import normalizes
from .precision import (cast_rounding, cast_rounding_at_scale, lowest, rounding_of,
                        stored_scale)
from .gains import bias_scales, linear_gains
from .metrics import REORDERED_MARGIN
from .formulas import GATHERS, SETTINGLESS, near_zero_roundings, rounds_operands
from .formulas import ALLOWANCE as RECOMPUTE_MARGIN
from .formulas import allowed as recompute_allowance
from .routing import moved_rows
from .scale import added_scale, scale_noise
from .sources import STEP_KEY, code_values, earlier_sources, loss_inputs, loss_values
from .statistics import STATS_RESOLUTION, sketch_bound
from .sums import CallRows, at_scale, terms_error
from .transit import SUM_OF_RECORDS

# Errors estimated from statistics (min, max: single elements) scatter around the true one by
# a few times: records judged from them get this much more room.
STATS_GAIN = 2.0
# (x - mean) / std: an error d moves x - mean by |d_c| and std by at most as much, relatively
NORMALIZATION_GAIN = 2.0
# its backward, gx = (w / std) (g - mean(g) - x_hat mean(g x_hat)), depends on the input
# through the spread once and through the normalized values twice
BACKWARD_NORMALIZATION_GAIN = 3.0
# A relative error is a norm over the elements that carry it: where few do, what a record
# passes on of its inputs' error is a ratio of a few random numbers. The norm of n independent
# errors spreads by 1/sqrt(2 n) of itself; gains get this many such spreads more room, with n
# the elements the record's error is spread over, at least ||d||² / max|d|².
SAMPLING_SPREADS = 3.0
DECIDING_SHARE = 0.25  # least share of an input a ReLU-like decision passes gradients for
# Weights drift in training along the data (a gradient is an outer product of the data), so the
# error a drift makes in a module's output can exceed the drift's share of the weights: up to
# 2x in 99 %, 12x at most of 121 drifted Linear/Embedding records (5 architectures, 4 steps).
WEIGHT_GAIN = 4.0
# Losses of logits that log-sum-exp them (modules and op records): Evidence._cross_entropy
CROSS_ENTROPIES = frozenset({"CrossEntropyLoss", "NLLLoss", "cross_entropy", "nll_loss"})
# Modules whose output, in (0, 1), scales other values in their parent's code (an SE
# layer's attention, a gate): what the gradient it gets sums may cancel (_summed_over_broadcast)
GATES = frozenset({"Sigmoid", "Hardsigmoid", "Softmax"})
# Error propagation by gains is first-order: inputs off by their own size are other values.
UNRELATED = 1.0


def labels(frame: pd.DataFrame) -> np.ndarray:
    """:func:`compare.format.record_label` of each row."""
    columns = ["module", "cls", "call_idx", "kind", "index", "occurrence"]
    return np.array([fmt.record_label(*r) for r in frame[columns].itertuples(index=False)],
                    dtype=object)


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


def _combined(errors: np.ndarray, weights: np.ndarray) -> float:
    """The error sources give together: the largest of the data's (``~weights``) and the
    largest of the weights', in quadrature."""
    data, drift = errors[~weights], errors[weights]
    return math.hypot(data.max() if len(data) else 0.0, drift.max() if len(drift) else 0.0)


def _summed(errors: np.ndarray, weights: np.ndarray, tensors: np.ndarray) -> float:
    """The error sources give a product of the data (``~weights``): the sum of the data's
    errors, one per tensor (``tensors``: each source's first record of its tensor; the
    largest of its records'), and the largest of the weights', in quadrature."""
    drift = errors[weights]
    data, of = errors[~weights], tensors[~weights]
    order = np.lexsort((-data, of))  # per tensor, its largest first
    largest = np.r_[True, of[order][1:] != of[order][:-1]] if len(of) else np.zeros(0, bool)
    return math.hypot(data[order][largest].sum(), drift.max() if len(drift) else 0.0)


def _summed_over_broadcast(i: int, gradients: np.ndarray, values: np.ndarray,
                           given: np.ndarray, shapes: np.ndarray, rms: np.ndarray) -> float:
    """The error of gradient ``i`` (a ``GATES`` output's) where code's backward sums a product
    of a gradient ``g`` (of ``gradients``) and a forward value ``x`` (of ``values``) of g's
    shape over the positions that ``i``'s shape was broadcast along (an SE layer's
    ``x * attention``): the sum may cancel. An error of relative size ``e`` random over g's
    elements, and unrelated to ``|x|``, gives ``e ||g|| rms(x)`` in the sum (its squares
    add), ``F = ||g|| rms(x) / ||i||`` times ``e`` relatively, and so for an error in ``x``;
    one proportional to g gives ``e`` (``F`` at least 1). The largest ``F (e_g + e_x)`` of
    such pairs, 0 where none is (A's rms)."""
    shape = shapes[i]
    if not isinstance(shape, tuple) or not rms[i] > 0:
        return 0.0
    numel = math.prod(shape)
    out = 0.0
    for j in gradients:
        full = shapes[j]
        if not (isinstance(full, tuple) and math.prod(full) > numel and len(full) >= len(shape)
                and all(n in (1, m) for n, m in zip(shape[::-1], full[::-1]))):
            continue
        norm = rms[j] * math.sqrt(math.prod(full))
        for v in values[[shapes[v] == full for v in values]]:
            gain = max(norm * rms[v] / (rms[i] * math.sqrt(numel)), 1.0)
            if math.isfinite(gain):
                out = max(out, gain * (given[j] + given[v]))
    return out


class Evidence:
    """The rows of one comparison as arrays: errors, sources (records that are the same
    tensor merged), and what holds without a bound."""

    def __init__(self, frame: pd.DataFrame, user_tol: bool,
                 computed: tuple[pd.Series, pd.Series]):
        self.frame, self.n, self.user_tol = frame, len(frame), user_tol
        n = self.n
        self.err = err = _rel_error(frame)
        # B's rows are A's in another order (not weights): judged with the rows paired
        self.elementwise = err.copy()
        paired = frame["reordered_rel_err"].to_numpy(float)
        with np.errstate(invalid="ignore"):
            self.reordered = (REORDERED_MARGIN * paired < err) & ~frame["kind"].isin(
                [fmt.PARAM, fmt.PARAM_GRAD]).to_numpy()
        err[self.reordered] = paired[self.reordered]
        self.from_stats = frame["rel_l2_err"].isna().to_numpy() & \
            frame["rel_err_from_stats"].notna().to_numpy()
        self.measured = frame["status"].to_numpy(object)  # the metrics': equal, nan_mismatch...
        self.compared = np.isin(self.measured, list(st.COMPARED))
        self.seq = frame["seq"].to_numpy(np.int64)
        self.rank = frame["rank"].fillna(-1).to_numpy()
        self.step_key = list(zip(frame["epoch"], frame["step"]))
        # both runs computed in the same dtypes throughout (then weights must agree exactly)
        self.one_precision = bool((frame["dtype_a"] == frame["dtype_b"])[self.compared].all())
        # weights: a call's own, and parameters its code hands on as inputs
        self.params = np.asarray(fmt.holds_weights(frame["kind"], frame["producer"]), bool)
        self.label = labels(frame)
        self.dtypes = list(zip(frame["dtype_a"], frame["dtype_b"]))
        sums = frame["sketched"].fillna(0).to_numpy(float).astype(int)  # of sketches compared
        self.sketched = sums > 0
        # integer records: indices, masks, routing
        self.discrete = np.array([rounding_of(a).unit == 0 and rounding_of(b).unit == 0
                                  for a, b in self.dtypes])
        # integers a call returns, decided from floating values it gets (a router's top-k);
        # where its inputs were not dumped (kinds=), any call's may be
        calls = list(zip(self.step_key, self.rank, frame["call"]))
        kind = frame["kind"].to_numpy(object)
        floating = {c for c, k, d, both in zip(calls, kind, self.discrete, self.compared)
                    if k in (fmt.INPUT, fmt.PARAM) and not d and both}
        inputs = {c for c, k in zip(calls, kind) if k == fmt.INPUT}
        self.decided = self.discrete & (kind == fmt.OUTPUT) & np.array(
            [c in floating or c not in inputs for c in calls])
        self.first = np.arange(n)  # the first record of the same tensor
        self.all_sources = earlier_sources(frame)  # compared or not
        self.moved = moved_rows(frame)
        self.sources = self._merged_sources(frame)
        self.repeat = self.first != np.arange(n)
        self.has_sources = np.array([len(s) > 0 for s in self.sources])
        # a normalization's input gives its call the error of the values it normalizes (a
        # LayerNorm, RMSNorm, BatchNorm: exactly, whatever the group's size), else the error
        # its centered values carry, up to twice: through them and through their spread; its
        # weights weigh the groups unevenly (NORMALIZATION_GAIN)
        forward = (frame["kind"] == fmt.INPUT).to_numpy()  # (a gradient's: its grad_input's)
        normalized = frame["normalized_rel_err"].to_numpy(float)
        exact = normalizes(frame) & np.isfinite(normalized)
        seen = NORMALIZATION_GAIN * np.where(exact, normalized,
                                             frame["centered_rel_err"].to_numpy(float))
        with np.errstate(divide="ignore", invalid="ignore"):
            amplified = np.where(seen > err, seen / err, 1.0)
        amplified[~np.isfinite(amplified)] = 1.0
        # B ran on A's value instead (a localizing re-run): as a source it gives what the cast
        # to B's dtype moves A's value by at B's scale, whatever arrived
        self.replaced = (frame["injected"] == 1).to_numpy()
        cast = cast_rounding_at_scale(frame) * amplified
        # as a source, weights count WEIGHT_GAIN times their error, a bias its error at its
        # scale in the output; estimated from their sketch, times what that estimate may fall
        # short by (sketch_bound of its sums), from statistics alone STATS_GAIN
        data = np.where(np.isnan(seen) | ~forward, err,
                        np.where(exact, seen, np.fmax(err, seen)))
        # five statistics do not see an error random in sign (rounding's: it moves a norm by
        # a 1/sqrt(n) share of itself), so a record estimated from them gives, as a source, at
        # least one rounding to the precision it was computed in (a float32 gradient arriving
        # from bfloat16 matmuls under autocast carries their rounding: precision.computed_in)
        unseen = self.from_stats & ~self.sketched & (self.measured != st.EQUAL)  # (digests)
        if unseen.any():
            units = [side.map({d: rounding_of(d).unit for d in side.unique()}).to_numpy(float)
                     for side in computed]
            data[unseen] = np.fmax(data[unseen], np.fmax(*units)[unseen])
        bias_scale = bias_scales(frame)
        estimated = np.where(self.sketched, [sketch_bound(k) if k else 1.0 for k in sums],
                             STATS_GAIN)
        weight_error = err * np.where(self.from_stats, estimated, 1)
        param_error = weight_error * np.where(np.isnan(bias_scale), WEIGHT_GAIN, bias_scale)
        self.given = np.where(self.replaced, cast, np.where(self.params, param_error, data))
        self.err_in = np.array([self.combined(self.given, s) for s in self.sources])
        # the largest error of the data (not the weights) a record is computed from
        plain = np.where(self.replaced, cast, err)
        self.data_in = np.array([np.nanmax(plain[s[~self.params[s]]], initial=0.0)
                                 for s in self.sources])
        self.err_in = np.fmax.reduce([np.hypot(self.err_in, self._decided(frame)),
                                      self._normalized_backward(frame),
                                      terms_error(frame, self.sources, self.first, self.given),
                                      self._exponentiated(frame),
                                      self._cross_entropy(frame)])
        # an Embedding's output gets what its lookup gives, exactly bounded, not a gain
        self.looked_up = _looked_up(frame, self.all_sources,
                                    np.where(self.replaced, cast, weight_error))
        self.err_in = np.where(np.isnan(self.looked_up), self.err_in, self.looked_up)
        with np.errstate(invalid="ignore"):  # inf - inf: a non-finite record, judged apart
            self.added = np.sqrt(np.clip(err ** 2 - self.err_in ** 2, 0.0, None))
        self.added[np.isnan(self.added)] = np.inf
        # an output that multiplies its sources carries the sum of their errors (a gated
        # MLP's silu(x W) * x V twice its input's): what amplification may explain of it.
        # Only outputs: a gradient through code has its factors' sum in through_code, and
        # summing every value its code uses left Whisper's query gradients calibrated on too
        # few others; integers are no factor, and a lookup has its exact bound
        products = [_summed(self.given[s], self.params[s], self.first[s])
                    if kind == fmt.OUTPUT else 0.0
                    for s, kind in zip((s[~self.discrete[s]] for s in self.sources),
                                       frame["kind"])]
        self.summed_in = np.where(np.isnan(self.looked_up), np.fmax(self.err_in, products),
                                  self.err_in)
        self.through_code = self._through_code(frame)
        self.linear_gain = linear_gains(frame)
        self.scale_added = added_scale(frame, self.sources, self.replaced)
        # a gradient sent back through its parent's own code gets its sources' errors summed
        # with the forward values that code multiplies them by (through_code)
        self.scale_noise = scale_noise(frame, self.sources, err,
                                       np.fmax(self.err_in, self.through_code))
        self.sampling = self._sampling(frame)
        self.weight_status = self._weight_statuses()
        self.unbounded = self._unbounded()  # why there is no bound, "" where there is
        # what B's code between two records of one tensor changed (compare.transit), and what
        # casts may: one rounding to the lowest precision B computes in, relatively, or at the
        # tensor's scale its underflow (code between modules may round through it and back);
        # a sum of k records, one per addition, each at most a unit of its partial sum, which
        # the terms' magnitude bounds, of mean zero and independent: sqrt(k - 1) of them in
        # the norm (Higham and Mary's probabilistic bound; the worst case, k - 1, would let
        # a 3 % error hide in a bfloat16 sum of 9)
        self.transit = frame["transit_rel_diff"].to_numpy(float)
        cast = rounding_of(lowest(frame["dtype_b"][self.compared].unique()) if self.compared.any()
                           else "float64")
        additions = frame["transit_from"].fillna("").map(
            lambda sent: sent.count(SUM_OF_RECORDS)).to_numpy(float)
        with np.errstate(divide="ignore"):
            self.transit_floor = np.sqrt(np.fmax(additions, 1)) * (
                cast.unit + cast.underflow / stored_scale(frame, "b"))
        self.in_transit = self.transit > self.transit_floor  # changed beyond that (NaN: no link)
        # B's value is the sum of other records' values, as in A, within rounding: its error
        # is theirs, summed (cancelling terms amplify it relatively)
        self.summed = (self.transit <= self.transit_floor) & (additions > 0)
        # what B's computation of a call added, recomputed from its records (compare.recompute),
        # and what rounding in the dtype it computes in explains, relatively and near zero
        self.recomputed = frame["recomputed_rel_err"].to_numpy(float)
        # (the lower of the dtype the call computed in and the lowest it was given)
        dtypes = [lowest([c, r]) if r else c for c, r in zip(
            computed[1], frame["recomputed_dtype"].fillna(""))]
        unit, underflow = (np.array([getattr(rounding_of(d), f) for d in dtypes])
                           for f in ("unit", "underflow"))
        with np.errstate(invalid="ignore"):
            terms = frame["recomputed_terms"].to_numpy(float)
            self.recomputed_floor = recompute_allowance(
                unit, frame["recomputed_spread"].to_numpy(float), terms, underflow,
                stored_scale(frame, "b"),
                near_zero_roundings(frame["cls"].fillna("").to_numpy(object), terms),
                rounds_operands(frame["cls"].fillna("").to_numpy(object),
                                frame["kind"].to_numpy(object)),
                frame["recomputed_accumulation"].to_numpy(float))
        # what a recomputation within rounding proves: all of a call with no setting of its
        # own (SETTINGLESS), recomputed on every sample
        self.recomputed_whole = ((frame["recomputed_stride"].to_numpy(float) == 1) & frame[
            "cls"].isin(list(SETTINGLESS)).to_numpy(bool))
        self.miscomputed = self.recomputed > self.recomputed_floor  # NaN: not recomputed
        # what rounding gives, without the margin that keeps a recomputation from accusing
        # a call of rounding: where a call's error is excused as its own rounding, no more
        self.recomputed_rounding = self.recomputed_floor / RECOMPUTE_MARGIN
        # what a call B computed within rounding makes of its operands' relative errors: its
        # result sums terms that are products of them, so errors proportional to the
        # elements (rounding, a cast) reach it as the terms' root sum of squares against the
        # result, the spread, and a random error about so (1 where no term cancels; 27 for a
        # product of centred rows with a near-constant vector)
        self.cancelling = np.where(self.recomputed <= self.recomputed_floor,
                                   frame["recomputed_spread"].to_numpy(float), np.nan)

    def _merged_sources(self, frame: pd.DataFrame) -> list[np.ndarray]:
        sources = [s[self.compared[s]] for s in self._through_one_sided()]
        for members in _same_tensor(frame, self.err, self.compared):
            first = min(members, key=lambda i: (self.seq[i], i))
            merged = np.setdiff1d(np.concatenate([sources[i] for i in members]), members)
            merged = merged[self.seq[merged] < self.seq[first]]
            for i in members:
                self.first[i], sources[i] = first, merged
        return sources

    def _through_one_sided(self) -> list[np.ndarray]:
        """:attr:`all_sources`, where a source only one run recorded (an op of code the other
        run does not run: eager attention's ``softmax`` against a fused kernel) stands for
        what it is computed from, in turn: the record's error is judged against the error
        of the records both runs have that it comes from."""
        one_sided = np.isin(self.measured, list(st.ONE_SIDED))
        out: list[np.ndarray] = []
        for s in self.all_sources:
            lone, found, seen = list(s[one_sided[s]]), [s[~one_sided[s]]], set()
            while lone:
                j = lone.pop()
                if j not in seen:
                    seen.add(j)
                    sources = self.all_sources[j]
                    found.append(sources[~one_sided[sources]])
                    lone.extend(sources[one_sided[sources]])
            out.append(np.unique(np.concatenate(found)).astype(np.int64) if seen else s)
        return out

    def _decided(self, frame: pd.DataFrame) -> np.ndarray:
        """For a grad_input, the error that decisions on its call's inputs may put in it: where
        an input is positive on one side only (a fraction f of it), a ReLU, a max or a clamp
        passes the gradient in one run and not in the other: sqrt(f / active) of it,
        relatively, with ``active`` the share of the input that passes gradients (taken as at
        least a quarter: a ReLU passes about half); none where B ran on A's input (injected),
        whose signs a cast keeps. That error sits in the k flipped elements:
        it gets the room of an error spread over k elements (``_sampling``), a few times
        itself where k is 1 (a TF32 convolution's rounding tipping one element of a ReLU's
        input)."""
        # (an input B replaced with A's value holds what arrived: B ran on A's signs)
        flips = np.where(self.reordered | self.replaced, 0.0,
                         frame["sign_flips"].fillna(0.0).to_numpy(float))
        numel = frame["numel"].to_numpy(float)
        share = np.divide(flips, numel, out=np.zeros(self.n), where=numel > 0)
        inputs = (frame["kind"] == fmt.INPUT).to_numpy()
        out = np.zeros(self.n)
        for i in np.flatnonzero((frame["kind"] == fmt.GRAD_INPUT).to_numpy()):
            s = self.sources[i][inputs[self.sources[i]] & (share[self.sources[i]] > 0)]
            if len(s):
                k = s[np.argmax(share[s])]
                out[i] = math.sqrt(share[k] / DECIDING_SHARE) * (
                    1.0 + SAMPLING_SPREADS / math.sqrt(2.0 * flips[k]))
        return out

    def _sampling(self, frame: pd.DataFrame) -> np.ndarray:
        """Per row, the room a gain gets for the few elements its error may be spread over:
        ``1 + SAMPLING_SPREADS / sqrt(2 n)``, ``n = ||d||² / max|d|²``, the larger of the
        record's and its largest source's (1 where not known)."""
        peak = frame["max_abs_err"].to_numpy(float)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            spread = self.err * frame["rms_a"].to_numpy(float) * np.sqrt(
                frame["numel"].to_numpy(float))
            elements = (spread / peak) ** 2
        # (a record of rows in another order: its element-by-element peak says nothing)
        elements = np.where(np.isfinite(elements) & ~self.reordered, elements, 0.0)
        # an error of the record's own in few elements (a bug in one) gets no more room than
        # the error it receives is spread over
        widest = np.array([max(elements[i], elements[s[np.argmax(self.given[s])]])
                           if len(s) else elements[i] for i, s in enumerate(self.sources)])
        with np.errstate(divide="ignore"):
            room = 1.0 + SAMPLING_SPREADS / np.sqrt(2.0 * widest)
        return np.where(widest >= 1.0, room, 1.0)

    def _normalized_backward(self, frame: pd.DataFrame) -> np.ndarray:
        """For the grad_input and the weight's gradient (index 0, the same as the first input's
        and incoming gradient's) of a call whose input or incoming gradient has a centered
        error (a normalization's, :func:`compare.centering.normalized_sizes`):
        ``NORMALIZATION_GAIN`` times the incoming gradient's and ``BACKWARD_NORMALIZATION_GAIN``
        times the input's (an input B ran on A's value instead gives what ``given`` says), in
        quadrature. Both are projections of the gradient on what centering leaves; the bias's
        gradient, its sum, is not."""
        centered = np.nan_to_num(frame["centered_rel_err"].to_numpy(float), nan=0.0)
        rows = CallRows(frame)
        out = np.zeros(self.n)
        for i in np.flatnonzero(frame["kind"].isin([fmt.GRAD_INPUT, fmt.PARAM_GRAD]).to_numpy()):
            x, gy = rows.of_call(i, fmt.INPUT), rows.of_call(i, fmt.GRAD_OUTPUT)
            from_x = 0.0 if x is None else (
                self.given[x] if self.replaced[x] else BACKWARD_NORMALIZATION_GAIN * centered[x])
            from_gy = 0.0 if gy is None or self.replaced[gy] else \
                NORMALIZATION_GAIN * centered[gy]
            if (x is not None and centered[x]) or (gy is not None and centered[gy]):
                out[i] = math.hypot(from_x, from_gy)
        return out

    def _exponentiated(self, frame: pd.DataFrame) -> np.ndarray:
        """For a gradient the loss gives (:func:`compare.sources.loss_values`: a cross-entropy
        of logits, a softmax), the error its outputs give it through an exponential:
        ``exp(z + d) = exp(z) (1 + d)``, so the outputs' absolute error, ``rel_error *
        rms_a``, is the probabilities' relative error, and so the gradient's (Funnel's
        float32 logits of rms 7.4 carry 4e-7 and give their loss's gradient 1.5e-6). At
        least their relative error: a loss code that does not exponentiate gives that."""
        rms = frame["rms_a"].to_numpy(float)
        out = np.zeros(self.n)
        for i, outputs in enumerate(loss_values(frame)):
            outputs = np.intersect1d(outputs, self.sources[i])
            if len(outputs):
                absolute = self.given[outputs] * np.fmax(rms[outputs], 1.0)
                out[i] = np.fmax.reduce(absolute, initial=0.0)
        return out

    def _cross_entropy(self, frame: pd.DataFrame) -> np.ndarray:
        """For the loss, what its logits' largest error gives it if it is their cross-entropy,
        ``mean_t (logsumexp(z_t) - z_t[y_t])``: a log-sum-exp moves by at most the largest
        change of its arguments, so the loss by at most twice the logits' largest absolute
        change (``max_abs_err``, of records with values), ``2 max|dz| / |L|`` relatively,
        whatever the change's shape (Funnel's float32 logits, 3.6e-7 off from drifted weights
        but 1.6e-5 at most and along the gradient, move their loss of 13.2 by 1.1e-5, 8.2e-7
        of it). The loss: the first output of the root call where it is a scalar (a model
        given labels returns it first; its logits: :func:`compare.sources.loss_inputs`), and
        the scalar output of a call of a cross-entropy (``CROSS_ENTROPIES``: a module, an op
        record), its logits its inputs. A loss summed over tokens, or not a cross-entropy,
        gets what other rules give."""
        scale = np.abs(frame["rms_a"].to_numpy(float))
        largest = frame["max_abs_err"].to_numpy(float)
        numel = frame["numel"].to_numpy(float)
        kind = frame["kind"].to_numpy(object)
        losses = frame["cls"].isin(list(CROSS_ENTROPIES)).to_numpy()
        scalar = (kind == fmt.OUTPUT) & (numel == 1) & (scale > 0)
        first = (frame["index"] == 0).to_numpy()
        out = np.zeros(self.n)
        for i, given in enumerate(loss_inputs(frame)):
            s = self.sources[i]
            if not scalar[i] or not (losses[i] or first[i]):
                continue
            logits = s[(kind[s] == fmt.INPUT) & (numel[s] > 1)] if losses[i] \
                else np.intersect1d(given, s)
            logits = logits[np.isfinite(largest[logits])]
            if len(logits):
                out[i] = 2 * largest[logits].max() / scale[i]
        return out

    def _through_code(self, frame: pd.DataFrame) -> np.ndarray:
        """For a gradient that comes back through its parent's own code (attention, a gate),
        the error of the gradients it is sent back from plus that of the forward values the
        code's backward multiplies them by (:func:`compare.sources.code_values`, of every
        record of the tensor: the probabilities, keys and values of attention): where one
        upstream error reaches every factor of a product, their relative errors add, and the
        forward values all carry the error of the input they were computed from (SegFormer's
        key gradient, float32 against float64: 5.5e-7 where the largest factor's is 2.6e-7).
        The dump does not show which values the code multiplies: where it only adds the
        gradient on (a residual), this allows up to twice the error that passes through.
        Where the gradient is a gate's (``GATES``) and a broadcast product's, summed over
        positions, that sum may cancel (:func:`_summed_over_broadcast`)."""
        out = np.zeros(self.n)
        of_tensor: dict[int, list[np.ndarray]] = {}
        for i, values in enumerate(code_values(frame)):
            of_tensor.setdefault(self.first[i], []).append(values)
        shapes = frame["shape_a"].to_numpy(object)
        rms = frame["rms_a"].to_numpy(float)
        gate = set(self.first[frame["cls"].isin(list(GATES)).to_numpy()])  # (by tensor)
        backward = frame["kind"].isin([fmt.GRAD_OUTPUT, fmt.GRAD_INPUT]).to_numpy()
        for i in range(self.n):
            values = np.intersect1d(np.concatenate(of_tensor[self.first[i]]), self.sources[i])
            gradients = np.setdiff1d(self.sources[i], values)
            if len(values) and len(gradients):
                out[i] = self.combined(self.given, gradients) + self.combined(self.given, values)
                if self.first[i] in gate:
                    factors = values[~self.params[values] & ~self.discrete[values]]
                    out[i] = max(out[i], _summed_over_broadcast(
                        i, gradients[backward[gradients]], factors, self.given, shapes, rms))
        return out

    def combined(self, errors: np.ndarray, rows: np.ndarray) -> float:
        """The error that records ``rows`` (with ``errors``) give together (``_combined``)."""
        return _combined(errors[rows], self.params[rows])

    def within_tolerance(self, i: int) -> bool:
        """Within the user's rtol/atol (the metrics judged every element, or each statistic)."""
        return self.measured[i] in st.PASSING

    def _weight_statuses(self) -> np.ndarray:
        """Weights come from before the step: ``close`` within one rounding (or the given
        tolerance), else ``inherited``."""
        out = self.measured.copy()
        for i in np.flatnonzero(self.params & self.compared & (self.measured != st.EQUAL)):
            within = self.err[i] == 0 or (self.within_tolerance(i) if self.user_tol else
                                          self.err[i] <= cast_rounding(*self.dtypes[i]))
            out[i] = st.CLOSE if within else st.INHERITED
        return out

    def _unbounded(self) -> np.ndarray:
        """Why two dumps cannot bound what each record adds ("" where they can; see the
        module docstring). Weights are looked up by indices where their module's own code
        gets integers: as its inputs (an embedding's token ids) or from its children (a
        router's choice of experts whose weights the parent holds); another module's integers
        (the position ids an attention's projections never see) select nothing of them. An
        ``Embedding``'s lookup has a bound where its ids were counted (:func:`_looked_up`)."""
        # (a call's own weights: a parameter handed on is not looked up by that call's indices)
        drifted = ((self.weight_status == st.INHERITED) & ~self.replaced
                   & (self.frame["kind"] == fmt.PARAM).to_numpy())
        unknown = self.from_stats & ~self.sketched  # how much: five statistics cannot tell
        module = self.frame["module"].to_numpy(object)
        kind = self.frame["kind"].to_numpy(object)
        out = np.full(self.n, "", object)
        for i, s in enumerate(self.sources):
            moved = s[drifted[s]]
            integers = s[self.discrete[s] & ~self.replaced[s]]  # (A's, where B ran on them)
            if self.discrete[i] and self.err_in[i] > 0:
                out[i] = "its integers are decided from inputs with an error"
            elif self.data_in[i] >= UNRELATED:
                out[i] = (f"the data it is computed from is off by {self.data_in[i]:.3g}, its "
                          f"own size or more" if math.isfinite(self.data_in[i]) else
                          "the data it is computed from is off without measure (zero or not "
                          "finite on one side only)")
            elif np.any(self.err[integers] > 0):
                out[i] = "integers it is computed with differ between the runs"
            elif np.any(unknown[moved]):
                out[i] = ("its weights differ by an amount their five statistics cannot "
                          "tell")
            elif np.isnan(self.looked_up[i]) and any(
                    _selects(module[j], kind[j], owner) for owner in set(module[moved])
                    for j in integers):
                out[i] = "drifted weights it gets are looked up by indices"
        return out


def _looked_up(frame: pd.DataFrame, sources: list[np.ndarray], weight_error: np.ndarray
               ) -> np.ndarray:
    """For the output of an ``Embedding`` (:data:`compare.formulas.GATHERS`), the error its
    weights' error (``weight_error``: as far as known, an estimate's shortfall included; where
    B ran on A's weights, what the cast moves them by) gives it through the lookup, ``sqrt(c)
    · e_W · ||W|| / ||y||``: ``y = W[x]`` holds row ``r`` as often as ``x`` names it, ``c_r``
    times, so ``||dy||² = Σ_r c_r ||dW_r||² <= c ||dW||²``, with ``c`` the most times one id
    occurs (``index_count`` of its input; loose where that id is a padding row, which does not
    train, and where training moved rows it does not look up). NaN for other rows, and where
    the count or the weights (among its ``sources``: the module's, recorded at any of its
    calls) are not known."""
    rms = frame["rms_a"].to_numpy(float)
    numel = frame["numel"].to_numpy(float)
    count = frame["index_count"].to_numpy(float)
    weight = ((frame["kind"] == fmt.PARAM) & (frame["index"] == 0)).to_numpy()
    rows = CallRows(frame)
    out = np.full(len(frame), np.nan)
    for i in np.flatnonzero((frame["cls"].isin(GATHERS) & (frame["kind"] == fmt.OUTPUT)
                             & (frame["index"] == 0)).to_numpy()):
        x, w = rows.of_call(i, fmt.INPUT), sources[i][weight[sources[i]]]
        if x is not None and len(w) and rms[i] > 0:
            out[i] = math.sqrt(count[x]) * weight_error[w[0]] * at_scale(rms, numel, w[0], i)
    return out


def _selects(module: str, kind: str, owner: str) -> bool:
    """Whether an integer record (of ``module``, ``kind``) is one the code of ``owner`` gets:
    its input, or a child's output."""
    if kind == fmt.INPUT:
        return module == owner
    return kind == fmt.OUTPUT and module != owner and fmt.contains(owner, module)


def _same_tensor(frame: pd.DataFrame, err: np.ndarray, compared: np.ndarray) -> list[np.ndarray]:
    """Groups of two or more rows that are evidently one tensor seen by several records (same
    step, size and every error figure identical)."""
    candidates = frame[compared & (err > 0) & np.isfinite(err)]
    key = [*STEP_KEY, "numel", "rel_l2_err", "max_abs_err", "mean_abs_err", "stat_rel_diff"]
    members: dict[tuple, list[int]] = {}
    for position, figures in zip(candidates.index, candidates[key].fillna(-1).itertuples(
            index=False, name=None)):
        members.setdefault(figures, []).append(position)
    return [np.array(rows) for rows in members.values() if len(rows) > 1]

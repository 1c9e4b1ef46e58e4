"""The verdict: each record's status from an error model of the two runs.

Every compared record has a relative error ``rel_error`` (``||b - a|| / ||a||``; for records
known by their statistics, an estimate from them; where B holds A's rows in another order,
``reordered_rel_err`` at least ``REORDERED_MARGIN`` times smaller, that one: code that orders
rows otherwise, e.g. tokens grouped by expert with an unstable sort, is no error until a
consumer's result differs, and the reason says so; never for weights). Its *input error*
(computed, with the other figures below, by :mod:`compare.evidence`, which defines
``WEIGHT_GAIN``, ``STATS_GAIN``, ``SAMPLING_SPREADS`` and ``UNRELATED``) combines the errors
of the records it is computed from (:mod:`compare.sources`, earlier in execution order): the largest
of the data it receives and ``WEIGHT_GAIN`` times the largest of its weights (a bias: its
error at its scale in the output, :func:`compare.gains.bias_scales`), in quadrature
(independent errors: weights drifted in earlier steps, data in this one; several sources of
data often carry one upstream error, which counts once), and for a gradient sent back, what
decisions on its call's inputs explain (``sqrt`` of four times the share of an input positive
on one side only: a ReLU passes those gradients in one run only); for a gradient that comes
back through a parent's own code (attention, a gate), the gradients' error plus that of the
forward values the code multiplies them by (one upstream error reaches every factor of a
product, and the factors' relative errors add: the queries, keys and values of attention all
carry the error of the input they were computed from, in a healthy pair too). A
normalization's input counts with the error of the values it normalizes (a LayerNorm, RMSNorm
or BatchNorm fed it alone), else with its error after centering, as its incoming gradient
does (:mod:`compare.centering`);
a sum that cancels, with its terms' absolute errors, and an input code between modules
computes, with the absolute errors of the outputs it alone took (:mod:`compare.sums`);
the loss, with twice its logits' largest absolute error over its scale (a cross-entropy moves
by no more), and a gradient the loss gives, with its logits' absolute error (it exponentiates
them: :meth:`compare.evidence.Evidence._cross_entropy`, ``_exponentiated``). Its *added error*
is what it carries beyond that, ``sqrt(max(rel_error² - input_error², 0))``.

The *expected* added error of a record is calibrated from the dump (:mod:`compare.calibration`):
what comparable records typically add, at least one rounding of the lower precision involved
at the tensor's scale; none where the same kernels ran on equal dtypes and the dump shows it.

A record is

- ``DIFF`` when ``rel_error > sqrt((gain * input_error)² + (SPREAD * expected)²)``: more than
  its inputs' error, amplified as comparable records amplify theirs (``gain``: calibrated
  between ``GAIN`` and ``MAX_GAIN``, or what the call's weight matrix or its own forward pass
  shows, :mod:`compare.gains`, or, of a call B computed within rounding, the spread of the
  terms it sums (how far cancelling terms amplify errors of its operands' elements), if
  more; at least ``EXACT_GAIN`` where no added error is
  expected, and downstream of a failing record, whose consequences are only news when they
  more than double; ``STATS_GAIN`` times more for records judged from statistics; with room
  for errors spread over few elements, ``SAMPLING_SPREADS``);
  also where B changed a tensor that A hands on unchanged between two records by more than
  rounding through B's lowest precision may (:mod:`compare.transit`: an error between
  modules, found exactly); and where B's own computation of a call, recomputed from its
  records (:mod:`compare.recompute`: a ``Linear``, a convolution, an elementwise
  activation, a normalization, an ``Embedding``, an op of two tensors), is off by more than
  rounding in the dtype it computed in explains (a bound, not a typical figure: a call
  recomputed within it is still judged by the rule above, what could hide in it is at most
  that bound, and, where it passes, what it adds at most its recomputed error, measured;
  where that error is within what rounding gives, without the margin, the rule's own error
  is at least it, which may be far more than comparable records add where the terms a call
  sums cancel, as in a normalization's backward: :meth:`_Judgement._own_rounding`; and where
  its recomputed error is at most half its error, the rest is its inputs' error through the
  call, however far beyond the gain: :meth:`_Judgement._amplified`);
- ``inherited`` when not, but it carries an error from a failing (or inherited) source beyond
  what it would carry from healthy sources;
- ``close`` otherwise, ``equal`` when bit-identical.

Without a bound: integer records (indices, masks, routing) decided from inputs with any error,
or returned by a call that gets floating values and rounds (some error is expected of it: a
router's top-k of logits it computes in bfloat16, where a near-tie flips with any rounding,
even on injected inputs), and what such records select (unless B ran on A's, injected);
what differing weights feed where
how much the weights used differ is unknown (weights known by their five statistics but no
sketch, as in format version 1 dumps, or looked up by indices: a module's weights where its
own code gets integers, as its inputs or from its children, but for an ``Embedding`` whose
ids were counted: :func:`compare.evidence._looked_up`); and what is computed from data
(not weights) off by ``UNRELATED`` of its size or more (B's inputs are no longer A's with an
error, so no gain bounds what code makes of them: a loss from logits 118 % off, after runs
diverged). Weights known by their sketch count with what its estimate may fall short by
(:func:`compare.statistics.sketch_bound` of its sums), by five statistics alone ``STATS_GAIN``
times their estimate.

With user-given ``rtol``/``atol`` a record within them (every element ``|b - a| <= atol +
rtol |b|``, or, known by statistics, each statistic) is ``close``; outside them it is
``inherited`` when a source outside them explains it, else ``DIFF``. Weights (``param``
records) have no sources in the step: a weight that differs (in two dtypes: by more than one
rounding; or beyond the given tolerance) is ``inherited`` (from earlier steps) and the summary
says so; but ``DIFF`` at a run's first step (``FIRST_STEP``: no step before it changed the
weights) and where both runs compute bit-identically. Records with
values that were not comparable (missing, dropped, unsupported, different shapes) keep their
status, except records whose shapes differ where their rows moved between calls, none lost
(:mod:`compare.routing`), after a selection that differs (an integer source with an error, e.g.
the tokens routed to an expert, or a source whose shape differs so): ``inherited``. Records
that are the same tensor seen by several modules (e.g. a container's output and its last
child's) are judged once, at the first of them; the others repeat its judgement.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import pandas as pd

from . import format as fmt
from . import status as st
from .calibration import EXACT_GAIN, EXACT_LABEL, GAIN, Expectation, calibrate
from .evidence import STATS_GAIN, Evidence
from .formulas import UNWEIGHTED
from .gains import adjoint_gains
from .precision import computed_in, precision_of, rounding_of
from .scale import describe as describe_scale
from .transit import SUM_OF_RECORDS

SPREAD = 6.0    # how far above the typical added error of comparable records one may go
# values of rms one subnormal spacing or more (half a spacing over the rms at most) round to
# nearest on that grid without bias in their scale
SMOOTH_UNDERFLOW = 0.5
LAST_BITS = 4.0  # units of rounding that differ in the last bits where no error is expected
LINEAR_MARGIN = 1.3  # the random-error gain of a weight matrix is met within 15 % (tuning set)
STATS_NOTE = ("; estimated from statistics (a difference that keeps min, max, mean, std and "
              "norm cannot be seen)")

WRONG_WEIGHTS = "the runs did not start from the same weights, or diverged at an earlier step"
FIRST_STEP = (0, 0)  # (epoch, step) of a run's first step: no step before it moved the weights
IN_TRANSIT = "B changed its values by"  # how the reason of a record changed in transit begins
MISCOMPUTED = "B's values differ by"  # how the reason of a call B computed wrongly begins
USER_TOLERANCE = "user_tolerance"  # attribute of a judged result: judged by the user's rtol/atol
VERDICT_COLUMNS = ("rel_error", "input_rel_error", "added_rel_error", "expected_rel_error",
                   "added_ratio", "hidden_rel_error", "recomputed_allowance", "unbounded",
                   "source", "same_as", "reason")


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
    computed = computed_in(frame, tf32)
    records = Evidence(frame, user_tol=rtol is not None or atol is not None,
                       computed=computed)
    expected = calibrate(frame, records.err, records.err_in, records.summed_in, records.added,
                         records.compared & records.has_sources & ~records.repeat,
                         same_kernels, computed)
    judgement = _Judgement(records, expected)
    for i in np.lexsort((records.seq, frame["rank"].fillna(-1), frame["step"], frame["epoch"])):
        if records.compared[i]:
            judgement.judge(i)
        elif records.measured[i] == st.SHAPE_MISMATCH:
            judgement.reshaped(i)
    return judgement.result()


def _before(rank_step: tuple, steps: set[tuple]) -> bool:
    """Whether ``steps`` (of (rank, (epoch, step))) hold an earlier step of the same rank."""
    return any(k[0] == rank_step[0] and k[1] < rank_step[1] for k in steps)


class _Judgement:
    """Statuses and reasons, decided record by record in execution order (a record's sources
    are judged before it)."""

    def __init__(self, records: Evidence, expected: Expectation):
        self.r, self.expected = records, expected
        n = records.n
        self.adjoint_gain = adjoint_gains(records.frame, records.err, expected.level,
                                          records.weight_status == st.INHERITED)
        self.status = records.weight_status.copy()
        self.healthy = records.err.copy()  # the error a record would carry from healthy sources
        self.tainted = np.zeros(n, bool)     # carries an error from a failing or inherited source
        # reasons given with the rows (a side's replicas that differ) stand
        self.reason = (records.frame["reason"].fillna("").to_numpy(object, copy=True)
                       if "reason" in records.frame else np.full(n, "", object))
        self.failed: set[tuple] = set()  # (rank, (epoch, step)) with a failing record
        self.differed: set[tuple] = set()  # (rank, (epoch, step)) with a record not equal
        self.err_in, self.added = records.err_in.copy(), records.added.copy()
        self.hidden = np.zeros(n)  # the added error that inputs' error could hide
        self.unbounded = np.full(n, "", object)  # why no bound holds what it adds (where no
        # link or recomputation bounds it either: result() keeps it where hidden is infinite)
        self.source = np.full(n, "", object)
        self.same_as = np.full(n, "", object)

    def judge(self, i: int) -> None:
        r, s = self.r, self.r.sources[i]
        if len(s):
            self.source[i] = r.label[s[np.argmax(r.err[s])]]
        if r.repeat[i]:
            self._repeat(i, r.first[i])
            return
        carrying = s[(np.isin(self.status[s], list(st.CARRYING)) | self.tainted[s])
                     & ~r.replaced[s]]
        self.tainted[i] = len(carrying) > 0
        if r.through_code[i] > self.err_in[i]:
            # one upstream error in every factor of the parent's code's product; calibration
            # keeps the largest, so the typical added error of such records holds some of
            # this sum too, counted twice: conservative (calibrated on the sum, Whisper's
            # healthy float64/float32 pair fails at its query's gradient)
            self.err_in[i] = r.through_code[i]
            self.added[i] = math.sqrt(max(r.err[i] ** 2 - self.err_in[i] ** 2, 0.0))
        level = SPREAD * self.expected.level[i]
        envelope = math.hypot(r.combined(self.healthy, s), level)
        self.healthy[i] = r.given[i] if r.replaced[i] else min(r.err[i], envelope)
        if r.measured[i] == st.EQUAL:
            return
        rank_step = (self.r.rank[i], self.r.step_key[i])
        self.differed.add(rank_step)
        if r.params[i]:
            if self.status[i] != st.INHERITED:
                return
            if _before(rank_step, self.failed):  # a divergence found earlier explains it
                self.reason[i] = (f"weights differ by {r.err[i]:.3g}: the divergence of an "
                                  f"earlier step changed them")
            elif _before(rank_step, self.differed):  # so may what the runs' rounding did
                self.reason[i] = (f"weights differ by {r.err[i]:.3g}: the differences an "
                                  f"earlier step's records show changed them")
            elif (r.one_precision and self.expected.label[i] == EXACT_LABEL
                    and not r.replaced[i]):
                self.status[i] = st.DIFF
                self.reason[i] = (f"weights differ by {r.err[i]:.3g} where both runs compute "
                                  f"bit-identically: {WRONG_WEIGHTS}")
            elif rank_step[1] == FIRST_STEP and not r.replaced[i]:
                self.status[i] = st.DIFF
                self.reason[i] = (f"weights differ by {r.err[i]:.3g} at the first step, more "
                                  f"than a cast between the runs' dtypes moves them: the runs "
                                  f"did not start from the same weights")
            else:
                self.reason[i] = f"weights differ by {r.err[i]:.3g} before this step"
            return
        self.status[i] = self._status(i, carrying, envelope, level)
        if self.status[i] in st.FAILING:
            self.failed.add((r.rank[i], r.step_key[i]))
            self.reason[i] = self._why(i) + (STATS_NOTE if r.from_stats[i] else "")
        elif self.status[i] == st.INHERITED and len(carrying):
            worst = carrying[np.argmax(r.err[carrying])]
            self.reason[i] = f"carries the error of {r.label[worst]} ({r.err[worst]:.3g})"
        if r.reordered[i] and not r.user_tol:
            self.reason[i] = "; ".join(filter(None, [self.reason[i], (
                f"B holds A's rows in another order (rel error {r.elementwise[i]:.3g} element "
                f"by element, {r.err[i]:.3g} with the rows paired by content): judged so; its "
                f"consumers show whether the order matters")]))

    def reshaped(self, i: int) -> None:
        """A record whose shapes differ is ``inherited`` where its rows moved between calls
        (:mod:`compare.routing`) and a selection that differs between the runs explains it: an
        integer source with an error (routing's indices, a top-k: an expert's tokens), or a
        source whose shape differs so."""
        r = self.r
        if not r.moved[i]:
            return
        causes = [j for j in r.all_sources[i]
                  if (r.compared[j] and r.discrete[j] and r.err[j] > 0 and not r.replaced[j])
                  or (r.measured[j] == st.SHAPE_MISMATCH and self.status[j] == st.INHERITED)]
        if causes:
            self.status[i], self.source[i] = st.INHERITED, r.label[causes[0]]
            shape_a, shape_b = r.frame.at[i, "shape_a"], r.frame.at[i, "shape_b"]
            self.reason[i] = (f"its shape follows a selection that differs between the runs "
                              f"({r.label[causes[0]]}): {shape_a} in A, {shape_b} in B, rows "
                              f"moved between calls, none lost")

    def _repeat(self, i: int, first: int) -> None:
        """The same tensor as ``first``, judged already: the same judgement, but an error
        found there is only carried here."""
        self.same_as[i] = self.r.label[first]
        self.tainted[i] = self.tainted[first] or self.status[first] in st.FAILING
        self.healthy[i] = self.healthy[first]
        self.hidden[i] = self.hidden[first]
        self.unbounded[i] = self.unbounded[first]
        if self.r.measured[i] == st.EQUAL:
            return
        carried = self.status[first] in st.CARRYING
        self.status[i] = st.INHERITED if carried else self.status[first]
        self.reason[i] = f"the same values as {self.r.label[first]}" if carried else ""

    def _status(self, i: int, carrying: np.ndarray, envelope: float, level: float) -> str:
        r = self.r
        if r.user_tol:
            outside = carrying[~np.isin(self.status[carrying], list(st.PASSING))]
            explains = len(outside) and r.err[i] <= math.hypot(
                self.gain(i) * r.combined(r.err, outside), level)
            return (st.CLOSE if r.within_tolerance(i) else st.INHERITED if explains
                    else r.measured[i])
        if r.measured[i] == st.NAN_MISMATCH:
            explains = any(r.measured[j] == st.NAN_MISMATCH or not math.isfinite(r.err[j])
                           for j in carrying)
            return st.INHERITED if explains else st.NAN_MISMATCH
        self.unbounded[i] = self._unbounded(i, level)
        bound = math.inf if self.unbounded[i] else math.hypot(
            self._judged_gain(i) * self.err_in[i], level, self._last_bit(i))
        # an error up to this size, added here, passes for its inputs' error amplified, but
        # where what it adds is the change since a record of the same tensor, measured
        self.hidden[i] = math.sqrt(max(bound ** 2 - level ** 2 - self._last_bit(i) ** 2, 0.0))
        if r.in_transit[i]:  # what it adds is that change, at least
            self.added[i] = max(self.added[i], r.transit[i])
            return st.DIFF
        if r.miscomputed[i]:  # what it adds is what B's computation of it added
            self.added[i] = max(self.added[i], r.recomputed[i])
            return st.DIFF
        if r.transit[i] <= r.transit_floor[i]:
            self.hidden[i] = min(self.hidden[i], r.transit_floor[i])
        settled = r.recomputed[i] <= r.recomputed_floor[i]  # B computed it as A's code does
        if settled:
            self.hidden[i] = min(self.hidden[i], r.recomputed_floor[i])
        if r.summed[i] and (r.err[i] > bound or self._scale_moves(i, level)):
            self.added[i] = r.transit[i]
            self.reason[i] = (f"its terms' error, summed ({r.frame.at[i, 'transit_from']}), "
                              f"which B adds within rounding ({r.transit[i]:.3g})")
        elif self._scale_moves(i, level):
            return st.DIFF
        elif r.err[i] > bound:
            if self._amplified(i):
                self.reason[i] = (f"its inputs' error ({self.err_in[i]:.3g}) amplified by its "
                                  f"call, which B computed within rounding (recomputed "
                                  f"{r.recomputed[i]:.3g} from its own records)")
            elif self._own_rounding(i, bound, level):
                self.reason[i] = (f"its own computation's rounding, where the terms it sums "
                                  f"cancel (recomputed {r.recomputed[i]:.3g} from its own "
                                  f"records, within the {r.recomputed_rounding[i]:.3g} that "
                                  f"rounding gives), and its inputs' error "
                                  f"({self.err_in[i]:.3g})")
            else:
                return st.DIFF
            # what it adds is what it was recomputed to add
            self.added[i] = self.hidden[i] = r.recomputed[i]
        elif settled:  # what it adds itself, measured: the rest of a first-order estimate
            self.added[i] = min(self.added[i], r.recomputed[i])  # is its inputs' error
        return st.INHERITED if self.tainted[i] and r.err[i] > envelope else st.CLOSE

    def gain(self, i: int) -> float:
        """The calibrated gain, or what the module's weight matrix gives a random error, with
        ``LINEAR_MARGIN``, or what its forward pass shows its backward gives one, with a
        calibrated gain's margin (:mod:`compare.gains`), or, of a call B computed within
        rounding, the spread of the terms it sums (``Evidence.cancelling``), if any is more;
        with the room for an error spread over few elements (``Evidence._sampling``)."""
        linear, adjoint = self.r.linear_gain[i], self.adjoint_gain[i]
        cancelling = self.r.cancelling[i]
        return self.r.sampling[i] * max(self.expected.gain[i],
                                        LINEAR_MARGIN * linear if math.isfinite(linear) else 0.0,
                                        GAIN * adjoint if math.isfinite(adjoint) else 0.0,
                                        cancelling if math.isfinite(cancelling) else 0.0)

    def _unbounded(self, i: int, level: float) -> str:
        """Why no bound holds what it adds ("" where one does; the module docstring): what
        :attr:`Evidence.unbounded` says, and an integer a call decides while it rounds
        (where some error is expected)."""
        if self.r.unbounded[i] or not (self.r.decided[i] and level > 0):
            return self.r.unbounded[i]
        return "its call decides its integers from values it rounds, where a near-tie flips"

    def _judged_gain(self, i: int) -> float:
        """``gain``, at least ``EXACT_GAIN`` downstream of a failing record (only more than
        doubling what it carries is news), ``STATS_GAIN`` times more when judged from
        statistics."""
        gain = max(self.gain(i), EXACT_GAIN) if self.tainted[i] else self.gain(i)
        return gain * (STATS_GAIN if self.r.from_stats[i] else 1.0)

    def _amplified(self, i: int) -> bool:
        """Whether a record of an elementwise call B computed within rounding carries an
        error that its inputs' explain, however much more than the gain says: where the
        call's own error, recomputed from its records on every sample, is at most half the
        record's (a quarter of its square), the rest comes from its inputs' error through
        the call (a ReLU that keeps the small elements of a large input passes on its
        absolute error, large against what is left). Not where the inputs carry none, nor
        for calls with settings or weights of their own (recomputed at each side's, which
        may differ: an eps)."""
        r = self.r
        return (r.recomputed_whole[i] and r.recomputed[i] <= r.recomputed_floor[i]
                and self.err_in[i] > 0 and r.recomputed[i] <= r.err[i] / 2)

    def _own_rounding(self, i: int, bound: float, level: float) -> bool:
        """Whether a record's error is what its call's own computation added, measured, and
        its inputs' error as the rule bounds it: the call recomputed from its records within
        what rounding gives (``Evidence.recomputed_rounding``, which grows where the terms it
        sums cancel: a normalization's backward removes the gradient's mean and its
        projection on the normalized input; not the margin above it, which keeps a
        recomputation from accusing rounding), and ``err <= hypot(bound, recomputed)``. A
        call that B computed otherwise than from its own operands (a planted error, a wrong
        kernel) is off its recomputation; one given other operands or settings than A's
        (weights, an eps) is recomputed to add little while it differs from A by more. Not
        where no error is expected (``level`` 0: bit-identical records expected, where any
        change is the finding)."""
        r = self.r
        return (level > 0 and r.recomputed[i] <= r.recomputed_rounding[i]
                and r.err[i] <= math.hypot(bound, r.recomputed[i]))

    def _scale_moves(self, i: int, level: float) -> bool:
        """The scale test (:mod:`compare.scale`): backward records only, where the sources'
        scales bound it (and the elements pair up: not values in another order), beyond what
        the rounding ``level`` allows may move it (:meth:`_rounding_scale`)."""
        r = self.r
        added = r.scale_added[i]
        return (not self._unbounded(i, level) and not r.reordered[i] and math.isfinite(added)
                and added > max(r.scale_noise[i], self._rounding_scale(i, level),
                                self._last_bit(i)))

    def _rounding_scale(self, i: int, level: float) -> float:
        """How far the added error ``level`` allows may move a record's scale: its relative
        roundings as far as themselves (calibrated errors may be systematic), its underflow
        not, where the record's values spread over a subnormal spacing or more (``underflow``
        at most 1/2): rounding to nearest on that fixed grid is then unbiased (Sheppard's
        correction: the rounding error of values spread smoothly over the grid is
        uncorrelated with them), but for elements under half the smallest subnormal, flushed
        to zero, which move the scale by their share of the norm², at most ``underflow²`` (a
        float16 gradient of rms 8e-7 rounds to 4 % of itself, and a 3 % error in its scale is
        news). Values of a few spacings round with a bias of up to ``underflow``: all of
        ``level``."""
        e = self.expected
        if e.underflow[i] > SMOOTH_UNDERFLOW:
            return level
        return level * e.relative[i] + e.underflow[i] ** 2

    def _last_bit(self, i: int) -> float:
        """Where no error is expected, the last bits still may differ: vectorised kernels and
        reductions round the elements that memory alignment leaves to their scalar loop
        differently, and alignment differs between runs (a rerun differs so, now and then; a
        re-run on injected copies often), through the unrecorded code between modules too:
        ``LAST_BITS`` units of the precision, in rel-L2."""
        if self.expected.label[i] != EXACT_LABEL:
            return 0.0
        return LAST_BITS * rounding_of(precision_of(*self.r.dtypes[i])).unit

    def _why(self, i: int) -> str:
        r = self.r
        err, err_in, added = r.err[i], self.err_in[i], self.added[i]
        level, label, source = self.expected.level[i], self.expected.label[i], self.source[i]
        if r.measured[i] == st.NAN_MISMATCH:
            return ("NaN/Inf at other places than in A, and none of its sources has that"
                    + (f" (largest source: {source})" if source else "")
                    + loss_scale_overflow(r.frame.loc[i], rerun=bool(r.replaced.any())))
        if r.user_tol:
            return (f"outside the given tolerance, with sources within it (rel error {err:.3g}, "
                    f"inputs {err_in:.3g})")
        if r.miscomputed[i]:
            stride = r.frame.at[i, "recomputed_stride"]
            sampled = f", on one sample in {stride:.0f}" if stride > 1 else ""
            kind = r.frame.at[i, "kind"]
            weighted = r.frame.at[i, "cls"] not in UNWEIGHTED and kind != fmt.PARAM_GRAD
            return (f"{MISCOMPUTED} {r.recomputed[i]:.3g} (rel) from what its own records give "
                    f"({r.frame.at[i, 'cls']}: recomputed from its "
                    f"{'input' if kind == fmt.OUTPUT else 'incoming gradient'}"
                    f"{' and weights' if weighted else ''}"
                    f"{', summed over positions' if kind == fmt.PARAM_GRAD else ''}{sampled}), "
                    f"where rounding explains "
                    f"{r.recomputed_floor[i]:.2g}: this call's own computation is not what it "
                    f"is in A")
        if r.in_transit[i]:
            sent = r.frame.at[i, "transit_from"]
            how = "adds" if SUM_OF_RECORDS in sent else "hands on"
            return (f"{IN_TRANSIT} {r.transit[i]:.3g} (rel) since {sent}, which A {how} "
                    f"unchanged: the code between them (between modules, a hook, a "
                    f"communication) is not what it is in A")
        inputs = (f"its inputs carry {err_in:.3g} ({source})" if source else
                  "it has no recorded inputs")
        bound = math.hypot(self._judged_gain(i) * err_in, SPREAD * level, self._last_bit(i))
        if err <= bound:  # failed the scale test only
            return f"{describe_scale(r.scale_added[i], r.scale_noise[i])}; {inputs}"
        if label == EXACT_LABEL:
            return f"added rel error {added:.3g} where {label[len('none: '):]}; {inputs}"
        beyond = f"= {added / level:.0f}x" if level > 0 else "beyond"
        return f"added rel error {added:.3g} {beyond} the {label} ({level:.2g}); {inputs}"

    def result(self) -> pd.DataFrame:
        """The comparison's rows with their statuses and the verdict columns."""
        r, level = self.r, self.expected.level
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(level > 0, self.added / level,
                             np.where(self.added > 0, np.inf, 0.0))
        numbers = {"rel_error": r.err, "input_rel_error": self.err_in,
                   "added_rel_error": self.added,
                   "expected_rel_error": level, "added_ratio": ratio,
                   "hidden_rel_error": self.hidden,
                   # what rounding explains of recomputed_rel_err (NaN: not recomputed)
                   "recomputed_allowance": np.where(np.isnan(r.recomputed), np.nan,
                                                    r.recomputed_floor)}
        out = r.frame.assign(
            status=self.status, source=self.source,
            unbounded=np.where(np.isinf(self.hidden), self.unbounded, ""),
            same_as=self.same_as, reason=self.reason,
            **{k: np.where(r.compared, v, np.nan) for k, v in numbers.items()})
        out.attrs[USER_TOLERANCE] = r.user_tol
        return out


def loss_scale_overflow(row: pd.Series, rerun: bool = False) -> str:
    """For a gradient record with more NaN/Inf on one side than on the other, where that side's
    values carry a loss scale: that it overflowed there and what to do; ``rerun``: B is a
    re-run on A's values, which puts A's gradients in at its own scale, where they may
    overflow though B's own did not; else ""."""
    if row["kind"] not in fmt.BACKWARD_KINDS:
        return ""
    nonfinite = {side: row[f"nan_{side}"] + row[f"inf_{side}"] for side in ("a", "b")}
    for side, other, name in (("b", "a", "B"), ("a", "b", "A")):
        scale = row.get(f"grad_scale_{side}", fmt.NO_GRAD_SCALE)
        if not (pd.notna(scale) and scale != fmt.NO_GRAD_SCALE
                and nonfinite[side] > nonfinite[other]):
            continue
        overflow = f"{scale:.6g}: they overflow {row[f'dtype_{side}']} here"
        if rerun and side == "b":
            return (f"; B ran on A's gradients, put in at its loss scale of {overflow} (this "
                    f"re-run cannot localize the step: re-run it at a lower loss scale)")
        return (f"; {name}'s gradients carry a loss scale of {overflow} (a GradScaler skips "
                f"such a step and lowers its scale; compare a step it did not skip)")
    return ""

"""Summary of a comparison: a one-line verdict, counts per status, the first divergence with
its reason, and the suspects ranked by added error."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import pandas as pd

from . import format as fmt
from . import status as st
from .arguments import COLUMNS as ARGUMENT_COLUMNS
from .arguments import describe as describe_argument
from .comparison import ARGUMENTS, INCOMPLETE_STEPS
from .sources import earlier_sources, enclosing_modules
from .precision import precision_of, rounding_of
from .verdict import IN_TRANSIT, USER_TOLERANCE

SUSPECTS = 5  # suspects listed by the text summary
# modules and ops whose results depend on random numbers, not only on their inputs
RANDOM_CLASSES = re.compile(r"[Dd]ropout|DropPath|StochasticDepth|bernoulli")
# A passing record adding this many times the typical added error of comparable records
# stands out: what its inputs' error could hide is then no agreement (verdict.SPREAD).
OUTLIER = 6.0
SETTLE = ("re-run B on A's values to settle it: HookerAndDumper(..., inject=A) in B's loop "
          "(A dumped with params=True), then h5cmp A B --injected C")


def _ratio(value: float) -> str:
    """An added error in units of the expected one, e.g. ``31x``; "new" where none is expected."""
    return "new" if not np.isfinite(value) else f"{value:.0f}x" if value >= 10 else f"{value:.1f}x"


@dataclass
class Divergence:
    """The earliest failing record in execution order, and where its error comes from.

    ``verdict``: ``origin`` (a record the module computes, its output or the gradient it sends
    back, carries more error than its sources and the precisions explain: the error starts in
    this module), ``between_modules`` (the record is an input or an incoming gradient: the
    difference arose in code outside any hooked submodule, e.g. in the parent's own forward,
    the loss, or the data), or ``weights`` (the module's weights differ before the step).
    ``upstream``: the records it is computed from.
    """

    row: pd.Series
    verdict: str
    upstream: pd.DataFrame
    producer: Optional[pd.DataFrame] = None  # output rows of the call that made this input
    aliases: pd.DataFrame = field(default_factory=pd.DataFrame)  # later records of the tensor
    # (module, class) of the call whose code ran the record's call (None: the root's caller)
    enclosing: Optional[tuple[str, str]] = None
    ops_recorded: bool = False  # whether the dumps hold the ops of that call's code

    @property
    def direction(self) -> str:
        return fmt.direction_of(self.row["kind"])

    @property
    def parent(self) -> str:
        """The module whose own code ran this record's call ("<root>": the model's own
        forward; "": the code calling the model)."""
        op = fmt.split_op(self.row["module"])
        if op is not None:  # an op: the module whose code ran it
            return op[0] or fmt.ROOT_NAME
        if self.enclosing is None:
            return ""
        return self.enclosing[0] or fmt.ROOT_NAME

    def _ops_hint(self) -> Optional[str]:
        """The ``ops=`` glob that records the ops of the code that ran this record's call."""
        if fmt.split_op(self.row["module"]) is not None or self.enclosing is None:
            return None
        module, cls = self.enclosing
        return module or cls  # the root by its class (its key)

    def _carried(self) -> Optional[pd.Series]:
        """For an incoming gradient, its gradient source with the largest error among those
        that carry one from before this record (``inherited``: drifted weights, an upstream
        error), if any."""
        if self.row["kind"] != fmt.GRAD_OUTPUT or self.upstream.empty:
            return None
        carrying = self.upstream[(self.upstream["status"] == st.INHERITED)
                                 & self.upstream["kind"].isin(list(fmt.BACKWARD_KINDS))]
        return None if carrying.empty else carrying.loc[carrying["rel_error"].idxmax()]

    def describe(self, advise_rerun: bool = True) -> str:
        """The divergence in words; ``advise_rerun``: say how an injected re-run settles
        what two dumps cannot."""
        r = self.row
        micro_batch = f" (micro-batch {r['micro_batch']})" if r["micro_batch"] > 0 else ""
        op = fmt.split_op(r["module"])
        call = (f"op {op[1]} of module {op[0] or '<root>'}" if op is not None
                else f"module {r['module'] or '<root>'} ({r['cls']})")
        where = (f"step {fmt.step_label(r['epoch'], r['step'], r['rank'])}, {self.direction}, "
                 f"{call} call {r['call_idx']}{micro_batch}, {_tensor_path(r)}")
        numel = int(r["numel"]) if pd.notna(r["numel"]) else "n/a"
        figures = (f"rel error {r['rel_error']:.3g}, max_abs_err {r['max_abs_err']:.3g}, "
                   f"{numel} elements, status {r['status']}")
        if r["status"] == st.HASH_MISMATCH:
            figures = (f"the bits differ ({numel} elements, {r['dtype_a']} / {r['dtype_b']}); a "
                       f"hash record holds a digest, not values: dump this step with values or "
                       f"statistics to measure the error, status {r['status']}")
            if r["grad_scale_a"] != r["grad_scale_b"]:
                figures += (f"; the runs held this gradient at loss scales "
                            f"{r['grad_scale_a']:g} and {r['grad_scale_b']:g}, whose bits "
                            f"cannot agree: check determinism at one scale")
        if r["status"] == st.REPLICA_MISMATCH:  # a fault of one side's run, whatever B holds
            measured = (f"max_abs_err {r['max_abs_err']:.3g}" if pd.notna(r["max_abs_err"])
                        else "statistics")
            return "\n".join([
                f"first divergence: {where}",
                f"  a side's ranks disagree on this replicated tensor (its base rank's copy "
                f"against the other side: {measured}, {numel} elements), status {r['status']}",
                f"  why: {r['reason']}"])
        lines = [f"first divergence: {where}", f"  {figures}"]
        if pd.notna(r.get("shard_rank", np.nan)):  # a sharded tensor put together
            lines.append(f"  put together from the ranks' shards: the largest error is in rank "
                         f"{int(r['shard_rank'])}'s shard")
        if r["reason"]:
            lines.append(f"  why: {r['reason']}")
        hint = _loss_scale_ratio(r)
        if hint:
            lines.append(f"  {hint}")
        if len(self.aliases):
            lines.append("  the same tensor is also " + ", ".join(
                fmt.row_label(a) for _, a in self.aliases.iterrows()))
        if self.verdict == st.ORIGIN:
            lines.append(f"  the error starts in this {'op' if op is not None else 'module'} "
                         f"(its own computation)")
            if RANDOM_CLASSES.search(str(r["cls"])) or (op is not None and
                                                       RANDOM_CLASSES.search(op[1])):
                lines.append("  it draws random numbers: if the runs draw different ones "
                             "(another device, generator or seed), their masks differ; "
                             "compare with dropout off (p=0) in both runs")
        elif self.verdict == st.WEIGHTS:
            what = ("a parameter of the model handed to this call differs" if self.row["kind"]
                    == fmt.INPUT else "this module's weights differ")
            lines.append(f"  {what} before the step: compare an earlier step "
                         "(or the checkpoints) to find where")
        else:
            origin = f"{self.parent}'s own code" if self.parent else "the code calling the model"
            lines.append(
                f"  the difference arose between {r['transit_from']} and this {r['kind']}: in "
                f"the code between the two (their enclosing module's own code, a hook, or a "
                f"communication)" if str(r["reason"]).startswith(IN_TRANSIT) else
                f"  the difference is already in this {r['kind']}: it arose outside any "
                f"hooked submodule (in {origin}, the loss, or the data)")
            carried = self._carried()
            if carried is not None and not str(r["reason"]).startswith(IN_TRANSIT):
                lines.append(f"  but it is sent back from records that already differ "
                             f"({fmt.row_label(carried)}: {carried['rel_error']:.3g}), and code "
                             f"that sums them (attention's backward, over positions) may amplify "
                             f"that beyond the gain allowed here, as far as two dumps can tell"
                             f"{'; ' + SETTLE if advise_rerun else ''}")
            hint = self._ops_hint()
            if hint is not None and self.ops_recorded:
                lines.append(f"  {self.parent}'s ops are recorded: h5cmp A B --module "
                             f"'{self.enclosing[0]}/*' --all lists them, as they ran")
            elif hint is not None:
                lines.append(f"  to see which of {self.parent}'s ops: dump both runs again with "
                             f"HookerAndDumper(..., ops=[{hint!r}])")
            if self.producer is not None and len(self.producer):
                p = self.producer.iloc[0]
                state = ("which matched: the change happened between the two modules"
                         if not self.producer["status"].isin(st.CARRYING).any()
                         else "which already differed")
                lines.append(f"  {r['kind']}[{r['index']}] came from "
                             f"{fmt.module_key(p['module'], p['cls'])} (call {p['call']}), {state}")
        return "\n".join(lines)


LOSS_SCALE_FROM = 2.0 ** 8  # the least loss scale a report names (GradScaler starts at 2^16)


def _loss_scale_ratio(row: pd.Series) -> str:
    """Where a gradient record of B is A's times a power of two of at least
    ``LOSS_SCALE_FROM`` (or its inverse), within 1 % (``1 + scale_err``, what B holds along
    A's values, accounts for its error), and the larger side's values carry no recorded loss
    scale: that factor, which a loss scale its dumper was not told of explains, and how to
    tell it; else "" (a factor of 2 or 32 is likelier a mean taken otherwise, a scale
    recorded is divided out already)."""
    if row["kind"] not in fmt.BACKWARD_KINDS or not pd.notna(row.get("scale_err")):
        return ""
    ratio = 1.0 + float(row["scale_err"])
    if ratio <= 0 or not math.isfinite(ratio):
        return ""
    power = round(math.log2(ratio))
    larger = row.get("grad_scale_b" if power > 0 else "grad_scale_a", fmt.NO_GRAD_SCALE)
    scaled = (abs(power) >= math.log2(LOSS_SCALE_FROM) and abs(ratio / 2.0 ** power - 1.0)
              <= 0.01 and (pd.isna(larger) or larger == fmt.NO_GRAD_SCALE))
    explained = abs(float(row["rel_error"]) - abs(ratio - 1.0)) <= 0.01 * max(abs(ratio - 1.0),
                                                                              1.0)
    if not (scaled and explained):
        return ""
    return (f"B's values are {2.0 ** power:.6g} (2^{power}) times A's, as a loss scale makes "
            f"them: if a run scales its loss (torch.amp.GradScaler), give its dumper the scaler "
            f"(HookerAndDumper(..., scaler=scaler)) to compare without it")


@dataclass
class Summary:
    """Counts of rows per status, the verdict, the first divergence (None when every pair
    passes) and the suspects: failing records ranked by added error over the expected level."""

    counts: dict[str, int]
    total: int
    first: Optional[Divergence]
    precision: str = ""
    suspects: pd.DataFrame = field(default_factory=pd.DataFrame)
    largest: Optional[pd.Series] = None   # the passing record with the largest added_ratio
    weights: Optional[pd.Series] = None   # the parameter that differs most, if any
    later_step: bool = False              # they differ in a step after the first of training
    from_stats: int = 0                   # records judged from statistics (estimates)
    user_tolerance: bool = False          # judged by the user's rtol/atol
    incomplete: tuple[str, ...] = ()      # compared steps their dumper marked incomplete
    # passing records where the inputs' error could hide an error that clean inputs would
    # show, most added over the expected first: two dumps cannot tell there (where a record
    # fails: only the outliers before the first failing one, where it may begin instead)
    undecided: pd.DataFrame = field(default_factory=pd.DataFrame)
    rerun_given: bool = False  # an injected re-run answers (--injected): no advice to make one
    # arguments (non-tensor leaves) that differ between paired calls (compare.arguments)
    arguments: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=ARGUMENT_COLUMNS))
    # those of them in a step whose every tensor is bit-identical in B: they changed no value
    # recorded (a flag such as use_cache), so they are listed, not a divergence
    inert_arguments: pd.DataFrame = field(
        default_factory=lambda: pd.DataFrame(columns=ARGUMENT_COLUMNS))

    @property
    def outliers(self) -> pd.DataFrame:
        """Undecided records that stand out among comparable records (``OUTLIER``)."""
        if self.undecided.empty:
            return self.undecided
        ratio = self.undecided["added_ratio"]  # infinite where none is expected: no yardstick
        return self.undecided[(ratio >= OUTLIER) & np.isfinite(ratio)]

    @property
    def cannot_tell(self) -> bool:
        """Nothing fails, but two dumps cannot rule out an error the verdict would name; or
        the first divergence may begin at an earlier record, an outlier two dumps cannot
        judge."""
        return ((self.ok or self.first is not None) and not self.user_tolerance
                and len(self.undecided) > 0)

    @property
    def ok(self) -> bool:
        return all(self.counts[s] == 0 for s in st.FAILING) and self.arguments.empty

    def _leading_argument(self) -> Optional[pd.Series]:
        """The first argument that differs, if it comes no later than the first divergence
        of the tensors (in an earlier step, or earlier in its step on its rank)."""
        if self.arguments.empty or self.first is None:
            return None if self.arguments.empty else self.arguments.iloc[0]
        r = self.first.row
        rank = -1 if pd.isna(r["rank"]) else r["rank"]
        step = (r["epoch"], r["step"])
        for _, arg in self.arguments.iterrows():  # (by step, rank, then order in the step)
            at = (arg["epoch"], arg["step"])
            if at < step or (at == step and arg["rank"] == rank and arg["seq"] <= r["seq"]):
                return arg
        return None

    def verdict(self) -> str:
        """One line: agreement within the precisions, or where B first diverges."""
        weights = ""
        if self.weights is not None:
            w = self.weights
            when = (", from earlier steps: an earlier step shows where the runs began to "
                    "differ" if self.later_step else "")
            weights = (f"; weights differ (up to {w['rel_error']:.3g} in "
                       f"{w['module'] or '<root>'}{when})")
        if self.counts[st.UNSUPPORTED]:  # e.g. digests against statistics: nothing was compared
            weights += (f"; {self.counts[st.UNSUPPORTED]} of {self.total} records could not be "
                         f"compared ({st.UNSUPPORTED})")
        arg = self._leading_argument()
        if arg is not None:
            return (f"B diverges from A: first at step "
                    f"{fmt.step_label(arg['epoch'], arg['step'], arg['rank'])} "
                    f"{fmt.direction_of(arg['kind'])} in {arg['module'] or '<root>'} (its "
                    f"{arg['kind']} {arg['path']} is {arg['value_a']} in A, {arg['value_b']} in "
                    f"B: the runs gave the call other arguments){weights}")
        if self.first is not None:
            r = self.first.row
            at = fmt.step_label(r["epoch"], r["step"], r["rank"])
            earlier = ""
            if self.cannot_tell:
                worst = self.undecided.iloc[0]
                where = fmt.step_label(worst["epoch"], worst["step"], worst["rank"])
                earlier = (f"; two dumps cannot tell whether it begins earlier: "
                           f"{'' if where == at else f'step {where} '}{worst['label']} "
                           f"({fmt.direction_of(worst['kind'])}) adds "
                           f"{worst['added_rel_error']:.3g}, {_ratio(worst['added_ratio'])} "
                           f"typical, which {_hiding(worst)}")
            return (f"B diverges from A: first at step {at} {self.first.direction} in "
                    f"{r['module'] or '<root>'} ({r['kind']}[{r['index']}]){earlier}{weights}")
        if not self.ok:
            bad = ", ".join(f"{self.counts[s]} {s}" for s in st.STATUSES
                            if s in st.FAILING and self.counts[s])
            return f"B cannot be fully compared with A: {bad}{weights}"
        within = ("within the given tolerance" if self.user_tolerance else
                  f"within {self.precision} rounding" if self.precision else "exactly")
        if self.cannot_tell:
            worst = self.outliers.iloc[0] if len(self.outliers) else None
            bound = self.undecided["hidden_rel_error"].max()
            if worst is not None:
                return (f"B may diverge from A; two dumps cannot tell: {worst['label']} adds "
                        f"{worst['added_rel_error']:.3g}, {_ratio(worst['added_ratio'])} "
                        f"typical, which {_hiding(worst)}{weights}")
            where = self.undecided.loc[self.undecided["hidden_rel_error"].idxmax(), "label"]
            return (f"B agrees with A {within} as far as two dumps can tell: an added error "
                    f"of up to {bound:.3g} could hide in its inputs' error (in {where}; "
                    f"suspects below){weights}")
        if self.largest is None or self.user_tolerance or not self.largest["added_rel_error"]:
            return f"B agrees with A {within}{weights}"
        r = self.largest
        return (f"B agrees with A {within} (largest added error {r['added_rel_error']:.3g}, "
                f"{_ratio(r['added_ratio'])} typical, in {r['module'] or '<root>'} "
                f"{r['kind']}[{r['index']}]){weights}")

    def __str__(self) -> str:
        parts = ", ".join(f"{self.counts[s]} {s}" for s in st.STATUSES if self.counts[s])
        estimated = (f" ({self.from_stats} judged from statistics: estimates, blind to what "
                     f"keeps them)" if self.from_stats else "")
        lines = [self.verdict(), f"{self.total} tensor pairs: {parts or 'none'}{estimated}"]
        if self.incomplete:
            lines.append(f"incomplete: {', '.join(self.incomplete)}: the step failed, records "
                         f"after the failure are missing")
        if len(self.arguments):
            lines.append(f"{len(self.arguments)} argument(s) differ between paired calls "
                         f"(numbers, flags, names given to a module or op):")
            lines += [f"  {describe_argument(r)}"
                      for _, r in self.arguments.head(SUSPECTS).iterrows()]
            if len(self.arguments) > SUSPECTS:
                lines.append(f"  ... {len(self.arguments) - SUSPECTS} more")
        if len(self.inert_arguments):
            lines.append(f"{len(self.inert_arguments)} argument(s) differ between paired calls "
                         f"in steps whose every tensor is bit-identical (they changed no value "
                         f"recorded: not a divergence):")
            lines += [f"  {describe_argument(r)}"
                      for _, r in self.inert_arguments.head(SUSPECTS).iterrows()]
            if len(self.inert_arguments) > SUSPECTS:
                lines.append(f"  ... {len(self.inert_arguments) - SUSPECTS} more")
        if self.first is not None:
            lines.append(self.first.describe(advise_rerun=not self.rerun_given))
        if self.cannot_tell:
            where = ("before the first divergence, " if self.first is not None else "")
            lines.append(f"cannot tell: {where}in {len(self.undecided)} records an added error "
                         f"larger than what comparable records add could pass for their inputs' "
                         f"error amplified; suspects, most added over the typical first:")
            for r in self.undecided.head(SUSPECTS).itertuples():
                hidden = (f"up to {r.hidden_rel_error:.3g}" if r.hidden_rel_error < 1
                          else "any error")
                lines.append(f"  {_ratio(r.added_ratio):>5}  step "
                             f"{fmt.step_label(r.epoch, r.step, r.rank)} "
                             f"{fmt.direction_of(r.kind):<8} {r.label} (added "
                             f"{r.added_rel_error:.3g}; {hidden} could hide)")
            if not self.rerun_given:
                lines.append(f"  {SETTLE}")
        if len(self.suspects) > 1:
            lines.append("suspects, worst first (added error in units of the expected one; "
                         "new: none expected):")
            for r in self.suspects.head(SUSPECTS).itertuples():
                lines.append(f"  {_ratio(r.added_ratio):>5}  step {fmt.step_label(r.epoch, r.step, r.rank)} "
                             f"{fmt.direction_of(r.kind):<8} {r.label} (added {r.added_rel_error:.3g})")
            if len(self.suspects) > SUSPECTS:
                lines.append(f"  ... {len(self.suspects) - SUSPECTS} more")
        return "\n".join(lines)


def _tensor_path(row: pd.Series) -> str:
    """``output[0] output``: the record's kind and index, then where it sat in the call's
    arguments or results (once, where that says the same: a tuple's ``output[0]``)."""
    label = f"{row['kind']}[{row['index']}]"
    return label if row["path"] == label else f"{label} {row['path']}"


def _hiding(row: pd.Series) -> str:
    """What could hide an undecided record's added error, in words."""
    if row["hidden_rel_error"] < 1:
        return f"its inputs' error ({row['input_rel_error']:.3g}) could hide"
    why = row.get("unbounded")
    if isinstance(why, str) and why:
        return (f"two dumps cannot bound: {why} (its inputs carry "
                f"{row['input_rel_error']:.3g})")
    return f"its inputs' error ({row['input_rel_error']:.3g}), amplified, could hide any of it"


def summarize(result: pd.DataFrame) -> Summary:
    """Summary of a :func:`compare.compare_dumps` result (give it every row: a result filtered
    by module or kind may leave out the first divergence)."""
    counts = {s: int((result["status"] == s).sum()) for s in st.STATUSES}
    failing = result[result["status"].isin(st.VALUE_FAILURES)]
    first = _diagnose(result, failing.iloc[0]) if len(failing) else None
    values = result[result["status"].isin([st.EQUAL, st.CLOSE, st.INHERITED, st.DIFF])]
    pairs = {(a, b) for a, b in zip(values["dtype_a"], values["dtype_b"])
             if rounding_of(a).unit > 0 or rounding_of(b).unit > 0}  # floating: they round
    lowest = {precision_of(a, b) for a, b in pairs if a != b}
    precision = ", ".join(sorted(lowest)) if lowest else (
        "" if (values["status"] == st.EQUAL).all() else ", ".join(sorted({a for a, _ in pairs})))
    passing = result[(result["status"] == st.CLOSE) & np.isfinite(result["added_ratio"])
                     & (result["same_as"] == "")]
    largest = passing.loc[passing["added_ratio"].idxmax()] if len(passing) and \
        passing["added_ratio"].notna().any() else None
    weight_rows = fmt.holds_weights(result["kind"], result["producer"])
    params = result[weight_rows & (result["status"] == st.INHERITED)]
    # (a parameter that differs by more than its own size is noise in one run at least, e.g.
    # a bias no gradient reaches moved by the optimizer alone: no measure of how far apart
    # the weights are, unless every one is)
    sized = params[params["rel_error"] <= 1]
    sized = sized if len(sized) else params
    weights = sized.loc[sized["rel_error"].idxmax()] if len(sized) else None
    later = weights is not None and (weights["epoch"], weights["step"]) != (0, 0)
    suspects = failing[failing["status"] == st.DIFF].sort_values(
        ["added_ratio", "added_rel_error"], ascending=False, kind="stable")
    suspects = suspects.assign(label=[fmt.row_label(r) for _, r in suspects.iterrows()])
    from_stats = int((result["rel_l2_err"].isna() & result["rel_err_from_stats"].notna()
                      & ~weight_rows).sum())
    # (not a record whose own computation, recomputed from its records on every sample,
    # added no more than an outlier would: what it adds itself is measured, not bounded)
    measured = ((result["recomputed_stride"] == 1)
                & (result["recomputed_rel_err"] <= OUTLIER * result["expected_rel_error"]))
    # (a record any error could pass in, where it stands out: the others would make every
    # later step undecided)
    outlier = (result["added_ratio"] >= OUTLIER) & np.isfinite(result["added_ratio"])
    candidates = (result["status"].isin([st.CLOSE, st.INHERITED])
                  & ~weight_rows & (result["same_as"] == "")
                  & (result["hidden_rel_error"] > OUTLIER * result["expected_rel_error"])
                  & ((result["hidden_rel_error"] < 1) | outlier) & ~measured).to_numpy()
    if first is not None:  # where it may begin instead: an outlier before it, where as
        # much as the first divergence adds could hide
        candidates = candidates & (
            outlier & _before(result, first.row)
            & (result["hidden_rel_error"] >= first.row["added_rel_error"])).to_numpy()
    undecided = result[candidates]
    undecided = undecided.sort_values(["added_ratio", "hidden_rel_error"], ascending=False,
                                      kind="stable")
    undecided = undecided.assign(label=[fmt.row_label(r) for _, r in undecided.iterrows()])
    arguments = pd.DataFrame(list(result.attrs.get(ARGUMENTS, ())), columns=ARGUMENT_COLUMNS)
    inert = _in_identical_steps(arguments, result)
    return Summary(counts, len(result), first, precision, suspects, largest, weights, later,
                   from_stats, bool(result.attrs.get(USER_TOLERANCE)),
                   tuple(result.attrs.get(INCOMPLETE_STEPS, ())), undecided,
                   arguments=arguments[~inert].reset_index(drop=True),
                   inert_arguments=arguments[inert].reset_index(drop=True))


def _in_identical_steps(arguments: pd.DataFrame, result: pd.DataFrame) -> np.ndarray:
    """Which ``arguments`` were given in a step (every rank) whose every record is ``equal``
    (bit-identical), as is every record of the steps after it: whatever they change, it is
    no value the dumps hold (a flag that updates a buffer another step reads is not inert
    where that step differs)."""
    equal = (result["status"] == st.EQUAL).groupby([result["epoch"], result["step"]]).all()
    steps = sorted(equal.index)
    # per step, whether it and every later step are all equal
    from_here = dict(zip(reversed(steps), np.logical_and.accumulate(
        [bool(equal[k]) for k in reversed(steps)]))) if steps else {}
    return np.array([bool(from_here.get((e, s), False)) for e, s in
                     zip(arguments["epoch"], arguments["step"])], dtype=bool)


def _before(result: pd.DataFrame, row: pd.Series) -> pd.Series:
    """Records that ran before ``row``: in an earlier step (any rank: ranks exchange
    gradients), or earlier in its step on its rank; for a weight (which the step gets from
    the ones before) only the former; for a weight's gradient (taken after ranks sum
    theirs) also every other record of its step, on any rank."""
    step = list(zip(result["epoch"], result["step"]))
    at = (row["epoch"], row["step"])
    earlier = pd.Series([k < at for k in step], index=result.index)
    if fmt.holds_weights(row["kind"], row["producer"]):
        return earlier
    same = pd.Series([k == at for k in step], index=result.index)
    rank = result["rank"].fillna(-1) == (-1 if pd.isna(row["rank"]) else row["rank"])
    before = earlier | (same & rank & (result["seq"] < row["seq"]))
    if row["kind"] == fmt.PARAM_GRAD:
        before |= same & (result["kind"] != fmt.PARAM_GRAD)
    return before


def _diagnose(result: pd.DataFrame, row: pd.Series) -> Divergence:
    same_step = result[fmt.in_step_of(result, row)]
    position = same_step.index.get_loc(row.name)
    upstream = same_step.iloc[earlier_sources(same_step)[position]]
    aliases = fmt.later_records(same_step, row)
    if fmt.holds_weights(row["kind"], row["producer"]):
        return Divergence(row, st.WEIGHTS, upstream, aliases=aliases)
    if row["kind"] in (fmt.INPUT, fmt.GRAD_OUTPUT):
        producer = None
        if row["kind"] == fmt.INPUT and row["producer"] >= 0:
            producer = same_step[(same_step["call"] == row["producer"])
                                 & (same_step["kind"] == fmt.OUTPUT)]
        enclosing = enclosing_modules(same_step).get(int(row["call"]))
        ops_recorded = enclosing is not None and bool(
            same_step["module"].str.startswith(enclosing[0] + fmt.OP_SEPARATOR).any())
        return Divergence(row, st.BETWEEN_MODULES, upstream, producer, aliases, enclosing,
                          ops_recorded)
    return Divergence(row, st.ORIGIN, upstream, aliases=aliases)

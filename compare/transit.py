"""Values in transit: one tensor handed from a module call to the next, in B as in A.

A call's output is the input of the calls that consume it (the input row's ``producer``), and
the gradient a consumer sends back for that input is the gradient that arrives at the
producer's output, unchanged where nothing else uses the tensor; so is the gradient arriving at
each output that a sum made between modules adds unchanged (the ``addends`` column: a residual
``x + f(x)``, an in-place ``out += shortcut``), and, where a sum is a partial one that a call
consumes and later sums add on (:func:`sum_links`), the sum of those uses' gradients. Where A
holds the same bits in both records of such a link (:func:`identities`; not all zeros; for a
sum, A's values agree with it to its rounding), the code between them is the identity in A,
and B runs the same code: in any precision it hands the values on unchanged, or rounded
through the dtypes it computes in. Where B's two records differ by
more, B's code between them (functional code between modules, a hook, a communication, an
in-place change) changed the values in B only, whatever error the values carried before.
Per later record of a link:

``transit_rel_diff``
    ``||later_b - earlier_b|| / ||earlier_b||`` from B's values (the largest over its links:
    a change any of them shows is a change; a tensor handed back by a call, as an eval-mode
    dropout does, is in several links, and one made after the change shows none);
    0 where B's bits agree; where B holds statistics only, the difference of the two norms (a
    lower bound); where a digest stands for B's values and the bits differ, inf; for a sum,
    ``||later_b - sum(terms_b)|| / ||sum(|terms_b|)||`` (its rounding, where B's bits agree).
``transit_from``
    the earlier record (:func:`compare.format.record_label`), or the records summed, joined
    by :data:`SUM_OF_RECORDS`.

The verdict (:mod:`compare.verdict`) allows what casts through B's lowest precision may do.
In a localizing re-run (B ``injected``: it ran on A's values), a record holding what arrived
before A's value replaced it is linked to the record it was handed on from, which B computed.
No record is linked where a record of the same tensor in A, of a call enclosing the later
one's, was replaced between the two (the enclosing call's input: its child got A's value,
replaced itself or not), nor where the earlier record is replaced; a sum's term B replaced
stands for A's value rounded to B's dtype (what B summed).
Sharded records put together from parts have no link.
"""
from __future__ import annotations

import itertools
import math
from typing import Iterator, Optional

import numpy as np
import pandas as pd

from . import format as fmt
from .dataflow import addend_edges
from .dump import StepReader, StepReaders, one_side, read_chunks, reading
from .pairing import from_shards
from .precision import ROUNDABLE, lowest, rounded, rounding_of

TRANSIT_COLUMNS = ("transit_rel_diff", "transit_from")
STEP = ["epoch", "step", "rank"]
SUM_OF_RECORDS = " + "  # joins the records of a transit_from that are summed


def identities(frame: pd.DataFrame, side: str) -> list[Optional[tuple]]:
    """Per row, what identifies its values on ``side`` ("a" or "b"), equal for equal bits: its
    dtype and shape with its digest or checksum (a digest is the checksum its dataset would
    have), else with its statistics and sketch; None where nothing does, or its values are all
    zeros (which many tensors share)."""
    digest, checksum = (frame[f"{c}_{side}"].to_numpy(np.int64) for c in ("digest", "checksum"))
    words = np.where(digest != fmt.NO_DIGEST, digest, checksum)
    columns = [f"{c}_{side}" for c in (*fmt.STAT_COLUMNS, *fmt.SKETCH_COLUMNS)]
    numbers = frame[columns].to_numpy(float)
    stated = (numbers[:, fmt.STAT_COLUMNS.index("stat_norm")] > 0) & ~np.isnan(
        numbers[:, :len(fmt.STAT_COLUMNS)]).any(axis=1)
    numbers = np.nan_to_num(numbers, nan=-1.0)
    out: list[Optional[tuple]] = []
    for dtype, shape, word, known, figures in zip(frame[f"dtype_{side}"], frame[f"shape_{side}"],
                                                 words, stated, numbers):
        if word != fmt.NO_CHECKSUM:
            out.append((dtype, tuple(shape), int(word)) if word != 0 else None)
        else:
            out.append((dtype, tuple(shape), tuple(figures)) if known else None)
    return out


def links(pairs: pd.DataFrame) -> list[tuple[int, int]]:
    """``(earlier, later)`` row labels of ``pairs`` whose records hold one tensor handed on, with
    the same bits in A: a call's output and a consumer's input, the consumer's grad_input for
    that input and the call's grad_output; the gradient of a sum (its consumer's grad_input, or
    the grad_output of the call that returned it) and the grad_output of each of its addends.
    In a localizing re-run, the later record may be one B replaced (what arrived), where
    B handed its own value on (:func:`_handed_on`)."""
    known = _known(pairs)
    flow = known.loc[(known["kind"] == fmt.INPUT) & (known["producer_a"] >= 0),
                     [*STEP, "call_a", "index", "producer_a"]]

    def of(kind: str, call: str, row: str, extra=()) -> pd.DataFrame:
        rows = known.loc[(known["kind"] == kind) & known["identity"].notna(),
                         [*STEP, "call_a", *extra, "identity", "row"]]
        return rows.rename(columns={"call_a": call, "row": row})
    forward = of(fmt.INPUT, "call_a", "later", ["index"]).merge(
        flow, on=[*STEP, "call_a", "index"]).merge(
        of(fmt.OUTPUT, "producer_a", "earlier"), on=[*STEP, "producer_a", "identity"])
    # a consumer that hands an input back as its output (its output holds the input's bits)
    # sends back for it the whole gradient of that tensor, other uses' included: where it does
    # in A but not in B (a cast A did not need makes a new tensor), B's is its share only
    computed = known[~known["replaced"]]  # B's bits are B's own
    handed_back = _without(_handed_back(computed, STEP), _handed_back(
        computed.assign(identity=identities(computed, "b")), STEP))
    sent = _without(of(fmt.GRAD_INPUT, "call_a", "earlier", ["index"]), handed_back)
    backward = sent.merge(flow, on=[*STEP, "call_a", "index"]).merge(
        of(fmt.GRAD_OUTPUT, "producer_a", "later"), on=[*STEP, "producer_a", "identity"])
    # a sum made between modules: the gradient of each output it adds unchanged is the sum's,
    # the gradient its consumer sends back for it (an input), or that arrives at it (an output)
    added = addend_edges(known, "call_a", "addends_a", STEP)
    added = added[added["addend_kind"] == fmt.OUTPUT].drop(columns="addend_kind")
    addends = of(fmt.GRAD_OUTPUT, "addend", "later", ["index"]).rename(
        columns={"index": "addend_index"})

    def summed(kind: str, sum_gradients: pd.DataFrame) -> pd.DataFrame:
        terms = sum_gradients.merge(added[added["kind"] == kind].drop(columns="kind"),
                                    on=[*STEP, "call_a", "index"])
        return terms.merge(addends, on=[*STEP, "addend", "addend_index", "identity"])
    parts = [forward, backward, summed(fmt.INPUT, sent),
             summed(fmt.OUTPUT, of(fmt.GRAD_OUTPUT, "call_a", "earlier", ["index"]))]
    found = dict.fromkeys(zip(pd.concat([p["earlier"] for p in parts]),
                              pd.concat([p["later"] for p in parts])))
    return _handed_on(known, list(found))


def _handed_on(known: pd.DataFrame, found: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The links of ``found`` along which B handed its own value on: the earlier record is not
    one B replaced, and the later one got no replaced value on the way (:func:`_arrived`)."""
    replaced = _replacements(known)
    return [(earlier, later) for earlier, later in found if not known.at[earlier, "replaced"]
            and _arrived(known, replaced, known.at[earlier, "seq_b"], later)]


def _replacements(known: pd.DataFrame) -> dict[tuple, list[tuple[float, str]]]:
    """``(*step, identity in A)`` -> ``(seq_b, module)`` of the records B replaced."""
    replaced = known[known["replaced"]]
    between: dict[tuple, list[tuple[float, str]]] = {}
    for *step, identity, seq, module in zip(*(replaced[c] for c in (
            *STEP, "identity", "seq_b", "module"))):
        if identity is not None:
            between.setdefault((*step, identity), []).append((seq, module))
    return between


def _arrived(known: pd.DataFrame, replaced: dict, start: float, later: int) -> bool:
    """Whether record ``later`` holds what B's code made of its values since ``start`` (B's
    seq), computed by B or replaced (what arrived): no record with its bits in A, of a call
    enclosing its own, was replaced in between in B's order (that call's code, the later
    record's module's included, then got A's value, whether or not the injector replaced
    the later record too; a sibling's replaced copy is its own)."""
    if not replaced:
        return True
    seq_b, within = known.at[later, "seq_b"], known.at[later, "module"]
    return not any(start < seq < seq_b and module != within and fmt.contains(module, within)
                   for seq, module in replaced.get(
                       (*(known.at[later, c] for c in STEP), known.at[later, "identity"]), ()))


def sum_links(pairs: pd.DataFrame) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(terms, totals)`` row labels of ``pairs``: the gradient arriving at an output that a
    partial sum adds (a pre-norm block's attention output, added to the residual into a sum
    that the next norm consumes and the block's last add sums on) is the sum's, which is the
    sum of what the sum's uses send back: the consuming call's grad_input and the gradients of
    the sums it is added into (``terms``). ``totals``: that output's grad_output, and every
    other grad_output of the step with the same bits in A (an enclosing call that returned the
    same tensor). An output some call consumes as well is none (its gradient has that use's
    share). Where A's values agree with the sum, B's must too. In a localizing re-run, a term
    B replaced stands for A's value rounded to its dtype in B (what B summed), and a total B
    replaced for what arrived where no value was replaced on the way (:func:`_arrived`)."""
    both = _known(pairs)
    both = both[both["occurrence"] == 0]
    replaced = _replacements(both)
    keys = list(zip(*(both[c] for c in (*STEP, "call_a", "kind", "index"))))
    label, seq = dict(zip(keys, both.index)), dict(zip(keys, both["seq_a"]))
    added = addend_edges(both, "call_a", "addends_a", STEP)
    consumed = _consumed(both)
    branches = added[(added["addend_kind"] == fmt.OUTPUT) & (added["kind"] == fmt.INPUT)]
    branches = {key: list(zip(group["addend"], group["addend_index"])) for key, group in
                branches.groupby([*STEP, "call_a", "index"])}
    gradients = both[both["kind"] == fmt.GRAD_OUTPUT]
    identity_of = dict(zip(gradients.index, gradients["identity"]))
    same_bits = {}  # (step, identity in A) -> grad_output rows
    for key, row in zip(zip(*(gradients[c] for c in STEP)), gradients.index):
        if identity_of[row] is not None:
            same_bits.setdefault((key, identity_of[row]), []).append(row)
    gradient_of = {fmt.INPUT: fmt.GRAD_INPUT, fmt.OUTPUT: fmt.GRAD_OUTPUT}
    # where each call's forward ended (its first output's event): a sum recorded until then by
    # it or a later call ran inside it, and its share is in the call's grad_input already
    returned = both[both["kind"] == fmt.OUTPUT].groupby([*STEP, "call_a"])["seq_a"].min()
    out = []
    partials = added[added["addend_kind"] == fmt.INPUT]
    for (*step, consumer, index), onward in partials.groupby([*STEP, "addend", "addend_index"]):
        end = returned.get((*step, consumer))
        if end is None:
            continue
        later = [(c, kind, i) for c, kind, i in zip(onward["call_a"], onward["kind"],
                                                    onward["index"])
                 if not (c >= consumer and seq[(*step, c, kind, i)] <= end)]
        terms = [label.get((*step, consumer, fmt.GRAD_INPUT, index))] + [
            label.get((*step, c, gradient_of[kind], i)) for c, kind, i in later]
        if None in terms or len(terms) < 2:
            continue
        for branch, branch_index in branches.get((*step, consumer, index), ()):
            total = label.get((*step, branch, fmt.GRAD_OUTPUT, branch_index))
            if total is None or (*step, branch) in consumed:
                continue
            identity = identity_of[total]
            totals = _as_summed(both, replaced, terms, same_bits[tuple(step), identity]
                                if identity is not None else [total])
            if totals:
                out.append((tuple(terms), tuple(totals)))
    return out


def fan_out_links(pairs: pd.DataFrame) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(terms, totals)`` row labels of ``pairs``: the gradient arriving at an output that
    several calls consume (the keys and values of an attention computed from one norm's output,
    or one input passed twice) is the sum of what those uses send back for it, their
    grad_inputs (``terms``; a call inside another consuming call is that call's, whose
    grad_input holds its share). ``totals``: the output's grad_output and every other one with
    its bits in A (an enclosing call that returned the same tensor); in a localizing re-run, B
    replaced (what arrived) where no value was replaced on the way (:func:`_arrived`). Where
    A's values agree with the sum (no use that is no call), B's must too."""
    known = _known(pairs)
    known = known[known["occurrence"] == 0]
    keys = [*STEP, "call_a", "kind", "index"]
    label = dict(zip(zip(*(known[c] for c in keys)), known.index))
    used = known[(known["kind"] == fmt.INPUT) & (known["producer_a"] >= 0)
                 & known["identity"].notna()]
    outputs = known[(known["kind"] == fmt.OUTPUT) & known["identity"].notna()]
    output_index = dict(zip(zip(*(outputs[c] for c in (*STEP, "call_a", "identity"))),
                            outputs["index"]))
    gradients = known[known["kind"] == fmt.GRAD_OUTPUT]
    same_bits: dict[tuple, list[int]] = {}  # (step, identity in A) -> grad_output rows
    for *step, identity, row in zip(*(gradients[c] for c in (*STEP, "identity", "row"))):
        if identity is not None:
            same_bits.setdefault((*step, identity), []).append(row)
    returned = known[known["kind"] == fmt.OUTPUT].groupby([*STEP, "call_a"])["seq_a"].min()
    replaced = _replacements(known)
    out = []
    for (*step, producer, identity), uses in used.groupby(
            [*STEP, "producer_a", "identity"], sort=False):
        windows = [(seq, returned.get((*step, call), math.inf))
                   for call, seq in zip(uses["call_a"], uses["seq_a"])]
        outer = [(call, index) for call, index, seq in zip(uses["call_a"], uses["index"],
                                                           uses["seq_a"])
                 if not any(start < seq <= end for start, end in windows)]
        index = output_index.get((*step, producer, identity))
        total = label.get((*step, producer, fmt.GRAD_OUTPUT, index))
        terms = [label.get((*step, call, fmt.GRAD_INPUT, i)) for call, i in outer]
        if len(terms) < 2 or None in terms or total is None:
            continue
        totals = _as_summed(known, replaced, terms, same_bits.get(
            (*step, known.at[total, "identity"]), [total]))
        if totals:
            out.append((tuple(terms), tuple(totals)))
    return out


def _as_summed(known: pd.DataFrame, replaced: dict, terms: list[int], totals: list[int]
               ) -> list[int]:
    """The ``totals`` that hold what B summed its ``terms`` into (:func:`_arrived`;
    ``replaced``: :func:`_replacements`)."""
    start = max(known.at[t, "seq_b"] for t in terms)
    return [t for t in totals if _arrived(known, replaced, start, t)]


def _consumed(both: pd.DataFrame) -> set[tuple]:
    """``(*step, call)`` of the calls some call consumes an output of, but for a consumer
    that hands its input back with the same bits in A (an ``Identity``, a dropout of rate 0):
    that is the tensor itself going on (or, if a copy, one whose share A's check of the sum
    sees), not a use of its own."""
    inputs = both[(both["producer_a"] >= 0) & (both["kind"] == fmt.INPUT)]
    outputs = both[both["kind"] == fmt.OUTPUT]
    handed_back = set(zip(*(outputs[c] for c in (*STEP, "call_a")), identities(outputs, "a")))
    return {(*step, producer) for *step, producer, call, identity in zip(
                *(inputs[c] for c in (*STEP, "producer_a", "call_a")), identities(inputs, "a"))
            if identity is None or (*step, call, identity) not in handed_back}


def _known(pairs: pd.DataFrame) -> pd.DataFrame:
    """The rows of :func:`_linkable` with B's replaced ones, and columns ``identity`` (in A,
    :func:`identities`), ``row`` (the label) and ``replaced``."""
    both = _linkable(pairs, arrived=True)
    return both.assign(identity=identities(both, "a"), row=both.index,
                       replaced=_replaced(both))


def _linkable(pairs: pd.DataFrame, arrived: bool = False) -> pd.DataFrame:
    """Rows both runs recorded, computed by each (not injected; with ``arrived``, B's replaced
    records too: what arrived), not put together from shards."""
    return pairs[(pairs["side"] == "both") & (arrived | ~_replaced(pairs))
                 & (pairs["injected_a"].fillna(0) == 0) & ~from_shards(pairs)]


def _replaced(rows: pd.DataFrame) -> pd.Series:
    """Which of ``rows`` B replaced with A's value (a localizing re-run): they hold what
    arrived."""
    return rows["injected_b"].fillna(0) != 0


def _without(rows: pd.DataFrame, keys: pd.DataFrame) -> pd.DataFrame:
    """``rows`` whose values in ``keys``' columns are no row of ``keys``."""
    marked = rows.merge(keys, on=list(keys.columns), how="left", indicator=True)
    return marked[marked["_merge"] == "left_only"].drop(columns="_merge")


def _handed_back(rows: pd.DataFrame, step: list[str]) -> pd.DataFrame:
    """``step`` keys, ``call_a`` and ``index`` of the inputs a call returns as an output with
    the same bits (``rows["identity"]``: one side's :func:`identities`)."""
    known = rows[rows["identity"].notna()]
    inputs = known.loc[known["kind"] == fmt.INPUT, [*STEP, "call_a", "index", "identity"]]
    outputs = known.loc[known["kind"] == fmt.OUTPUT, [*STEP, "call_a", "identity"]]
    return inputs.merge(outputs, on=[*STEP, "call_a", "identity"])[
        [*STEP, "call_a", "index"]].drop_duplicates()


def measure(pairs: pd.DataFrame, files_a: dict, files_b: dict, chunk_elements: int
            ) -> dict[int, dict]:
    """``TRANSIT_COLUMNS`` per later record of each link (:func:`links`, :func:`sum_links`,
    :func:`fan_out_links`), by row label; ``files_a``, ``files_b``: the step files by
    (epoch, step, rank)."""
    out: dict[int, dict] = {}

    def note(later: int, diff: float, earlier: list[pd.Series]) -> None:
        if math.isnan(diff) or (later in out and diff <= out[later]["transit_rel_diff"]):
            return
        out[later] = {"transit_rel_diff": diff, "transit_from": SUM_OF_RECORDS.join(
            fmt.record_label(e["module"], e["cls_a"], e["call_idx"], e["kind"], e["index"],
                             e["occurrence"]) for e in earlier)}
    with StepReaders(files_a) as readers_a, StepReaders(files_b) as readers_b:
        found = links(pairs)
        linked = sorted({row for link in found for row in link})
        in_b = dict(zip(linked, identities(pairs.loc[linked], "b")))
        for earlier, later in found:
            e, l = pairs.loc[earlier], pairs.loc[later]
            key = (e["epoch"], e["step"], e["rank"])
            if in_b[earlier] is not None and in_b[earlier] == in_b[later]:
                note(later, 0.0, [e])  # B's bits agree
                continue
            with reading(str(files_b[key].path)):
                note(later, _difference(e, l, readers_b[key], chunk_elements), [e])
        for terms, totals in sum_links(pairs) + fan_out_links(pairs):
            rows, ends = [pairs.loc[t] for t in terms], [pairs.loc[t] for t in totals]
            key = (rows[0]["epoch"], rows[0]["step"], rows[0]["rank"])
            if not all(r["dataset_a"] and r["dataset_b"] for r in (*rows, *ends)) or len(
                    {tuple(r[f"shape_{s}"]) for r in (*rows, *ends) for s in "ab"}) > 1:
                continue  # values of one shape on both sides are needed
            replaced = _replaced(pairs.loc[list(terms)]).to_numpy()
            if any(r["dtype_b"] not in ROUNDABLE for r in itertools.compress(rows, replaced)):
                continue  # B summed A's value cast to a dtype this cannot round to
            with reading(str(files_a[key].path)):
                in_a = _sum_differences(*([_values(readers_a[key], r, chunk_elements, "a")
                                           for r in part] for part in (rows, ends[:1])))[0]
            unit = rounding_of(lowest(r["dtype_a"] for r in (*rows, *ends))).unit
            if not in_a <= math.sqrt(len(rows) - 1) * unit:  # one per addition (evidence)
                continue  # the sum's uses are not all recorded, or it is not what A does
            with reading(str(files_b[key].path)):  # a term B replaced: A's value, as B's
                summed = [(rounded(part, r["dtype_b"], r["grad_scale_b"]) for part in _values(
                              readers_a[key], r, chunk_elements, "a")) if was_replaced
                          else _values(readers_b[key], r, chunk_elements)
                          for r, was_replaced in zip(rows, replaced)]
                for total, diff in zip(totals, _sum_differences(
                        summed, [_values(readers_b[key], r, chunk_elements) for r in ends])):
                    note(total, diff, rows)
    return out


def _sum_differences(terms: list[Iterator[np.ndarray]], totals: list[Iterator[np.ndarray]]
                     ) -> list[float]:
    """Per total, ``||total - sum(terms)|| / || sum(|terms|) ||`` from their values in chunks
    (:func:`_values`): how far it lies from the terms' sum, relative to the terms' magnitude
    (what rounding their sum may move it by, whatever they cancel)."""
    squares = np.zeros(len(totals) + 1)
    for parts in itertools.zip_longest(*terms, *totals):
        wide = np.complex128 if any(np.iscomplexobj(p) for p in parts) else np.float64
        parts = [p.astype(wide, copy=False) for p in parts]
        summed = np.sum(parts[:len(terms)], axis=0)
        squares[-1] += np.square(np.sum(np.abs(parts[:len(terms)]), axis=0)).sum()
        for k, whole in enumerate(parts[len(terms):]):
            squares[k] += np.square(np.abs(whole - summed)).sum()
    return [0.0 if d == 0 else math.sqrt(d / squares[-1]) if squares[-1] > 0 else math.inf
            for d in squares[:-1]]


def _difference(earlier: pd.Series, later: pd.Series, reader: StepReader, chunk_elements: int
                ) -> float:
    """``transit_rel_diff`` of one link whose bits differ in B (NaN where B's records cannot
    say)."""
    rows = (earlier, later)
    if tuple(earlier["shape_b"]) != tuple(later["shape_b"]):
        return math.inf
    if all(r["dataset_b"] and r["digest_b"] == fmt.NO_DIGEST for r in rows):
        squares = np.zeros(2)
        # zip_longest: both readers end, which checks their checksums
        for x, y in itertools.zip_longest(*(_values(reader, r, chunk_elements) for r in rows)):
            wide = np.complex128 if np.iscomplexobj(x) or np.iscomplexobj(y) else np.float64
            x, y = x.astype(wide, copy=False), y.astype(wide, copy=False)
            squares += (np.square(np.abs(y - x)).sum(), np.square(np.abs(x)).sum())
        if squares[0] == 0:
            return 0.0
        return math.sqrt(squares[0] / squares[1]) if squares[1] > 0 else math.inf
    if all(r["digest_b"] != fmt.NO_DIGEST or r["dataset_b"] for r in rows):
        # a digest stands for values: bits of one dtype differ, by how much it does not say
        # (of two dtypes, a cast changes them: it cannot say)
        same = earlier["dtype_b"] == later["dtype_b"] and earlier["encoding_b"] == later[
            "encoding_b"]
        return math.inf if same else math.nan
    norms = earlier["stat_norm_b"], later["stat_norm_b"]
    return abs(norms[1] - norms[0]) / norms[0] if norms[0] > 0 else math.nan


def _values(reader: StepReader, row: pd.Series, chunk_elements: int, side: str = "b"
            ) -> Iterator[np.ndarray]:
    """One side's values of ``row`` (``reader``: its step's :class:`compare.dump.StepReader`)."""
    return read_chunks(reader.dataset(one_side(row, side)), row[f"dtype_{side}"],
                       row[f"encoding_{side}"], chunk_elements, int(row[f"checksum_{side}"]),
                       row[f"grad_scale_{side}"])

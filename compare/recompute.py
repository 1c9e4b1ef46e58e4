"""A call recomputed from its own records: what B's computation of one call added.

Where a module's class says what it computes (:mod:`compare.formulas`: ``Linear``,
convolutions, elementwise activations, normalizations, ``Embedding``, adaptive average
pools; among op records, elementwise functions, elementwise ops and matrix products of two
tensors, softmaxes, sums and means, scaled dot-product attention), its output
follows from its input and weights, and the gradient it sends back from the gradient that
arrives and its input.
Recomputed in float64 from B's own records of the call, the difference is what B's
computation of that call added, whatever error its operands carried: the error of a call's
own forward or backward, measured exactly where the error figures of
:mod:`compare.verdict` can only bound it (a gradient that already carries 10 % hides a 10 %
error added to it). Per ``output[0]`` and ``grad_input[0]`` record of such a call (and the
gradients of an op's other tensor operands: ``grad_input[1]`` of an op of two, an
attention's key, value and mask):

``recomputed_rel_err``
    ``||b - f(b's operands)|| / ||f(b's operands)||``;
``recomputed_spread``
    ``||sqrt(sum_k term_k²)|| / ||f(b's operands)||`` over the terms an element sums (1 for
    an elementwise function): how far rounding the operands may move the result, relative
    to it; more where the terms cancel;
``recomputed_terms``
    the number of terms an element sums (1 for an elementwise function);
``recomputed_stride``
    1 where every sample of the call was recomputed, k where every k-th (a large call);
``recomputed_dtype``
    the lowest dtype of B's records it was recomputed from and of the record (a call may
    round through any dtype it is given: an RMSNorm of a bfloat16 input rounds its
    normalized values to bfloat16, then scales them by float32 weights).

Rounding explains :func:`compare.formulas.allowed` of it. Where B ran on A's values
(``injected``: its record holds what B would have used), the call's operands are A's, rounded
to the dtype B holds them in. B's
weights are B's values (``params=True``), else A's where B's are known to be the same (B ran
on A's; or their statistics and sketch agree to float64 rounding); calls whose weights are
neither have no figures. The formula is the class's candidate that A's records follow best
within A's rounding (each side at its own recorded ``eps``): where none does (a class of that
name that computes something else; TF32 in A), no figures; nor for records of statistics or
digests, non-finite values (among those recomputed), and weights of more than
:data:`MAX_ELEMENTS` elements (an ``Embedding``'s: of the rows its input names, the only
ones read). A large call is recomputed on every k-th of the samples its formula treats apart
(:data:`SAMPLE_ELEMENTS`, :data:`SAMPLE_PRODUCTS`; a BatchNorm's channels): time and memory
stay bounded.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import h5py
import numpy as np
import pandas as pd

from . import format as fmt
from .decoding import decode, unscaled
from .dump import StepReaders, one_side, reading
from .pairing import from_shards
from .arguments import same_number
from .attributes import NO_ATTRIBUTES, Attributes, Recorded
from .centering import BATCH_NORM
from .attention import ATTENTION, ATTENTION_OPERANDS, ATTENTION_OPTIONS
from .formulas import (BIAS_GRADIENTS, CONVOLUTIONS, ELEMENTWISE, GATHERS, OVER_DIM, POOLS,
                       PRODUCTS, ROUNDS_RESULT, TWO_TENSORS, UNWEIGHTED, WEIGHTED, allowed,
                       candidates, near_zero_roundings, rounds_operands)
from .operands import RECOMPUTE_FIGURES, Operands
from .precision import BINARY_FORMATS, lowest, precision_of, rounded, rounding_of
from .statistics import STATS_RESOLUTION

RECOMPUTE_COLUMNS = (*RECOMPUTE_FIGURES, "recomputed_stride", "recomputed_dtype")
MAX_ELEMENTS = 1 << 24  # per weight: 128 MiB in float64
# A call is recomputed on at most this many elements of each of its records, and a weighted
# call with at most this many products: beyond that, on every k-th of the samples its formula
# treats apart (_Call._sampling), the same in every record and on both sides.
SAMPLE_ELEMENTS = 1 << 20
SAMPLE_PRODUCTS = 1 << 28
FLOATS = ("float64", "float32", "float16", "bfloat16")  # what is recomputed from
INDICES = ("int64", "int32")  # what a gathering call's input is (torch takes these only)
MASKS = (*FLOATS, "bool")  # what an attention's mask is: added, or where it may look
MASK = ATTENTION_OPERANDS.index("attn_mask")  # its position


# the records a check reads besides its own: forward from the input, backward from the
# gradient that arrives (and the input, for an elementwise function)
NEEDS = {fmt.OUTPUT: (fmt.INPUT,), fmt.GRAD_INPUT: (fmt.GRAD_OUTPUT, fmt.INPUT),
         fmt.PARAM_GRAD: (fmt.GRAD_OUTPUT,)}


def _argument_paths(name: str, position: Optional[int]) -> tuple[str, ...]:
    """Where an op's argument ``name`` is recorded (docs/format.md, ``path``): at its
    ``position`` (None: keyword only), or by name."""
    return (*(() if position is None else (f"args[{position}]",)), f"kwargs['{name}']")


# the paths of an op's tensor operands, by position: an op of two tensors' (TWO_TENSORS) given
# by position, an attention's by position or name
OPERAND_PATHS = {**{op: (("args[0]",), ("args[1]",)) for op in TWO_TENSORS},
                 ATTENTION: tuple(_argument_paths(name, position)
                                  for position, name in enumerate(ATTENTION_OPERANDS))}
# an operand's position by op and path
OPERAND_AT = {(op, path): position for op, positions in OPERAND_PATHS.items()
              for position, paths in enumerate(positions) for path in paths}
# the paths of an op's options (Operands.options), by parameter name
OPTION_PATHS = {ATTENTION: {name: _argument_paths(name, position)
                            for name, position in ATTENTION_OPTIONS.items()}}
# where an op over a dimension (OVER_DIM) is given it
DIM_PATHS = ("args[1]", "kwargs['dim']")


class _Sampling(NamedTuple):
    """Which slices of a call's records it is recomputed on: every ``stride``-th of the
    samples along its leading ``axes`` flattened into one (0: whole), or every
    ``stride``-th channel (axis 1) and parameter element (``channels``: a BatchNorm)."""

    axes: int
    channels: bool
    stride: int


def recomputable(pairs: pd.DataFrame) -> pd.DataFrame:
    """The rows of calls whose class :func:`compare.formulas.candidates` knows, on both sides,
    the same class in both, first occurrences, tensor index 0 (and the calls' weights and
    their bias's gradient; an op of several operands, each and their gradients); none put
    together from shards."""
    classes = pairs["cls_a"].dropna().unique()  # NaN: recorded in B only
    known = pairs["cls_a"].isin([c for c in classes if candidates(str(c))]) & (
        pairs["cls_a"] == pairs["cls_b"])
    operands = pd.Series(list(zip(pairs["cls_a"], pairs["path_a"])), index=pairs.index,
                         dtype=object).isin(list(OPERAND_AT)) & pairs["kind"].isin(
        [fmt.INPUT, fmt.GRAD_INPUT])
    data = ((pairs["index"] == 0) | operands) & (pairs["occurrence"] == 0) & pairs["kind"].isin(
        [fmt.INPUT, fmt.OUTPUT, fmt.GRAD_OUTPUT, fmt.GRAD_INPUT])
    weights = (pairs["kind"] == fmt.PARAM) & pairs["path_a"].isin(["weight", "bias"])
    bias = (pairs["kind"] == fmt.PARAM_GRAD) & (pairs["path_a"] == "bias")
    return pairs[known & (pairs["side"] == "both") & (data | weights | bias)
                 & ~from_shards(pairs)]


# what a recomputation reads of the comparison's figures: the record's scale, and whether
# B's weights are A's
FIGURES_READ = ("rms_a", "stat_rel_diff", "rel_err_from_stats")


class _Work(NamedTuple):
    """One call to recompute: its step's key, its rows by label, the module's recorded
    attributes per side, and the comparison's figures of its rows (``FIGURES_READ``)."""

    step: tuple
    rows: dict[int, dict]
    recorded: dict[str, Recorded]
    figures: dict[int, dict]


def measure(pairs: pd.DataFrame, files_a: dict, files_b: dict, metrics: dict[int, dict],
            attributes: dict[str, Attributes], runner: Callable = map, jobs: int = 1
            ) -> dict[int, dict]:
    """``RECOMPUTE_COLUMNS`` per ``output[0]``/``grad_input[0]`` row label of the calls
    :func:`recomputable` gives; ``metrics``: the comparison's figures by row label (whether
    B's weights are A's); ``attributes``: each side's recorded module attributes (eps,
    convolution geometry) by ``"a"``, ``"b"`` (B's under A's names, or none where they
    differ: then A's). The calls are recomputed in ``jobs`` parts of about equal size, by
    ``runner`` (``map``, or a process pool's or a cluster's)."""
    rows = recomputable(pairs)
    records = rows.to_dict("index")
    work = []
    for key, labels in rows.groupby(["epoch", "step", "rank", "call_a"], sort=False).groups.items():
        call = {label: records[label] for label in labels}
        first = call[labels[0]]
        at = (*key[:3], first["module"])
        a = attributes["a"].at(at, NO_ATTRIBUTES, int(first["call_a"]))
        b = attributes["b"].at(at, attributes["a"], int(first["call_b"]))
        # B at its own eps (torch's RMSNorm without one takes its dtype's), at A's geometry:
        # a convolution that slides otherwise than A's computes something else
        recorded = {"a": a, "b": b._replace(conv=a.conv or b.conv, numbers=_numbers_for_b(
            a.numbers, b.numbers, _unit(call.values())))}
        figures = {label: {k: v for k, v in metrics.get(label, {}).items() if k in FIGURES_READ}
                   for label in labels}
        work.append(_Work(key[:3], call, recorded, figures))
    out: dict[int, dict] = {}
    for part in runner(_measure_part, _parts(work, files_a, files_b, jobs)):
        out.update(part)
    return out


def _numbers_for_b(a: dict, b: dict, unit: float) -> dict:
    """The numbers a call of B is recomputed at, by path: its own where they are the same
    argument as A's (:func:`compare.arguments.same_number`: a mask's fill of each run's
    dtype, a value from data within one rounding), A's where B was given another (code that
    scales by another number, or softmaxes over another dim, computes something else); none
    where B recorded none (its names mapped from A's: not known)."""
    return {path: value if path not in a or same_number(a[path], value, unit) else a[path]
            for path, value in b.items()}


def _unit(rows) -> float:
    """A call's rounding: the unit roundoff of the lowest precision of its floating records
    (``rows`` as dicts), on either side."""
    return max((rounding_of(precision_of(r["dtype_a"], r["dtype_b"])).unit for r in rows
                if r["dtype_a"] in BINARY_FORMATS and r["dtype_b"] in BINARY_FORMATS),
               default=0.0)


def _parts(work: list[_Work], files_a: dict, files_b: dict, jobs: int) -> list[tuple]:
    """``work`` cut into at most ``jobs`` tasks of about equal elements (each with the
    locations of the step files it reads), the largest calls placed first."""
    size = {id(w): sum(math.prod(_shape(r, "a")) for r in w.rows.values()
                       if r["kind"] != fmt.PARAM or r["cls_a"] not in GATHERS) for w in work}
    parts: list[list[_Work]] = [[] for _ in range(max(1, min(jobs, len(work))))]
    loads = [0] * len(parts)
    for w in sorted(work, key=lambda w: -size[id(w)]):
        least = loads.index(min(loads))
        parts[least].append(w)
        loads[least] += size[id(w)]
    return [({w.step: files_a[w.step].location for w in part},
             {w.step: files_b[w.step].location for w in part}, part) for part in parts if part]


def _measure_part(task: tuple) -> dict[int, dict]:
    """:func:`measure`'s figures of one part's calls (a task of :func:`_parts`)."""
    locations_a, locations_b, work = task
    out: dict[int, dict] = {}
    with StepReaders(locations_a) as readers_a, StepReaders(locations_b) as readers_b:
        for w in work:
            recomputed = _Call(w.rows, {"a": readers_a, "b": readers_b}, w.figures, w.recorded)
            for kind, operand in recomputed.records():
                with reading(" or ".join(str(f[w.step].path) for f in (locations_a,
                                                                        locations_b))):
                    label, figures = recomputed.check(kind, operand)
                if figures is not None:
                    out[label] = figures
    return out


def _columns(formula, kind: str, operands: Operands) -> Optional[dict]:
    """``formula``'s figures, or None where the operands do not fit it (shapes it does not
    expect, e.g. a parameter of another shape than the class's)."""
    try:
        figures = formula(kind, operands)
    except (ValueError, IndexError):  # numpy: operands of shapes the formula cannot take
        return None
    return None if figures is None else figures.columns()


class _Call:
    """One call's records, read on demand from both sides."""

    def __init__(self, rows: dict[int, dict], readers: dict[str, StepReaders],
                 metrics: dict[int, dict], recorded: dict[str, Recorded]):
        """``rows``: the call's rows of :func:`recomputable` as dicts, by row label;
        ``recorded``: the module's attributes it is recomputed at, per side."""
        self.metrics, self.readers, self.recorded = metrics, readers, recorded
        self.by_kind: dict[str, dict] = {}  # the call's records, and its parameters by name
        self.params: dict[str, dict] = {}
        # an op of several operands: the records of those after the first and their
        # gradients (the first's are by_kind's), by position, by kind
        cls = self.cls = next(iter(rows.values()))["cls_a"]
        self.others: list[dict[str, dict]] = [{} for _ in OPERAND_PATHS.get(cls, ())[1:]]
        self.bias_grad: Optional[dict] = None  # the gradient of its bias, summed over positions
        for label, row in rows.items():
            row = {**row, "label": label}
            position = OPERAND_AT.get((cls, row["path_a"]))
            if row["kind"] == fmt.PARAM_GRAD:
                self.bias_grad = row
            elif row["kind"] == fmt.PARAM:
                self.params.setdefault(row["path_a"], row)
            elif cls in OPERAND_PATHS and row["kind"] in (fmt.INPUT, fmt.GRAD_INPUT):
                if position == 0:
                    self.by_kind.setdefault(row["kind"], row)
                elif position is not None:  # (else given by a name not known: not recomputed)
                    self.others[position - 1].setdefault(row["kind"], row)
            else:
                self.by_kind.setdefault(row["kind"], row)
        self.formulas, self.takes_weights = candidates(cls), cls not in UNWEIGHTED
        self.two_operands = cls in TWO_TENSORS
        self.over_dim = cls in OVER_DIM  # works over the dim it was given
        self.gathers = cls in GATHERS  # its weight is read at the rows its input names
        self.sampling = self._sampling(cls)
        self.cache: dict[tuple, Optional[np.ndarray]] = {}

    def _sampling(self, cls: str) -> Optional[_Sampling]:
        """Which slices of the call's records it is recomputed on (``SAMPLE_ELEMENTS``,
        ``SAMPLE_PRODUCTS``): every k-th of the samples its formula treats apart, as coarse
        as fit (slices of the first axis, else the rows of more leading axes, down to a
        Linear's rows or an activation's elements), or, for a BatchNorm, every k-th channel;
        None where not even one fits, or the records' samples do not line up (shapes that
        differ between the sides: the comparison did not read those values)."""
        rows = [*self.by_kind.values(), *(r for o in self.others for r in o.values()),
                *self.params.values()]
        if any(_shape(r, "a") != _shape(r, "b") for r in rows):
            return None
        if cls == ATTENTION:
            return self._attention_sampling([_shape(r, "a") for r in rows])
        # operands broadcast against each other, or reduced over a dim: whole, where they fit
        if cls in TWO_TENSORS or cls in OVER_DIM:
            fits = max((math.prod(_shape(r, "a")) for r in rows), default=0) <= SAMPLE_ELEMENTS
            if cls in PRODUCTS:  # each element of the result sums the first operand's last axis
                result = self.by_kind.get(fmt.OUTPUT) or self.by_kind.get(fmt.GRAD_OUTPUT)
                first = self.by_kind.get(fmt.INPUT)
                fits = fits and result is not None and first is not None and math.prod(
                    _shape(result, "a")) * math.prod(_shape(first, "a")[-1:]) <= SAMPLE_PRODUCTS
            return _Sampling(0, False, 1) if fits else None
        shapes = [_shape(row, "a") for row in self.by_kind.values()]
        # the axes samples may lie along: a gathering call's output has a row per index
        leading = [s[:-1] if self.gathers and kind != fmt.INPUT else s
                   for kind, s in zip(self.by_kind, shapes)]
        ndims = {len(s) for s in leading}
        if len(ndims) != 1:  # parameters only (nothing to recompute), or records that differ
            return None
        ndim = ndims.pop()
        channels = BATCH_NORM in cls and ndim >= 2
        finest = 0 if channels else self._sample_axes(cls, ndim, leading)
        weight = self.params.get("weight")
        # multiply-adds per element of a sample: a weighted call's smaller weight dimension
        # (times a convolution's kernel size)
        products = math.prod(_shape(weight, "a")[2:]) * min(_shape(weight, "a")[:2]) if (
            cls in WEIGHTED and weight) else 0
        for axes in range(min(1, finest), finest + 1):  # the coarsest samples first
            samples = {s[1] if channels else math.prod(s[:axes]) for s in leading}
            count = samples.pop()
            per_sample = max(math.prod(s) for s in shapes) // max(count, 1)
            if samples or per_sample == 0:
                return None
            fit = SAMPLE_ELEMENTS // per_sample
            if products:
                fit = min(fit, SAMPLE_PRODUCTS // max(1, per_sample * products))
            if fit >= 1:
                return _Sampling(axes, channels, -(-count // fit))
        return None

    def _attention_sampling(self, shapes: list[tuple]) -> Optional[_Sampling]:
        """An attention's: whole where its scores (each query against each key, per batch and
        head) fit ``SAMPLE_ELEMENTS`` and their products ``SAMPLE_PRODUCTS``, else every k-th
        slice of the first axis where each of its records (``shapes``) has it (a batch); None
        where neither fits."""
        query, key = self.by_kind.get(fmt.INPUT), self.others[0].get(fmt.INPUT)
        result = self.by_kind.get(fmt.OUTPUT) or self.by_kind.get(fmt.GRAD_OUTPUT)
        if query is None or key is None or result is None:
            return None
        query, key, result = (_shape(r, "a") for r in (query, key, result))
        if min(len(query), len(key), len(result)) < 2:
            return None
        scores = math.prod(result[:-1]) * key[-2]
        features = max(query[-1], result[-1], 1)
        # (a mask of fewer axes broadcasts along the leading ones: not a batch's)
        count = result[0] if all(len(s) == len(result) >= 3 and s[0] == result[0]
                                 for s in shapes) else 1
        per_sample = -(-scores // max(count, 1))
        fit = min(SAMPLE_ELEMENTS // max(per_sample, 1),
                  SAMPLE_PRODUCTS // max(per_sample * features, 1))
        if fit >= count:
            return _Sampling(0, False, 1)
        return _Sampling(1, False, -(-count // fit)) if fit >= 1 and count > 1 else None

    def _sample_axes(self, cls: str, ndim: int, shapes: list[tuple]) -> int:
        """How many leading axes of the call's records hold samples its formula treats apart
        (0: it needs them whole)."""
        if BATCH_NORM in cls:
            return 0
        if cls in ELEMENTWISE or self.gathers:
            return ndim
        if cls in POOLS:  # each channel of each sample apart
            return max(ndim - POOLS[cls], 0)
        if cls in WEIGHTED:
            return 1 if cls in CONVOLUTIONS else max(ndim - 1, 0)
        # a LayerNorm or RMSNorm: over the trailing axes its weight spans, else per row or
        # position (channels first): never the axes it normalizes over
        weight = self.params.get("weight")
        span = _shape(weight, "a") if weight else ()
        if span and len(span) < ndim and all(s[ndim - len(span):] == span for s in shapes):
            return ndim - len(span)
        return max(0, min(1, ndim - 1))

    def records(self) -> list[tuple[str, int]]:
        """``(kind, operand)`` of the records :meth:`check` recomputes: the output and the
        gradient sent back, of an op of several operands for each, and its bias's gradient.
        (One tensor given at several places, ``x * x``, has its gradient recorded once, the
        sum of what each place sends back: A's records do not follow the formula there.)"""
        return [(fmt.OUTPUT, 0), (fmt.GRAD_INPUT, 0)] + [
            (fmt.GRAD_INPUT, position) for position, records in enumerate(self.others, 1)
            if fmt.GRAD_INPUT in records] + (
            [(fmt.PARAM_GRAD, 0)] if self.bias_grad is not None else [])

    def check(self, kind: str, operand: int = 0) -> tuple[Optional[int], Optional[dict]]:
        """The row label of the call's ``kind`` record (of an op of several operands, the
        gradient of ``operand``) and B's figures, recomputed by the formula A's records follow
        best within A's rounding; None, None where none does."""
        records = self.by_kind if operand == 0 else {
            **self.by_kind, kind: self.others[operand - 1].get(kind)}
        summed = kind == fmt.PARAM_GRAD  # over every position: each sample is needed
        if summed:
            records = {**records, kind: self.bias_grad}
        if self.sampling is None or records.get(kind) is None or (
                kind != fmt.OUTPUT and fmt.GRAD_OUTPUT not in records) or (
                summed and self.sampling.stride != 1):
            return None, None
        row = records[kind]
        needed = [k for k in (kind, *NEEDS[kind]) if k in records]
        operands = {side: self._operands(kind, {k: records[k] for k in needed}, side, operand)
                    for side in ("a", "b")}
        if any(o is None for o in operands.values()):
            return None, None
        # a call rounds through the lowest dtype it is given (an op's second operand too),
        # or, rounding only its result, through the result's
        given = [*(records[k] for k in needed), *self.params.values(),
                 *(o[fmt.INPUT] for o in self.others if fmt.INPUT in o)]
        dtype = {side: row[f"dtype_{side}"] if row["cls_a"] in ROUNDS_RESULT and not summed
                 else lowest([r[f"dtype_{side}"] for r in given]) for side in ("a", "b")}
        rounding = rounding_of(dtype["a"])
        # (where A's rounding underflows: at the scale A held its values at, a loss scale's)
        scale = self.metrics.get(row["label"], {}).get("rms_a", math.nan) * row["grad_scale_a"]
        fits = []  # (how far within A's rounding, formula) of the formulas A's records follow
        for formula in BIAS_GRADIENTS if summed else self.formulas:
            a = _columns(formula, kind, operands["a"])
            if a is not None:
                ratio = a["recomputed_rel_err"] / allowed(
                    rounding.unit, a["recomputed_spread"], a["recomputed_terms"],
                    rounding.underflow, scale, near_zero_roundings(row["cls_a"],
                                                                   a["recomputed_terms"]),
                    rounds_operands(row["cls_a"], kind), a["recomputed_accumulation"])
                if ratio <= 1:
                    fits.append((ratio, len(fits), formula))
        if not fits:
            return None, None  # not what A computes
        b = _columns(min(fits)[2], kind, operands["b"])
        if b is None:
            return None, None
        return row["label"], {**b, "recomputed_stride": float(self.sampling.stride),
                              "recomputed_dtype": dtype["b"]}

    def _operands(self, kind: str, needed: dict[str, dict], side: str, operand: int
                  ) -> Optional[Operands]:
        """The call's records ``needed`` (by kind) and parameters on ``side``, an op's other
        operands and options (None where one of them is not known)."""
        tensors = {k: self._operand(row, side) if k != kind else self._tensor(row, side)
                   for k, row in needed.items()}
        params = {p: self._weight(p, side) for p in ("weight", "bias") if p in self.params}
        others = self._others(side)
        if any(v is None for v in (*tensors.values(), *params.values())) or others is None:
            return None
        if not params and self.takes_weights and needed[kind]["call_idx"] > 0:
            return None  # its weights are recorded at the module's first call only
        recorded = self.recorded[side]
        return Operands(tensors, params.get("weight"), params.get("bias"), eps=recorded.eps,
                        conv=recorded.conv, rows=self._rows() if self.gathers else None,
                        others=others, operand=operand, dim=self._dim(side),
                        options=self._options(side))

    def _others(self, side: str) -> Optional[tuple]:
        """An op's operands after its first on ``side``, by position (:attr:`Operands.others`):
        their tensors; of an op of two operands, else the number it was given at
        ``args[1]`` (``x * 0.5``; a 0-d array, which broadcasts; B's as :func:`_numbers_for_b`
        says); an attention's mask as added to its scores (a boolean one: ``-inf`` where it
        may not look), None where it was given none. None where one given is not known."""
        values = []
        for position, records in enumerate(self.others, 1):
            row = records.get(fmt.INPUT)
            if row is not None:
                value = self._operand(row, side)
                if value is not None and row[f"dtype_{side}"] == "bool":
                    value = np.where(value != 0, 0.0, -np.inf)
            elif self.two_operands:
                number = self.recorded[side].numbers.get(OPERAND_PATHS[self.cls][position][0])
                value = None if number is None else np.array(number)
            else:
                values.append(None)  # given none
                continue
            if value is None:
                return None
            values.append(value)
        return tuple(values)

    def _options(self, side: str) -> dict:
        """The numbers and flags the call was given, by parameter name
        (:attr:`Operands.options`; B's as :func:`_numbers_for_b` says)."""
        numbers, options = self.recorded[side].numbers, {}
        for name, paths in OPTION_PATHS.get(self.cls, {}).items():
            given = [numbers[path] for path in paths if path in numbers]
            if given:
                options[name] = given[0]
        return options

    def _dim(self, side: str) -> Optional[int]:
        """The dimension the call was given to work over (``DIM_PATHS``; B's as
        :func:`_numbers_for_b` says), None where it was given none or takes none."""
        if not self.over_dim:
            return None
        numbers = self.recorded[side].numbers
        given = [numbers[path] for path in DIM_PATHS if path in numbers]
        return int(given[0]) if given and float(given[0]).is_integer() else None

    def _rows(self) -> Optional[np.ndarray]:
        """A gathering call's weight rows its input names on either side, in increasing
        order (None: no input known): all the weight it is recomputed from."""
        key = ("rows",)
        if key not in self.cache:
            named = [self._operand(self.by_kind[fmt.INPUT], side) for side in ("a", "b")
                     ] if fmt.INPUT in self.by_kind else []
            named = [n for n in named if n is not None]
            self.cache[key] = np.unique(np.concatenate([n.ravel() for n in named])).astype(
                np.int64) if named else None
        return self.cache[key]

    def _operand(self, row: dict, side: str) -> Optional[np.ndarray]:
        """What the call computed from on ``side``: where B ran on A's values (``injected``),
        A's rounded to the dtype B holds there, at B's loss scale (its record holds what B
        would have used; a float32 gradient of 2e-7 cast to float16 is 8 % off, at a loss
        scale of 1024 a rounding)."""
        if side == "b" and row["injected_b"] == 1:
            key = (row["label"], "a as b")
            if key not in self.cache:
                values = self._tensor(row, "a")
                self.cache[key] = (values if values is None or row["dtype_b"] not in FLOATS
                                   else rounded(values, row["dtype_b"], row["grad_scale_b"]))
            return self.cache[key]
        return self._tensor(row, side)

    def _weight(self, path: str, side: str) -> Optional[np.ndarray]:
        """The call's parameter ``path`` on ``side``: B's values, A's where B ran on them
        (:meth:`_operand`), else A's where B's are known to be the same (statistics and
        sketch equal to float64 rounding)."""
        row = self.params[path]
        if side == "b" and not row["dataset_b"] and row["injected_b"] != 1:
            figures = self.metrics.get(row["label"], {})
            if max(figures.get("stat_rel_diff", math.inf),
                   figures.get("rel_err_from_stats", math.inf)) < STATS_RESOLUTION:
                side = "a"
        return self._operand(row, side)

    def _tensor(self, row: dict, side: str) -> Optional[np.ndarray]:
        """``row``'s values on ``side`` in float64, or None where it holds none to use; only
        the samples of :attr:`sampling` (a record's with its sampled axes flattened into one;
        a BatchNorm's parameters at the channels sampled)."""
        key = (row["label"], side)
        if key not in self.cache:
            self.cache[key] = None
            shape = _shape(row, side)
            param, sampling = row["kind"] in (fmt.PARAM, fmt.PARAM_GRAD), self.sampling
            gathered = param and self.gathers  # read at the rows its input names only
            rows = self._rows() if gathered else None  # (reads the inputs)
            mask = row["kind"] == fmt.INPUT and OPERAND_AT.get((self.cls, row["path_a"])) == MASK
            dtypes = (INDICES if self.gathers and row["kind"] == fmt.INPUT else
                      MASKS if mask else FLOATS)
            elements = math.prod(shape) if rows is None else len(rows) * math.prod(shape[1:])
            usable = (row[f"dataset_{side}"] and row[f"dtype_{side}"] in dtypes and
                      row[f"digest_{side}"] == fmt.NO_DIGEST and sampling is not None and
                      0 < elements <= (MAX_ELEMENTS if param else math.inf) and
                      (not gathered or rows is not None and len(shape) == 2
                       and 0 <= rows[0] and rows[-1] < shape[0]))
            if usable:
                reader = self.readers[side][(row["epoch"], row["step"], row["rank"])]
                ds = reader.dataset(one_side(row, side))
                stored = ds[rows] if gathered else _sampled(ds, shape, sampling, param)
                values = unscaled(decode(stored, row[f"dtype_{side}"], row[f"encoding_{side}"]),
                                  row[f"grad_scale_{side}"])
                # (a mask may hide keys at -inf)
                finite = ~np.isnan(values) & (values != np.inf) & (mask | (values != -np.inf))
                if not np.iscomplexobj(values) and finite.all():
                    self.cache[key] = values.astype(np.float64)
        return self.cache[key]


def _sampled(ds: h5py.Dataset, shape: tuple, sampling: _Sampling, param: bool) -> np.ndarray:
    """The stored values of ``ds`` (of ``shape``) that ``sampling`` keeps: a parameter whole
    (a BatchNorm's at the channels kept); a record's every ``stride``-th channel, or its
    sampled leading axes flattened into one and every ``stride``-th kept. Up to two sampled
    axes only the kept values are read (strided selections); beyond, the second axis in
    blocks (bounded memory). Not checked against its checksum: the comparison read and
    checked every value of records of equal shapes before."""
    k = sampling.stride
    if param:
        return ds[()].reshape(-1)[::k] if sampling.channels else np.asarray(ds[()])
    if sampling.channels:
        return ds[:, ::k]
    if sampling.axes <= 1:
        return ds[::k] if sampling.axes else np.asarray(ds[()])
    axes, trailing = sampling.axes, shape[sampling.axes:]
    rows = math.prod(shape[1:axes])  # in one slice of the first axis
    per_row = math.prod(shape[2:axes])  # rows in one index of the second axis
    block = max(1, SAMPLE_ELEMENTS // max(1, per_row * math.prod(trailing)))
    kept = []
    for index in range(shape[0]):
        if axes == 2:  # its rows are the second axis: one strided selection
            first = -(index * rows) % k
            if first < rows:
                kept.append(ds[index, first::k].reshape(-1, *trailing))
            continue
        for start in range(0, shape[1], block):  # read in bounded blocks of the second axis
            first = -(index * rows + start * per_row) % k
            if first < min(block, shape[1] - start) * per_row:
                part = ds[index, start:start + block].reshape(-1, *trailing)
                kept.append(part[first::k])
    return np.concatenate(kept)


def _shape(row: dict, side: str) -> tuple:
    """``row``'s shape on ``side``."""
    return tuple(int(n) for n in row[f"shape_{side}"])

"""Sums that cancel: a record made by adding up terms keeps their absolute errors.

A sum much smaller than its terms (a residual block whose branch nearly undoes its input, a
convolution's bias gradient before a BatchNorm, zero but for rounding) carries the terms'
errors at the terms' scale, which is many times its own relative error: a term of relative
error ``err_j`` and scale ``rms_j`` (over ``n_j`` elements) gives a record of scale ``rms``
(over ``n``) the relative error ``err_j · rms_j · sqrt(n_j / n) / rms``. Taken as sums:

- a gradient with an incoming one ``CANCELLATION`` times its scale or more (the largest such
  term counts);
- what a module call's own code adds up, where a child's result is among the terms and all
  are of the record's size (in quadrature, as independent rounding errors add; errors that
  one upstream error put in several terms may add in the same direction, which this
  understates): forward, the call's output
  from its inputs and the outputs of its last child, unless a recorded call consumed them
  (``x + mlp(x)``); backward, the grad_input of an input that children take too, from the
  call's incoming gradient and each such child's grad_input. Terms that cannot add up to the
  record (one larger than the record and the others together: an attention's output is not
  its input plus anything) are no sum; without the call's own, its children's may be;
- an input that its parent's own code computes (no recorded call output it) from the
  outputs of its earlier children that no recorded call took an output of (the code their
  only consumer): code that slices, sums or averages them hands on their absolute errors,
  whole at most (a slice of a fused projection may hold all of its output's error, counted
  as for a slice of ``1 / PARTS`` of it at most; an average of values that partly cancel is
  smaller than they are), in quadrature, at the record's scale (data that reached the code
  through a recorded call counts by its relative error, as everywhere). Bloom's attention
  context, of rms 0.083, averages the values' third of a query-key-value output of rms
  0.145 with the attention probabilities: the values carry 1.9e-6 where the whole output
  carries 1.3e-6, and the context 2.8e-6, within the output's 3.9e-6 at its scale. Not a
  bound for averages that give a few positions most of the weight (attention's
  probabilities may stretch a norm by up to the square root of the positions: 1.4 there).
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from . import format as fmt

CANCELLATION = 100.0  # a gradient this much smaller than the sum of its terms' scale cancels
# The most parts of one output that code between modules is taken to slice apart and use one
# of (a fused projection's query, key and value, or gate and up): a part may hold all of the
# output's error; a smaller slice (a class token of 256 positions) is charged this much.
PARTS = 4


class CallRows:
    """The rows of a comparison by ``(epoch, step, rank, call, kind, index)`` (rank -1 when
    not distributed): which record of which call each row is."""

    def __init__(self, frame: pd.DataFrame):
        self.keys = list(zip(frame["epoch"], frame["step"], frame["rank"].fillna(-1),
                             frame["call"], frame["kind"], frame["index"]))
        self._row = {k: i for i, k in enumerate(self.keys)}

    def of_call(self, i: int, kind: str) -> int | None:
        """The row of kind ``kind`` (same index) of row ``i``'s call, if recorded."""
        return self._row.get((*self.keys[i][:4], kind, self.keys[i][5]))


def terms_error(frame: pd.DataFrame, sources: list[np.ndarray], same: np.ndarray,
                given: np.ndarray) -> np.ndarray:
    """Per row, the relative error its terms' errors ``given`` give it where it is a sum of
    them or what code between modules made of them (see the module docstring), else 0.
    ``sources``: each row's source rows; ``same``: each row's first row of the same tensor."""
    rms = frame["rms_a"].to_numpy(float)
    numel = frame["numel"].to_numpy(float)
    kind = frame["kind"].to_numpy(object)
    incoming = kind == fmt.GRAD_OUTPUT
    out = np.zeros(len(frame))
    for i in np.flatnonzero(np.isin(kind, [fmt.GRAD_INPUT, fmt.PARAM_GRAD])):
        s = sources[i][incoming[sources[i]]]
        if not len(s) or not rms[i] > 0 or not numel[i] > 0:
            continue
        scaled = at_scale(rms, numel, s, i)
        big = scaled >= CANCELLATION
        if big.any():
            out[i] = float(np.max(scaled[big] * given[s][big]))
    rows = CallRows(frame)
    consumed = consumed_calls(frame, rows.keys)
    for i, terms in summed_terms(frame, sources, same, rows, consumed).items():
        if rms[i] > 0:
            out[i] = max(out[i], float(np.hypot.reduce(rms[terms] * given[terms])) / rms[i])
    computed = (kind == fmt.INPUT) & (frame["producer"].to_numpy() == fmt.NO_PRODUCER)
    for i in np.flatnonzero(computed & (rms > 0) & (numel > 0)):
        s = np.array([j for j in sources[i] if kind[j] == fmt.OUTPUT
                      and rows.keys[j][:4] not in consumed], dtype=np.int64)
        if len(s):  # (a slice of an output of more than PARTS times its size: PARTS)
            scaled = np.fmin(at_scale(rms, numel, s, i), math.sqrt(PARTS) * rms[s] / rms[i])
            out[i] = max(out[i], float(np.hypot.reduce(np.nan_to_num(scaled * given[s]))))
    return out


def at_scale(rms: np.ndarray, numel: np.ndarray, rows, i: int) -> np.ndarray:
    """What relative errors of ``rows`` are at row ``i``'s scale, ``rms_j · sqrt(n_j / n) /
    rms``: their absolute errors over ``i``'s norm (``rms``, ``numel``: of every row)."""
    return rms[rows] * np.sqrt(numel[rows] / numel[i]) / rms[i]


def consumed_calls(frame: pd.DataFrame, keys: list[tuple]) -> set[tuple]:
    """``(epoch, step, rank, call)`` of the calls whose outputs a recorded call took as an
    input (``keys``: :attr:`CallRows.keys`)."""
    return {(*k[:3], p) for k, p in zip(keys, frame["producer"]) if k[4] == fmt.INPUT}


def summed_terms(frame: pd.DataFrame, sources: list[np.ndarray], same: np.ndarray,
                 rows: CallRows, consumed: set[tuple]) -> dict[int, np.ndarray]:
    """Per output or grad_input that a call's own code may add up, its terms (the module
    docstring's second case; ``consumed``: :func:`consumed_calls`)."""
    key = rows.keys
    module = frame["module"].to_numpy(object)
    numel = frame["numel"].to_numpy(float)

    def child(j: int, i: int) -> bool:
        return module[j] != module[i] and module[j].startswith(
            f"{module[i]}." if module[i] else "")

    def took(j: int, x: int) -> bool:  # j's call took the tensor of input row x
        own_input = rows.of_call(j, fmt.INPUT)
        return own_input is not None and same[own_input] == same[x]

    rms = frame["rms_a"].to_numpy(float)

    def adds_up(terms: list[int], i: int) -> bool:  # the triangle inequality, norms alike
        norms = np.sort(rms[terms])
        return bool(norms[-1] <= (rms[i] + norms[:-1].sum()) * (1 + 1e-6))

    out = {}
    for i in np.flatnonzero(frame["kind"].isin([fmt.OUTPUT, fmt.GRAD_INPUT]).to_numpy()):
        s = sources[i][numel[sources[i]] == numel[i]]
        call = key[i][3]
        if key[i][4] == fmt.OUTPUT:
            own = [j for j in s if key[j][4] == fmt.INPUT and key[j][3] == call]
            outputs = [j for j in sources[i] if key[j][4] == fmt.OUTPUT and child(j, i)]
            last = max((key[j][3] for j in outputs), default=None)
            children = [j for j in s if key[j][4] == fmt.OUTPUT and key[j][3] == last
                        and child(j, i) and key[j][:4] not in consumed]
        else:
            x = rows.of_call(i, fmt.INPUT)
            if x is None:
                continue
            own = [j for j in s if key[j][4] == fmt.GRAD_OUTPUT and key[j][3] == call]
            children = [j for j in s if key[j][4] == fmt.GRAD_INPUT and child(j, i)
                        and took(j, x)]
        for terms in (own + children, children):
            if children and len(terms) >= 2 and adds_up(terms, i):
                out[i] = np.array(terms)
                break
    return out

"""Calls a run made in another order, paired by their arguments.

Records pair by module path and call number: the n-th call of a module in a step pairs with
the other run's n-th. A module called several times in a step with other names, integers or
flags each time may be called in another order by the other run: ModernBERT's and Gemma3's
rotary embedding is called once per attention type, in the order of a ``set`` of strings,
which changes with the process's hash seed. Numbering alone would pair the full-attention call
of one run with the sliding-window call of the other.

B's calls of a module take the number of A's call with the same *signature* (the path, type
and recorded text of each :data:`NAMING_TYPES` argument) where, in a step and micro-batch,

- each run's calls of the module have distinct signatures, and the two runs' sets are the same;
- in each run the calls were given the same tensors (by their checksums, digests or
  statistics), so that their order cannot change what they compute: a rotary embedding given
  the same hidden states and positions per attention type. Calls given other tensors may feed
  each other (a shared block told its layer index, each call given the last one's output):
  their order matters, and another order there is a difference, reported as their arguments
  (:mod:`compare.arguments`), not renumbered away.

The records renumbered are the calls' own (inputs, outputs and their gradients); a module's
weights are the same at each of its calls and keep their numbers. The calls made inside a
renumbered call, submodules' and ops' (their forward records lie between its first and its
last), take the number of the call at the same place inside A's
paired call: the n-th call of a module inside B's call, the n-th inside A's; where a module is
called a different number of times inside the paired calls, or renumbering would give two of
its calls one number, it keeps its numbers. Anywhere else the numbers stand.

A localizing re-run (:mod:`dumper.injection`) pairs its calls with the reference's by the same
rule, call by call as they start: a call whose signature is one of the reference's (where
those are distinct and given the same tensors) takes that call's values, and a call with one
the reference lacks takes none.
"""
from __future__ import annotations

import bisect
from typing import Iterable

import numpy as np
import pandas as pd

from . import format as fmt

STEP = ["epoch", "step", "rank"]
NAMING_TYPES = ("str", "int", "bool")  # the arguments that tell a module's calls apart
CALL_KINDS = (fmt.INPUT, fmt.OUTPUT, fmt.GRAD_INPUT, fmt.GRAD_OUTPUT)  # a call's own records
FORWARD_KINDS = (fmt.INPUT, fmt.PARAM, fmt.OUTPUT)  # recorded as a call starts and returns
Signature = tuple  # sorted (path, type name, recorded text) of a call's NAMING_TYPES arguments
Inside = dict  # module called inside -> the parent's call_idx -> its call_idxs there, in order


def signature(arguments: Iterable[tuple[str, str, str]]) -> Signature:
    """A call's signature from its non-tensor arguments' ``(path, type name, text)``."""
    return tuple(sorted(a for a in arguments if a[1] in NAMING_TYPES))


def module_calls(rows: pd.DataFrame, arguments: pd.DataFrame) -> pd.DataFrame:
    """One row per call of ``rows`` (records of a dump's index) with forward records: its
    step, ``module``, ``call_idx``, ``micro_batch``, execution order (``call``), the first and
    last ``seq`` of its forward records (``start``, ``end``: a call made inside it records
    between them), ``repeated`` (the module has other calls in that step and micro-batch), and
    for a repeated call its ``signature`` (from ``arguments``: the index rows of the non-tensor
    inputs, :func:`compare.arguments.argument_rows`) and ``given`` (what tells its tensor
    inputs' values apart: :func:`_described`), in execution order."""
    rows = rows.assign(rank=rows["rank"].fillna(-1))  # (a dump made without ranks)
    forward = rows[rows["kind"].isin(FORWARD_KINDS)]
    calls = forward.groupby([*STEP, "module", "call_idx"], sort=False).agg(
        call=("call", "min"), micro_batch=("micro_batch", "first"), start=("seq", "min"),
        end=("seq", "max")).reset_index()
    calls["repeated"] = calls.duplicated([*STEP, "module", "micro_batch"], keep=False)
    keys = list(zip(*(calls[c] for c in (*STEP, "call"))))
    wanted = {k for k, repeated in zip(keys, calls["repeated"]) if repeated}
    inputs = _of_calls(rows[(rows["kind"] == fmt.INPUT) & (rows["index"] >= 0)], wanted)
    given = {key: tuple(sorted(_described(group), key=lambda input: input[0]))
             for key, group in inputs.groupby([*STEP, "call"], sort=False)}
    signatures = {key: signature(zip(group["path"], group["dtype"], group["value"]))
                  for key, group in _of_calls(arguments, wanted).groupby([*STEP, "call"],
                                                                        sort=False)}
    calls["signature"] = [signatures.get(k, ()) for k in keys]
    calls["given"] = [given.get(k, ()) for k in keys]
    return calls.sort_values("start", kind="stable").reset_index(drop=True)


def _of_calls(rows: pd.DataFrame, calls: set[tuple]) -> pd.DataFrame:
    """``rows`` of the ``(epoch, step, rank, call)`` in ``calls``."""
    return rows[np.array([k in calls for k in zip(*(rows[c] for c in (*STEP, "call")))],
                         dtype=bool)]


def _described(inputs: pd.DataFrame) -> Iterable[tuple]:
    """Per tensor input of a call, what tells its values apart from another's: its index,
    dtype, shape, checksum, digest and statistics (a NaN as None: equal to another; a list
    as a tuple)."""
    columns = ["index", "dtype", "shape", "checksum", "digest", *fmt.STAT_COLUMNS]
    for values in zip(*(inputs[c] for c in columns)):
        yield tuple(None if isinstance(v, float) and v != v else
                    tuple(v) if isinstance(v, list) else v for v in values)


def told_apart(calls: pd.DataFrame) -> dict[Signature, int]:
    """The ``call_idx`` of each signature among ``calls`` (one module's calls in one micro-
    batch of a step, rows of :func:`module_calls`), where their signatures are distinct and
    the calls were given the same tensors (module docstring); else empty."""
    found = dict(zip(calls["signature"], calls["call_idx"]))
    if len(calls) < 2 or len(found) != len(calls) or len(set(calls["given"])) > 1:
        return {}
    return found


def calls_inside(step_calls: pd.DataFrame, parent: pd.DataFrame) -> Inside:
    """Per module called inside the calls ``parent`` (one module's calls in a step, rows of
    :func:`module_calls`), the ``call_idx`` it got within each of them, in order: the calls
    of its submodules and ops that recorded between its first and last forward record.
    ``step_calls``: that step's calls, in execution order."""
    path = parent["module"].iloc[0]
    starts, ends = list(step_calls["start"]), list(step_calls["end"])
    modules, call_idxs = list(step_calls["module"]), list(step_calls["call_idx"])
    found: Inside = {}
    for owner, start, end in zip(parent["call_idx"], parent["start"], parent["end"]):
        at = bisect.bisect_right(starts, start)
        while at < len(starts) and starts[at] <= end:
            if ends[at] <= end and runs_inside(modules[at], path):
                found.setdefault(modules[at], {}).setdefault(owner, []).append(call_idxs[at])
            at += 1
    return found


def align_calls(rows_a: pd.DataFrame, rows_b: pd.DataFrame, arguments_a: pd.DataFrame,
                arguments_b: pd.DataFrame) -> pd.DataFrame:
    """``rows_b`` with the calls that B made in another order than A renumbered as A's (see
    the module docstring); ``arguments_a``/``_b``: the index rows of each run's non-tensor
    inputs. Unchanged where the runs called their modules in the same order."""
    calls_a, calls_b = module_calls(rows_a, arguments_a), module_calls(rows_b, arguments_b)
    group = [*STEP, "module", "micro_batch"]
    orders_a, orders_b = ({key: tuple(g["signature"]) for key, g in
                           calls[calls["repeated"]].groupby(group, sort=False)}
                          for calls in (calls_a, calls_b))
    # the groups B called in another order than A, parents first
    others = sorted((key for key, order in orders_b.items() if key in orders_a
                     and order != orders_a[key] and len(order) == len(orders_a[key])),
                    key=lambda key: key[3].count("."))
    steps_a = dict(iter(calls_a.groupby(STEP, sort=False))) if others else {}
    steps_b = dict(iter(calls_b.groupby(STEP, sort=False))) if others else {}
    renumber: dict[tuple, dict[int, int]] = {}  # (epoch, step, rank, module) -> B's -> A's
    done = set()  # (epoch, step, rank, module, micro_batch): renumbered, or inside one that is
    for *step, module, micro_batch in others:
        step = tuple(step)
        if (*step, module, micro_batch) in done:
            continue
        in_a, in_b = steps_a[step], steps_b[step]
        a = in_a[(in_a["module"] == module) & (in_a["micro_batch"] == micro_batch)]
        b = in_b[(in_b["module"] == module) & (in_b["micro_batch"] == micro_batch)]
        taken, theirs = told_apart(a), told_apart(b)
        if not taken or set(taken) != set(theirs):
            continue
        moved = {i: taken[s] for s, i in theirs.items()}
        for inner, pairs in [(module, moved), *_inside(moved, in_a, a, in_b, b)]:
            renumber.setdefault((*step, inner), {}).update(pairs)
            done.add((*step, inner, micro_batch))
    if not renumber:
        return rows_b
    keys = zip(rows_b["epoch"], rows_b["step"], rows_b["rank"], rows_b["module"])
    own = rows_b["kind"].isin(CALL_KINDS)
    return rows_b.assign(call_idx=[renumber[k].get(i, i) if k in renumber and mine else i
                                   for k, i, mine in zip(keys, rows_b["call_idx"], own)])


def _inside(moved: dict[int, int], in_a: pd.DataFrame, a: pd.DataFrame, in_b: pd.DataFrame,
            b: pd.DataFrame) -> list[tuple[str, dict[int, int]]]:
    """Per module called inside B's calls ``b`` that ``moved`` pairs with A's ``a``, the
    renumbering of its calls there (``in_a``, ``in_b``: the step's calls)."""
    inside_a = calls_inside(in_a, a)
    found = []
    for module, by_owner in calls_inside(in_b, b).items():
        there = inside_a.get(module, {})
        if any(len(there.get(moved[o], ())) != len(ids) for o, ids in by_owner.items()):
            continue
        pairs = {i: j for o, ids in by_owner.items() for i, j in zip(ids, there[moved[o]])}
        if set(pairs) == set(pairs.values()):  # a permutation of its own calls: no clash
            found.append((module, pairs))
    return found


def runs_inside(module: str, parent: str) -> bool:
    """Whether ``module`` (a module path or an op record's name) runs inside ``parent``."""
    if not parent:  # the root module
        return module != ""
    return module.startswith(f"{parent}.") or module.startswith(f"{parent}{fmt.OP_SEPARATOR}")


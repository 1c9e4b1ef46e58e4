"""Calls a run made in another order, paired by their arguments.

Records pair by module path and call number: the n-th call of a module in a step pairs with
the other run's n-th. A module called several times in a step with other names, integers or
flags each time may be called in another order by the other run: ModernBERT's and Gemma3's
rotary embedding is called once per attention type, in the order of a ``set`` of strings,
which changes with the process's hash seed. Numbering alone would pair the full-attention call
of one run with the sliding-window call of the other.

Where each run's calls of a module in a step carry distinct :data:`NAMING_TYPES` arguments (its
*signature*: path, type and recorded text of each) and the two runs' sets of signatures are
the same, B's calls take the number of A's call with the same signature; and so do the calls
made inside them, submodules' and ops': the n-th call of a module inside B's call takes the
number of the n-th inside the A call it pairs with. A module called a different number of
times inside the paired calls keeps its numbers. Calls whose arguments differ between the
runs keep their numbers too, and the difference is reported (:mod:`compare.arguments`).

The same rule serves a localizing re-run (:mod:`dumper.injection`), which injects into each
call the reference's values of the call it pairs with.
"""
from __future__ import annotations

import bisect
from typing import Iterable

import pandas as pd

from . import format as fmt

STEP = ["epoch", "step", "rank"]
NAMING_TYPES = ("str", "int", "bool")  # the arguments that tell a module's calls apart
Signature = tuple  # sorted (path, type name, recorded text) of a call's NAMING_TYPES arguments
Inside = dict  # module called inside -> parent's call_idx -> its call_idxs there, in order


def signature(arguments: Iterable[tuple[str, str, str]]) -> Signature:
    """A call's signature from its non-tensor arguments' ``(path, type name, text)``."""
    return tuple(sorted(a for a in arguments if a[1] in NAMING_TYPES))


def module_calls(rows: pd.DataFrame, arguments: pd.DataFrame) -> pd.DataFrame:
    """One row per call of ``rows`` (records of a dump's index): its step, ``module``,
    ``call_idx``, execution order (``call``) and ``signature``, from ``arguments`` (the index
    rows of the non-tensor inputs, :func:`compare.arguments.argument_rows`)."""
    calls = rows.groupby([*STEP, "module", "call_idx"], sort=False)["call"].min().reset_index()
    signatures = {key: signature(zip(group["path"], group["dtype"], group["value"]))
                  for key, group in arguments.groupby([*STEP, "call"], sort=False)}
    calls["signature"] = [signatures.get(k, ()) for k in zip(
        calls["epoch"], calls["step"], calls["rank"], calls["call"])]
    return calls.sort_values("call", kind="stable")


def by_signature(calls: pd.DataFrame) -> dict[Signature, int]:
    """The ``call_idx`` of each signature among one module's ``calls`` in a step; empty
    where two calls share one (no signature tells them apart)."""
    found = dict(zip(calls["signature"], calls["call_idx"]))
    return found if len(found) == len(calls) else {}


def calls_inside(calls: pd.DataFrame, parent: pd.DataFrame) -> Inside:
    """Per module called inside the calls ``parent`` (one module's calls in a step, rows of
    :func:`module_calls`), the ``call_idx`` it got within each of them, in order; ``calls``:
    that step's calls."""
    starts, owners = list(parent["call"]), list(parent["call_idx"])
    path = parent["module"].iloc[0]
    found: Inside = {}
    for module, call_idx, call in zip(calls["module"], calls["call_idx"], calls["call"]):
        at = bisect.bisect_right(starts, call) - 1
        if at >= 0 and runs_inside(module, path):
            found.setdefault(module, {}).setdefault(owners[at], []).append(call_idx)
    return found


def align_calls(rows_a: pd.DataFrame, rows_b: pd.DataFrame, arguments_a: pd.DataFrame,
                arguments_b: pd.DataFrame) -> pd.DataFrame:
    """``rows_b`` with the calls that B made in another order than A renumbered as A's (see
    the module docstring); ``arguments_a``/``_b``: the index rows of each run's non-tensor
    inputs. Unchanged where the runs called their modules in the same order."""
    calls_a, calls_b = module_calls(rows_a, arguments_a), module_calls(rows_b, arguments_b)
    steps_a = dict(iter(calls_a.groupby(STEP, sort=False)))
    renumber: dict[tuple, dict[int, int]] = {}  # (epoch, step, rank, module) -> B's -> A's
    for step, in_b in calls_b.groupby(STEP, sort=False):
        in_a = steps_a.get(step)
        if in_a is None:
            continue
        modules_a = dict(iter(in_a.groupby("module", sort=False)))
        for module, b in sorted(in_b.groupby("module", sort=False),
                                key=lambda item: item[0].count(".")):  # parents first
            a = modules_a.get(module)
            if (*step, module) in renumber or a is None or len(b) < 2:
                continue
            taken = by_signature(a)
            if list(a["signature"]) == list(b["signature"]) or set(taken) != set(b["signature"]) \
                    or len(b) != len(a):
                continue
            moved = {i: taken[s] for i, s in zip(b["call_idx"], b["signature"])}
            renumber[(*step, module)] = moved
            inside_a, inside_b = calls_inside(in_a, a), calls_inside(in_b, b)
            for inner, by_owner in inside_b.items():
                there = inside_a.get(inner, {})
                if all(len(there.get(moved[o], ())) == len(ids) for o, ids in by_owner.items()):
                    renumber[(*step, inner)] = {i: j for o, ids in by_owner.items()
                                                for i, j in zip(ids, there[moved[o]])}
    if not renumber:
        return rows_b
    keys = zip(rows_b["epoch"], rows_b["step"], rows_b["rank"], rows_b["module"])
    return rows_b.assign(call_idx=[renumber[k].get(i, i) if k in renumber else i
                                   for k, i in zip(keys, rows_b["call_idx"])])


def runs_inside(module: str, parent: str) -> bool:
    """Whether ``module`` (a module path or an op record's name) runs inside ``parent``."""
    if not parent:  # the root module
        return module != ""
    return module.startswith(f"{parent}.") or module.startswith(f"{parent}{fmt.OP_SEPARATOR}")

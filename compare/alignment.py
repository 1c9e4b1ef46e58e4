"""Op records of two runs paired by sequence alignment within each module call.

Op records (``dumper.ops``) are named ``{module}/{op}#{n}``: the n-th op of that name in the
module call. When the two runs' code runs different ops there (a fused kernel against its
decomposition, an extra cast, a refactor), numbering alone pairs the n-th ``mul`` of one side
with the n-th of the other even when one side has an extra ``mul`` before it. Within each module
call that both sides ran, the two sequences of ops, in execution order and described by their
name and output shape, are aligned (``difflib.SequenceMatcher``: longest common runs first);
B's ops that align with one of A's take that op's name, so they pair; the others keep their
name (primed, ``add#1'``, where A has an op of that name) and are reported as one side's.
Module records pair by path and call number (after :mod:`compare.call_order`).

A call's inputs (and their gradients) are numbered by the tensors among its arguments, so one
argument that is a tensor in one run and ``None`` in the other (an attention mask one
attention implementation builds and another does not) shifts the number of every later
input. Where one run's call got tensors at every place the other's did and more, B's inputs
take the number of A's at the same place (``kwargs['position_ids']``); those at a place A's
call lacks, a number A's does not use (reported as one side's). Other calls keep their
numbering: tensors at the same places, or at other ones (an argument positional in one run,
a keyword in the other), pair in order.
"""
from __future__ import annotations

import difflib

import pandas as pd

from . import format as fmt

CALL_KEY = ["epoch", "step", "rank", "owner", "call_idx"]


def _op_calls(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per op call of ``rows``: its call key, ``module``, execution order (``call``)
    and signature (op name and output shape)."""
    owners = [fmt.split_op(m) for m in rows["module"]]
    ops = rows.assign(owner=[o[0] if o else None for o in owners])
    ops = ops[ops["owner"].notna()]
    if ops.empty:
        return ops.assign(signature=[])
    first_output = ops[(ops["kind"] == fmt.OUTPUT) & (ops["index"] == 0)]
    shapes = dict(zip(zip(first_output["module"], first_output["call_idx"]),
                      first_output["shape"]))
    calls = ops.groupby([*CALL_KEY, "module"], sort=False, dropna=False).agg(
        call=("call", "min"), cls=("cls", "first")).reset_index()
    calls["signature"] = [f"{cls}:{shapes.get((m, i), '?')}"
                          for cls, m, i in zip(calls["cls"], calls["module"], calls["call_idx"])]
    return calls.sort_values("call", kind="stable")


def align_ops(rows_a: pd.DataFrame, rows_b: pd.DataFrame) -> pd.DataFrame:
    """``rows_b`` with each op record renamed to the A op it aligns with (see the module
    docstring); unchanged when both sides ran the same ops everywhere."""
    calls_a, calls_b = _op_calls(rows_a), _op_calls(rows_b)
    if calls_b.empty or calls_a.empty:
        return rows_b
    renames: dict[tuple, str] = {}
    grouped_a = dict(iter(calls_a.groupby(CALL_KEY, sort=False, dropna=False)))
    for key, b in calls_b.groupby(CALL_KEY, sort=False, dropna=False):
        a = grouped_a.get(key)
        if a is None or list(a["signature"]) == list(b["signature"]):
            continue
        names_a, names_b = list(a["module"]), list(b["module"])
        matcher = difflib.SequenceMatcher(None, list(a["signature"]), list(b["signature"]),
                                          autojunk=False)
        new = {}
        for block in matcher.get_matching_blocks():
            for k in range(block.size):
                new[names_b[block.b + k]] = names_a[block.a + k]
        taken = set(names_a)
        for name in names_b:
            if name not in new:
                lone = name
                while lone in taken:
                    lone += "'"
                new[name] = lone
                taken.add(lone)
        epoch, step, rank, _, call_idx = key
        renames.update({(epoch, step, rank, call_idx, old): name
                        for old, name in new.items() if old != name})
    if not renames:
        return rows_b
    keys = zip(rows_b["epoch"], rows_b["step"], rows_b["rank"], rows_b["call_idx"],
               rows_b["module"])
    return rows_b.assign(module=[renames.get(k, k[-1]) for k in keys])


INPUT_KINDS = (fmt.INPUT, fmt.GRAD_INPUT)  # numbered by the arguments' tensors


def align_inputs(rows_a: pd.DataFrame, rows_b: pd.DataFrame) -> pd.DataFrame:
    """``rows_b`` with its calls' inputs renumbered by where they sit (module docstring);
    unchanged where each call got its tensors at the same places in both runs."""
    call = ["epoch", "step", "rank", "module", "call_idx", "occurrence", "kind"]
    a_calls, b_calls = ({key: (tuple(paths), tuple(indices)) for key, paths, indices in zip(
        grouped.index, grouped["path"], grouped["index"])}
        for grouped in (rows[rows["kind"].isin(INPUT_KINDS)].groupby(call, sort=False)[
            ["path", "index"]].agg(tuple) for rows in (rows_a, rows_b)))
    renumber: dict[tuple, int] = {}
    for key, (paths_b, indices_b) in b_calls.items():
        paths_a, indices_a = a_calls.get(key, (None, None))
        if paths_a is None or paths_a == paths_b or not (
                set(paths_a) <= set(paths_b) or set(paths_b) <= set(paths_a)):
            continue  # alike, or other places (positional in one run, keywords in the other)
        index_a = dict(zip(paths_a, indices_a))
        spare = max(index_a.values()) + 1
        for path, index in zip(paths_b, indices_b):
            if path in index_a:
                renumber[(*key, index)] = index_a[path]
            else:
                renumber[(*key, index)], spare = spare, spare + 1
    if not renumber:
        return rows_b
    keys = zip(*(rows_b[c] for c in call), rows_b["index"])
    return rows_b.assign(index=[renumber.get(k, k[-1]) for k in keys])

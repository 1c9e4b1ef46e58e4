"""Pairing: match the tensor records of two dumps by (step, module, call, kind, index)."""
from __future__ import annotations

import copy
from typing import Iterable, Optional

import numpy as np
import pandas as pd

from . import format as fmt
from .decoding import value_dtype
from .dump import Dump
from .errors import DumpError
from .sources import STEP_KEY

KEY = [*STEP_KEY, "module", "call_idx", "kind", "index", "occurrence"]
SIDE_COLUMNS = ["seq", "call", "cls", "micro_batch", "group", "path", "dtype", "shape", "encoding",
                "dataset", "status", "checksum", "digest", "producer", "addends", "injected",
                "grad_scale",
                "parts", "replicas_differ",
                *fmt.STAT_COLUMNS, *fmt.SKETCH_COLUMNS]
NOTED_STEPS = 3  # steps named by a note on the records one side left out


def align_ranks(a: Dump, b: Dump, rank: Optional[int] = None
                ) -> tuple[Dump, Dump, Optional[str]]:
    """``a`` and ``b`` restricted to the steps that can pair, and a note when a rank was chosen.

    Steps pair by (epoch, step, rank). A dump made without ``torch.distributed`` pairs with one
    rank of a distributed dump: ``rank``, else the lowest one. A given ``rank`` also restricts
    a distributed side to that rank; two distributed dumps otherwise pair rank by rank.
    """
    single_a, single_b = (all(s.rank is None for s in d.steps) for d in (a, b))
    if rank is not None and single_a and single_b:
        raise DumpError(f"{a.path} / {b.path}: --rank {rank}: neither dump is distributed "
                        f"(they hold no ranks); leave --rank out")
    if rank is None:
        if single_a == single_b:
            return a, b, None
        rank = min(s.rank for s in (b if single_a else a).steps)
    note = None
    if single_a != single_b:
        single, other = ("A", "B") if single_a else ("B", "A")
        note = (f"{single} is not distributed: compared with rank {rank} of {other} "
                f"(choose another with --rank)")
    return at_rank(a, rank), at_rank(b, rank), note


def at_rank(dump: Dump, rank: int, label: Optional[int] = None) -> Dump:
    """The steps of ``rank``, and the non-distributed steps, labelled as rank ``label``
    (default: ``rank``)."""
    label = rank if label is None else label
    steps = []
    for step in dump.steps:
        if step.rank is None or step.rank == rank:
            if step.rank != label:
                step = copy.copy(step)
                step.rank = label
            steps.append(step)
    if not steps:
        ranks = sorted({s.rank for s in dump.steps})
        raise DumpError(f"{dump.path}: no step of rank {rank} (its ranks: {ranks}); "
                        f"choose one with --rank")
    return Dump(dump.path, steps)


def tensor_rows(dump: Dump, steps: Optional[Iterable[str]] = None) -> pd.DataFrame:
    """Index rows of tensors (stored, described by statistics or a digest, dropped or unsupported) of the
    chosen steps (``"S"`` or ``"E:S"``; all by default)."""
    index = dump.index
    rows = index[(index["dataset"] != "") | index["stat_nan"].notna()
                 | (index["digest"] != fmt.NO_DIGEST)
                 | index["status"].isin([fmt.ST_DROPPED, fmt.ST_UNSUPPORTED])]
    if steps:
        wanted = [steps] if isinstance(steps, str) else list(steps)
        bad = [w for w in wanted if not fmt.STEP_SPEC.fullmatch(str(w))]
        if bad:
            raise ValueError(f"steps: {bad[0]!r} is no step; give S or E:S, e.g. '3' or '0:3'")
        rows = rows[[_step_matches(e, s, wanted) for e, s in zip(rows["epoch"], rows["step"])]]
    # parts: where a sharded tensor's values are (compare.assembly); none for a stored tensor.
    # replicas_differ: which rank's copy of a replicated tensor put together differs
    # (compare.assembly); "" for none
    return rows.assign(rank=rows["rank"].fillna(-1).astype(int), parts=[()] * len(rows),
                       replicas_differ="")


def from_shards(pairs: pd.DataFrame) -> pd.Series:
    """Per row of paired records, whether either side's tensor is put together from its
    ranks' shards (``parts``, :mod:`compare.assembly`) rather than stored whole."""
    return pd.concat([pairs[f"parts_{side}"].map(lambda p: isinstance(p, tuple) and len(p) > 0)
                      for side in ("a", "b")], axis=1).any(axis=1)


def select(rows: pd.DataFrame, modules: Optional[Iterable[str]] = None,
           kinds: Optional[Iterable[str]] = None) -> pd.DataFrame:
    """``rows`` of modules matching a glob of ``modules`` (path or key) and of ``kinds``."""
    if modules:
        patterns = list(modules)
        rows = rows[[fmt.module_matches(m, c, patterns) for m, c in zip(rows["module"], rows["cls"])]]
    if kinds:
        rows = rows[rows["kind"].isin(list(kinds))]
    return rows


def _step_matches(epoch: int, step: int, wanted: list[str]) -> bool:
    return any(w == str(step) or w == f"{epoch}:{step}" for w in wanted)


def pair_records(rows_a: pd.DataFrame, rows_b: pd.DataFrame) -> pd.DataFrame:
    """One row per key present on either side, with ``_a``/``_b`` side columns and ``side``
    (``both``, ``a_only``, ``b_only``), in execution order (step, then A's sequence, else B's)."""
    a = rows_a[KEY + SIDE_COLUMNS]
    b = rows_b[KEY + SIDE_COLUMNS]
    # (one block per column out of the merge: copied into few before columns are added)
    merged = a.merge(b, on=KEY, how="outer", suffixes=("_a", "_b")).copy()
    in_a, in_b = merged["seq_a"].notna(), merged["seq_b"].notna()  # every record has a seq
    merged["side"] = np.where(in_a & in_b, "both", np.where(in_a, "a_only", "b_only"))
    merged["order"] = merged["seq_a"].fillna(merged["seq_b"])
    merged = merged.sort_values(["epoch", "step", "rank", "order"], kind="stable")
    return merged.drop(columns="order").reset_index(drop=True)


def recorded_on_both_sides(pairs: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """``pairs`` less the one-sided records the other side's dumper was not asked to record,
    and a note per step or kind left out. A step only one side recorded tensors in (one run
    dumped in more steps) is not compared; a kind that one side recorded none of in a step
    both sides recorded (``kinds=``, or ``params=True`` on one side only) is not a missing
    record; nor are weights that one side records at each call (``params=True``) and the
    other at the module's first call only: they are compared where both sides have them."""
    keep = pd.Series(True, index=pairs.index)
    notes = []
    step_kind = [*STEP_KEY, "kind"]
    present = pairs.groupby(step_kind)["side"].agg(lambda s: set(s))
    in_step = pairs.groupby(STEP_KEY)["side"].agg(lambda s: set(s))
    both_steps = {k for k, sides in in_step.items() if "both" in sides
                  or {"a_only", "b_only"} <= sides}
    for side, name, other_name in (("a_only", "A", "B"), ("b_only", "B", "A")):
        lone = [k for k, sides in in_step.items() if sides == {side}]
        if lone:  # a run dumped in more steps than the other
            keep &= ~pd.Series(list(zip(*(pairs[c] for c in STEP_KEY))), index=pairs.index
                               ).isin(lone)
            notes.append(f"{name}'s step{'s' if len(lone) > 1 else ''} "
                         f"{_shown([fmt.step_label(*k) for k in lone])} "
                         f"{'are' if len(lone) > 1 else 'is'} not compared: {other_name} "
                         f"recorded no tensor in {'them' if len(lone) > 1 else 'it'}")
    present = present[[k[:3] in both_steps for k in present.index]]
    for side, other, name, other_name in (("a_only", "b_only", "A", "B"),
                                          ("b_only", "a_only", "B", "A")):
        lone = present.map(lambda sides: sides == {side})
        steps: dict[str, list[str]] = {}  # kind -> the steps where only this side has it
        for key in lone[lone].index:
            rows = (pairs[step_kind] == pd.Series(key, index=step_kind)).all(axis=1)
            keep &= ~rows
            steps.setdefault(key[-1], []).append(fmt.step_label(*key[:3]))
        for kind, labels in steps.items():
            notes.append(f"{name}'s {kind} records of step{'s' if len(labels) > 1 else ''} "
                         f"{_shown(labels)} are not compared: {other_name} recorded none "
                         f"(dumped with other kinds or params)")
    params = pairs[(pairs["kind"] == fmt.PARAM) & keep]
    both = params[params["side"] == "both"][["module", "index"]].drop_duplicates()
    known = set(map(tuple, both.to_numpy()))
    lone_params = (params["side"] != "both").to_numpy() & np.array(
        [(m, i) in known for m, i in zip(params["module"], params["index"])], dtype=bool)
    keep[params.index[lone_params]] = False
    return pairs[keep].reset_index(drop=True), notes


def unlike_forms(pairs: pd.DataFrame, index_a: pd.DataFrame, index_b: pd.DataFrame
                 ) -> tuple[pd.DataFrame, list[str]]:
    """``pairs`` less the records the two runs hold in unlike forms, which no error measures,
    and a note on them: a tensor where the other run's call got or returned ``None`` (or
    another non-tensor) at that place (an attention mask one implementation builds and another
    does not need), and tensors of other kinds of dtype (a mask as booleans in one run, as
    additive floats in the other). The records computed from them are compared as ever."""
    place = ["epoch", "step", "rank", "module", "call_idx", "kind"]
    keep = pd.Series(True, index=pairs.index)
    examples = []
    for side, other_index, other in (("a", index_b, "B"), ("b", index_a, "A")):
        lone = pairs[pairs["side"] == f"{side}_only"]
        if lone.empty:
            continue
        leaves = other_index[other_index["index"] == -1]  # its non-tensor leaves
        others = set(zip(*(leaves[c].fillna(-1) if c == "rank" else leaves[c] for c in place),
                         leaves["path"]))
        # a gradient is of the input or output at its place
        lone_place = lone[place].assign(kind=lone["kind"].replace(
            {fmt.GRAD_INPUT: fmt.INPUT, fmt.GRAD_OUTPUT: fmt.OUTPUT}))
        unlike = [(*k, p) in others for k, p in zip(zip(*(lone_place[c] for c in place)),
                                                    lone[f"path_{side}"])]
        keep[lone.index[unlike]] = False
        examples += [f"{_place(r, side)} a tensor in {side.upper()}, not in {other}"
                     for _, r in lone[unlike].head(1).iterrows()]
    both = pairs[pairs["side"] == "both"]
    kinds = [(_dtype_kind(a), _dtype_kind(b)) for a, b in zip(both["dtype_a"], both["dtype_b"])]
    apart = [None not in k and k[0] != k[1] for k in kinds]
    keep[both.index[apart]] = False
    examples += [f"{_place(r, 'a')} {r['dtype_a']} in A, {r['dtype_b']} in B"
                 for _, r in both[apart].head(1).iterrows()]
    dropped = int((~keep).sum())
    notes = [f"{dropped} record(s) are not compared: the runs hold them in unlike forms "
             f"(e.g. {'; '.join(examples)}), which no error measures"] if dropped else []
    return pairs[keep].reset_index(drop=True), notes


def _place(row: pd.Series, side: str) -> str:
    """``model.layers.0 input kwargs['attention_mask']``: where a record sits in its call."""
    path = row[f"path_{side}"]
    where = path if path.startswith(row["kind"]) else f"{row['kind']} {path}"
    return f"{row['module'] or fmt.ROOT_NAME} {where}"


def _dtype_kind(dtype) -> Optional[str]:
    """What a recorded dtype's values are, as numpy's kind of what they decode to
    (:func:`compare.decoding.value_dtype`): ``b``ool, ``i``nteger (signed or not),
    ``f``loating or ``c``omplex; None if unknown."""
    try:
        kind = np.dtype(value_dtype(str(dtype))).kind
    except TypeError:
        return None
    return "i" if kind == "u" else kind


def _shown(labels: list[str]) -> str:
    """The first :data:`NOTED_STEPS` of ``labels``, and how many more."""
    return ", ".join(labels[:NOTED_STEPS]) + (
        f" and {len(labels) - NOTED_STEPS} more" if len(labels) > NOTED_STEPS else "")


def outside_compiled_regions(pairs: pd.DataFrame, compiled_a: set[str], compiled_b: set[str]
                             ) -> tuple[pd.DataFrame, list[str]]:
    """``pairs`` less the records of one side inside a module the other side ran as compiled
    code (``module.compile()``, ``torch.compile``: the modules inside are not recorded), and a
    note per side saying how many are left out."""
    keep = pd.Series(True, index=pairs.index)
    notes = []
    for side, compiled, name, other in (("a_only", compiled_b, "A", "B"),
                                        ("b_only", compiled_a, "B", "A")):
        if not compiled:
            continue
        inside = (pairs["side"] == side) & pairs["module"].map(
            lambda m: any(fmt.contains(c, m) and m != c for c in compiled))
        if inside.any():
            keep &= ~inside
            regions = ", ".join(sorted(c or fmt.ROOT_NAME for c in compiled))
            notes.append(f"{int(inside.sum())} of {name}'s records are not compared: they are "
                         f"inside modules {other} ran as compiled code ({regions}), which "
                         f"record nothing inside")
    return pairs[keep].reset_index(drop=True), notes


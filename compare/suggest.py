"""Proposing rename rules (``h5cmp A B --suggest-map``) by aligning the two dumps' calls.

Each module's first call in the first step both dumps hold is summarized by a signature: its
class-independent shapes and dtypes of inputs and outputs. The two call sequences are aligned
in execution order (``difflib``); every aligned pair whose paths differ asks for a rename. A
pair's rule keeps the components both paths end with (``backbone.h.0`` / ``transformer.h.0``:
``backbone.**`` -> ``transformer.{1}``) and turns the numbers both paths hold into wildcards
(``model.layers.3.self_attn`` / ``h.3.attn``: ``model.layers.*.self_attn`` -> ``h.{1}.attn``).
Rules are chosen greedily, the one that explains most aligned pairs first, and kept only if
they map more aligned pairs right. The user checks them: a suggestion, not a verdict.
"""
from __future__ import annotations

import difflib
from collections import Counter
from typing import Optional

import pandas as pd

from . import format as fmt
from .dump import Dump
from .mapping import NameMapping, Rule

_SIGNED_KINDS = (fmt.INPUT, fmt.OUTPUT)


def suggest_mapping(dump_a: Dump, dump_b: Dump) -> NameMapping:
    """Rules renaming ``dump_b``'s module paths to ``dump_a``'s (empty if the aligned calls
    already share their names, or nothing aligns)."""
    pairs = aligned_modules(dump_a.index, dump_b.index)
    counts = Counter(_rule_for(b, a) for b, a in pairs if b != a)
    chosen: list[Rule] = []
    best = _score(chosen, pairs)
    for rule, _ in counts.most_common():
        trial = _specific_first(chosen + [rule])
        score = _score(trial, pairs)
        if score > best:
            chosen, best = trial, score
    return NameMapping(tuple(chosen), origin="--suggest-map")


def aligned_modules(index_a: pd.DataFrame, index_b: pd.DataFrame) -> list[tuple[str, str]]:
    """``(B path, A path)`` of the module calls that align, in order."""
    key = _first_common_step(index_a, index_b)
    if key is None:
        return []
    calls_a, calls_b = (_signatures(i[(i["epoch"] == key[0]) & (i["step"] == key[1])])
                        for i in (index_a, index_b))
    matcher = difflib.SequenceMatcher(None, [s for _, s in calls_b], [s for _, s in calls_a],
                                      autojunk=False)
    return [(calls_b[i + k][0], calls_a[j + k][0])
            for i, j, size in matcher.get_matching_blocks() for k in range(size)]


def _first_common_step(index_a: pd.DataFrame, index_b: pd.DataFrame) -> Optional[tuple]:
    steps = set(zip(index_a["epoch"], index_a["step"])) & set(zip(index_b["epoch"],
                                                                   index_b["step"]))
    return min(steps) if steps else None


def _signatures(rows: pd.DataFrame) -> list[tuple[str, tuple]]:
    """``(module, signature)`` of each module's first call, in call order."""
    rows = rows[(rows["call_idx"] == 0) & rows["kind"].isin(_SIGNED_KINDS)]
    rows = rows.drop_duplicates(["call", "kind", "index"]).sort_values(["call", "kind", "index"])
    out = []
    for (call, module), group in rows.groupby(["call", "module"], sort=True):
        out.append((module, tuple(zip(group["kind"], group["dtype"], map(tuple, group["shape"])))))
    return out


def _rule_for(b: str, a: str) -> Rule:
    parts_b, parts_a = (p.split(".") if p else [] for p in (b, a))
    same = 0
    while (same < min(len(parts_b), len(parts_a))
           and parts_b[len(parts_b) - 1 - same] == parts_a[len(parts_a) - 1 - same]):
        same += 1
    head_b, head_a = parts_b[:len(parts_b) - same], parts_a[:len(parts_a) - same]
    numbers = [p for p in head_b if p.isdigit()]
    pattern = [("*" if p.isdigit() else p) for p in head_b]
    to = [f"{{{numbers.index(p) + 1}}}" if p in numbers else p for p in head_a]
    if same:
        rest = f"{{{len(numbers) + 1}}}"
        return Rule(".".join(pattern + ["**"]), ".".join(to + [rest]))
    return Rule(".".join(pattern), ".".join(to))


def _specific_first(rules: list[Rule]) -> list[Rule]:
    """Rules in the order they are tried, so that a general rule does not hide the exceptions
    to it: rules without ``**`` first, then those naming more components literally."""
    def key(rule: Rule) -> tuple:
        literal = [p for p in rule.pattern.split(".") if "*" not in p]
        return ("**" in rule.pattern, -len(literal), rule.pattern.count("*"))
    return sorted(rules, key=key)


def _score(rules: list[Rule], pairs: list[tuple[str, str]]) -> int:
    mapping = NameMapping(tuple(rules))
    return sum(mapping.rename(b)[0] == a for b, a in pairs)

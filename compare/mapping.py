"""Renaming B's module paths to A's before pairing, for models whose names differ (a refactor,
a port into another codebase, a model wrapped one level deeper).

A :class:`NameMapping` is an ordered list of :class:`Rule`\\ s; the first rule that matches a
path renames it, paths no rule matches keep their name. Rules come from a file
(:func:`load_mapping`, ``h5cmp --map``), from a prefix that explains most unpaired records
(:func:`find_prefix`, applied by :func:`compare.compare_dumps` when nothing else pairs them), or
from aligning the two call sequences (:func:`compare.suggest.suggest_mapping`).
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Iterable, Optional, Union

import pandas as pd

from .errors import DumpError

PathLike = Union[str, Path]
_GROUP_REF = re.compile(r"\{(\d+)\}")
OUTPUT_KINDS = ("output", "grad_output")  # the kinds numbered by a call's outputs
UNMAPPED_LABEL = "[B]"  # marks a B path that a rename would otherwise confuse with another


@dataclasses.dataclass(frozen=True)
class Rule:
    """Rename module paths matching ``pattern`` to ``to``.

    ``glob`` patterns match whole paths; ``*`` matches within one path component, ``**`` any
    number of components, none included (``model.**`` matches ``model`` and everything
    under it); each wildcard is numbered from 1 in order and
    ``{n}`` in ``to`` puts back what it matched. ``regex`` patterns use Python's syntax and
    ``\\1`` in ``to``. Empty components a rename leaves (``{1}`` that matched nothing) are
    dropped. ``outputs`` renumbers the output (and output gradient) records of the matched
    modules: ``{B's index: A's index}``.
    """

    pattern: str
    to: str
    syntax: str = "glob"  # "glob" or "regex"
    outputs: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.syntax not in ("glob", "regex"):
            raise ValueError(f"rule syntax must be 'glob' or 'regex', got {self.syntax!r}")
        try:
            object.__setattr__(self, "_regex", re.compile(
                _glob_regex(self.pattern) if self.syntax == "glob" else self.pattern))
        except re.error as exc:
            raise ValueError(f"pattern {self.pattern!r} is not a valid {self.syntax}: {exc}") \
                from exc
        if self.syntax == "glob":
            refs = [int(n) for n in _GROUP_REF.findall(self.to)]
            template = _GROUP_REF.sub(r"\\g<\1>", self.to.replace("\\", "\\\\"))
        else:
            refs = [int(a or b) for a, b in re.findall(r"\\(\d+)|\\g<(\d+)>", self.to)]
            template = self.to
        if refs and max(refs) > self._regex.groups:
            raise ValueError(f"{self.to!r} refers to wildcard {max(refs)}; {self.pattern!r} "
                             f"has {self._regex.groups}")
        object.__setattr__(self, "_template", template)

    def rename(self, path: str) -> Optional[str]:
        """``path`` renamed, or None if the rule does not match it."""
        match = self._regex.fullmatch(path)
        if match is None:
            return None
        return ".".join(part for part in match.expand(self._template).split(".") if part)

    def as_dict(self) -> dict:
        """The rule as a rules file writes it."""
        out: dict = {self.syntax: self.pattern, "to": self.to}
        if self.outputs:
            out["outputs"] = {b: a for b, a in self.outputs}
        return out


_GLOB_TOKENS = {".**": r"(?:\.(.*))?", "**.": r"(?:(.*)\.)?", "**": "(.*)", "*": "([^.]*)"}


def _glob_regex(pattern: str) -> str:
    parts = re.split(r"(\.\*\*|\*\*\.|\*\*|\*)", pattern)
    return "".join(_GLOB_TOKENS.get(p, re.escape(p)) for p in parts)


@dataclasses.dataclass(frozen=True)
class NameMapping:
    """Rules applied in order to B's module paths; ``origin`` says where they came from."""

    rules: tuple[Rule, ...]
    origin: str = "rules"

    def rename(self, path: str) -> tuple[str, Optional[Rule]]:
        """``path`` renamed by the first rule that matches it (unchanged if none), and the
        rule."""
        for rule in self.rules:
            try:
                renamed = rule.rename(path)
            except (re.error, IndexError) as exc:  # a replacement Python cannot expand
                raise DumpError(f"{self.origin}: rule {rule.pattern!r} -> {rule.to!r}: cannot "
                                f"rename {path!r} ({exc}); fix its 'to'") from exc
            if renamed is not None:
                return renamed, rule
        return path, None

    def apply(self, rows: pd.DataFrame) -> pd.DataFrame:
        """Index rows with ``module`` renamed (and the ``index`` of renumbered outputs). A path
        no rule renames that a renamed path now shares (B's own wrapper root, once ``model.``
        is stripped) is relabelled ``[B] path``, so that it pairs with nothing."""
        if rows.empty or not self.rules:
            return rows
        renamed = {path: self.rename(path) for path in rows["module"].unique()}
        targets = {new for new, rule in renamed.values() if rule is not None}
        names = {path: new if rule is not None or new not in targets else
                 f"{UNMAPPED_LABEL} {path or '<root>'}" for path, (new, rule) in renamed.items()}
        numbering = {path: dict(rule.outputs) for path, (_, rule) in renamed.items()
                     if rule is not None and rule.outputs}
        if numbering:
            rows = rows.assign(index=[
                numbering[m].get(i, i) if m in numbering and k in OUTPUT_KINDS else i
                for m, k, i in zip(rows["module"], rows["kind"], rows["index"])])
        return rows.assign(module=rows["module"].map(names))

    def describe(self) -> str:
        """One line for reports: where the rules come from and what they are."""
        shown = "; ".join(f"{r.pattern} -> {r.to or '<root>'}" for r in self.rules[:4])
        more = f"; and {len(self.rules) - 4} more" if len(self.rules) > 4 else ""
        return f"B's module names renamed by {self.origin}: {shown}{more}"

    def to_text(self) -> str:
        """The rules as a rules file (JSON, which is also YAML) that ``--map`` reads."""
        return json.dumps({"rules": [r.as_dict() for r in self.rules]}, indent=2)


def load_mapping(path: PathLike) -> NameMapping:
    """The rules of a file: YAML (needs PyYAML: ``pip install 'h5cmp[map]'``) or JSON, either a
    list of rules or ``{"rules": [...]}``; each rule ``{glob: ..., to: ...}`` or ``{regex: ...,
    to: ...}``, optionally ``outputs: {B index: A index}``. Raises :class:`DumpError` naming
    the file and the rule."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DumpError(f"{path}: cannot read the rules file ({exc})") from exc
    data = _parse(path, text)
    if isinstance(data, dict) and set(data) == {"rules"}:
        data = data["rules"]
    if not isinstance(data, list):
        raise DumpError(f"{path}: a rules file holds a list of rules (or {{rules: [...]}}), "
                        f"each {{glob: PATTERN, to: NAME}} or {{regex: PATTERN, to: NAME}}")
    return NameMapping(tuple(_rule(path, n, item) for n, item in enumerate(data, 1)),
                       origin=f"the rules of {path}")


def _parse(path: Path, text: str):
    if path.suffix.lower() == ".json":
        try:
            return json.loads(text)
        except ValueError as exc:
            raise DumpError(f"{path}: not valid JSON ({exc})") from exc
    try:
        import yaml
    except ImportError:
        try:
            return json.loads(text)
        except ValueError:
            raise DumpError(f"{path}: reading YAML rules needs PyYAML: pip install "
                            f"'h5cmp[map]' (or write the rules as JSON)") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DumpError(f"{path}: not valid YAML ({first})") from exc


def _rule(path: Path, number: int, item: object) -> Rule:
    where = f"{path}: rule {number}"
    if not isinstance(item, dict):
        raise DumpError(f"{where}: expected {{glob: PATTERN, to: NAME}}, got {item!r}")
    syntaxes = [s for s in ("glob", "regex") if s in item]
    unknown = set(item) - {"glob", "regex", "to", "outputs"}
    if len(syntaxes) != 1 or "to" not in item or unknown:
        raise DumpError(f"{where}: give exactly one of glob/regex, and to (got keys "
                        f"{', '.join(map(str, item))})")
    pattern, to = item[syntaxes[0]], item["to"]
    if not isinstance(pattern, str) or not isinstance(to, str):
        raise DumpError(f"{where}: pattern and to must be text")
    outputs = item.get("outputs") or {}
    try:
        pairs = tuple(sorted((int(b), int(a)) for b, a in dict(outputs).items()))
        return Rule(pattern, to, syntaxes[0], pairs)
    except (TypeError, ValueError) as exc:
        raise DumpError(f"{where}: {exc}") from exc


def find_prefix(modules_a: Iterable[str], modules_b: Iterable[str]) -> Optional[NameMapping]:
    """A rule that renames B's paths by a prefix (B's model wrapped one level deeper than A's,
    as a Lightning module's ``model.``, or the other way round) under which most of B's paths
    are A's, where most are not as they are; None if no prefix does."""
    set_a, set_b = set(modules_a), set(modules_b)
    common = len(set_a & set_b)
    best: Optional[tuple[int, Rule]] = None
    for rule in _prefix_rules(set_a, set_b):
        hits = sum(1 for path in set_b if (renamed := rule.rename(path)) is not None
                   and renamed in set_a)
        if best is None or hits > best[0]:
            best = (hits, rule)
    if best is None or best[0] <= 2 * common or best[0] < len(set_b) / 2:
        return None
    return NameMapping((best[1],), origin="a prefix that pairs most records (pass --map "
                                          "rules to choose others)")


def _prefix_rules(set_a: set[str], set_b: set[str]) -> Iterable[Rule]:
    """Candidate prefix rules: B's paths under a module that is A's root, or A's paths under
    a module that is B's root (each root's children name the candidates)."""
    tops_a = {p.split(".")[0] for p in set_a if p}
    tops_b = {p.split(".")[0] for p in set_b if p}
    for path in set_b:  # A's top-level children appear under this B module
        if path and any(f"{path}.{top}" in set_b for top in tops_a):
            yield Rule(f"{path}.**", "{1}")
    for path in set_a:  # B's top-level children appear under this A module
        if path and any(f"{path}.{top}" in set_a for top in tops_b):
            yield Rule("**", f"{path}.{{1}}")

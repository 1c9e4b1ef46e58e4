"""Which modules and which kinds of record a dump keeps."""
from __future__ import annotations

import fnmatch
from typing import Iterable, Optional, Union

from torch import nn

from compare import format as fmt

Patterns = Union[str, Iterable[str], None]
Types = Union[type, str, Iterable[Union[type, str]], None]


def _as_tuple(value) -> tuple:
    if value is None:
        return ()
    if isinstance(value, (str, type)):
        return (value,)
    return tuple(value)


class Selection:
    """Module and kind filters.

    A module is kept when its path or key (``path.Class``) matches an ``include`` glob (all are
    included when none is given), matches no ``exclude`` glob, and, if ``module_types`` is given,
    is an instance of one of them (classes, or class names).
    """

    def __init__(self, include: Patterns = None, exclude: Patterns = None,
                 module_types: Types = None, kinds: Optional[Iterable[str]] = None):
        self.include = _as_tuple(include)
        self.exclude = _as_tuple(exclude)
        self.module_types = _as_tuple(module_types)
        self.kinds = frozenset(fmt.KINDS if kinds is None else _as_tuple(kinds))
        unknown = self.kinds - set(fmt.KINDS)
        if unknown:
            raise ValueError(f"unknown kinds {sorted(unknown)}; choose from {list(fmt.KINDS)}")
        for t in self.module_types:
            if not isinstance(t, (str, type)):
                raise TypeError(f"module_types takes classes or class names, not {t!r}")

    def wants_kind(self, kind: str) -> bool:
        return kind in self.kinds

    def wants_module(self, path: str, module: nn.Module) -> bool:
        names = (path, fmt.module_key(path, type(module).__name__))
        if self.include and not any(fnmatch.fnmatchcase(n, p) for n in names for p in self.include):
            return False
        if any(fnmatch.fnmatchcase(n, p) for n in names for p in self.exclude):
            return False
        if self.module_types:
            return any(isinstance(module, t) if isinstance(t, type) else type(module).__name__ == t
                       for t in self.module_types)
        return True

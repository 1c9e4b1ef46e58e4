"""Epoch/step windows: which (epoch, step) pairs a dumper captures."""
from __future__ import annotations

from typing import Iterable, Union


class Every:
    """Every ``n``-th value from ``start`` on: ``Every(100)`` holds 0, 100, 200, ..."""

    def __init__(self, n: int, start: int = 0):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"every(n) needs a positive int n, got {n!r}")
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"every(n, start) needs a non-negative int start, got {start!r}")
        self.n, self.start = n, start

    def __contains__(self, value: int) -> bool:
        return value >= self.start and (value - self.start) % self.n == 0

    def __repr__(self) -> str:
        return f"every({self.n}, start={self.start})"


def every(n: int, start: int = 0) -> Every:
    """Window holding every ``n``-th epoch or step from ``start``."""
    return Every(n, start)


WindowSpec = Union[None, int, range, Every, Iterable[int]]


class Window:
    """Normalised window: ``None`` = all, an int, a range, :func:`every`, or any iterable of ints."""

    def __init__(self, spec: WindowSpec, what: str):
        self._all = spec is None
        if spec is None or isinstance(spec, (range, Every)):
            self._members = spec
        elif isinstance(spec, int) and not isinstance(spec, bool):
            self._members = frozenset({_check(spec, what)})
        elif isinstance(spec, (str, bytes)) or not isinstance(spec, Iterable):
            raise TypeError(f"{what} must be None, an int, a range, every(n) or ints; got {spec!r}")
        else:
            self._members = frozenset(_check(v, what) for v in spec)
        if isinstance(spec, range) and len(spec) and min(spec) < 0:
            raise ValueError(f"{what} must not hold negative values, got {spec!r}")

    def __contains__(self, value: int) -> bool:
        return self._all or value in self._members


def _check(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must hold ints, got {value!r}")
    if value < 0:
        raise ValueError(f"{what} must not hold negative values, got {value}")
    return value

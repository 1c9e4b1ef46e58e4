"""Flatten the nested arguments and results of a module call into (path, leaf) pairs."""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator

MAX_DEPTH = 16


def leaves(obj: Any, path: str, depth: int = 0) -> Iterator[tuple[str, Any]]:
    """Yield ``(path, leaf)`` for every leaf of tuples, lists, dicts, namedtuples and dataclasses.

    Paths read like Python: ``args[0]``, ``kwargs['mask']``, ``output.logits[1]``. Anything else
    (tensors included) is a leaf; nesting deeper than ``MAX_DEPTH`` is treated as a leaf too.
    """
    if depth >= MAX_DEPTH:
        yield path, obj
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):
        for name in obj._fields:
            yield from leaves(getattr(obj, name), f"{path}.{name}", depth + 1)
    elif isinstance(obj, (tuple, list)):
        for i, item in enumerate(obj):
            yield from leaves(item, f"{path}[{i}]", depth + 1)
    elif isinstance(obj, dict):
        for key, item in obj.items():
            yield from leaves(item, f"{path}[{key!r}]", depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from leaves(getattr(obj, field.name), f"{path}.{field.name}", depth + 1)
    else:
        yield path, obj


def short_repr(obj: Any, limit: int = 80) -> str:
    """``repr`` cut to ``limit`` characters; never raises."""
    try:
        text = repr(obj)
    except Exception as exc:  # a user object with a broken __repr__ must not stop training
        text = f"<{type(obj).__name__}: repr failed: {type(exc).__name__}>"
    return clip(text, limit)


def leaf_text(leaf: Any) -> tuple[str, str]:
    """How a non-tensor leaf is recorded: its type's name and its :func:`short_repr` (the
    pair a call's signature is made of, in the dump and in the injector alike)."""
    return type(leaf).__name__, short_repr(leaf)


def clip(text: str, limit: int) -> str:
    """``text``, cut to ``limit`` characters with ``...`` when longer."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def map_tensors(obj: Any, fn, depth: int = 0) -> Any:
    """``obj`` rebuilt with every leaf ``fn(leaf)`` in :func:`leaves` order (same containers).

    Leaves are visited in exactly the order :func:`leaves` yields them, so a counter in ``fn``
    numbers them the way the dump does.
    """
    if depth >= MAX_DEPTH:
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(getattr(obj, n), fn, depth + 1) for n in obj._fields))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(item, fn, depth + 1) for item in obj)
    if isinstance(obj, dict):
        return type(obj)((key, map_tensors(item, fn, depth + 1)) for key, item in obj.items())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_tensors(getattr(obj, f.name), fn, depth + 1)
                   for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return fn(obj)


def call_leaves(args: tuple, kwargs: dict) -> Iterator[tuple[str, Any]]:
    """Leaves of a call's arguments: positional ``args[i]...`` then ``kwargs['name']...``."""
    yield from leaves(args, "args")
    yield from leaves(kwargs, "kwargs")

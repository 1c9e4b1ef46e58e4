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
    return text if len(text) <= limit else text[: limit - 3] + "..."

"""Per-step bookkeeping of module calls shared by every set of module hooks."""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterator

import torch
from torch import nn


def hookable_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``model.named_modules()`` less TorchScript modules, which run no Python hooks (and
    refuse module hooks)."""
    return ((path, m) for path, m in model.named_modules()
            if not isinstance(m, torch.jit.ScriptModule))


class CallTracker:
    """Numbers each module's calls within a step (``call_idx``: the n-th call of that module,
    from 0 — the numbering dumps and injection agree on) and carries per-call state from a
    forward pre-hook to the forward hook of the same call (a stack per module: calls can nest).
    """

    def __init__(self) -> None:
        self._counts: dict[int, int] = defaultdict(int)
        self._open: dict[int, list[Any]] = defaultdict(list)

    def next_index(self, module: nn.Module) -> int:
        """``call_idx`` of the call starting now."""
        index = self._counts[id(module)]
        self._counts[id(module)] = index + 1
        return index

    def push(self, module: nn.Module, state: Any) -> None:
        self._open[id(module)].append(state)

    def pop(self, module: nn.Module) -> Any:
        """State pushed by the innermost open call of ``module`` (None if there is none)."""
        stack = self._open[id(module)]
        return stack.pop() if stack else None

    def clear(self) -> None:
        self._counts.clear()
        self._open.clear()

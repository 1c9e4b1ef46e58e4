"""The NaN/Inf sentinel: find the first module call, forward or backward, that made a
non-finite value, on every step, cheaply (``HookerAndDumper(..., on_nonfinite=...)``).

Forward: each hooked call's output tensors are checked when the call returns (children return
before their parents, so the first non-finite output is the innermost call that has one); the
report says whether the call's inputs were finite (then the call made the NaN/Inf) or not
(it arose before the call, in code outside the hooked modules). Backward: the gradient of every
module input and output is checked as autograd delivers it; the first non-finite one was sent
back by the backward of the module(s) that took that tensor as input (their own output
gradients, checked earlier, were finite), or comes from the loss when no module took it.

A check is one reduction (a sum; only a non-finite sum is confirmed element by element), with a
host read per tensor. Hooks only read: the model's numerics do not change.
"""
from __future__ import annotations

import collections
import math
import warnings
import weakref
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .calls import hookable_modules
from .capture import hook_gradient, in_backward
from .flatten import call_leaves, leaves
from .grads import gradient_edge

ACTIONS = ("raise", "warn")


class NonFiniteError(RuntimeError):
    """A module call made NaN or Inf (raised by the sentinel with ``on_nonfinite="raise"``)."""


def is_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite (integers and booleans always are)."""
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return True
    if t.is_complex():
        return bool(torch.isfinite(t).all())
    total = float(t.detach().sum())
    return math.isfinite(total) or bool(torch.isfinite(t).all())  # a sum may overflow


def describe(t: torch.Tensor) -> str:
    """``shape dtype``, and its NaN/Inf counts when it has any."""
    text = f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
    if not is_finite(t):
        nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
        text += f" with {nan} NaN, {inf} Inf of {t.numel()}"
    return text


class _Watched:
    """A tensor whose gradient is checked: what it is, and the modules that took it as input."""

    __slots__ = ("what", "users")

    def __init__(self, what: str):
        self.what, self.users = what, []


class NonFiniteSentinel:
    """Hooks ``model`` for one step; reports the first non-finite value by ``action``
    (``"raise"``: :class:`NonFiniteError` from the hook, stopping the step there; ``"warn"``:
    a warning, once per step). ``history`` earlier events are quoted in the report.
    :meth:`remove` removes every hook."""

    def __init__(self, model: nn.Module, action: str, history: int = 8):
        if action not in ACTIONS:
            raise ValueError(f"on_nonfinite must be one of {ACTIONS} or None, got {action!r}")
        self.action = action
        self.report: Optional[str] = None  # the first report of this step
        self._history: collections.deque = collections.deque(maxlen=history)
        self._calls = 0
        # per gradient edge (node, slot) of a watched tensor: what it is and the modules that
        # took it as input; the nodes are kept so that their ids stay unique
        self._watched: dict[tuple[int, int], _Watched] = {}
        self._nodes: list = []
        self._checked: dict[int, tuple[weakref.ref, int]] = {}  # outputs found finite
        self.handles: list[RemovableHandle] = []
        for path, module in hookable_modules(model):
            cls = type(module).__name__
            self.handles.append(module.register_forward_pre_hook(
                lambda m, args, kwargs, path=path: self._pre_hook(path, args, kwargs),
                with_kwargs=True))
            self.handles.append(module.register_forward_hook(
                lambda m, args, kwargs, out, path=path, cls=cls:
                self._post_hook(path, cls, args, kwargs, out), with_kwargs=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self._watched.clear()
        self._nodes.clear()
        self._checked.clear()

    def _pre_hook(self, path: str, args: tuple, kwargs: dict) -> None:
        if in_backward() or self.report is not None:
            return
        for _, leaf in call_leaves(args, kwargs):
            if isinstance(leaf, torch.Tensor):
                watched = self._watch(leaf, f"the input of {path or '<root>'}")
                if watched is not None:
                    watched.users.append(path)

    def _post_hook(self, path: str, cls: str, args: tuple, kwargs: dict, output: Any) -> None:
        if in_backward() or self.report is not None:
            return
        self._calls += 1
        name = f"{path or '<root>'} ({cls}), call {self._calls}"
        for leaf_path, leaf in leaves(output, "output"):
            if not isinstance(leaf, torch.Tensor) or self._seen_finite(leaf):
                continue
            if not is_finite(leaf):
                inputs = [(p, t) for p, t in call_leaves(args, kwargs)
                          if isinstance(t, torch.Tensor)]
                finite_in = all(is_finite(t) for _, t in inputs)
                where = ("this call made it (its inputs are finite)" if finite_in else
                         "its inputs were already non-finite: it arose before this call, in "
                         "code outside the hooked modules")
                state = "; ".join(f"{p}: {describe(t)}" for p, t in inputs) or "none"
                self._found(f"forward: {leaf_path} of {name} is {describe(leaf)}; {where}. "
                            f"Inputs: {state}")
                return
            self._watch(leaf, f"{leaf_path} of {path or '<root>'}")
            if not leaf.is_inference():
                self._checked[id(leaf)] = (weakref.ref(leaf), leaf._version)
        self._history.append(f"forward {name}: output finite")

    def _seen_finite(self, t: torch.Tensor) -> bool:
        """Whether ``t`` was found finite at its current version (a container returns its last
        child's output: checked once)."""
        known = self._checked.get(id(t))
        return (known is not None and known[0]() is t and not t.is_inference()
                and known[1] == t._version)

    def _watch(self, t: torch.Tensor, what: str) -> Optional["_Watched"]:
        """Check ``t``'s gradient when autograd delivers it (once per gradient edge)."""
        if not t.requires_grad or not torch.is_grad_enabled():
            return None
        node, slot = gradient_edge(t)
        key = (id(node), slot)
        watched = self._watched.get(key)
        if watched is None:
            watched = self._watched[key] = _Watched(what)
            self._nodes.append(node)
            self.handles.append(hook_gradient(t, lambda grad: self._on_grad(watched, grad)))
        return watched

    def _on_grad(self, watched: "_Watched", grad: torch.Tensor) -> None:
        if self.report is not None:
            return
        what, users = watched.what, watched.users
        if is_finite(grad):
            self._history.append(f"backward: gradient of {what}: finite")
            return
        if users:
            depth = max(p.count(".") + bool(p) for p in users)
            innermost = " or ".join(dict.fromkeys(p or "<root>" for p in users
                                                  if p.count(".") + bool(p) == depth))
            origin = (f"the backward of {innermost} made it (grad_input; its grad_output was "
                      f"finite)")
        else:
            origin = "no hooked module took this tensor as input: it comes from the loss"
        self._found(f"backward: the gradient of {what} is {describe(grad)}; {origin}")

    def _found(self, what: str) -> None:
        last = "\n".join(f"  {event}" for event in self._history) or "  (none)"
        self.report = (f"h5cmp: first non-finite value: {what}\nthe last {len(self._history)} "
                       f"events before it:\n{last}")
        if self.action == "raise":
            self.remove()  # the step stops here: leave no hook behind whoever catches it
            raise NonFiniteError(self.report)
        warnings.warn(self.report, RuntimeWarning, stacklevel=2)

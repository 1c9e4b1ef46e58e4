"""Interventions on a run: reference injection (teacher forcing) and perturbations.

Both modify what flows through chosen modules. Input replacement runs before every other
forward pre-hook (``prepend=True``), so the module and any dumper see the injected inputs.
Output replacement runs after the forward hooks registered before it (a user's hook that
changes the output is part of the module), so register an :class:`Injector` *before* the
dumper's hooks of the step for the dump to record what flowed downstream. Every hook registered
here is kept in a handle list and removed by ``remove()``.
"""
from __future__ import annotations

import contextlib
import itertools
import os
from typing import Iterable, Iterator, Optional, Union

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from compare import format as fmt
from compare.dump import Dump, load_dump

from .calls import CallTracker, hook_target, hookable_modules
from .capture import in_backward
from .encoding import decode_to_tensor
from .flatten import map_tensors

INJECTABLE = (fmt.INPUT, fmt.OUTPUT, fmt.GRAD_OUTPUT)


class _StraightThrough(torch.autograd.Function):
    """Forward: the replacement values, exactly. Backward: the gradient passes unchanged."""

    @staticmethod
    def forward(ctx, x, replacement):
        return replacement.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _replace(t: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    if t.requires_grad and torch.is_grad_enabled():
        return _StraightThrough.apply(t, values)
    return values


def _selected(path: str, module: nn.Module, patterns: tuple[str, ...]) -> bool:
    """All modules when no pattern is given."""
    return not patterns or fmt.module_matches(path, type(module).__name__, patterns)


class _Hooks:
    """Registered hooks and per-step call numbering, shared by injection and perturbation."""

    def __init__(self):
        self.handles: list[RemovableHandle] = []
        self.calls = CallTracker()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.calls.clear()


class Injector:
    """Replace module inputs, outputs or incoming gradients with a reference dump's tensors.

    ``kinds`` ⊆ {``input``, ``output``, ``grad_output``}; ``include`` globs (module paths or
    keys) choose the modules (all by default). For step ``(epoch, step)`` the tensors of the
    same module, call and index in the reference dump's step are used, cast to the run's dtype
    and device; values are exact after the cast, and gradients flow through unchanged. Dumping
    while injecting all inputs gives each module's *local* error (see ``compare.localize``).
    """

    def __init__(self, reference: Union[str, os.PathLike, Dump], kinds: Iterable[str] = (fmt.INPUT,),
                 include: Union[str, Iterable[str], None] = None):
        self.reference = load_dump(reference)
        self.kinds = frozenset((kinds,) if isinstance(kinds, str) else kinds)
        bad = self.kinds - set(INJECTABLE)
        if bad or not self.kinds:
            raise ValueError(f"kinds must be a non-empty subset of {list(INJECTABLE)}, got {sorted(bad)}")
        self.include = (include,) if isinstance(include, str) else tuple(include or ())
        self._hooks = _Hooks()
        self._tensors: dict[tuple, tuple] = {}
        self._reader = None
        self.injected = 0

    def register(self, model: nn.Module, epoch: int, step: int) -> None:
        """Install the hooks for step ``(epoch, step)``; :meth:`remove` takes them away."""
        step_file = next((s for s in self.reference.steps if (s.epoch, s.step) == (epoch, step)), None)
        if step_file is None:
            raise KeyError(f"reference dump {self.reference.path} has no step {epoch}:{step}")
        rows = step_file.index[step_file.index["dataset"] != ""]
        self._tensors = {(r.module, r.call_idx, r.kind, r.index): r for r in rows.itertuples()
                         if r.kind in self.kinds and r.occurrence == 0}
        self._reader = step_file.open()
        for path, module in hookable_modules(hook_target(model)):
            if _selected(path, module, self.include):
                self._hooks.handles.append(module.register_forward_pre_hook(
                    self._pre_hook(path), with_kwargs=True, prepend=True))
                self._hooks.handles.append(module.register_forward_hook(
                    self._post_hook(path), with_kwargs=True))

    def remove(self) -> None:
        self._hooks.remove()
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    @contextlib.contextmanager
    def injecting(self, model: nn.Module, epoch: int, step: int) -> Iterator["Injector"]:
        self.register(model, epoch, step)
        try:
            yield self
        finally:
            self.remove()

    def _reference(self, key: tuple, like: torch.Tensor) -> Optional[torch.Tensor]:
        row = self._tensors.get(key)
        if row is None:
            return None
        ref = decode_to_tensor(self._reader.read_raw(row), row.dtype)
        if tuple(ref.shape) != tuple(like.shape):
            raise ValueError(f"cannot inject {row.group}/{row.dataset}: reference shape "
                             f"{tuple(ref.shape)} != run shape {tuple(like.shape)}")
        self.injected += 1
        return ref.to(dtype=like.dtype, device=like.device)

    def _replacer(self, module: str, call_idx: int, kind: str):
        counter = itertools.count()

        def replace(leaf):
            if not isinstance(leaf, torch.Tensor):
                return leaf
            ref = self._reference((module, call_idx, kind, next(counter)), leaf)
            return leaf if ref is None else _replace(leaf, ref)
        return replace

    def _pre_hook(self, path: str):
        def hook(module, args, kwargs):
            if in_backward():  # activation-checkpoint recomputation
                return None
            call_idx = self._hooks.calls.next_index(module)
            self._hooks.calls.push(module, call_idx)
            if fmt.INPUT not in self.kinds:
                return None
            replace = self._replacer(path, call_idx, fmt.INPUT)
            args = map_tensors(args, replace)
            return args, map_tensors(kwargs, replace)
        return hook

    def _post_hook(self, path: str):
        def hook(module, args, kwargs, output):
            if in_backward():
                return None
            call_idx = self._hooks.calls.pop(module)
            if fmt.OUTPUT in self.kinds:
                output = map_tensors(output, self._replacer(path, call_idx, fmt.OUTPUT))
            if fmt.GRAD_OUTPUT in self.kinds:
                counter = itertools.count()

                def hook_grad(leaf):
                    if isinstance(leaf, torch.Tensor):
                        index = next(counter)
                        if leaf.requires_grad:
                            key = (path, call_idx, fmt.GRAD_OUTPUT, index)
                            self._hooks.handles.append(leaf.register_hook(
                                lambda g, key=key: self._reference(key, g)))
                    return leaf
                map_tensors(output, hook_grad)
            return output
        return hook


class Perturbation:
    """Scale, noise or offset on chosen modules' outputs (``where="output"``) or on the gradient
    arriving at them (``where="grad_output"``): ``x * scale + noise * N(0, 1) + offset``.
    For sensitivity checks, and to plant a known error in tests. ``remove()`` undoes it."""

    def __init__(self, model: nn.Module, include: Union[str, Iterable[str]],
                 where: str = fmt.OUTPUT, scale: float = 1.0, noise: float = 0.0,
                 offset: float = 0.0, seed: int = 0):
        if where not in (fmt.OUTPUT, fmt.GRAD_OUTPUT):
            raise ValueError(f"where must be 'output' or 'grad_output', got {where!r}")
        self._hooks = _Hooks()
        self._gen = torch.Generator().manual_seed(seed)
        self.scale, self.noise, self.offset, self.where = scale, noise, offset, where
        patterns = (include,) if isinstance(include, str) else tuple(include)
        matched = [m for p, m in hookable_modules(hook_target(model)) if _selected(p, m, patterns)]
        if not matched:
            raise ValueError(f"no module matches {list(patterns)}; see dumper.module_keys(model)")
        for module in matched:
            self._hooks.handles.append(module.register_forward_hook(self._hook, prepend=True))

    def _apply(self, t: torch.Tensor) -> torch.Tensor:
        out = t * self.scale if self.scale != 1.0 else t
        if self.noise:
            noise = torch.randn(t.shape, generator=self._gen).to(dtype=t.dtype, device=t.device)
            out = out + self.noise * noise
        return out + self.offset if self.offset else out

    def _hook(self, module, args, output):
        def each(leaf):
            if not isinstance(leaf, torch.Tensor) or not leaf.is_floating_point():
                return leaf
            if self.where == fmt.OUTPUT:
                return self._apply(leaf)
            if leaf.requires_grad:  # autograd may deliver no gradient (None): leave it so
                self._hooks.handles.append(leaf.register_hook(
                    lambda grad: None if grad is None else self._apply(grad)))
            return leaf
        return map_tensors(output, each)

    def remove(self) -> None:
        self._hooks.remove()


def perturb(model: nn.Module, include: Union[str, Iterable[str]], **kwargs) -> Perturbation:
    """Install a :class:`Perturbation`; call ``.remove()`` on the result to undo it."""
    return Perturbation(model, include, **kwargs)

"""Perturbations: plant a known error in chosen modules, for sensitivity checks and tests.

The hooks run before every other forward hook of the module (``prepend=True``), so a dumper
records the perturbed values as the module's own; a perturbation of what a module sends back
wraps its ``forward`` instead (the change must happen inside the call). Every hook and wrap
made here is kept in a handle list and undone by ``remove()``. (Reference injection is
:mod:`dumper.injection`.)
"""
from __future__ import annotations

import functools
import warnings
from typing import Iterable, Union

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from compare import format as fmt

from .calls import hookable_modules, module_class, unwrapped
from .flatten import map_tensors


PLACES = (fmt.OUTPUT, fmt.GRAD_OUTPUT, fmt.GRAD_INPUT)


class Perturbation:
    """Scale, noise or offset, ``x * scale + noise * N(0, 1) + offset``, on chosen modules'
    outputs (``where="output"``: its forward computes wrongly), on the gradient arriving at
    them (``"grad_output"``: an error between modules, after the consumers sent it back), or
    on the gradients they send back for their floating inputs (``"grad_input"``: its backward
    computes wrongly; the module computes on a copy of each input whose gradient is changed,
    inside the call). For sensitivity checks, and to plant a known error in tests.
    ``remove()`` undoes it, and warns when it planted nothing meanwhile: no matched module
    ran (one defined but never called, e.g. a pooler the loss does not use), or none had a
    floating tensor at that place (``"grad_input"`` of an embedding, whose input is ids)."""

    def __init__(self, model: nn.Module, include: Union[str, Iterable[str]],
                 where: str = fmt.OUTPUT, scale: float = 1.0, noise: float = 0.0,
                 offset: float = 0.0, seed: int = 0):
        if where not in PLACES:
            raise ValueError(f"where must be one of {', '.join(map(repr, PLACES))}, got {where!r}")
        self._handles: list[Union[RemovableHandle, _ForwardWrap]] = []
        self._gen = torch.Generator().manual_seed(seed)
        self.scale, self.noise, self.offset, self.where = scale, noise, offset, where
        patterns = (include,) if isinstance(include, str) else tuple(include)
        if not patterns:
            raise ValueError("include=[] chooses no module to perturb; give module globs "
                             "('*' for every module)")
        matched = [m for p, m in hookable_modules(unwrapped(model))
                   if fmt.module_matches(p, module_class(m).__name__, patterns)]
        if not matched:
            raise ValueError(f"no module matches {list(patterns)}; see dumper.module_keys(model)")
        self.patterns = patterns
        self.planted = 0  # values changed, or gradients hooked or copied to change, so far
        for module in matched:
            if where == fmt.GRAD_INPUT:
                self._handles.append(self._wrap_forward(module))
            else:
                self._handles.append(module.register_forward_hook(self._hook, prepend=True))

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
                self.planted += 1
                return self._apply(leaf)
            if leaf.requires_grad:  # autograd may deliver no gradient (None): leave it so
                self.planted += 1
                self._handles.append(leaf.register_hook(
                    lambda grad: None if grad is None else self._apply(grad)))
            return leaf
        return map_tensors(output, each)

    def _wrap_forward(self, module: nn.Module) -> "_ForwardWrap":
        """Run ``module``'s forward on copies of its floating inputs whose gradients are
        changed, so the change is part of the call (hooks see the inputs themselves)."""
        def changed(leaf):
            if not isinstance(leaf, torch.Tensor) or not leaf.is_floating_point() or not (
                    leaf.requires_grad and torch.is_grad_enabled()):
                return leaf
            self.planted += 1
            copy = leaf.clone()
            copy.register_hook(self._apply)
            return copy
        return _ForwardWrap(module, changed)

    def remove(self) -> None:
        if self._handles and self.planted == 0:
            warnings.warn(f"h5cmp: the perturbation of {list(self.patterns)} planted nothing: "
                          f"no module it matches was called while it was installed, or none "
                          f"had a floating tensor at its {self.where}", RuntimeWarning,
                          stacklevel=2)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def perturb(model: nn.Module, include: Union[str, Iterable[str]], **kwargs) -> Perturbation:
    """Install a :class:`Perturbation`; call ``.remove()`` on the result to undo it."""
    return Perturbation(model, include, **kwargs)


class _ForwardWrap:
    """``module.forward`` run on ``change``'s copies of its arguments' tensors until
    ``remove()``. A copy the module returns untouched (it hands an input back: nothing of its
    own to perturb) is returned as the input itself; a module that changes an input in place
    changes the copy. Removed in any order, a wrap only passes through; it leaves
    ``module.forward`` as it found it where nothing replaced it since."""

    def __init__(self, module: nn.Module, change):
        self._module, self._found = module, vars(module).get("forward")
        self.active = True
        forward = module.forward

        @functools.wraps(forward)
        def wrapped(*args, **kwargs):
            if not self.active:
                return forward(*args, **kwargs)
            copies: dict[int, tuple[torch.Tensor, int]] = {}

            def copied(leaf):
                made = change(leaf)
                if made is not leaf:
                    copies[id(made)] = (leaf, made._version)
                return made
            out = forward(*map_tensors(args, copied), **map_tensors(kwargs, copied))
            return map_tensors(out, lambda leaf: copies[id(leaf)][0] if id(leaf) in copies and (
                leaf._version == copies[id(leaf)][1]) else leaf)
        self._wrapped = module.forward = wrapped

    def remove(self) -> None:
        self.active = False
        if vars(self._module).get("forward") is self._wrapped:
            if self._found is not None:
                self._module.forward = self._found
            else:
                del self._module.forward

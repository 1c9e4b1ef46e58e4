"""Looking at a model without dumping: its module keys, and each call's input/output shapes."""
from __future__ import annotations

import itertools

import pandas as pd
import torch
from torch import nn

from compare import format as fmt

from .encoding import dtype_name
from .calls import CallHooks, hookable_modules, module_class, named_modules, unwrapped
from .flatten import call_leaves, leaves


def module_keys(model: nn.Module) -> list[str]:
    """Every module's key (``path.Class``, the root's class alone), in definition order: the
    names dump groups and ``h5cmp --module`` globs use."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"module_keys needs a torch.nn.Module, got {type(model).__name__}")
    return [fmt.module_key(path, module_class(m).__name__) for path, m in named_modules(unwrapped(model))]


def io_shapes(model: nn.Module, *args, **kwargs) -> pd.DataFrame:
    """Run one forward pass (no grad, nothing written) and return, per module call and tensor,
    its shape and dtype: columns ``call, module, cls, call_idx, key, kind, index, path, dtype,
    shape``. ``print(io_shapes(...).to_string())`` prints the table."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"io_shapes needs a torch.nn.Module, got {type(model).__name__}")
    model = unwrapped(model)  # run eagerly: compiled code would skip the hooks
    rows: list[dict] = []
    calls = itertools.count()

    def record(info: dict, kind: str, items) -> None:
        tensors = [(path, leaf) for path, leaf in items if isinstance(leaf, torch.Tensor)]
        for index, (path, t) in enumerate(tensors):
            rows.append({**info, "kind": kind, "index": index, "path": path,
                         "dtype": dtype_name(t.dtype), "shape": tuple(t.shape)})

    def enter(module, path, call_idx, a, kw):
        cls = module_class(module).__name__
        info = {"call": next(calls), "module": path, "cls": cls, "call_idx": call_idx,
                "key": fmt.module_key(path, cls)}
        record(info, fmt.INPUT, call_leaves(a, kw))
        return info, None

    def leave(module, info, out):
        record(info, fmt.OUTPUT, leaves(out, "output"))

    hooks = CallHooks(enter, leave)
    try:
        for path, m in hookable_modules(model):
            hooks.install(path, m)
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        hooks.remove()
    frame = pd.DataFrame(rows, columns=["call", "module", "cls", "call_idx", "key", "kind", "index",
                                        "path", "dtype", "shape"])
    return frame.sort_values(["call", "kind"], kind="stable", ignore_index=True)

"""How much a module's weight matrix amplifies an error it receives, from the dump's figures.

A linear map ``y = W x`` (a Linear, a convolution of any groups, GPT-2's Conv1D) sends an
input error ``d`` of independent elements to ``W d`` with ``E ||W d||² = P ||W||_F² rms(d)²``
over ``P = numel(y) / n_out`` output positions, while ``||y||² = P n_out rms(y)²``. So the
relative error grows by

    forward:   ||W||_F rms(x)  / (sqrt(n_out) rms(y))
    backward:  ||W||_F rms(gy) / (sqrt(n_in) rms(gx)),  n_in = numel(x) n_out / numel(y)

(``gx = W^T gy``). Rounding errors are close to independent; a record whose error is its
input's amplified this way is no news, however few records of its class calibrate a gain
(a classifier head is one of a kind). Figures: A's root mean squares (``rms_a``) of the call's
first input and output (their gradients backward) and A's weight norm (``rms_a`` times the
square root of its element count, values or statistics).
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from . import format as fmt


def _weight(params: pd.DataFrame) -> tuple[float, tuple] | None:
    """Norm and shape of a call's first parameter of two or more dimensions."""
    for r in params.itertuples():
        shape = r.shape_a if isinstance(r.shape_a, tuple) else r.shape_b
        if isinstance(shape, tuple) and len(shape) >= 2 and r.rms_a == r.rms_a:
            return float(r.rms_a) * math.sqrt(math.prod(shape)), shape
    return None


def _outputs(weight_shape: tuple, out_shape: tuple) -> int:
    """Output features of a weight for an output of ``out_shape`` (0 when they do not match):
    its first dimension, on the output's last or second; GPT-2's Conv1D keeps it transposed."""
    first, second = weight_shape[0], weight_shape[1]
    if out_shape and (out_shape[-1] == first or (len(out_shape) > 1 and out_shape[1] == first)):
        return first
    return second if out_shape and out_shape[-1] == second else 0


def linear_gains(frame: pd.DataFrame) -> np.ndarray:
    """Per row, the amplification above for the output (forward) and the grad_input of a call
    of a module owning a weight of two or more dimensions; NaN elsewhere."""
    out = np.full(len(frame), np.nan)
    rows = frame.assign(pos=np.arange(len(frame)), rank=frame["rank"].fillna(-1))
    params = rows[rows["kind"] == fmt.PARAM]
    weights = {m: _weight(p) for m, p in params.groupby("module", sort=False)}
    first = {(fmt.INPUT, 0), (fmt.OUTPUT, 0), (fmt.GRAD_INPUT, 0), (fmt.GRAD_OUTPUT, 0)}
    for (_, _, _, module, call_idx), call in rows.groupby(
            ["epoch", "step", "rank", "module", "call_idx"], sort=False):
        weight = weights.get(module)
        if weight is None:
            continue
        norm, shape = weight
        by_kind = {(k, i): r for k, i, r in zip(call["kind"], call["index"],
                                                 call.itertuples()) if (k, i) in first}
        x, y = by_kind.get((fmt.INPUT, 0)), by_kind.get((fmt.OUTPUT, 0))
        if x is None or y is None or not isinstance(y.shape_a, tuple):
            continue
        n_out = _outputs(shape, y.shape_a)
        if not n_out or not y.rms_a > 0:
            continue
        out[y.pos] = norm * x.rms_a / (math.sqrt(n_out) * y.rms_a)
        gy, gx = by_kind.get((fmt.GRAD_OUTPUT, 0)), by_kind.get((fmt.GRAD_INPUT, 0))
        if gy is not None and gx is not None and gx.rms_a > 0 and y.numel > 0:
            n_in = x.numel * n_out / y.numel
            out[gx.pos] = norm * gy.rms_a / (math.sqrt(n_in) * gx.rms_a)
    return out

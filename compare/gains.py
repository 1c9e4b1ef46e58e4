"""How much a module call amplifies an error it receives, from the dump's figures.

**Weight matrices.** A linear map ``y = W x`` (a Linear, a convolution of any groups, GPT-2's
Conv1D) sends an input error ``d`` of independent elements to ``W d`` with
``E ||W d||² = P ||W||_F² rms(d)²`` over ``P = numel(y) / n_out`` output positions, while
``||y||² = P n_out rms(y)²``. So the relative error grows by

    forward:   ||W||_F rms(x)  / (sqrt(n_out) rms(y))
    backward:  ||W||_F rms(gy) / (sqrt(n_in) rms(gx)),  n_in = numel(x) n_out / numel(y)

(``gx = W^T gy``). The weight's gradient ``dW = sum_p gy_p x_p^T`` over the positions
takes an error of independent elements in ``gy`` to ``E ||dgy^T X||² = n_out rms(dgy)²
||X||_F²``, and one in ``x`` likewise, so

    weight gradient:  rms(gy) rms(x) sqrt(P) / rms(dW)
    bias gradient:    rms(gy) sqrt(P) / rms(db)      (db = sum_p gy_p)

which are large where the positions' contributions cancel (a batch of two whose gradients
are opposite; a bias before a BatchNorm, whose gradient is zero but for rounding). A
normalization's weight and bias are vectors summed over positions the same way (``dγ =
sum_p gy_p x̂_p``, ``x̂`` of unit root mean square: the bias's gain, ``P`` the positions per
channel). Rounding
errors are close to independent; a record whose error is its input's amplified this way is
no news, however few records of its class calibrate a gain (a classifier head is one of a
kind). Figures: A's root mean squares (``rms_a``) of the call's
first input and output (their gradients backward) and A's weight norm (``rms_a`` times the
square root of its element count, values or statistics).

**Biases.** A bias ``b`` is added to the output, so an error in it moves the output by
exactly its own absolute error: a relative error ``e`` is ``e rms(b) / rms(y)`` in ``y``,
however large ``e`` (a bias no gradient reaches, such as a key projection's, is rounding noise
that differs between runs by many times itself, at a negligible scale).

**Any call with one input, backward from forward.** A call's backward multiplies the gradient
by the transpose of the Jacobian ``J`` its forward has at that input, and ``||J^T||_F =
||J||_F``. An input error ``dx`` of independent elements becomes ``J dx`` with ``||J dx|| ≈
||J||_F ||dx|| / sqrt(numel(x))``; a gradient error ``dgy`` becomes ``J^T dgy`` with
``||J^T dgy|| ≈ ||J||_F ||dgy|| / sqrt(numel(y))``. So the forward pass of the same call
measures the backward's gain: with ``||dy||`` the output's error that its input's explains,

    backward:  (||dy|| / ||dx||) · rms(gy) / rms(gx)

A normalization fed few elements per group cancels most of its gradient (``g`` less its mean
and its projection on the normalized input), and this gain is then large where its class's is
not. ``||dy||`` is the output's error less the rounding comparable outputs add (``level``), in
quadrature; where the call's weights differ between the runs they explain part of it too, and
no gain is taken. The input's error must be measured (values or statistics) and not zero.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Iterator

import numpy as np
import pandas as pd

from . import format as fmt
from .formulas import POOLS

_FIRST = {(fmt.INPUT, 0), (fmt.OUTPUT, 0), (fmt.GRAD_INPUT, 0), (fmt.GRAD_OUTPUT, 0)}


def _weight(params: pd.DataFrame) -> tuple[float, tuple, int] | None:
    """Norm, shape and parameter index of a call's first parameter of two or more
    dimensions."""
    for r in params.itertuples():
        shape = r.shape_a if isinstance(r.shape_a, tuple) else r.shape_b
        if isinstance(shape, tuple) and len(shape) >= 2 and r.rms_a == r.rms_a:
            return float(r.rms_a) * math.sqrt(math.prod(shape)), shape, int(r.index)
    return None


def _outputs(weight_shape: tuple, out_shape: tuple) -> int:
    """Output features of a weight for an output of ``out_shape`` (0 when they do not match):
    its first dimension, on the output's last or second; GPT-2's Conv1D keeps it transposed."""
    first, second = weight_shape[0], weight_shape[1]
    if out_shape and (out_shape[-1] == first or (len(out_shape) > 1 and out_shape[1] == first)):
        return first
    return second if out_shape and out_shape[-1] == second else 0


class _Calls:
    """The module calls of a comparison, walked without pandas groups (a dump may hold
    thousands): per call, its first input, output and gradients (row positions by ``(kind,
    index)``), and how many input records it has, and how many floating ones; the rows'
    figures (and whether each is floating) as arrays."""

    def __init__(self, frame: pd.DataFrame):
        kind, index = frame["kind"].to_numpy(object), frame["index"].to_numpy()
        keys = zip(frame["epoch"], frame["step"], frame["rank"].fillna(-1), frame["module"],
                   frame["call_idx"])
        self.first: dict[tuple, dict[tuple, int]] = {}
        self.inputs: dict[tuple, int] = {}
        self.floating_inputs: dict[tuple, int] = {}
        self.floating = frame["dtype_a"].fillna("").str.contains("float|complex").to_numpy()
        for pos, (key, k, i) in enumerate(zip(keys, kind, index)):
            if k == fmt.INPUT:
                self.inputs[key] = self.inputs.get(key, 0) + 1
                self.floating_inputs[key] = self.floating_inputs.get(key, 0) + self.floating[pos]
            if (k, i) in _FIRST:
                self.first.setdefault(key, {})[(k, i)] = pos
        self.rms = frame["rms_a"].to_numpy(float)
        self.numel = frame["numel"].to_numpy(float)
        self.shape = frame["shape_a"].to_numpy(object)

    def __iter__(self) -> Iterator[tuple[tuple, str, dict[tuple, int]]]:
        """``(epoch, step, rank, module, call_idx), module, first records`` per call."""
        for key, first in self.first.items():
            yield key, key[3], first


def bias_scales(frame: pd.DataFrame) -> np.ndarray:
    """Per ``param`` row of a module's ``bias`` beside its ``weight`` (a Linear, a convolution,
    GPT-2's Conv1D), its scale over its module's outputs', ``rms(b) / rms(y)`` (A's figures;
    the largest over the module's calls): a bias is added to the output, so a relative error
    ``e`` in it is one of ``e rms(b) / rms(y)`` there (a key projection's bias, which no
    gradient reaches, differs between runs by many times itself and moves nothing); NaN
    elsewhere, and where A's bias or output is zero."""
    out = np.full(len(frame), np.nan)
    path, kind = frame["path"].to_numpy(object), frame["kind"].to_numpy(object)
    rms = frame["rms_a"].to_numpy(float)
    keys = list(zip(frame["epoch"], frame["step"], frame["rank"].fillna(-1), frame["module"]))
    params = {(key, name): pos for pos, (key, name, k) in enumerate(zip(keys, path, kind))
              if k == fmt.PARAM}
    outputs: dict[tuple, float] = {}  # per module, the smallest output scale of its calls
    for key, k, index, scale in zip(keys, kind, frame["index"], rms):
        if k == fmt.OUTPUT and index == 0 and scale > 0:
            outputs[key] = min(outputs.get(key, math.inf), scale)
    for (key, name), pos in params.items():
        if name == "bias" and (key, "weight") in params and rms[pos] > 0 and key in outputs:
            out[pos] = rms[pos] / outputs[key]
    return out


def linear_gains(frame: pd.DataFrame) -> np.ndarray:
    """Per row, the weight-matrix amplification above for the output (forward) and the
    grad_input of a call of a module owning a weight of two or more dimensions given a
    floating first input (not an Embedding's indices), for the gradients of the parameters a
    call sums over positions (:func:`_sum_gains`), and for an average pool's output
    (:func:`_pool_gain`); NaN elsewhere."""
    out = np.full(len(frame), np.nan)
    params = frame.loc[frame["kind"] == fmt.PARAM,
                       ["module", "index", "path", "shape_a", "shape_b", "rms_a"]]
    weights = {m: _weight(p) for m, p in params.groupby("module", sort=False)}
    calls = _Calls(frame)
    rms, numel = calls.rms, calls.numel
    pooled = frame.loc[frame["cls"].isin(list(POOLS)), ["module", "cls"]].drop_duplicates()
    pools = {m: POOLS[c] for m, c in zip(pooled["module"], pooled["cls"])}  # their dims
    outputs: dict[tuple, int] = {}  # per call of a module with a weight matrix: its n_out
    for key, module, first in calls:
        weight = weights.get(module)
        if weight is None:
            if module in pools:
                _pool_gain(calls, first, pools[module], out)
            continue
        norm, shape, index = weight
        x, y = first.get((fmt.INPUT, 0)), first.get((fmt.OUTPUT, 0))
        if (x is None or y is None or not calls.floating[x]  # (an Embedding's indices)
                or not isinstance(calls.shape[y], tuple)):
            continue
        n_out = _outputs(shape, calls.shape[y])
        if not n_out or not rms[y] > 0:
            continue
        outputs[key] = n_out
        out[y] = norm * rms[x] / (math.sqrt(n_out) * rms[y])
        gy, gx = first.get((fmt.GRAD_OUTPUT, 0)), first.get((fmt.GRAD_INPUT, 0))
        if gy is not None and gx is not None and rms[gx] > 0 and numel[y] > 0:
            n_in = numel[x] * n_out / numel[y]
            out[gx] = norm * rms[gy] / (math.sqrt(n_in) * rms[gx])
    _sum_gains(frame, calls, params, weights, outputs, out)
    return out


def _pool_gain(calls: _Calls, first: dict[tuple, int], dims: int, out: np.ndarray) -> None:
    """An adaptive average pool over its last ``dims`` dimensions whose bins tile its input
    (each pooled size a multiple of the output's, so bins of ``n`` inputs that do not
    overlap): each output is the mean of its bin, so ``|mean(d)| <= rms(d over the bin)`` and
    ``||dy||² <= ||dx||² / n`` (Cauchy-Schwarz: errors that agree in sign, as drifted weights
    give, meet it), a relative error grown by ``rms(x) / rms(y)`` at most: large where the
    mean cancels (Swin's pool of a normalized sequence: 1.0 into 0.44, its error 2.2x
    its input's). Backward each input gets its bin's gradient over ``n``: no gain."""
    x, y = first.get((fmt.INPUT, 0)), first.get((fmt.OUTPUT, 0))
    if x is None or y is None or not calls.floating[x] or not calls.rms[y] > 0:
        return
    shape_x, shape_y = calls.shape[x], calls.shape[y]
    if not (isinstance(shape_x, tuple) and isinstance(shape_y, tuple)
            and len(shape_x) == len(shape_y) >= dims and shape_x[:-dims] == shape_y[:-dims]
            and all(o > 0 and i % o == 0 for i, o in zip(shape_x[-dims:], shape_y[-dims:]))):
        return
    out[y] = max(1.0, calls.rms[x] / calls.rms[y])


def _sum_gains(frame: pd.DataFrame, calls: _Calls, params: pd.DataFrame, weights: dict,
               outputs: dict[tuple, int], out: np.ndarray) -> None:
    """Into ``out``, per gradient of a parameter that a call of its module (its only call in
    the step: several calls' gradients add up) sums over the positions of its incoming
    gradient ``gy``: ``rms(gy) f sqrt(P) / rms(dp)`` (above), ``P`` the positions. For the
    weight matrix, ``f = rms(x)`` and ``P = numel(gy) / n_out``; for a vector of ``n``
    (one element per channel: ``gy``'s second or last dimension), ``P = numel(gy) / n`` and
    ``f = 1`` for a bias, and for the weight of a normalization (a module whose parameters
    are all vectors of one length), which multiplies the normalized input, of unit root
    mean square by construction; and ``f = 1``, ``P = numel(gy) / numel(p)`` for the only
    parameter of a module given no floating input, a lookup whose output elements are its
    parameter's (an Embedding, Swin's relative position bias: its table's gradient sums what
    arrives at the positions each entry went to)."""
    rms, numel = calls.rms, calls.numel
    made = Counter(key[:4] for key, _, _ in calls)
    grad = frame["kind"] == fmt.PARAM_GRAD
    grads = {k: pos for k, pos in zip(
        zip(frame["epoch"][grad], frame["step"][grad], frame["rank"][grad].fillna(-1),
            frame["module"][grad], frame["index"][grad]), np.flatnonzero(grad.to_numpy()))}
    vectors = {m: dict(zip(p["index"], zip(p["path"], p["shape_a"])))
               for m, p in params.groupby("module")}
    for key, module, first in calls:
        gy = first.get((fmt.GRAD_OUTPUT, 0))
        shape_gy = calls.shape[gy] if gy is not None else None
        if gy is None or made[key[:4]] != 1 or not isinstance(shape_gy, tuple) or not shape_gy:
            continue
        owned = vectors.get(module, {})
        shapes = [shape for _, shape in owned.values()]
        normalization = bool(shapes) and all(
            isinstance(s, tuple) and len(s) == 1 and s == shapes[0] for s in shapes)
        weight, x = weights.get(module), first.get((fmt.INPUT, 0))
        for i, (path, shape) in owned.items():
            dp = grads.get((*key[:4], i))
            if dp is None or not rms[dp] > 0 or not isinstance(shape, tuple):
                continue
            if weight is not None and i == weight[2] and key in outputs and x is not None:
                factor, positions = rms[x], numel[gy] / outputs[key]
            elif len(shape) == 1 and (path == "bias" or normalization) and shape[0] in (
                    shape_gy[-1], shape_gy[1] if len(shape_gy) > 1 else None):
                factor, positions = 1.0, numel[gy] / shape[0]
            elif len(owned) == 1 and not calls.floating_inputs.get(key) and math.prod(shape):
                factor, positions = 1.0, numel[gy] / math.prod(shape)  # a lookup
            else:
                continue
            out[dp] = rms[gy] * factor * math.sqrt(positions) / rms[dp]


def adjoint_gains(frame: pd.DataFrame, err: np.ndarray, level: np.ndarray,
                  drifted: np.ndarray) -> np.ndarray:
    """Per row, the backward gain above for the grad_input[0] of a call with one input record
    and an output, from its forward's errors (``err``: each row's relative error; ``level``:
    the added error expected of it; ``drifted``: weights that differ between the runs, which
    explain part of the output's error in their module and the modules around it); NaN
    elsewhere, and where B ran on A's input instead (a localizing re-run)."""
    out = np.full(len(frame), np.nan)
    moved = set(frame["module"][drifted & (frame["kind"] == fmt.PARAM).to_numpy()])
    replaced = (frame["injected"] == 1).to_numpy()
    calls = _Calls(frame)
    rms, numel = calls.rms, calls.numel
    for key, module, first in calls:
        x, y = first.get((fmt.INPUT, 0)), first.get((fmt.OUTPUT, 0))
        gy, gx = first.get((fmt.GRAD_OUTPUT, 0)), first.get((fmt.GRAD_INPUT, 0))
        if (x is None or y is None or gy is None or gx is None or replaced[x]
                or calls.inputs.get(key) != 1
                or any(fmt.contains(module, m) for m in moved)):
            continue
        with np.errstate(invalid="ignore", over="ignore"):  # values at a dtype's limit: inf
            dx = err[x] * rms[x] * math.sqrt(numel[x])
            dy = math.sqrt(max(err[y] ** 2 - level[y] ** 2, 0.0)) * rms[y] * math.sqrt(numel[y])
        if dx > 0 and math.isfinite(dx) and math.isfinite(dy) and rms[gx] > 0:
            out[gx] = dy / dx * rms[gy] / rms[gx]
    return out

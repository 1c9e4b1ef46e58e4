"""The scale test: backward records judged by their error along A's values.

Backpropagation is linear in the gradient it carries: a gradient sent back is the incoming one
times a Jacobian, a gradient arriving at an output the sum of what its consumers sent. So the
*scale* of a gradient's error, ``s = <a, b - a> / <a, a>`` (the metric ``scale_err``: B is
``(1 + s)`` times A plus an error orthogonal to A), passes from record to record unchanged,
while rounding errors, uncorrelated with the gradient itself, move it by about their size over
the square root of the number of elements. A module whose backward scales its gradient wrong
(or code between modules that does) moves ``s`` by that much at once, which an accumulated
error of 12 % hides from the relative error (``sqrt(0.12² + 0.1²)`` is within a gain of 1.3 of
0.12) but not from the scale: it stays within a few tenths of a percent elsewhere.

A backward record's *added scale* is how far its ``s`` lies outside the range of its backward
sources' (0 inside; ``|s|`` without sources: the loss gradient itself). It is news when it
exceeds ``SCALE_NOISE`` times the relative error the record and its sources carry over the
square root of its number of elements, and what the level its relative error is judged
against may move ``s`` by (records at rounding level move it by as much, but for the underflow
part of their rounding: :meth:`compare.verdict._Judgement._rounding_scale`), and what the
scale errors of the forward values the backward used may move it by.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from . import format as fmt

# How many noise units (error / sqrt(elements)) an added scale may reach without being news:
# healthy pairs of the tuning architectures reached 20 at most (a grouped expert matmul's
# gradient), most records under 8; a 10 % plant reaches 20-90.
SCALE_NOISE = 24.0
# How much a backward may move the scale of its gradient per unit of scale error in the values
# it was computed from (a normalization divides by their spread: 1; a product of two: 2)
FORWARD_SCALE_GAIN = 2.0


def added_scale(frame: pd.DataFrame, sources: list[np.ndarray], replaced: np.ndarray
                ) -> np.ndarray:
    """Per row, its added scale (see the module docstring); NaN for forward records and
    records without values on both sides. A replaced (injected) source has A's value: 0."""
    scale = frame["scale_err"].to_numpy(float)
    backward = frame["kind"].isin(list(fmt.BACKWARD_KINDS)).to_numpy()
    known = backward & np.isfinite(scale)
    given = np.where(replaced, 0.0, scale)
    out = np.full(len(frame), np.nan)
    for i in np.flatnonzero(known):
        backward_sources = sources[i][backward[sources[i]]]
        s = backward_sources[known[backward_sources]]
        if len(s):
            low, high = given[s].min(), given[s].max()
            out[i] = max(low - scale[i], scale[i] - high, 0.0)
        elif not len(backward_sources):  # the loss gradient itself
            out[i] = abs(scale[i])  # (sources whose scale is unknown leave it unknown: NaN)
    return out


def scale_noise(frame: pd.DataFrame, sources: list[np.ndarray], err: np.ndarray,
                err_in: np.ndarray) -> np.ndarray:
    """Per row, the added scale its errors may explain: ``SCALE_NOISE`` times the larger of
    its own and its sources' relative error over the square root of its element count, and
    ``FORWARD_SCALE_GAIN`` times the largest scale error of its forward sources (the values
    the backward was computed from: a BatchNorm fed 1.05 times its input sends back 1/1.05
    times the gradient). A gradient arriving as a part of another (a later sibling's
    grad_input of another element count: code between them sliced or concatenated it, as a
    ViT's patch embeddings beside the class token; a reshape or a permutation keeps the
    scale) may move as far as its sources' error: only an error random in sign keeps a
    part's scale the whole's, and an error from upstream
    (drifted weights) is not (the class token's gradient carries nearly all of the whole's
    norm, and its scale moved by -0.0064 where the patches' moved by +0.0038)."""
    numel = frame["numel"].to_numpy(float)
    scale = np.abs(np.nan_to_num(frame["scale_err"].to_numpy(float)))
    kind = frame["kind"].to_numpy(object)
    forward = np.isin(kind, list(fmt.FORWARD_KINDS))
    moved = np.array([scale[s[forward[s]]].max() if forward[s].any() else 0.0
                      for s in sources])
    with np.errstate(divide="ignore", invalid="ignore"):
        noise = SCALE_NOISE * np.fmax(err, err_in) / np.sqrt(np.where(numel > 0, numel, np.nan))
    part = np.array([kind[i] == fmt.GRAD_OUTPUT and np.any(
        (kind[s] == fmt.GRAD_INPUT) & (numel[s] > 0) & (numel[s] != numel[i]))
        for i, s in enumerate(sources)])
    noise = np.where(part, np.fmax(noise, err_in), noise)
    return np.fmax(noise, FORWARD_SCALE_GAIN * moved)


def describe(added: float, noise: float) -> str:
    return (f"its error along A's values (scale) moves by {added:.3g} beyond its sources', "
            f"where errors of its size move it by {noise:.2g} at most"
            if math.isfinite(noise) else f"its error along A's values moves by {added:.3g}")

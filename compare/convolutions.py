"""What torch's convolutions compute, in float64 (:mod:`compare.formulas`): ``Conv1d``,
``Conv2d``, ``Conv3d`` at a recorded geometry, per kernel offset a grouped matrix product of
the shifted input, padded by its padding mode (backward: of the gradient, added back where
it came from, zeros only); and the transposed ones, the same two the other way round."""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import numpy as np

from . import format as fmt
from .operands import Figures, Operands

# torch's padding modes as numpy.pad's
PADDING_MODES = {"zeros": "constant", "reflect": "reflect", "replicate": "edge",
                 "circular": "wrap"}


class _Sliding(NamedTuple):
    """A convolution's kernel sliding over an input: the input's padding per spatial
    dimension (before, after), and the output's spatial size."""

    pads: tuple[tuple[int, int], ...]
    out: tuple[int, ...]

    @classmethod
    def of(cls, geometry: fmt.ConvGeometry, kernel: tuple, spatial: tuple
           ) -> Optional["_Sliding"]:
        """How ``geometry`` slides ``kernel`` over ``spatial`` (None: not at all, or a
        geometry of other dimensions)."""
        if not len(geometry.stride) == len(geometry.dilation) == len(kernel) == len(spatial):
            return None
        if geometry.padding == "valid":
            pads = ((0, 0),) * len(kernel)
        elif geometry.padding == "same":  # torch: the odd one after
            totals = [d * (k - 1) for d, k in zip(geometry.dilation, kernel)]
            pads = tuple((t // 2, t - t // 2) for t in totals)
        elif len(geometry.padding) == len(kernel):
            pads = tuple((p, p) for p in geometry.padding)
        else:
            return None
        out = tuple((s + lo + hi - d * (k - 1) - 1) // st + 1 for s, (lo, hi), k, st, d in zip(
            spatial, pads, kernel, geometry.stride, geometry.dilation))
        return cls(pads, out) if min(out, default=1) > 0 else None

    def windows(self, geometry: fmt.ConvGeometry, kernel: tuple):
        """Per kernel offset, the offset and the slices of the padded input it multiplies."""
        for offset in np.ndindex(*kernel):
            yield offset, tuple(slice(o * d, o * d + st * (m - 1) + 1, st) for o, d, st, m in zip(
                offset, geometry.dilation, geometry.stride, self.out))


def _correlated(x: np.ndarray, weight: np.ndarray, geometry: fmt.ConvGeometry,
                sliding: _Sliding) -> np.ndarray:
    """torch's convolution (a cross-correlation) of padded ``x`` by ``weight``, no bias:
    one grouped matrix product per kernel offset (memory: a few inputs' and outputs')."""
    n, groups, kernel = x.shape[0], geometry.groups, weight.shape[2:]
    out_channels, group_channels = weight.shape[:2]
    grouped = x.reshape(n, groups, group_channels, *x.shape[2:])
    weights = weight.reshape(groups, out_channels // groups, group_channels, *kernel)
    total = np.zeros((groups, out_channels // groups, n * math.prod(sliding.out)))
    for offset, window in sliding.windows(geometry, kernel):
        columns = np.moveaxis(grouped[(slice(None),) * 3 + window], 0, 2)
        total += weights[(Ellipsis, *offset)] @ columns.reshape(groups, group_channels, -1)
    total = total.reshape(groups, out_channels // groups, n, *sliding.out)
    return np.moveaxis(total, 2, 0).reshape(n, out_channels, *sliding.out)


def _correlated_back(g: np.ndarray, weight: np.ndarray, geometry: fmt.ConvGeometry,
                     sliding: _Sliding, shape: tuple) -> np.ndarray:
    """The gradient a zero-padded convolution of an input of ``shape`` sends back from ``g``
    at its output: each kernel offset's products added where they came from."""
    n, groups, kernel = shape[0], geometry.groups, weight.shape[2:]
    out_channels, group_channels = weight.shape[:2]
    arriving = np.moveaxis(g.reshape(n, groups, out_channels // groups, *sliding.out), 0, 2)
    arriving = arriving.reshape(groups, out_channels // groups, -1)
    weights = np.swapaxes(weight.reshape(groups, out_channels // groups, group_channels,
                                         *kernel), 1, 2)
    padded = tuple(s + lo + hi for s, (lo, hi) in zip(shape[2:], sliding.pads))
    back = np.zeros((n, groups, group_channels, *padded))
    for offset, window in sliding.windows(geometry, kernel):
        part = (weights[(Ellipsis, *offset)] @ arriving).reshape(
            groups, group_channels, n, *sliding.out)
        back[(slice(None),) * 3 + window] += np.moveaxis(part, 2, 0)
    inside = tuple(slice(lo, lo + s) for s, (lo, _) in zip(shape[2:], sliding.pads))
    return back[(slice(None),) * 3 + inside].reshape(shape)


def _squared_terms(x: np.ndarray, weight: np.ndarray, geometry: fmt.ConvGeometry,
                   sliding: _Sliding) -> float:
    """The sum of every squared product ``(x w)²`` that :func:`_correlated` adds up: per
    kernel offset, each input channel's squares in the window times its weights' squares
    over the output channels of its group (a sum per channel, not a product per pixel)."""
    groups, kernel = geometry.groups, weight.shape[2:]
    out_channels, group_channels = weight.shape[:2]
    squares = np.square(weight).reshape(groups, out_channels // groups, group_channels, *kernel)
    per_input = squares.sum(axis=1).reshape(groups * group_channels, *kernel)
    x_squared, axes = np.square(x), (0, *range(2, x.ndim))
    return float(sum(x_squared[(slice(None), slice(None)) + window].sum(axis=axes)
                     @ per_input[(slice(None), *offset)]
                     for offset, window in sliding.windows(geometry, kernel)))


def _squared_terms_back(g: np.ndarray, weight: np.ndarray, geometry: fmt.ConvGeometry,
                        sliding: _Sliding, shape: tuple) -> float:
    """The sum of every squared product ``(g w)²`` that :func:`_correlated_back` adds up
    inside the input (not in its padding): per kernel offset, each output channel's squared
    gradient at the positions whose product lands inside, times its weights' squares over
    its group's input channels."""
    per_output = np.square(weight).sum(axis=1)  # (out channels, *kernel)
    g_squared, axes = np.square(g), (0, *range(2, g.ndim))
    total = 0.0
    for offset in np.ndindex(*weight.shape[2:]):
        inside = []  # output positions o with 0 <= o s + offset d - before < size
        for o, size, (before, _), s, d, m in zip(offset, shape[2:], sliding.pads,
                                                geometry.stride, geometry.dilation,
                                                sliding.out):
            first = max(0, -(-(before - o * d) // s))
            inside.append(slice(first, max(first, min(m, (size - 1 + before - o * d) // s + 1))))
        total += float(g_squared[(slice(None), slice(None), *inside)].sum(axis=axes)
                       @ per_output[(slice(None), *offset)])
    return total


def convolution(dims: int, kind: str, ops: Operands) -> Optional[Figures]:
    """torch's ``Conv1d``/``Conv2d``/``Conv3d`` (``dims``) at the call's recorded geometry
    (where none is recorded: stride 1, no padding, one group)."""
    t, weight, bias = ops.tensors, ops.weight, ops.bias
    x = t.get(fmt.INPUT)
    geometry = ops.conv or _plain(dims)
    if weight is None or x is None or weight.ndim != dims + 2 or x.ndim != dims + 2:
        return None
    (out_channels, group_channels), kernel = weight.shape[:2], weight.shape[2:]
    sliding = _Sliding.of(geometry, kernel, x.shape[2:])
    if sliding is None or out_channels % geometry.groups or \
            x.shape[1] != group_channels * geometry.groups or \
            (bias is not None and bias.shape != (out_channels,)):
        return None
    out_shape = (x.shape[0], out_channels, *sliding.out)
    if kind == fmt.OUTPUT:
        y, mode = t[fmt.OUTPUT], PADDING_MODES.get(geometry.padding_mode)
        if y.shape != out_shape or mode is None:
            return None
        padded = np.pad(x, ((0, 0), (0, 0), *sliding.pads), mode=mode)
        return _biased(y, _correlated(padded, weight, geometry, sliding),
                       _squared_terms(padded, weight, geometry, sliding), bias,
                       group_channels * math.prod(kernel))
    g, gx = t[fmt.GRAD_OUTPUT], t[fmt.GRAD_INPUT]
    padded = any(p for pads in sliding.pads for p in pads)
    if (padded and geometry.padding_mode != "zeros") or g.shape != out_shape or \
            gx.shape != x.shape:
        return None
    want = _correlated_back(g, weight, geometry, sliding, x.shape)
    squared = _squared_terms_back(g, weight, geometry, sliding, x.shape)
    return Figures(gx, want, squared, out_channels // geometry.groups * _reach(geometry,
                                                                                kernel))


def _plain(dims: int) -> fmt.ConvGeometry:
    """The geometry of a convolution whose dump records none: stride 1, no padding, one
    group (where it is another, A's records do not follow it: no figures)."""
    return fmt.ConvGeometry((1,) * dims, (0,) * dims, (1,) * dims, 1, "zeros")


def _biased(y: np.ndarray, want: np.ndarray, squared: float, bias: Optional[np.ndarray],
            terms: int) -> Figures:
    """A convolution's output figures, its ``bias`` (per channel, axis 1) added to what it
    sums of ``terms`` products per element (one more term)."""
    if bias is None:
        return Figures(y, want, squared, terms)
    want += bias.reshape(-1, *(1,) * (y.ndim - 2))
    squared += float(np.square(bias).sum()) * (y.size // len(bias))
    return Figures(y, want, squared, terms + 1)


def _reach(geometry: fmt.ConvGeometry, kernel: tuple) -> int:
    """How many kernel offsets reach one element of a convolution's input: those o < k with
    o d in one residue class modulo the stride, ``ceil(k gcd(d, s) / s)`` per dimension."""
    return math.prod(-(-k * math.gcd(d, s) // s) for k, d, s in zip(
        kernel, geometry.dilation, geometry.stride))


def transposed_convolution(dims: int, kind: str, ops: Operands) -> Optional[Figures]:
    """torch's ``ConvTranspose1d``/``2d``/``3d`` (``dims``): what a convolution of the same
    geometry and weight sends back, so forward :func:`_correlated_back` and backward
    :func:`_correlated` (zero padding), the output's size taken from its record (its
    ``output_padding`` is where no product lands)."""
    t, weight, bias = ops.tensors, ops.weight, ops.bias
    x, y = t.get(fmt.INPUT), t[fmt.OUTPUT if kind == fmt.OUTPUT else fmt.GRAD_OUTPUT]
    geometry = ops.conv or _plain(dims)
    if weight is None or x is None or not weight.ndim == x.ndim == y.ndim == dims + 2 or \
            geometry.padding_mode != "zeros" or isinstance(geometry.padding, str):
        return None
    (in_channels, group_channels), kernel = weight.shape[:2], weight.shape[2:]
    out_channels = group_channels * geometry.groups
    out_shape = (x.shape[0], out_channels, *y.shape[2:])
    sliding = _Sliding.of(geometry, kernel, y.shape[2:])
    if sliding is None or sliding.out != x.shape[2:] or y.shape != out_shape or \
            x.shape[1] != in_channels or in_channels % geometry.groups or \
            (bias is not None and bias.shape != (out_channels,)):
        return None
    if kind == fmt.OUTPUT:
        return _biased(y, _correlated_back(x, weight, geometry, sliding, out_shape),
                       _squared_terms_back(x, weight, geometry, sliding, out_shape), bias,
                       in_channels // geometry.groups * _reach(geometry, kernel))
    gx = t[fmt.GRAD_INPUT]
    if gx.shape != x.shape:
        return None
    padded = np.pad(y, ((0, 0), (0, 0), *sliding.pads))
    return Figures(gx, _correlated(padded, weight, geometry, sliding),
                   _squared_terms(padded, weight, geometry, sliding),
                   group_channels * math.prod(kernel))

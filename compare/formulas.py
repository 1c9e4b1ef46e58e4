"""What known module classes compute, in float64, and how far rounding may move it.

Each formula recomputes one record of a call (``output`` from the input, ``grad_input`` from
the incoming gradient and the input) from :class:`Operands` and returns :class:`Figures`: the
sums of the squared difference to the recorded values, of the squared result, and of the
squared *terms* its elements sum (the products of a matrix product, the parts of a
normalization's gradient), or None where the operands' shapes do not fit the formula.
:func:`candidates` lists the formulas a class name may mean; :mod:`compare.recompute` keeps
the one that A's own records follow best.

- ``Linear``: ``y = x Wᵀ + b``, ``gx = g W`` (Hugging Face's ``Conv1D``: its weight is
  ``Wᵀ``);
- ``Conv1d``, ``Conv2d``, ``Conv3d`` at the geometry the dump records (``fmt.CONV_PATH``;
  where it does not, stride 1, no padding, one group): per kernel offset, a grouped matrix
  product of the shifted input (backward: of the gradient, added back where it came from),
  padded by its padding mode (backward: zeros only); ``ConvTranspose1d``/``2d``/``3d``, the
  same two the other way round;
- the elementwise activations of :data:`ELEMENTWISE` (modules and op records): ``y = f(x)``,
  ``gx = g f'(x)``;
- ``Embedding`` (:data:`GATHERS`): ``y = W[x]``, the rows its integer input names (a copy:
  rounding explains one rounding of the result, no sum; its gradient goes to the weight only,
  none is sent back);
- elementwise ops of two tensors (:data:`BINARY`: op records of ``dumper.ops``, ``add``,
  ``sub``, ``mul``, ``div``, ``pow``, ``maximum``, ``minimum``, ``clamp_min``,
  ``clamp_max`` and their in-place forms), either broadcast against the other
  (the second may be a number, a 0-d array):
  ``y = f(x, z)``; backward, the gradient of operand ``i`` is
  ``g ∂f/∂operand_i`` summed over the axes it was broadcast along (:attr:`Operands.operand`
  says which); an add's terms are its operands (cancelling grows them), a product or a
  power has one.
  Only the result is rounded (the operands are used exactly, at the promoted dtype): the
  record's own dtype explains it (:data:`ROUNDS_RESULT`);
- matrix products of two tensors (:data:`PRODUCTS`, op records: ``matmul``, ``mm``,
  ``bmm``), at torch.matmul's shapes: ``y = x z``, ``gx = g zᵀ``, ``gz = xᵀ g``, summed
  over the batch axes an operand was broadcast along; and F.linear's ``x Wᵀ`` (``linear``,
  no bias);
- softmaxes (:data:`SOFTMAXES`, op records: ``softmax``, ``log_softmax``) over the dim they
  were given (A's: B reducing over another computes something else), of the input less its
  maximum, and sums and means (:data:`REDUCTIONS`) over it, or over every dim; only their
  result is rounded;
- scaled dot-product attention (op records, :mod:`compare.attention`): ``o = softmax(scale
  q kᵀ + mask) v`` and the gradients of its query, key, value and mask;
- adaptive average pools (:data:`POOLS`), at the sizes their records have: output ``i`` of a
  dimension of ``L`` inputs and ``n`` outputs is the mean of inputs ``floor(i L / n)`` to
  ``ceil((i + 1) L / n)``, PyTorch's bins; backward, each output's gradient shared equally
  among its bin's inputs (a global pool, ``n = 1``: the mean, and the gradient over ``L``);
- normalizations (class names with ``LayerNorm``, ``RMSNorm`` or ``BatchNorm``; not
  ``SyncBatchNorm`` or gated ones), at the module's recorded ``eps``: ``x̂ = (x - μ) / σ``
  (``σ = sqrt(mean((x - μ)²) + eps)``; ``μ = 0`` for an RMSNorm), ``y = γ x̂ + β``,
  ``gx = (ĝ - mean(ĝ) - x̂ mean(ĝ x̂)) / σ`` with ``ĝ = γ g`` (no ``mean(ĝ)`` for an RMSNorm),
  over the trailing dimensions the weight spans, or per position over the channels
  (ConvNeXt's channels-first LayerNorm), or per channel over the batch (a BatchNorm in
  training). Where ``|μ|`` is large against ``σ``, subtracting it cancels: the terms grow by
  ``1 + |μ| / σ``.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple, Optional, Union

import numpy as np

from . import format as fmt
from .attention import ATTENTION, attention
from .centering import BATCH_NORM, NORMALIZATIONS, NOT_NORMALIZATIONS, UNCENTERED
from .convolutions import convolution, transposed_convolution
from .operands import Figures, Formula, Operands, unbroadcast
from .precision import ROUNDING

# Each term of an element rounded once per operand the call rounds and the result once, each
# rounding at most the unit roundoff (its root mean square is u / sqrt(3)), the K terms of an
# element summed in the accumulator (a random walk: sqrt(K) roundings of it): twice that.
ALLOWANCE = 2.0


def allowed(unit: np.ndarray, spread: np.ndarray, terms: np.ndarray,
            underflow: np.ndarray = 0.0, scale: np.ndarray = 1.0,
            roundings: np.ndarray = 1.0, rounds_operands: np.ndarray = True,
            accumulation: np.ndarray = math.nan) -> np.ndarray:
    """What rounding explains of a recomputed record's relative error, for a call computed in
    a dtype of unit roundoff ``unit`` and smallest step ``underflow`` (accumulating in float32,
    or finer where the dtype is), of a result whose root mean square is ``scale`` (0 or NaN:
    not known, no near-zero term), rounded ``roundings`` times near zero
    (:func:`near_zero_roundings`): ``2 (u (1 + 2 spread) + u_acc sqrt(K) spread +
    roundings underflow / scale)``, without the ``2 u spread`` of its operands' rounding where
    the call does not round them (``rounds_operands`` False: :func:`rounds_operands`; what it
    computes from them in the accumulator is the ``u_acc`` term's); where ``accumulation`` is
    finite (a sum whose partial sums are known, :func:`bias_gradient`), ``u accumulation`` in
    place of ``u_acc sqrt(K) spread``: a kernel may hold its partial sums in the lowest
    dtype it is given (torch's CPU LayerNorm backward of a bfloat16 input does, 9 units of
    bfloat16 over 2048 positions)."""
    accumulator = np.minimum(unit, ROUNDING["float32"].unit)
    known = np.isfinite(accumulation)
    summed = np.where(known, unit * np.where(known, accumulation, 0.0),
                      accumulator * np.sqrt(terms) * spread)
    scale = np.asarray(scale, dtype=np.float64)
    operands = np.where(rounds_operands, 2.0 * np.asarray(spread, dtype=np.float64), 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        near_zero = np.where(scale > 0, np.divide(underflow * roundings, scale), 0.0)
    return ALLOWANCE * (unit * (1.0 + operands) + summed + near_zero)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def _silu_grad(x: np.ndarray) -> np.ndarray:
    s = _sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


_erf = np.frompyfunc(math.erf, 1, 1)  # numpy has none; math's is the C library's


def _normal_cdf(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + _erf(x / math.sqrt(2.0)).astype(np.float64))


_TANH_GELU = math.sqrt(2.0 / math.pi), 0.044715  # torch's approximate="tanh"


def _tanh_gelu(x: np.ndarray) -> np.ndarray:
    c, k = _TANH_GELU
    return 0.5 * x * (1.0 + np.tanh(c * (x + k * x ** 3)))


def _tanh_gelu_grad(x: np.ndarray) -> np.ndarray:
    c, k = _TANH_GELU
    t = np.tanh(c * (x + k * x ** 3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * k * x * x)


class Activation(NamedTuple):
    """An elementwise function in float64 and its derivative."""

    f: Callable[[np.ndarray], np.ndarray]
    grad: Callable[[np.ndarray], np.ndarray]


_RELU = Activation(lambda x: np.maximum(x, 0.0), lambda x: (x > 0).astype(np.float64))
_RELU6 = Activation(lambda x: np.clip(x, 0.0, 6.0),
                    lambda x: ((x > 0) & (x < 6)).astype(np.float64))
_SILU = Activation(lambda x: x * _sigmoid(x), _silu_grad)
_SIGMOID = Activation(_sigmoid, lambda x: _sigmoid(x) * (1.0 - _sigmoid(x)))
_TANH = Activation(np.tanh, lambda x: 1.0 - np.tanh(x) ** 2)
_GELU = Activation(lambda x: x * _normal_cdf(x),
                   lambda x: _normal_cdf(x) + x * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi))
_GELU_TANH = Activation(_tanh_gelu, _tanh_gelu_grad)
_EXP = Activation(np.exp, np.exp)
_RSQRT = Activation(lambda x: 1.0 / np.sqrt(x), lambda x: -0.5 / (x * np.sqrt(x)))
_SQRT = Activation(np.sqrt, lambda x: 0.5 / np.sqrt(x))
_LOG = Activation(np.log, lambda x: 1.0 / x)
_SIN = Activation(np.sin, np.cos)
_COS = Activation(np.cos, lambda x: -np.sin(x))
_NEG = Activation(np.negative, lambda x: np.full_like(x, -1.0))
_ABS = Activation(np.abs, np.sign)
_SQUARE = Activation(np.square, lambda x: 2.0 * x)
_CAST = Activation(lambda x: x, np.ones_like)  # to another dtype: one rounding, or none
# Module class names and op names (dumper.ops) of elementwise functions torch computes in one
# kernel (one rounding of the result; a cast's, none where it widens): the functions each may
# mean, the likelier first (a GELU module's ``approximate`` is not recorded, an op's is not
# read: the form A's records follow is the one). Hugging Face's activations written as
# several ops (NewGELUActivation, QuickGELUActivation) round each op's result: not these.
ELEMENTWISE: dict[str, tuple[Activation, ...]] = {
    "ReLU": (_RELU,), "relu": (_RELU,), "ReLU6": (_RELU6,),
    "SiLU": (_SILU,), "SiLUActivation": (_SILU,), "silu": (_SILU,),
    "Sigmoid": (_SIGMOID,), "sigmoid": (_SIGMOID,), "Tanh": (_TANH,), "tanh": (_TANH,),
    "GELU": (_GELU, _GELU_TANH), "gelu": (_GELU, _GELU_TANH), "GELUActivation": (_GELU,),
    "GELUTanh": (_GELU_TANH,), "exp": (_EXP,), "rsqrt": (_RSQRT,), "sqrt": (_SQRT,),
    "log": (_LOG,), "sin": (_SIN,), "cos": (_COS,), "neg": (_NEG,), "abs": (_ABS,),
    "square": (_SQUARE,), **{cast: (_CAST,) for cast in (
        "to", "float", "double", "half", "bfloat16", "type_as")},
}


class BinaryOp(NamedTuple):
    """An elementwise op of two operands, in float64: ``f(x, z)``, its partial derivatives
    by each operand, and whether the terms its elements sum are its operands (an add: they
    may cancel), else its result (a product)."""

    f: Callable[[np.ndarray, np.ndarray], np.ndarray]
    partials: tuple[Callable, Callable]
    terms_are_operands: bool


_BINARY = {
    "add": BinaryOp(np.add, (lambda x, z: 1.0, lambda x, z: 1.0), True),
    "sub": BinaryOp(np.subtract, (lambda x, z: 1.0, lambda x, z: -1.0), True),
    "mul": BinaryOp(np.multiply, (lambda x, z: z, lambda x, z: x), False),
    "div": BinaryOp(np.divide, (lambda x, z: 1.0 / z, lambda x, z: -x / np.square(z)), False),
    "pow": BinaryOp(np.power, (lambda x, z: z * np.power(x, z - 1.0),
                               lambda x, z: np.power(x, z) * np.log(x)), False),
    # a tie sends half the gradient to each (torch's derivatives.yaml)
    "maximum": BinaryOp(np.maximum, (lambda x, z: np.where(x == z, 0.5, x > z),
                                     lambda x, z: np.where(x == z, 0.5, z > x)), False),
    "minimum": BinaryOp(np.minimum, (lambda x, z: np.where(x == z, 0.5, x < z),
                                     lambda x, z: np.where(x == z, 0.5, z < x)), False),
    # a bound the input reaches keeps the gradient for the input
    "clamp_min": BinaryOp(np.maximum, (lambda x, z: x >= z, lambda x, z: x < z), False),
    "clamp_max": BinaryOp(np.minimum, (lambda x, z: x <= z, lambda x, z: x > z), False),
}
# by op name (dumper.ops), in place too (torch has no maximum_ or minimum_)
BINARY: dict[str, BinaryOp] = {**_BINARY, **{f"{name}_": _BINARY[name] for name in (
    "add", "sub", "mul", "div", "pow", "clamp_min", "clamp_max")}}
# softmaxes over the dim they are given, and sums and means over it (all dims where given
# none), by whether they divide by the count (op records; ``Operands.dim``): computed in
# float32 or finer whatever they are given
SOFTMAXES = ("softmax", "log_softmax")
REDUCTIONS = {"sum": False, "mean": True}
OVER_DIM = frozenset((*SOFTMAXES, *REDUCTIONS))
# calls that round only their result: the operands are used exactly (promoted, never lowered;
# what the kernel computes from them, in float32 or finer, rounds at the accumulator's unit)
ROUNDS_RESULT = frozenset((*ELEMENTWISE, *BINARY, *OVER_DIM))
# of those, the calls whose gradient is one kernel of the input and the incoming gradient
# (torch's derivatives.yaml: threshold_backward, silu_backward, gelu_backward, a cast's, a
# mean's division); the others' gradients reuse their rounded result (sigmoid, tanh, exp,
# sqrt, rsqrt, softmaxes) or round what several ops compute (sin, pow, div, a broadcast
# operand's products before their sum)
GRADIENT_ROUNDS_RESULT = frozenset((
    "ReLU", "relu", "ReLU6", "SiLU", "SiLUActivation", "silu", "GELU", "gelu",
    "GELUActivation", "GELUTanh", "neg", "abs", "to", "float", "double", "half", "bfloat16",
    "type_as", *REDUCTIONS))
# matrix products of two tensors (op records; ``a @ b`` is ``matmul``), torch.matmul's shapes;
# and F.linear's ``x Wᵀ`` of a weight given as its second operand (no bias: none else fits)
PRODUCTS = ("matmul", "mm", "bmm", "linear")
# ops of two tensors: the second operand is ``Operands.other``
TWO_TENSORS = frozenset((*BINARY, *PRODUCTS))
# adaptive average pools: their spatial dimensions
POOLS = {"AdaptiveAvgPool1d": 1, "AdaptiveAvgPool2d": 2, "AdaptiveAvgPool3d": 3}
# formulas that take no weights
UNWEIGHTED = frozenset((*ELEMENTWISE, *TWO_TENSORS, *OVER_DIM, *POOLS, ATTENTION))
# calls with no setting of their own that B could have otherwise than A (a number or dim B was
# given otherwise is recomputed at A's): a recomputation of every sample is all of them
SETTINGLESS = frozenset((*ELEMENTWISE, *TWO_TENSORS, *OVER_DIM, ATTENTION))
# spatial dimensions; and those that compute what a convolution sends back
CONVOLUTIONS = {"Conv1d": 1, "Conv2d": 2, "Conv3d": 3,
                "ConvTranspose1d": 1, "ConvTranspose2d": 2, "ConvTranspose3d": 3}
TRANSPOSED = frozenset(c for c in CONVOLUTIONS if c.startswith("ConvTranspose"))
WEIGHTED = ("Linear", "Conv1D", *CONVOLUTIONS)  # Conv1D: Hugging Face's transposed Linear
GATHERS = ("Embedding",)  # rows of its weight, by its integer input


def rounds_operands(cls: Union[str, np.ndarray], kind: Union[str, np.ndarray]) -> np.ndarray:
    """Whether a call of class ``cls`` may round its operands in computing its ``kind`` record
    (:func:`allowed`): all but the output of :data:`ROUNDS_RESULT`, the gradient of
    :data:`GRADIENT_ROUNDS_RESULT`, and a bias's gradient (:func:`bias_gradient`: the
    incoming gradient summed as recorded). Works on arrays too."""
    cls, kind = np.asarray(cls, dtype=object), np.asarray(kind, dtype=object)
    exact = np.where(kind == fmt.OUTPUT, np.isin(cls, list(ROUNDS_RESULT)),
                     (kind == fmt.PARAM_GRAD) | np.isin(cls, list(GRADIENT_ROUNDS_RESULT)))
    return ~exact


def bias_gradient(channels_first: bool, kind: str, ops: Operands) -> Optional[Figures]:
    """A bias's gradient (``kind`` ``param_grad``): the incoming gradient ``gy`` summed over
    every position, the channels being the trailing axes the bias spans (a Linear's, a
    LayerNorm's) or, ``channels_first``, axis 1 (a convolution's, a BatchNorm's, a
    channels-first LayerNorm's). One term per position. A kernel adding them in memory order
    rounds each partial sum ``S_k`` by up to a unit of it, and runs of equal terms (a mean's
    gradient, spread evenly over the positions it pooled) round alike, so that their roundings
    add up instead of cancelling: ``accumulated`` is ``sqrt(sum over channels and runs of
    (sum of |S_k| over the run)²) / ||S||``, the random walk of the partial sums where no two
    neighbours are equal (a kernel that adds in blocks or pairs rounds less)."""
    g, got = ops.tensors.get(fmt.GRAD_OUTPUT), ops.tensors.get(fmt.PARAM_GRAD)
    if kind != fmt.PARAM_GRAD or g is None or got is None or not 0 < got.ndim < g.ndim:
        return None
    if channels_first:
        if got.ndim != 1 or g.shape[1] != got.shape[0]:
            return None
        terms = np.moveaxis(g, 1, -1).reshape(-1, got.size)
    elif g.shape[g.ndim - got.ndim:] == got.shape:
        terms = g.reshape(-1, got.size)
    else:
        return None
    want = terms.sum(axis=0)
    return Figures(got.reshape(-1), want, float(np.square(terms).sum()), len(terms),
                   _accumulated(terms, want))


def _accumulated(terms: np.ndarray, total: np.ndarray) -> float:
    """:func:`bias_gradient`'s ``accumulated`` of ``terms`` (positions x channels)."""
    norm = float(np.linalg.norm(total))
    if not norm > 0:
        return math.nan
    running = np.cumsum(np.abs(np.cumsum(terms, axis=0)), axis=0)  # of |S_k|, per channel
    ends = np.ones(terms.shape, dtype=bool)  # where a run of equal terms ends
    ends[:-1] = terms[1:] != terms[:-1]
    channel, _ = np.nonzero(ends.T)  # channel by channel, the runs in order
    at_end = running.T[ends.T]
    before = np.concatenate([[0.0], at_end[:-1]])
    before[np.concatenate([[True], channel[1:] != channel[:-1]])] = 0.0  # a channel's first
    return math.sqrt(float(np.square(at_end - before).sum())) / norm


# a bias's gradient, its channels last or on axis 1: the one A's records follow is used
BIAS_GRADIENTS = (functools.partial(bias_gradient, False), functools.partial(bias_gradient, True))


def near_zero_roundings(cls: Union[str, np.ndarray], terms: Union[float, np.ndarray]
                        ) -> np.ndarray:
    """How many times rounding near zero a call of class ``cls`` summing ``terms`` terms
    per element may lose up to its dtype's smallest step, as a random walk: once for the
    result, or ``sqrt(K)`` for a convolution, whose kernels may round each partial sum to
    the dtype (float16 backward on a CPU: 22 units at a gradient scale of 9e-6, 2 at 1; a
    Linear's, once: 31 units where one rounding allows 53). Works on arrays too."""
    convolution = np.isin(np.asarray(cls, dtype=object), list(CONVOLUTIONS))
    return np.where(convolution, np.sqrt(np.asarray(terms, dtype=np.float64)), 1.0)


def candidates(cls: str) -> list[Formula]:
    """The formulas class name ``cls`` may mean, the likelier first."""
    if cls in ELEMENTWISE:
        return [functools.partial(_elementwise, activation) for activation in ELEMENTWISE[cls]]
    if cls in BINARY:
        return [functools.partial(_binary, BINARY[cls])]
    if cls in PRODUCTS:
        return [_linear_op if cls == "linear" else _product]
    if cls in SOFTMAXES:
        return [functools.partial(_softmax, cls == "log_softmax")]
    if cls in REDUCTIONS:
        return [functools.partial(_reduction, REDUCTIONS[cls])]
    if cls == ATTENTION:
        return [attention]
    if cls in CONVOLUTIONS:
        formula = transposed_convolution if cls in TRANSPOSED else convolution
        return [functools.partial(formula, CONVOLUTIONS[cls])]
    if cls in WEIGHTED:
        return [functools.partial(_linear, cls == "Conv1D")]
    if cls in GATHERS:
        return [_gathered]
    if cls in POOLS:
        return [functools.partial(_pooled, POOLS[cls])]
    if not any(n in cls for n in NORMALIZATIONS) or any(n in cls for n in NOT_NORMALIZATIONS):
        return []
    if BATCH_NORM in cls:
        return [functools.partial(_normalized, "batch", True)]
    # a class named LayerNorm may divide by the root mean square only, as T5's does
    centered = [False] if any(u in cls for u in UNCENTERED) else [True, False]
    return [functools.partial(_normalized, grouping, c) for grouping in ("last", "position")
            for c in centered]


def _linear(transposed: bool, kind: str, ops: Operands) -> Optional[Figures]:
    """A ``Linear`` (``transposed``: Hugging Face's ``Conv1D``, whose weight is ``Wᵀ``)."""
    t, weight, bias = ops.tensors, ops.weight, ops.bias
    x = t.get(fmt.INPUT)
    if weight is None or weight.ndim != 2:
        return None
    weight = weight.T if transposed else weight
    out_features, in_features = weight.shape

    def shaped(values: np.ndarray, features: int, like: np.ndarray) -> bool:
        """``values`` has ``like``'s shape with ``features`` last."""
        return values.ndim == like.ndim and values.shape == (*like.shape[:-1], features)

    if kind == fmt.OUTPUT:
        y = t[fmt.OUTPUT]
        if x is None or x.shape[-1] != in_features or not shaped(y, out_features, x):
            return None
        rows = x.reshape(-1, in_features)
        want = rows @ weight.T
        squared = float(np.square(rows).sum(axis=0) @ np.square(weight).sum(axis=0))
        if bias is not None:
            want += bias
            squared += len(rows) * float(np.square(bias).sum())
        return Figures(y.reshape(-1, out_features), want, squared,
                       in_features + (bias is not None))
    g, gx = t[fmt.GRAD_OUTPUT], t[fmt.GRAD_INPUT]
    if gx.shape[-1] != in_features or (x is not None and gx.shape != x.shape) or \
            not shaped(g, out_features, gx):
        return None
    rows = g.reshape(-1, out_features)
    squared = float(np.square(rows).sum(axis=0) @ np.square(weight).sum(axis=1))
    return Figures(gx.reshape(-1, in_features), rows @ weight, squared, out_features)


def _gathered(kind: str, ops: Operands) -> Optional[Figures]:
    """An ``Embedding``: the rows of its weight its input names, in the input's shape."""
    x, weight = ops.tensors.get(fmt.INPUT), ops.weight
    if kind != fmt.OUTPUT or x is None or weight is None or weight.ndim != 2:
        return None
    rows = np.arange(len(weight)) if ops.rows is None else ops.rows
    if len(rows) != len(weight) or len(rows) == 0:
        return None
    at = np.minimum(np.searchsorted(rows, x), len(rows) - 1)  # where each named row is held
    y = ops.tensors[fmt.OUTPUT]
    if (rows[at] != x).any() or y.shape != (*x.shape, weight.shape[1]):
        return None  # names a row it does not have, or is no index (not an integer)
    return Figures(y, weight[at], 0.0, 1)  # a copy: at most the rounding of storing it


def _bins(inputs: int, outputs: int) -> np.ndarray:
    """``(outputs, inputs)`` weights of an adaptive average pool along one dimension."""
    weights = np.zeros((outputs, inputs))
    for i in range(outputs):
        start, end = i * inputs // outputs, -(-(i + 1) * inputs // outputs)
        weights[i, start:end] = 1.0 / (end - start)
    return weights


def _along(values: np.ndarray, matrices: list[np.ndarray]) -> np.ndarray:
    """``values`` with each of its trailing axes, one per matrix ``(to, from)``, mapped by it."""
    for axis, matrix in zip(range(values.ndim - len(matrices), values.ndim), matrices):
        values = np.moveaxis(np.tensordot(values, matrix, axes=([axis], [1])), -1, axis)
    return values


def _pooled(dims: int, kind: str, ops: Operands) -> Optional[Figures]:
    """An adaptive average pool over the trailing ``dims`` axes, at its records' sizes."""
    t = ops.tensors
    x = t.get(fmt.INPUT)
    if kind == fmt.OUTPUT:
        source, got = x, t[fmt.OUTPUT]
    else:
        source, got = t[fmt.GRAD_OUTPUT], t[fmt.GRAD_INPUT]
        if x is not None and x.shape != got.shape:
            return None
    if source is None or source.ndim != got.ndim or source.ndim <= dims or \
            source.shape[:-dims] != got.shape[:-dims]:
        return None
    sizes = zip(source.shape[-dims:], got.shape[-dims:])
    matrices = [_bins(n, m) if kind == fmt.OUTPUT else _bins(m, n).T for n, m in sizes]
    return Figures(got, _along(source, matrices),
                   float(_along(np.square(source), [np.square(m) for m in matrices]).sum()),
                   math.prod(int((m > 0).sum(axis=1).max()) for m in matrices))


def _elementwise(activation: Activation, kind: str, ops: Operands) -> Optional[Figures]:
    """An elementwise function (:data:`ELEMENTWISE`): ``y = f(x)``, ``gx = g f'(x)``, one term
    (outside its domain, ``log`` of a negative, the result is not finite: no figures)."""
    t = ops.tensors
    x = t.get(fmt.INPUT)
    if x is None:
        return None
    with np.errstate(all="ignore"):
        if kind == fmt.OUTPUT:
            got, want = t[fmt.OUTPUT], activation.f(x)
        else:
            if t[fmt.GRAD_OUTPUT].shape != x.shape:
                return None
            got, want = t[fmt.GRAD_INPUT], t[fmt.GRAD_OUTPUT] * activation.grad(x)
    if got.shape != want.shape:
        return None
    return Figures(got, want, np.square(want), 1)


def _binary(op: BinaryOp, kind: str, ops: Operands) -> Optional[Figures]:
    """An elementwise op of two tensors (:data:`BINARY`), either broadcast."""
    t, x, z = ops.tensors, ops.tensors.get(fmt.INPUT), ops.other
    if x is None or z is None:
        return None
    with np.errstate(all="ignore"):
        if kind == fmt.OUTPUT:
            got, want = t[fmt.OUTPUT], op.f(x, z)
            if got.shape != want.shape:
                return None
            terms = np.square(x) + np.square(z) if op.terms_are_operands else np.square(want)
            return Figures(got, want, np.broadcast_to(terms, want.shape), 1)
        g, got = t[fmt.GRAD_OUTPUT], t[fmt.GRAD_INPUT]
        operand = z if ops.operand else x
        parts = g * op.partials[ops.operand](x, z)
        if g.shape != np.broadcast_shapes(x.shape, z.shape) or parts.shape != g.shape or \
                got.shape != operand.shape:
            return None
        return Figures(got, unbroadcast(parts, operand.shape), float(np.square(parts).sum()),
                       parts.size // max(operand.size, 1))


def _softmax(log: bool, kind: str, ops: Operands) -> Optional[Figures]:
    """A softmax over ``ops.dim`` of ``n`` elements (``log``: a log-softmax), from the input
    less its maximum, ``d``, whose exponentials sum to ``S``: ``p = exp(d) / S``; backward,
    ``gx = p (g - sum(g p))``, of a log-softmax ``d - log S`` and ``g - p sum(g)``. Terms
    forward: a probability times ``sqrt(1 + d²)`` (the rounding of ``d`` moves it by ``|d|``
    times as much, relative), a log-probability's ``d``, ``log S`` and 1 (``S``'s rounding,
    absolute in its log), each with the ``n`` of ``S``'s sum; backward, the products each
    element sums (a log-softmax's ``p sum(g)`` times ``sqrt(1 + log² p)``: torch's kernel
    exponentiates the rounded result)."""
    t, x, dim = ops.tensors, ops.tensors.get(fmt.INPUT), ops.dim
    if x is None or dim is None or not -x.ndim <= dim < x.ndim:
        return None
    with np.errstate(all="ignore"):  # inputs near float64's limits: terms not finite
        return _softmax_figures(log, kind, t, x, dim)


def _softmax_figures(log: bool, kind: str, t: dict, x: np.ndarray, dim: int
                     ) -> Optional[Figures]:
    """:func:`_softmax`'s figures, of records ``t`` (by kind)."""
    d = x - x.max(axis=dim, keepdims=True)
    exp = np.exp(d)
    total = exp.sum(axis=dim, keepdims=True)
    p, n = exp / total, x.shape[dim]
    if kind == fmt.OUTPUT:
        if log:
            want, terms = d - np.log(total), np.square(d) + np.square(np.log(total)) + 1.0
        else:
            want, terms = p, np.square(p) * (1.0 + np.square(d))
        got = t[fmt.OUTPUT]
    else:
        g, got = t[fmt.GRAD_OUTPUT], t[fmt.GRAD_INPUT]
        if g.shape != x.shape:
            return None
        if log:  # from the rounded log-probabilities: their exponentials move by |y| as much
            total_g = g.sum(axis=dim, keepdims=True)
            want = g - p * total_g
            terms = np.square(g) + np.square(p * total_g) * (1.0 + np.square(d - np.log(total)))
        else:
            want = p * (g - (g * p).sum(axis=dim, keepdims=True))
            terms = np.square(p) * (np.square(g) + np.square(g * p).sum(axis=dim, keepdims=True))
        n += 1
    if got.shape != want.shape:
        return None
    return Figures(got, want, np.broadcast_to(terms, want.shape), n)


def _reduction(mean: bool, kind: str, ops: Operands) -> Optional[Figures]:
    """A sum (``mean``: a mean) over ``ops.dim``, or over every dim where it was given none,
    its result of either shape (its dim kept or not): each result element sums the ``n``
    elements reduced (divided by ``n``); backward, ``gx`` the arriving gradient copied to them
    (divided by ``n``), one term."""
    t, x = ops.tensors, ops.tensors.get(fmt.INPUT)
    if x is None or ops.dim is not None and not -x.ndim <= ops.dim < x.ndim:
        return None
    dims = tuple(range(x.ndim)) if ops.dim is None else (ops.dim % x.ndim,)
    n = math.prod(x.shape[d] for d in dims)
    kept = tuple(1 if d in dims else size for d, size in enumerate(x.shape))
    divisor = float(n) if mean else 1.0
    if kind == fmt.OUTPUT:
        got = t[fmt.OUTPUT]
        if n == 0 or got.size != math.prod(kept):
            return None
        want = x.sum(axis=dims).reshape(got.shape) / divisor
        return Figures(got, want, float(np.square(x).sum()) / divisor ** 2, n)
    g, got = t[fmt.GRAD_OUTPUT], t[fmt.GRAD_INPUT]
    if got.shape != x.shape or g.size != math.prod(kept):
        return None
    want = np.broadcast_to(g.reshape(kept), x.shape) / divisor
    return Figures(got, want, float(np.square(want).sum()), 1)


def _product(kind: str, ops: Operands) -> Optional[Figures]:
    """A matrix product of two tensors (:data:`PRODUCTS`), torch.matmul's: a vector operand
    taken as a matrix of one row (first) or column (second), the batch axes broadcast;
    ``y = x z``, ``gx = g zᵀ`` and ``gz = xᵀ g``, summed over the batch axes the operand
    was broadcast along. Each element sums ``K`` products forward (``x``'s last axis);
    backward, those of the other operand's free axis times the batches summed."""
    t, x, z = ops.tensors, ops.tensors.get(fmt.INPUT), ops.other
    if x is None or z is None or x.ndim == 0 or z.ndim == 0:
        return None
    matrix_x = x[np.newaxis] if x.ndim == 1 else x
    matrix_z = z[:, np.newaxis] if z.ndim == 1 else z
    if matrix_x.shape[-1] != matrix_z.shape[-2]:
        return None
    try:
        batch = np.broadcast_shapes(matrix_x.shape[:-2], matrix_z.shape[:-2])
    except ValueError:
        return None
    matrix_shape = (*batch, matrix_x.shape[-2], matrix_z.shape[-1])
    products = math.prod(matrix_shape) * matrix_x.shape[-1]
    if kind == fmt.OUTPUT:
        y = t[fmt.OUTPUT]
        want = np.matmul(x, z)
        if y.shape != want.shape:
            return None
        return Figures(y, want, float(np.matmul(np.square(x), np.square(z)).sum()),
                       matrix_x.shape[-1])
    g, got = t[fmt.GRAD_OUTPUT], t[fmt.GRAD_INPUT]
    operand = matrix_z if ops.operand else matrix_x
    if g.size != math.prod(matrix_shape) or got.size != operand.size or \
            got.shape != (z if ops.operand else x).shape:
        return None
    g = g.reshape(matrix_shape)
    if ops.operand:
        parts = np.matmul(np.swapaxes(matrix_x, -1, -2), g)
        squared = np.matmul(np.swapaxes(np.square(matrix_x), -1, -2), np.square(g))
    else:
        parts = np.matmul(g, np.swapaxes(matrix_z, -1, -2))
        squared = np.matmul(np.square(g), np.swapaxes(np.square(matrix_z), -1, -2))
    return Figures(got, unbroadcast(parts, operand.shape).reshape(got.shape),
                   float(squared.sum()), products // max(operand.size, 1))


def _linear_op(kind: str, ops: Operands) -> Optional[Figures]:
    """F.linear of a weight ``W`` and no bias, the matrix product ``x Wᵀ``: the weight's
    gradient is that product's second operand's, transposed."""
    t, weight = ops.tensors, ops.other
    if weight is None or weight.ndim != 2:
        return None
    if kind == fmt.GRAD_INPUT and ops.operand == 1:
        if t[fmt.GRAD_INPUT].shape != weight.shape:
            return None
        t = {**t, fmt.GRAD_INPUT: t[fmt.GRAD_INPUT].T}
    return _product(kind, ops._replace(tensors=t, others=(weight.T,)))


def _grouping(grouping: str, x: np.ndarray, params: tuple) -> Optional[tuple]:
    """``(axes, parameter shape)`` of a normalization of ``x`` grouped so, with parameters of
    shape ``params`` (``()``: none), or None where they do not fit."""
    if grouping == "last":
        span = params or x.shape[-1:]
        if x.ndim < len(span) or x.shape[x.ndim - len(span):] != span:
            return None
        return tuple(range(x.ndim - len(span), x.ndim)), span
    if x.ndim < (3 if grouping == "position" else 2) or (params and params != (x.shape[1],)):
        return None  # (per position of a 2-D input is per row: "last" already)
    shape = (x.shape[1],) + (1,) * (x.ndim - 2)
    return ((1,) if grouping == "position" else (0, *range(2, x.ndim))), shape


def _normalized(grouping: str, centered: bool, kind: str, ops: Operands) -> Optional[Figures]:
    """A LayerNorm, RMSNorm (not ``centered``) or BatchNorm over ``grouping``'s axes."""
    t, weight, bias = ops.tensors, ops.weight, ops.bias
    x = t.get(fmt.INPUT)
    params = () if weight is None else weight.shape
    fit = None if x is None or math.isnan(ops.eps) else _grouping(grouping, x, params)
    if fit is None or (bias is not None and bias.shape != params):
        return None
    axes, shape = fit
    gamma = 1.0 if weight is None else weight.reshape(shape)
    mean = x.mean(axis=axes, keepdims=True) if centered else 0.0
    centred = x - mean
    sigma = np.sqrt(np.square(centred).mean(axis=axes, keepdims=True) + ops.eps)
    xhat, lift = centred / sigma, 1.0 + np.abs(mean) / sigma
    size = math.prod(x.shape[a] for a in axes)
    if kind == fmt.OUTPUT:
        y = t[fmt.OUTPUT]
        if y.shape != x.shape:
            return None
        want = xhat * gamma + (0.0 if bias is None else bias.reshape(shape))
        squared = np.square(xhat * gamma * lift) + (0.0 if bias is None else np.square(
            bias.reshape(shape)))
        return Figures(y, want, float(np.broadcast_to(squared, x.shape).sum()), size)
    g, gx = t[fmt.GRAD_OUTPUT], t[fmt.GRAD_INPUT]
    if g.shape != x.shape or gx.shape != x.shape:
        return None
    scaled = g * gamma
    first = scaled.mean(axis=axes, keepdims=True) if centered else 0.0
    second = (scaled * xhat).mean(axis=axes, keepdims=True)
    want = (scaled - first - xhat * second) / sigma
    squared = (np.square(scaled) + np.square(first) + np.square(xhat * second * lift)
               ) / np.square(sigma)
    return Figures(gx, want, float(np.broadcast_to(squared, x.shape).sum()), size)

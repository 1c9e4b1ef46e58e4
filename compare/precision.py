"""Precisions: what a rounding to each dtype may add, and which dtype each record of a
comparison was computed in (autocast and TF32 compute in less than a record's dtype says)."""
from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import pandas as pd

from . import format as fmt
from .sources import call_links


class Rounding(NamedTuple):
    """What one rounding to a floating-point dtype may add: relatively (the unit roundoff) and,
    near zero, absolutely (half the smallest subnormal)."""

    unit: float
    underflow: float


class BinaryFormat(NamedTuple):
    """An IEEE 754-style binary floating-point format with subnormals and infinities: its
    precision in bits (the implicit one included) and its largest and smallest normal
    exponents."""

    bits: int
    top: int
    bottom: int

    @property
    def rounding(self) -> Rounding:
        return Rounding(2.0 ** -self.bits, 2.0 ** (self.bottom - self.bits))

    @property
    def largest(self) -> float:
        """The largest finite value (``torch.finfo(dtype).max``)."""
        return (2 - 2.0 ** (1 - self.bits)) * 2.0 ** self.top

    @property
    def limits(self) -> dict[float, str]:
        """The values code takes from the dtype itself (``torch.finfo``), by name."""
        largest = self.largest
        return {largest: "max", -largest: "-max", 2.0 ** self.bottom: "tiny",
                -2.0 ** self.bottom: "-tiny", 2.0 ** (1 - self.bits): "eps"}


BINARY_FORMATS = {"float64": BinaryFormat(53, 1023, -1022), "float32": BinaryFormat(24, 127, -126),
                  "float16": BinaryFormat(11, 15, -14), "bfloat16": BinaryFormat(8, 127, -126)}
ROUNDING = {name: form.rounding for name, form in BINARY_FORMATS.items()}
ROUNDING.update({  # float8 and float4 formats: other largest values, no infinities
    "float8_e4m3fn": Rounding(2.0 ** -4, 2.0 ** -10), "float8_e4m3fnuz": Rounding(2.0 ** -4, 2.0 ** -11),
    "float8_e5m2": Rounding(2.0 ** -3, 2.0 ** -17), "float8_e5m2fnuz": Rounding(2.0 ** -3, 2.0 ** -18),
    "float8_e8m0fnu": Rounding(1.0, 2.0 ** -128), "float4_e2m1fn_x2": Rounding(2.0 ** -2, 2.0 ** -2),
    "complex128": ROUNDING["float64"], "complex64": ROUNDING["float32"],
    "complex32": ROUNDING["float16"],
    # float32 matmuls and convolutions on CUDA with TF32 allowed: 10-bit mantissas
    "tensorfloat32": Rounding(2.0 ** -11, 2.0 ** -150)})
# Modules whose float32 computation TF32 may touch: cuBLAS's, under the matmul flag, those
# owning a weight matrix or a batch of them (experts' grouped matmuls); cuDNN's, under its
# flag, convolutions and RNNs.
RNN_CLASSES = r"(?:LSTM|GRU|RNN)$"  # not their cells: matmuls
CONV_CLASSES = r"Conv"
EXACT_DTYPE = Rounding(0.0, 0.0)  # integers, bool
AUTOCAST_DTYPES = ("bfloat16", "float16")
# what enclosing code may compute a gradient in, below its tensors' dtype (an enclosing
# module's float32 output, e.g. rotary tables in a float64 model, says nothing of its matmuls)
LOWERED_BY_CODE = (*AUTOCAST_DTYPES, "tensorfloat32")



ROUNDABLE = ("float64", "float32", "float16", "bfloat16")  # the dtypes rounded() rounds to


def rounded(values: np.ndarray, dtype: str, grad_scale: float = fmt.NO_GRAD_SCALE
            ) -> Optional[np.ndarray]:
    """Real ``values`` rounded to ``dtype`` (to nearest, ties to even), as float64, where they
    are held at a loss scale ``grad_scale`` (a GradScaler's gradients: rounded times it, then
    divided again, exactly); None for a dtype this cannot round to (not in
    :data:`ROUNDABLE`: float8, float4, not needed so far)."""
    if dtype not in ROUNDABLE:
        return None
    if grad_scale != fmt.NO_GRAD_SCALE:
        at_scale = rounded(np.asarray(values, dtype=np.float64) * grad_scale, dtype)
        return at_scale / grad_scale
    if dtype != "bfloat16":
        return values.astype(dtype).astype(np.float64)
    # bfloat16: the upper half of float32's bits, rounded
    bits = values.astype(np.float32).view(np.uint32)
    bits = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
            ) & np.uint32(0xFFFF0000)
    return bits.view(np.float32).astype(np.float64)


def stored_scale(frame: pd.DataFrame, side: str) -> np.ndarray:
    """Per row, the scale (rms) of the values ``side`` (``"a"`` or ``"b"``) held: A's rms,
    unscaled (``rms_a``), times the loss scale that side's gradient was computed at; where a
    rounding underflows is relative to this (a GradScaler's float16 gradients underflow
    ``grad_scale`` times less than their unscaled values would)."""
    rms = frame["rms_a"].to_numpy(float)
    column = f"grad_scale_{side}"
    if column not in frame:
        return rms
    return rms * frame[column].fillna(fmt.NO_GRAD_SCALE).to_numpy(float)


def rounding_of(dtype: str) -> Rounding:
    return ROUNDING.get(dtype, EXACT_DTYPE)


def precision_of(dtype_a: str, dtype_b: str) -> str:
    """The lower precision of a pair (the one whose rounding dominates), e.g. ``bfloat16``."""
    return dtype_a if rounding_of(dtype_a).unit >= rounding_of(dtype_b).unit else dtype_b


def cast_rounding(dtype_a: str, dtype_b: str) -> float:
    """What casting a value of ``dtype_a`` to ``dtype_b`` moves it by, relatively, at most: one
    unit roundoff of the lower precision; none where the dtypes are the same."""
    return rounding_of(precision_of(dtype_a, dtype_b)).unit if dtype_a != dtype_b else 0.0


def one_rounding(unit: float | np.ndarray, underflows: list[tuple[float, np.ndarray]]
                 ) -> np.ndarray:
    """One rounding: ``unit`` relatively, and, near zero, each side's underflow at the scale
    it held its values at (:func:`stored_scale`), the larger: ``hypot(unit, underflow /
    scale)``."""
    return np.hypot(unit, underflow_at_scale(underflows))


def underflow_at_scale(underflows: list[tuple[float, np.ndarray]]) -> np.ndarray:
    """The near-zero part of :func:`one_rounding`: of each side's ``(underflow, scale)``, the
    largest ``underflow / scale`` (0 where the scale is not positive)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.fmax.reduce([np.where(scale > 0, underflow / scale, 0.0)
                               for underflow, scale in underflows])


def cast_rounding_at_scale(frame: pd.DataFrame) -> np.ndarray:
    """Per row, what casting A's value to B's dtype moves it by, relatively, as B holds it:
    :func:`cast_rounding`'s unit and, near zero, B's dtype's underflow at B's scale
    (:func:`one_rounding`; a float16 gradient of rms 2e-7 rounds to subnormals 8 % off), at
    most 1 (a value flushed to zero); none where the dtypes are the same or unknown."""
    scale = stored_scale(frame, "b")
    out = np.zeros(len(frame))
    for (a, b), rows in frame.groupby(["dtype_a", "dtype_b"]).indices.items():
        if a != b:
            out[rows] = np.fmin(one_rounding(cast_rounding(a, b),
                                             [(rounding_of(b).underflow, scale[rows])]), 1.0)
    return out


def lowest(dtypes) -> str:
    """The lowest precision of ``dtypes``; of equal ones (float16 and TF32), a real dtype."""
    return max(dtypes, key=lambda d: (rounding_of(d).unit, d != "tensorfloat32"))


class Weighted(NamedTuple):
    """Per row, whether its module computes with batched weights (``batched``: a weight of
    more than two dimensions, a convolution's or experts', or an RNN's), and which library
    does it on CUDA: ``cublas`` (weight matrices and batches of them) or ``cudnn``
    (convolutions; RNNs)."""

    batched: pd.Series
    cublas: pd.Series
    cudnn: pd.Series


def weighted(frame: pd.DataFrame) -> Weighted:
    params = frame[frame["kind"] == fmt.PARAM]
    dims = params["shape_a"].where(params["shape_a"].notna(), params["shape_b"]).map(
        lambda s: len(s) if isinstance(s, tuple) else 0)
    most = dims.groupby(params["module"]).max()
    ndim = frame["module"].map(most).fillna(0)
    cls = frame["cls"].fillna("")
    rnn = cls.str.contains(RNN_CLASSES, regex=True) & (ndim >= 2)
    conv = cls.str.contains(CONV_CLASSES, regex=True) & (ndim > 2)
    cudnn = rnn | conv
    return Weighted((ndim > 2) | rnn, (ndim >= 2) & ~cudnn, cudnn)


def autocast_dtype(frame: pd.DataFrame, dtypes: pd.Series) -> str:
    """The 16-bit float a side ran under autocast: the lowest float dtype of its outputs where
    that is below its weights' lowest (float32 weights, bfloat16 outputs); "" otherwise."""
    weights = dtypes[(frame["kind"] == fmt.PARAM) & (dtypes != "")].unique()
    outputs = dtypes[(frame["kind"] == fmt.OUTPUT) & dtypes.isin(AUTOCAST_DTYPES)].unique()
    if not len(weights) or not len(outputs):
        return ""
    low = lowest(outputs)
    return low if rounding_of(low).unit > rounding_of(lowest(weights)).unit else ""


def computed_in(frame: pd.DataFrame, tf32: tuple[tuple[bool, bool], tuple[bool, bool]]
                 ) -> tuple[pd.Series, pd.Series]:
    """The dtype each record was computed in, per side: its own, or lower where its call
    evidently computes in a lower precision. A call computes in the lowest of its outputs'
    dtypes (a router's float32 weights come from its bfloat16 logits), its descendants' (a
    container of bfloat16 layers), and, under autocast, the autocast dtype where it owns a
    weight of more than two dimensions (batched experts' matmuls; a grouped matmul may cast
    its result back to float32). A call's outputs and gradients are computed in its precision
    (autocast computes the gradient of a float32 input of a bfloat16 matmul in bfloat16, then
    casts it); a gradient arriving at an output in its consumers', and in the autocast
    precision of its enclosing calls, or TF32 where float32 matmuls may use it (an enclosing
    module's own code may have used the output: attention around a projection, a head fed
    what a pass-through dropout returned up the chain; a convolution's TF32 under cuDNN's flag
    stays in its module); an input made by its parent's own code, in the parent's. Where
    ``tf32`` allows it (:class:`Weighted`: cuBLAS's flag, cuDNN's), float32 modules with
    weights compute in ``tensorfloat32``."""
    sides = [frame["dtype_a"].fillna(""), frame["dtype_b"].fillna("")]
    parents, consumers = call_links(frame)
    keys = list(zip(frame["epoch"], frame["step"], frame["rank"].fillna(-1), frame["call"]))
    weights = weighted(frame)
    for side, column in enumerate(("dtype_a", "dtype_b")):
        own = sides[side]
        uses_tf32 = (weights.cublas & tf32[side][0]) | (weights.cudnn & tf32[side][1])
        # a module's own code (attention's matmuls) uses TF32 under the matmul flag only: a
        # child convolution's TF32 under cuDNN's stays in the child
        def by_code(dtypes: list[str]) -> list[str]:
            return [d for d in dtypes if d != "tensorfloat32" or tf32[side][0]]

        made = frame["kind"].isin([fmt.OUTPUT, fmt.GRAD_INPUT, fmt.PARAM_GRAD])  # by its kernels
        own = own.where(~(uses_tf32 & (own == "float32") & made), "tensorfloat32")
        tf32_calls = {k for k, used in zip(keys, uses_tf32) if used}
        autocast = autocast_dtype(frame, sides[side])
        own_out = {}  # the precision of each call's own computation: its lowest output dtype
        for key, out in zip(keys, own.where(frame["kind"] == fmt.OUTPUT, "")):
            if out:
                own_out[key] = lowest([out] + ([own_out[key]] if key in own_out else []))
        if autocast:
            for key in {k for k, b in zip(keys, weights.batched) if b}:
                own_out[key] = lowest([autocast] + ([own_out[key]] if key in own_out else []))
        inner: dict[tuple, str] = {}  # lowest output dtype of a call's descendants
        for key in sorted(parents, reverse=True):  # children before their parents
            low = [d for d in (own_out.get(key, ""), inner.get(key, "")) if d]
            up = parents[key]
            if up is not None and low:
                inner[up] = lowest(low + ([inner[up]] if up in inner else []))
        def of_call(call) -> list[str]:  # the precision a call computes in
            return [own_out.get(call, ""), inner.get(call, "")]

        def ancestors(call) -> list:
            out = []
            while (call := parents.get(call)) is not None:
                out.append(call)
            return out

        lowered = []
        for key, kind, producer, dtype in zip(keys, frame["kind"], frame["producer"], own):
            # an output or input is made by code (its children's results are sources); what
            # a call sends back, by its children's kernels too
            candidates = by_code([inner.get(key, "")]) if kind in (fmt.OUTPUT, fmt.INPUT) else [
                inner.get(key, "")]
            if kind in fmt.BACKWARD_KINDS or kind == fmt.OUTPUT:
                candidates.append(own_out.get(key, ""))
            parent = parents.get(key)
            if kind == fmt.GRAD_OUTPUT:  # made by its consumers' backward, or enclosing code
                # (the call's own TF32 kernels, and its children's, made none of it)
                candidates = [d for d in candidates if d != "tensorfloat32"]
                candidates += [d for c in consumers.get(key, []) for d in of_call(c)]
                candidates += [d for c in ancestors(key) for d in by_code(of_call(c))
                               if d in LOWERED_BY_CODE]
            if kind == fmt.INPUT and producer < 0 and parent is not None:
                candidates += by_code(of_call(parent))  # the parent's own matmuls too
                if parent in tf32_calls and dtype == "float32":
                    candidates.append("tensorfloat32")
            lowered.append(lowest([dtype] + [d for d in candidates if d]) if dtype else dtype)
        sides[side] = pd.Series(lowered, frame.index)
    return sides[0], sides[1]

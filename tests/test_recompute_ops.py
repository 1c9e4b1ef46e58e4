"""Op records recomputed (compare.recompute): elementwise ops and matrix products of two
tensors, broadcast either way, activations and softmaxes, as torch's autograd computes them;
a wrong kernel found exactly, and no false alarm where rounding, amplified by terms that
cancel, explains the error."""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Callable

import pytest
import torch
from torch import nn

from compare import compare_dumps, formulas, localize, summarize
from compare import format as fmt
from compare import status as st
from compare.status import ORIGIN
from compare.verdict import MISCOMPUTED
from dumper import HookerAndDumper

from helpers import ScaleGrad


class _GatedBlock(nn.Module):
    """A gated feed-forward with a residual and a broadcast scale (Llama's MLP, a layer
    scale): a product, an add and a broadcast product of two tensors in its own code."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.gate, self.up = nn.Linear(width, 2 * width), nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x):
        return x + self.scale * self.down(nn.functional.silu(self.gate(x)) * self.up(x))


class _WrongOp(torch.overrides.TorchFunctionMode):
    """B's kernel for the first ``op`` of a tensor is off by ``scale``: its result, or
    (``where="grad_input"``) the gradient it sends back for its operand ``operand`` (a
    tensor)."""

    def __init__(self, where: str, scale: float, op: str = "mul", operand: int = 1):
        super().__init__()
        self.where, self.scale, self.op, self.operand = where, scale, op, operand
        self.done = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in (self.op, f"__{self.op}__") and not self.done and \
                len(args) > self.operand and isinstance(args[0], torch.Tensor):
            self.done = True
            if self.where == "output":
                return func(*args, **kwargs) * self.scale
            args = list(args)
            args[self.operand] = ScaleGrad.apply(args[self.operand], self.scale)
        return func(*args, **kwargs)


def _dumped(directory, block: Callable, precision: str, wrong: dict = None, **options):
    """One step of ``block`` (built at seed 0, width 16) on a fixed batch, float32 or under
    bfloat16 or float16 autocast (``precision``), every op recorded; ``wrong``: a
    :class:`_WrongOp` in B's kernels."""
    torch.manual_seed(0)
    model = block()
    batch = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1))
    autocast = torch.autocast("cpu", dtype=getattr(torch, precision),
                              enabled=precision != "float32")
    with _WrongOp(**wrong) if wrong else contextlib.nullcontext(), \
            HookerAndDumper(directory, ops="*", **options).hooks(model, 0, 0):
        with autocast:
            loss = model(batch).float().pow(2).mean()
        loss.backward()
    return directory


def test_products_and_sums_of_two_tensors_are_recomputed_and_their_errors_found(tmp_path):
    """Op records of ``*`` and ``+`` (broadcast too), in a healthy float32 A against bfloat16
    B: output and both operands' gradients recomputed within rounding, the pair passes; a
    product B computes 1e-3 off, or whose gradient for its second operand is, is the first
    divergence of a float32 B, by 1e-3 recomputed."""
    a = _dumped(tmp_path / "a", _GatedBlock, "float32")
    result = compare_dumps(a, _dumped(tmp_path / "b", _GatedBlock, "bfloat16"))
    ops = result[result["cls"].isin(["mul", "add"])]
    recomputed = ops[ops["recomputed_rel_err"].notna()]
    assert set(zip(recomputed["module"], recomputed["kind"], recomputed["index"])) == {
        (op, kind, index) for op in ("/mul#0", "/mul#1", "/add#0")
        for kind, index in (("output", 0), ("grad_input", 0), ("grad_input", 1))} - {
        ("/add#0", "grad_input", 0)}  # the batch, which gets no gradient
    assert (recomputed["status"] != st.DIFF).all()
    assert summarize(result).ok, summarize(result).verdict()
    for where, index in (("output", 0), ("grad_input", 1)):
        planted = _dumped(tmp_path / where, _GatedBlock, "float32",
                          wrong={"where": where, "scale": 1.001})
        first = summarize(compare_dumps(a, planted)).first
        assert (first.row["module"], first.row["kind"], first.row["index"]) == (
            "/mul#0", where, index), first.row
        assert first.row["recomputed_rel_err"] == pytest.approx(1e-3, rel=0.05)
        assert MISCOMPUTED in first.row["reason"] and "(mul: recomputed" in first.row["reason"]


def _autograd_figures(name: str, x: torch.Tensor, z: torch.Tensor) -> list:
    """The figures of op ``name``'s formula for ``x`` and ``z`` (float64, requiring grad)
    against torch's own forward and backward: output, and each operand's gradient."""
    y = getattr(torch, name)(x, z) if hasattr(torch, name) else getattr(
        nn.functional, name)(x, z)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    y.backward(g)
    tensors = {fmt.INPUT: x.detach().numpy(), fmt.OUTPUT: y.detach().numpy(),
               fmt.GRAD_OUTPUT: g.numpy()}
    [formula] = formulas.candidates(name)
    return [formula(kind, formulas.Operands({**tensors, fmt.GRAD_INPUT: got.detach().numpy()},
                                            None, None, math.nan, others=(z.detach().numpy(),),
                                            operand=operand)).columns()
            for kind, operand, got in ((fmt.OUTPUT, 0, y), (fmt.GRAD_INPUT, 0, x.grad),
                                       (fmt.GRAD_INPUT, 1, z.grad))]


def _operands(shape_x: tuple, shape_z: tuple, low: float = 0.0) -> tuple:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.rand(s, generator=gen, dtype=torch.float64).add_(low).requires_grad_()
                 for s in (shape_x, shape_z))


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "pow", "maximum", "minimum",
                                "clamp_min", "clamp_max"])
@pytest.mark.parametrize("shape_x, shape_z", [((4, 1, 16), (8, 1)), ((16,), (4, 8, 16)),
                                              ((4, 8, 16), (4, 8, 16)), ((2, 3), ())])
def test_ops_of_two_tensors_follow_autograd_where_broadcast(op, shape_x, shape_z):
    """The formula of an op of two tensors gives what torch's own forward and backward give,
    in float64, for operands broadcast along leading, middle and all axes (no figures for a
    gradient that is all zeros: a maximum's to a number below every element)."""
    x, z = _operands(shape_x, shape_z, low=0.5)  # (a pair of its own: where torch's are 0)
    y = getattr(torch, op)(x, z)
    y.backward(torch.ones_like(y))
    for figures, result in zip(_autograd_figures(op, *_operands(shape_x, shape_z, low=0.5)),
                               (y, x.grad, z.grad)):
        assert (figures is None) == (not result.any()), (figures, result)
        if figures is None:
            continue
        assert figures["recomputed_rel_err"] < 1e-15, figures
        assert figures["recomputed_terms"] >= 1


@pytest.mark.parametrize("op, shape_x, shape_z, terms", [
    ("matmul", (3, 4), (4, 5), (4, 5, 3)),
    ("matmul", (2, 3, 4), (4, 5), (4, 5, 6)),  # a shared second operand: its gradient sums
    ("matmul", (4,), (4,), (4, 1, 1)),  # two vectors: a number
    ("matmul", (4,), (2, 4, 5), (4, 10, 1)),
    ("matmul", (2, 3, 4), (4,), (4, 1, 6)),
    ("matmul", (2, 1, 3, 4), (5, 4, 2), (4, 10, 6)),  # batch axes broadcast both ways
    ("bmm", (2, 3, 4), (2, 4, 5), (4, 5, 3)),
    ("mm", (3, 4), (4, 5), (4, 5, 3)),
    ("linear", (2, 3, 4), (5, 4), (4, 5, 6)),  # F.linear: x Wᵀ, its weight's gradient summed
])
def test_matrix_products_follow_autograd(op, shape_x, shape_z, terms):
    """A matrix product's formula gives torch's forward and both gradients, in float64,
    vectors and broadcast batches too; each element sums as many products as torch's
    kernels do (forward the shared axis; backward the other operand's free axis, times the
    batches an operand was broadcast along)."""
    figures = _autograd_figures(op, *_operands(shape_x, shape_z, low=-0.5))
    assert [f["recomputed_rel_err"] for f in figures] == pytest.approx([0, 0, 0], abs=1e-15)
    assert tuple(f["recomputed_terms"] for f in figures) == terms


class _Cancelling(nn.Module):
    """Rows centred, then projected on a direction close to the constant one, as a Mamba
    mixer's matmul does: the products each element sums cancel to a twentieth of them."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.direction = nn.Parameter(1.0 + 0.05 * torch.randn(width, 2))

    def forward(self, x):
        h = self.proj(x)
        return (h - h.mean(-1, keepdim=True)) @ self.direction


def test_a_product_whose_terms_cancel_amplifies_rounding_and_is_no_origin(tmp_path):
    """float32 A against bfloat16 autocast B, and B re-run on A's values: the product's
    inputs are A's cast to bfloat16, whose rounding the cancelling terms amplify 27-fold
    (15x a rounding of its result). Recomputed from its records, B computed the product
    within rounding: not an origin. A float32 B whose product is 1e-3 off is found there,
    by 1e-3 recomputed, in both directions."""
    a = _dumped(tmp_path / "a", _Cancelling, "float32", params=True)
    b = _dumped(tmp_path / "b", _Cancelling, "bfloat16")
    c = _dumped(tmp_path / "c", _Cancelling, "bfloat16", inject=a)
    injected = compare_dumps(a, c)
    product = injected[(injected["module"] == "/matmul#0") & (injected["kind"] == "output")]
    assert product["recomputed_spread"].item() > 20
    assert product["rel_error"].item() > 10 * 2.0 ** -8  # far beyond one rounding
    assert product["status"].item() == st.CLOSE
    table = localize(a, b, c)
    assert not (table["verdict"] == ORIGIN).any(), table[table["verdict"] == ORIGIN]
    for where, index in (("output", 0), ("grad_input", 1)):
        planted = _dumped(tmp_path / where, _Cancelling, "float32",
                          wrong={"where": where, "scale": 1.001, "op": "matmul"})
        first = summarize(compare_dumps(a, planted)).first
        assert (first.row["module"], first.row["kind"], first.row["index"]) == (
            "/matmul#0", where, index), first.row
        assert first.row["recomputed_rel_err"] == pytest.approx(1e-3, rel=0.05)
        assert MISCOMPUTED in first.row["reason"] and "(matmul: recomputed" in \
            first.row["reason"]


class _Scaled(nn.Module):
    """Numbers as second operands, as attention's scaling and a residual's factor are."""

    def __init__(self, width: int = 16, factor: float = 0.5):
        super().__init__()
        self.proj, self.factor = nn.Linear(width, width), factor

    def forward(self, x):
        h = self.proj(x) * self.factor
        h = h / 3.0 + 1.0
        return h - 0.25 * h * h


def test_ops_of_a_tensor_and_a_number_are_recomputed_from_the_recorded_number(tmp_path):
    """``x * 0.5``, ``x / 3.0``, ``x + 1.0``, ``0.25 * x``: the number is an argument row
    (its repr exact), read back as the second operand; the output and the tensor's gradient
    are recomputed within rounding in a healthy float32 / bfloat16 pair, and a product 1e-3
    off is the first divergence of a float32 B, by 1e-3 recomputed; so is a B whose code
    multiplies by another number (recomputed at A's, it computes something else)."""
    a = _dumped(tmp_path / "a", _Scaled, "float32")
    result = compare_dumps(a, _dumped(tmp_path / "b", _Scaled, "bfloat16"))
    with_numbers = {"/mul#0", "/div#0", "/add#0", "/mul#1"}
    rows = result[result["module"].isin(with_numbers)
                  & result["kind"].isin(["output", "grad_input"])]
    assert len(rows) == 8 and rows["recomputed_rel_err"].notna().all(), rows
    assert (rows["status"] != st.DIFF).all()
    assert summarize(result).ok, summarize(result).verdict()
    first = summarize(compare_dumps(a, _dumped(tmp_path / "wrong", _Scaled, "float32", wrong={
        "where": "output", "scale": 1.001}))).first
    assert (first.row["module"], first.row["kind"]) == ("/mul#0", "output"), first.row
    assert first.row["recomputed_rel_err"] == pytest.approx(1e-3, rel=0.05)
    assert MISCOMPUTED in first.row["reason"]
    other = functools.partial(_Scaled, factor=0.505)  # B's code multiplies by another number
    first = summarize(compare_dumps(a, _dumped(tmp_path / "other", other, "float32"))).first
    assert (first.row["module"], first.row["kind"]) == ("/mul#0", "output"), first.row
    assert first.row["recomputed_rel_err"] == pytest.approx(0.01, rel=0.05)
    assert MISCOMPUTED in first.row["reason"]


class _DtypeLimits(nn.Module):
    """Numbers taken from the dtype the code runs in, which differ between a float32 and a
    16-bit run as the same argument: a mask filled with its minimum, as Canine's and
    Splinter's heads do, and its machine epsilon added."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        logits = self.proj(x)
        limits = torch.finfo(logits.dtype)
        keep = (torch.arange(logits.shape[-1]) < 12).to(logits.dtype)
        masked = (logits + (1 - keep) * limits.min).log_softmax(-1).clamp_min(-30)
        return masked.float() * 10 + limits.eps  # float32 in both runs


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_a_number_that_is_each_runs_dtype_limit_is_recomputed_at_bs_own(tmp_path, precision):
    """``finfo(dtype).min`` and ``.eps`` in float32 A and a 16-bit autocast B: B's numbers
    are the same arguments as A's (each run's dtype limit), so B is recomputed at its own (at
    A's, B's float32 ``+ eps`` would be off by the 16-bit epsilon, far beyond float32's
    rounding) and the healthy pair passes; the elements holding the mask's fill are left out
    of a recomputation (they would be all of its norm), and one left with nothing gets none."""
    a = _dumped(tmp_path / "a", _DtypeLimits, "float32")
    result = compare_dumps(a, _dumped(tmp_path / "b", _DtypeLimits, precision))
    assert summarize(result).ok, summarize(result).verdict()
    assert not result["reason"].fillna("").str.contains(MISCOMPUTED).any()
    figures = result[result["index"] == 0].set_index(["module", "kind"])["recomputed_rel_err"]
    assert math.isnan(figures[("/mul#0", "output")])  # the fills and zeros: nothing left
    assert figures[[("/add#0", "output"), ("/log_softmax#0", "output"), ("/add#1", "output"),
                    ("/log_softmax#0", "grad_input")]].notna().all(), figures


def test_a_masks_fill_is_left_out_of_a_recomputation():
    """A log-softmax over a row masked with float32's minimum: 5 % off in the elements left
    is found as 5 %, not as nothing against the fills' norm; a formula that sums its terms
    whole (a product) gets no figures where its result holds a fill."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x[:, 5:] = torch.finfo(torch.float32).min
    y = torch.log_softmax(x, -1)
    off = y.clone()
    off[:, :5] *= 1.05
    [formula] = formulas.candidates("log_softmax")
    tensors = {fmt.INPUT: x.numpy(), fmt.OUTPUT: off.numpy()}
    figures = formula(fmt.OUTPUT, formulas.Operands(tensors, None, None, math.nan, dim=-1))
    assert figures.columns()["recomputed_rel_err"] == pytest.approx(0.05)
    filled = y.numpy()
    assert formulas.Figures(filled, filled, 1.0, 1).columns() is None


class _Attention(nn.Module):
    """Eager attention as Hugging Face writes it (a softmax given its dim and float32), with
    elementwise functions, an RMS and a log-softmax as op records."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2)
        probs = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
        gate = torch.tanh(q).relu() * torch.sigmoid(k) * torch.exp(k * 0.5)
        h = nn.functional.gelu(probs @ v) + gate * torch.rsqrt(v.pow(2).mean(-1, True) + 1.0)
        return self.out(nn.functional.silu(h)).log_softmax(-1)


ONE_TENSOR_OPS = ("/softmax#0", "/gelu#0", "/tanh#0", "/relu#0", "/sigmoid#0", "/exp#0",
                  "/pow#0", "/mean#0", "/rsqrt#0", "/silu#0", "/log_softmax#0")


def test_activations_and_softmaxes_are_recomputed_at_the_dim_they_were_given(tmp_path):
    """Op records of one tensor (and a power of a number), in a healthy float32 A against
    bfloat16 B: output and gradient recomputed within rounding (the softmax over the dim it
    was given by name, the log-softmax positionally), the pair passes; a softmax whose result
    or gradient B computes 1e-3 off is the first divergence of a float32 B, by 1e-3
    recomputed."""
    a = _dumped(tmp_path / "a", _Attention, "float32")
    result = compare_dumps(a, _dumped(tmp_path / "b", _Attention, "bfloat16"))
    rows = result[result["module"].isin(ONE_TENSOR_OPS)
                  & result["kind"].isin(["output", "grad_input"]) & (result["index"] == 0)]
    assert len(rows) == 2 * len(ONE_TENSOR_OPS), rows[["module", "kind"]]
    assert rows["recomputed_rel_err"].notna().all(), rows[rows["recomputed_rel_err"].isna()]
    assert (rows["status"] != st.DIFF).all()
    assert summarize(result).ok, summarize(result).verdict()
    for where in ("output", "grad_input"):
        planted = _dumped(tmp_path / where, _Attention, "float32",
                          wrong={"where": where, "scale": 1.001, "op": "softmax", "operand": 0})
        first = summarize(compare_dumps(a, planted)).first
        assert (first.row["module"], first.row["kind"]) == ("/softmax#0", where), first.row
        assert first.row["recomputed_rel_err"] == pytest.approx(1e-3, rel=0.05)
        assert MISCOMPUTED in first.row["reason"]


class _HalfSoftmax(nn.Module):
    """Attention whose softmax and GELU run in the autocast dtype (no ``dtype=float32``), as
    GPT-2's eager attention does under CPU autocast."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        probs = torch.softmax(q @ k.transpose(-1, -2) * 0.25, dim=-1)
        return self.out(nn.functional.gelu(probs @ v))


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_a_call_that_rounds_only_its_result_is_allowed_one_rounding(tmp_path, precision):
    """A softmax's or a GELU's result, and a GELU's gradient (one kernel of its input), round
    only once: B's 16-bit records are off their recomputation by ~0.4 units of rounding,
    within the two allowed, and 1 % wrong (2.6 units of bfloat16) is found (allowing their
    operands' rounding too, 6 units or more, passed it). A softmax's gradient reuses its rounded
    result: it keeps that allowance."""
    a = _dumped(tmp_path / "a", _HalfSoftmax, "float32")
    healthy = compare_dumps(a, _dumped(tmp_path / "b", _HalfSoftmax, precision))
    assert summarize(healthy).ok, summarize(healthy).verdict()
    ops = healthy[healthy["module"].isin(["/softmax#0", "/gelu#0"]) & (healthy["index"] == 0)
                  & healthy["kind"].isin(["output", "grad_input"])]
    assert len(ops) == 4 and ops["recomputed_rel_err"].notna().all(), ops
    assert (ops["recomputed_rel_err"] < ops["recomputed_allowance"] / 2).all(), ops
    for op, where in (("softmax", "output"), ("gelu", "output"), ("gelu", "grad_input")):
        planted = _dumped(tmp_path / f"{op}-{where}", _HalfSoftmax, precision,
                          wrong={"where": where, "scale": 1.01, "op": op, "operand": 0})
        first = summarize(compare_dumps(a, planted)).first
        assert first is not None and (first.row["module"], first.row["kind"]) == (
            f"/{op}#0", where), (op, where, first and first.row["module"])
        assert MISCOMPUTED in first.row["reason"]
        assert first.row["recomputed_rel_err"] > first.row["recomputed_allowance"]


def _one_tensor_figures(formula, run: Callable, x: torch.Tensor, dim=None) -> list:
    """The figures of ``formula`` for the output and the gradient of ``run(x)`` (``x``
    float64, requiring grad) against torch's own forward and backward; None where it does
    not fit."""
    y = run(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    y.backward(g)
    tensors = {fmt.INPUT: x.detach().numpy(), fmt.OUTPUT: y.detach().numpy(),
               fmt.GRAD_OUTPUT: g.numpy(), fmt.GRAD_INPUT: x.grad.numpy()}
    figures = [formula(kind, formulas.Operands(tensors, None, None, math.nan, dim=dim))
               for kind in (fmt.OUTPUT, fmt.GRAD_INPUT)]
    return [None if f is None else f.columns() for f in figures]


def _leaf(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float64).requires_grad_()


@pytest.mark.parametrize("name, dim", [("softmax", -1), ("softmax", 0), ("log_softmax", 1)])
def test_softmaxes_follow_autograd(name, dim):
    """A softmax's formula gives torch's forward and backward in float64 over any dim, each
    element's terms those of the sum over it (backward, one more); given no dim, none."""
    x = 3 * torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(0))
    [formula] = formulas.candidates(name)
    softmax = getattr(torch, name)
    figures = _one_tensor_figures(formula, lambda x: softmax(x, dim), _leaf(x), dim)
    assert [f["recomputed_rel_err"] for f in figures] == pytest.approx([0, 0], abs=1e-15)
    assert [f["recomputed_terms"] for f in figures] == [x.shape[dim], x.shape[dim] + 1]
    assert _one_tensor_figures(formula, lambda x: softmax(x, dim), _leaf(x)) == [None, None]
    # backward, its terms as the kernels compute it: g p-weighted sums (a log-softmax's from
    # its rounded result, which moves each exp(y) by |y| as much)
    x = _leaf(x)
    y = softmax(x, dim)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    y.backward(g)
    p, y = (y.exp(), y) if name == "log_softmax" else (y, None)
    with torch.no_grad():
        if y is None:
            terms = p.square() * (g.square() + (g * p).square().sum(dim, keepdim=True))
        else:
            terms = g.square() + (p * g.sum(dim, keepdim=True)).square() * (1 + y.square())
    spread = (terms.sum() / x.grad.square().sum()).sqrt().item()
    assert figures[1]["recomputed_spread"] == pytest.approx(spread, rel=1e-12)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_a_gelu_is_recomputed_by_the_formula_its_records_follow(approximate):
    """A GELU's ``approximate`` is not recorded: of its two formulas, the one torch's float64
    forward and backward follow fits to float64 rounding, the other not."""
    x = torch.linspace(-4, 4, 101)
    errors = [[f["recomputed_rel_err"] for f in _one_tensor_figures(
        formula, lambda x: nn.functional.gelu(x, approximate=approximate), _leaf(x))]
        for formula in formulas.candidates("GELU")]
    fits = errors[approximate == "tanh"]
    assert max(fits) < 1e-15 and min(errors[approximate != "tanh"]) > 1e-5, errors


FUNCTIONS = ("relu", "silu", "sigmoid", "tanh", "exp", "rsqrt", "sqrt", "log", "sin", "cos",
             "neg", "abs", "square", "double")
POSITIVE = ("rsqrt", "sqrt", "log")  # defined for positive inputs only


@pytest.mark.parametrize("name", FUNCTIONS)
def test_elementwise_ops_follow_autograd(name):
    """An elementwise op's formula gives torch's own float64 forward and backward, on both
    sides of 0 and at 0 where defined there (a cast to the dtype it has: the identity)."""
    [formula] = formulas.candidates(name)
    function = getattr(nn.functional, name, None) or getattr(torch.Tensor, name)
    x = torch.linspace(0.1, 4, 64) if name in POSITIVE else torch.arange(-12.0, 17.0) / 4
    assert name in POSITIVE or (x == 0).any()
    figures = _one_tensor_figures(formula, function, _leaf(x))
    assert [f["recomputed_rel_err"] for f in figures] == pytest.approx([0, 0], abs=1e-15)


@pytest.mark.parametrize("name", ["sum", "mean"])
@pytest.mark.parametrize("dim, keepdim", [(-1, True), (0, False), (None, False)])
def test_sums_and_means_follow_autograd(name, dim, keepdim):
    """A sum's or mean's formula gives torch's own float64 forward and backward over the dim
    it was given, kept or not, or over all of them; each element sums the elements reduced."""
    x = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(0))
    [formula] = formulas.candidates(name)
    reduce = getattr(torch.Tensor, name)
    figures = _one_tensor_figures(formula, lambda x: reduce(x) if dim is None else reduce(
        x, dim, keepdim=keepdim), _leaf(x), dim)
    assert [f["recomputed_rel_err"] for f in figures] == pytest.approx([0, 0], abs=1e-15)
    assert [f["recomputed_terms"] for f in figures] == [60 if dim is None else x.shape[dim], 1]

"""Op records of two tensors recomputed (compare.recompute): elementwise ops and matrix
products, broadcast either way, as torch's autograd computes them; a wrong kernel found
exactly, and no false alarm where rounding, amplified by terms that cancel, explains the
error."""
from __future__ import annotations

import contextlib
import math

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


class _WrongProduct(torch.overrides.TorchFunctionMode):
    """B's kernel for the first ``op`` of a tensor and another operand is off by ``scale``:
    its result, or (``where="grad_input"``, a tensor) the gradient it sends back for its
    second operand."""

    def __init__(self, where: str, scale: float, op: str = "mul"):
        super().__init__()
        self.where, self.scale, self.op, self.done = where, scale, op, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in (self.op, f"__{self.op}__") and not self.done and \
                len(args) == 2 and isinstance(args[0], torch.Tensor):
            self.done = True
            x, z = args
            if self.where == "output":
                return func(x, z, **kwargs) * self.scale
            return func(x, ScaleGrad.apply(z, self.scale), **kwargs)
        return func(*args, **kwargs)


def _dumped(directory, block: type, precision: str, wrong: dict = None, **options):
    """One step of ``block`` (built at seed 0, width 16) on a fixed batch, float32 or under
    bfloat16 autocast (``precision``), every op recorded; ``wrong``: a :class:`_WrongProduct`
    in B's kernels."""
    torch.manual_seed(0)
    model = block()
    batch = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bfloat16")
    with _WrongProduct(**wrong) if wrong else contextlib.nullcontext(), \
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
    y = getattr(torch, name)(x, z)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    y.backward(g)
    tensors = {fmt.INPUT: x.detach().numpy(), fmt.OUTPUT: y.detach().numpy(),
               fmt.GRAD_OUTPUT: g.numpy()}
    [formula] = formulas.candidates(name)
    return [formula(kind, formulas.Operands({**tensors, fmt.GRAD_INPUT: got.detach().numpy()},
                                            None, None, math.nan, other=z.detach().numpy(),
                                            operand=operand)).columns()
            for kind, operand, got in ((fmt.OUTPUT, 0, y), (fmt.GRAD_INPUT, 0, x.grad),
                                       (fmt.GRAD_INPUT, 1, z.grad))]


def _operands(shape_x: tuple, shape_z: tuple, low: float = 0.0) -> tuple:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.rand(s, generator=gen, dtype=torch.float64).add_(low).requires_grad_()
                 for s in (shape_x, shape_z))


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
@pytest.mark.parametrize("shape_x, shape_z", [((4, 1, 16), (8, 1)), ((16,), (4, 8, 16)),
                                              ((4, 8, 16), (4, 8, 16)), ((2, 3), ())])
def test_ops_of_two_tensors_follow_autograd_where_broadcast(op, shape_x, shape_z):
    """The formula of an op of two tensors gives what torch's own forward and backward give,
    in float64, for operands broadcast along leading, middle and all axes."""
    for figures in _autograd_figures(op, *_operands(shape_x, shape_z, low=0.5)):
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

    def __init__(self, width: int = 16):
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        h = self.proj(x) * 0.5
        h = h / 3.0 + 1.0
        return h - 0.25 * h * h


def test_ops_of_a_tensor_and_a_number_are_recomputed_from_the_recorded_number(tmp_path):
    """``x * 0.5``, ``x / 3.0``, ``x + 1.0``, ``0.25 * x``: the number is an argument row
    (its repr exact), read back as the second operand; the output and the tensor's gradient
    are recomputed within rounding in a healthy float32 / bfloat16 pair, and a product 1e-3
    off is the first divergence of a float32 B, by 1e-3 recomputed."""
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

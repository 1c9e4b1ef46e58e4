"""Test helpers: read a dump back as exact torch tensors, keyed by (module, call_idx, kind, index);
planted errors; skipping what torch itself cannot run here."""
from __future__ import annotations

import pytest
import torch

from architectures import cannot_run
from compare.dump import load_dump
from dumper.encoding import decode_to_tensor


def read_tensors(path, step: int | None = None, rank: int | None = None
                 ) -> dict[tuple, torch.Tensor]:
    """Every stored tensor of a one-step dump (or of its ``step`` of ``rank``), bit-exact, keyed
    by (module, call_idx, kind, index), with the occurrence appended for a repeated gradient."""
    dump = load_dump(path)
    out = {}
    for step in [s for s in dump.steps if (step, rank) in {(None, None), (s.step, s.rank)}]:
        with step.open() as reader:
            for row in step.index[step.index["dataset"] != ""].itertuples():
                key = (row.module, row.call_idx, row.kind, row.index) + (
                    (row.occurrence,) if row.occurrence else ())
                assert key not in out, f"duplicate record {key}"
                out[key] = decode_to_tensor(reader.read_raw(row), row.dtype)
    return out


class ScaleGrad(torch.autograd.Function):
    """Identity forward; scales the gradient in backward (a planted backward-only error)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


class Planted(torch.nn.Module):
    """Linear -> Tanh -> Linear -> ReLU -> Linear (+ an Identity with ``extra``)."""

    def __init__(self, extra: bool = False):
        super().__init__()
        self.inp = torch.nn.Linear(6, 16)
        self.act = torch.nn.Tanh()
        self.mid = torch.nn.Linear(16, 16)
        self.relu = torch.nn.ReLU()
        self.out = torch.nn.Linear(16, 3)
        self.extra = torch.nn.Identity() if extra else None

    def forward(self, x):
        h = self.mid(self.act(self.inp(x)))
        if self.extra is not None:
            h = self.extra(h)
        return self.out(self.relu(h))


class Indexed(torch.nn.Module):
    """A lookup of its own code, ``weight[ids]``: no rule knows what its rows' drift gives."""

    def __init__(self, rows: int, width: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(rows, width))

    def forward(self, ids):
        return self.weight[ids]


class Embedded(torch.nn.Module):
    """Token ids -> Embedding(64, 16) (or, ``indexed``, :class:`Indexed`) -> Linear -> (times
    ``between``, code between modules) -> Linear."""

    def __init__(self, between: float = 1.0, indexed: bool = False):
        super().__init__()
        self.emb = (Indexed if indexed else torch.nn.Embedding)(64, 16)
        self.lin1 = torch.nn.Linear(16, 16)
        self.lin2 = torch.nn.Linear(16, 4)
        self.between = between

    def forward(self, ids):
        return self.lin2(self.lin1(self.emb(ids)) * self.between)


def dump_embedded(directory, dtype: torch.dtype, *, drift: float = 0.0, plant: float = 1.0,
                  between: float = 1.0, step: int = 3, indexed: bool = False, **options):
    """Dump one step (labelled ``step``) of :class:`Embedded` (``indexed``: its lookup one of
    its own code) in ``dtype`` on ids naming 12 of its 64 rows; ``drift``: every weight off by
    that much (relative, random), as after training; ``plant``: the embedding's output scaled
    so (``dumper.perturb``). ``options`` go to ``HookerAndDumper``."""
    from dumper import HookerAndDumper, perturb
    torch.manual_seed(0)
    model = Embedded(between, indexed)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + drift * torch.randn(p.shape, generator=gen))
    model = model.to(dtype)
    ids = torch.randint(0, 12, (4, 6), generator=torch.Generator().manual_seed(1)) * 5
    planted = perturb(model, "emb", where="output", scale=plant) if plant != 1.0 else None
    with HookerAndDumper(directory, **options).hooks(model, 0, step):
        model(ids).pow(2).mean().backward()
    if planted is not None:
        planted.remove()
    return directory


def plant_error(model: Planted, where: str) -> None:
    """Make ``model.mid`` itself wrong: its output (``forward``), or, inside it, the gradient
    it sends back to its input (``backward``)."""
    if where == "forward":
        model.mid.register_forward_hook(lambda m, args, out: out * (1 + 1e-3))
    else:
        linear = model.mid.forward
        model.mid.forward = lambda x: linear(ScaleGrad.apply(x, 1.05))


def dump_run(directory, *, plant: str = "", extra: bool = False, steps: int = 2,
             dtype=torch.float32, seed: int = 0):
    """Train ``Planted`` for ``steps`` steps from ``seed``, dumping every step into ``directory``."""
    from dumper import HookerAndDumper
    torch.manual_seed(seed)
    model = Planted(extra=extra).to(dtype)
    if plant:
        plant_error(model, plant)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    dumper = HookerAndDumper(directory, params=True)
    gen = torch.Generator().manual_seed(seed + 1)
    for step in range(steps):
        x = torch.randn(8, 6, generator=gen).to(dtype).requires_grad_()
        with dumper.hooks(model, 0, step):
            model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return directory


def require_runnable(arch: str, *precisions: str) -> None:
    """Skip, with torch's reason, a variant torch itself cannot run on this machine."""
    for precision in precisions:
        why = cannot_run(arch, precision)
        if why:
            pytest.skip(f"torch cannot run {arch} at {precision} on this machine: {why}")

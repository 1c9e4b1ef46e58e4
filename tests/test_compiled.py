"""Regional compilation (``block.compile()`` on repeated blocks): dumps record the compiled blocks
at their boundaries without changing the numerics, and compare against an eager run."""
from __future__ import annotations

import warnings

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from compare import compare_dumps, format as fmt
from compare.cli import main
from compare.dump import load_dump
from dumper import HookerAndDumper, perturb


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        return x + nn.functional.gelu(self.lin(self.norm(x))) * 0.5


def _model(compiled: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block(), nn.Linear(64, 2))
    if compiled:
        for block in list(model)[:2]:
            block.compile()
    return model


def _step(model, directory=None, plant=None, **options):
    """One training step (after a warm-up one), dumped into ``directory`` if given; returns the
    output, the gradients and the dumper's warnings."""
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    model(x).sum().backward()
    model.zero_grad()
    if plant:
        perturb(model, **plant)
    caught = []
    if directory is None:
        out = model(x)
        out.sum().backward()
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with HookerAndDumper(directory, **options).hooks(model, 0, 0):
                out = model(x)
                out.sum().backward()
        assert not [w for w in caught if "ynamo" in str(w.message)]  # hooks run untraced
    return (out.detach(), [p.grad.clone() for p in model.parameters()],
            [str(w.message) for w in caught if "h5cmp" in str(w.message)])


@pytest.mark.parametrize("mode", ["tensors", "stats", "hash"])
def test_a_compiled_step_is_bit_identical_with_the_dumper(tmp_path, mode):
    plain_out, plain_grads, _ = _step(_model(True))
    out, grads, said = _step(_model(True), tmp_path, mode=mode)
    assert said == ["h5cmp: 0, 1 run as compiled code (module.compile()): recorded at their "
                    "boundaries; the 4 modules inside them are not recorded (compiled code runs "
                    "no hooks; run the step eagerly to record them)"]
    assert torch.equal(out, plain_out)
    assert all(torch.equal(g, h) for g, h in zip(grads, plain_grads))
    step = load_dump(tmp_path).steps[0]
    assert fmt.compiled_modules(step.attrs) == ["0", "1"]
    recorded = set(step.index["module"])
    assert {"0", "1", "2"} <= recorded and not recorded & {"0.lin", "0.norm", "1.lin"}


def test_a_compiled_run_compares_with_an_eager_one(tmp_path):
    _step(_model(False), tmp_path / "eager")
    _step(_model(True), tmp_path / "compiled")
    _step(_model(True), tmp_path / "wrong", plant={"include": "1", "scale": 1.001,
                                                    "where": "output"})
    healthy = CliRunner().invoke(
        main, [str(tmp_path / "eager"), str(tmp_path / "compiled")])
    assert healthy.exit_code == 0, healthy.output
    assert "inside modules B compiled in place (0, 1)" in healthy.stderr
    frame = compare_dumps(tmp_path / "eager", tmp_path / "compiled")
    assert not frame["module"].isin(["0.lin", "1.norm"]).any()
    assert set(frame[frame["module"] == "1"]["status"]) <= {"equal", "close"}
    wrong = CliRunner().invoke(main, [str(tmp_path / "eager"), str(tmp_path / "wrong")])
    assert wrong.exit_code == 1, wrong.output
    assert "first divergence: step 0:0, forward, module 1 (Block) call 0, output[0]" in wrong.output

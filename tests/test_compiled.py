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


def _step(model, directory=None, plant=None, warm_up=True, **options):
    """One training step (after a warm-up one, which compiles without hooks), dumped into
    ``directory`` if given; returns the output, the gradients and the dumper's warnings."""
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    if warm_up:
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


def _dumped_bit_for_bit(make, directory, warm_up=True, **options) -> list[str]:
    """A step of ``make()``'s model, without and then with the dumper: the outputs and
    gradients must be bit for bit the same; returns the dumper's warnings."""
    plain_out, plain_grads, _ = _step(make(), warm_up=warm_up)
    out, grads, said = _step(make(), directory, warm_up=warm_up, **options)
    assert torch.equal(out, plain_out)
    assert all(torch.equal(g, h) for g, h in zip(grads, plain_grads))
    return said


@pytest.mark.parametrize("mode,warm_up", [("tensors", True), ("stats", True), ("hash", True),
                                          ("tensors", False)])
def test_a_compiled_step_is_bit_identical_with_the_dumper(tmp_path, mode, warm_up):
    """Also where the blocks are first compiled in the dumped step: no hook inside them is
    there for dynamo to trace."""
    said = _dumped_bit_for_bit(lambda: _model(True), tmp_path, warm_up=warm_up, mode=mode)
    assert said == ["h5cmp: 0, 1 run as compiled code (torch.compile): recorded at their "
                    "boundaries; the 4 modules inside them are not recorded (hooks there would "
                    "change the compiled code and its numerics; run the dumped steps eagerly, "
                    "e.g. inside torch.compiler.set_stance('force_eager'), to record them)"]
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
    assert "inside modules B ran as compiled code (0, 1)" in healthy.stderr
    frame = compare_dumps(tmp_path / "eager", tmp_path / "compiled")
    assert not frame["module"].isin(["0.lin", "1.norm"]).any()
    assert set(frame[frame["module"] == "1"]["status"]) <= {"equal", "close"}
    wrong = CliRunner().invoke(main, [str(tmp_path / "eager"), str(tmp_path / "wrong")])
    assert wrong.exit_code == 1, wrong.output
    assert "first divergence: step 0:0, forward, module 1 (Block) call 0, output[0]" in wrong.output


def test_a_whole_compiled_model_is_recorded_at_its_boundary(tmp_path):
    """``torch.compile(model)``: the model's own inputs, outputs and gradients are recorded,
    nothing inside it, bit for bit as without the dumper; under ``force_eager`` every module."""
    def compiled():  # compiled afresh: dynamo would reuse a graph without the planted hook
        torch._dynamo.reset()
        return torch.compile(_model(False))

    said = _dumped_bit_for_bit(compiled, tmp_path / "whole", warm_up=False)
    assert said == ["h5cmp: <root> runs as compiled code (torch.compile): recorded at its "
                    "boundary; the 7 modules inside it are not recorded (hooks there would "
                    "change the compiled code and its numerics; run the dumped steps eagerly, "
                    "e.g. inside torch.compiler.set_stance('force_eager'), to record them)"]
    step = load_dump(tmp_path / "whole").steps[0]
    assert fmt.compiled_modules(step.attrs) == [""]
    assert set(step.index["module"]) == {""}
    assert set(step.index["cls"]) == {"Sequential"}
    _step(_model(False), tmp_path / "eager")
    healthy = CliRunner().invoke(main, [str(tmp_path / "eager"), str(tmp_path / "whole")])
    assert healthy.exit_code == 0, healthy.output
    assert "inside modules B ran as compiled code (<root>)" in healthy.stderr
    _step(compiled(), tmp_path / "wrong", warm_up=False,
          plant={"include": "1", "scale": 1.001, "where": "output"})
    wrong = CliRunner().invoke(main, [str(tmp_path / "eager"), str(tmp_path / "wrong")])
    assert wrong.exit_code == 1, wrong.output
    assert "first divergence: step 0:0, forward, module <root>" in wrong.output
    with torch.compiler.set_stance("force_eager"):
        _, _, said = _step(compiled(), tmp_path / "eagerly", warm_up=False)
    assert not said
    assert {"0.lin", "1.norm", "2"} <= set(load_dump(tmp_path / "eagerly").index["module"])


def test_a_submodule_replaced_by_its_compile_wrapper_pairs_with_the_eager_model(tmp_path):
    """``model[1] = torch.compile(model[1])``: compiled, the wrapper is recorded at its
    boundary under the block's path and class (``module_types`` selects it as a ``Block``);
    under ``force_eager`` every module is recorded under the eager model's names, not under
    the wrapper's ``_orig_mod`` (before: 14 records of B missing in A and 10 of A in B, exit
    2), and the pair is bit-identical."""
    def wrapped():
        torch._dynamo.reset()
        model = _model(False)
        model[1] = torch.compile(model[1])
        return model

    _step(_model(False), tmp_path / "eager")
    said = _dumped_bit_for_bit(wrapped, tmp_path / "compiled", warm_up=False)
    assert said and said[0].startswith("h5cmp: 1 runs as compiled code")
    step = load_dump(tmp_path / "compiled").steps[0]
    assert set(zip(step.index["module"], step.index["cls"])) >= {("1", "Block"), ("0.lin", "Linear")}
    assert not step.index["module"].str.startswith("1.").any()
    _step(wrapped(), tmp_path / "blocks", warm_up=False, module_types=[Block])
    assert set(load_dump(tmp_path / "blocks").steps[0].index["module"]) == {"0", "1"}
    healthy = CliRunner().invoke(main, [str(tmp_path / "eager"), str(tmp_path / "compiled")])
    assert healthy.exit_code == 0, healthy.output

    with torch.compiler.set_stance("force_eager"):
        _, _, said = _step(wrapped(), tmp_path / "eagerly", warm_up=False)
    assert not said
    modules = set(load_dump(tmp_path / "eagerly").steps[0].index["module"])
    assert modules == set(load_dump(tmp_path / "eager").steps[0].index["module"])
    assert {"1", "1.lin", "1.norm"} <= modules
    same = CliRunner().invoke(main, [str(tmp_path / "eager"), str(tmp_path / "eagerly")])
    assert same.exit_code == 0, same.output
    assert "B agrees with A exactly" in same.output

def test_a_compiled_checkpoint_wrapper_is_recorded_and_selected_as_the_module_inside(tmp_path):
    """``torch.compile(checkpoint_wrapper(block))`` (torchtitan's pattern): the compiled
    boundary is the block's, by class as by path: ``module_types=[Block]`` selects it (before:
    recorded as a ``CheckpointWrapper``, which the selection missed)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    torch._dynamo.reset()
    model = _model(False)
    model[1] = torch.compile(checkpoint_wrapper(model[1]))
    _step(model, tmp_path / "blocks", warm_up=False, module_types=[Block])
    index = load_dump(tmp_path / "blocks").steps[0].index
    assert set(zip(index["module"], index["cls"])) == {("0", "Block"), ("1", "Block")}


def test_a_regionally_compiled_hugging_face_model_trains_bit_for_bit_with_the_dumper(tmp_path):
    """A tiny Llama, each decoder layer compiled in place and first compiled in the dumped
    step: hooks inside the layers would be traced into their graphs (graph breaks, other
    kernels: gradients ~1e-7 apart, as a trial measured); none are placed there."""
    transformers = pytest.importorskip("transformers")

    def run(directory=None):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16))
        for layer in model.model.layers:
            layer.compile()
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
        dumper = HookerAndDumper(directory) if directory else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if dumper:
                dumper.register_hooks(model, 0, 0)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            if dumper:
                dumper.remove_hooks()
        return [loss.detach()] + [p.grad for p in model.parameters()]

    plain, dumped = run(), run(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(plain, dumped))
    recorded = set(load_dump(tmp_path).index["module"])
    assert {"model.layers.0", "model.layers.1", "lm_head"} <= recorded
    assert not {m for m in recorded if m.startswith("model.layers.0.")}


def test_a_submodule_replaced_by_its_compiled_wrapper_is_recorded_at_its_boundary(tmp_path):
    """model[0] = torch.compile(model[0]): the wrapper is hooked, nothing inside it (a review
    found its inner modules hooked as '0._orig_mod.*', inside the compiled code)."""
    def compiled():
        torch._dynamo.reset()
        model = _model(False)
        model[0] = torch.compile(model[0])
        return model

    _dumped_bit_for_bit(compiled, tmp_path / "sub", warm_up=False)
    recorded = set(load_dump(tmp_path / "sub").index["module"])
    assert {"0", "1", "1.lin", "2"} <= recorded and not any("_orig_mod" in m for m in recorded)
    assert fmt.compiled_modules(load_dump(tmp_path / "sub").steps[0].attrs) == ["0"]
    _step(_model(False), tmp_path / "eager")
    healthy = CliRunner().invoke(main, [str(tmp_path / "eager"), str(tmp_path / "sub")])
    assert healthy.exit_code == 0, healthy.output

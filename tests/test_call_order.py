"""A module called several times per step with other arguments each time, in another order in
each run, pairs by its arguments (ModernBERT's rotary embedding, called once per attention type
in the order of a ``set`` of strings, which changes with the process's hash seed)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from compare import compare_dumps, localize, summarize
from compare.cli import main
from dumper import HookerAndDumper, Injector
from dumper.injection import LOCALIZING

pytest.importorskip("transformers")
CHILD = Path(__file__).with_name("call_order_child.py")
ROOT = CHILD.parent.parent


def _dump(directory: Path, hash_seed: int, *extra: str) -> list[str]:
    """Dump one step of the child's ModernBERT with ``PYTHONHASHSEED=hash_seed``; the order
    it called its rotary embedding in."""
    env = {**os.environ, "PYTHONHASHSEED": str(hash_seed),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(CHILD), str(directory), *extra], env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def two_orders(tmp_path_factory):
    """Two dumps of the same step whose rotary-embedding calls ran in other orders, B's hash
    seed and A's order."""
    root = tmp_path_factory.mktemp("call_order")
    first = _dump(root / "a", 0)
    for seed in range(1, 12):
        if _dump(root / f"b{seed}", seed) != first:
            return root / "a", root / f"b{seed}", seed, first
    pytest.fail("every hash seed gave one order of the attention types")


def test_calls_in_another_order_pair_by_their_arguments(two_orders):
    a, b, _, _ = two_orders
    result = compare_dumps(a, b)
    rotary = result[result["module"] == "model.rotary_emb"]
    assert len(rotary) >= 4 and (rotary["status"] == "equal").all()
    ops = result[result["module"].str.startswith("model.rotary_emb/")]
    assert len(ops) >= 4 and (ops["status"] == "equal").all()  # and the ops inside
    assert (result["status"] == "equal").all(), result[result["status"] != "equal"]
    assert result.attrs["arguments"] == ()
    assert summarize(result).first is None
    shell = CliRunner().invoke(main, [str(a), str(b)])
    assert shell.exit_code == 0 and "B agrees with A exactly" in shell.output, shell.output


def test_a_localizing_rerun_in_another_order_finds_no_origin(two_orders, tmp_path):
    """B's order, re-run on A's values: the rotary embedding's calls pair with A's by their
    arguments in the local comparison too, so no call is an origin."""
    a, b, seed, order_a = two_orders
    rerun = tmp_path / "c"
    assert _dump(rerun, seed, "--inject", str(a)) != order_a
    table = localize(a, b, rerun)
    assert len(table) > 0 and (table["verdict"] == "fine").all(), \
        table[table["verdict"] != "fine"]
    shell = CliRunner().invoke(main, [str(a), str(b), "--injected", str(rerun)])
    assert shell.exit_code == 0 and "0 origin" in shell.output, shell.output
    assert "op by op" not in shell.output  # the runs agree: nothing to look inside for


class _Scaled(nn.Module):
    """A Linear scaled by a factor named by its argument."""

    def __init__(self):
        super().__init__()
        self.sub = nn.Linear(4, 4)
        self.scale = {"a": 1.0, "b": 3.0}

    def forward(self, x, kind: str):
        return self.sub(x) * self.scale[kind]


class _PerKind(nn.Module):
    """Calls ``p`` once per kind, in ``order``, on the same input (independent calls, as a
    rotary embedding per attention type); with ``reuse``, ``p``'s submodule again after."""

    def __init__(self, order, reuse=False):
        super().__init__()
        torch.manual_seed(0)
        self.p, self.head, self.order, self.reuse = _Scaled(), nn.Linear(4, 2), order, reuse

    def forward(self, x):
        out = {kind: self.p(x, kind) for kind in self.order}
        y = out["a"] + 2 * out["b"]
        return self.head(self.p.sub(y) if self.reuse else y)


class _Step(nn.Module):
    """A block told which layer it is (an int): a learned offset per layer."""

    def __init__(self):
        super().__init__()
        self.lin, self.offset = nn.Linear(4, 4), nn.Parameter(torch.randn(3, 4))

    def forward(self, x, layer: int):
        return torch.tanh(self.lin(x) + self.offset[layer])


class _Chained(nn.Module):
    """One block applied ``len(order)`` times, each told its layer in ``order``."""

    def __init__(self, order):
        super().__init__()
        torch.manual_seed(0)
        self.block, self.order = _Step(), order

    def forward(self, x):
        for layer in self.order:
            x = self.block(x, layer)
        return x


def _dump_in_process(directory, model, micro_batches=1, **options):
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    with HookerAndDumper(directory, **options).hooks(model, 0, 0):
        for chunk in x.chunk(micro_batches):
            model(chunk).sum().backward()


@pytest.mark.parametrize("case", ["weights inside", "reused after", "micro-batches"])
def test_reordered_calls_pair_with_weights_reuse_and_micro_batches(tmp_path, case):
    """The weights of a module inside the reordered calls (recorded at its first call), a
    submodule called again outside them, and two micro-batches each in another order: every
    record pairs, exit 0. A localizing re-run in B's order on A's values finds no origin."""
    reuse, micro = case == "reused after", 2 if case == "micro-batches" else 1
    a, b, reference, c = (tmp_path / name for name in ("a", "b", "reference", "c"))
    _dump_in_process(a, _PerKind(["a", "b"], reuse), micro)
    _dump_in_process(b, _PerKind(["b", "a"], reuse), micro)
    result = compare_dumps(a, b)
    assert (result["status"] == "equal").all(), result[result["status"] != "equal"]
    assert CliRunner().invoke(main, [str(a), str(b)]).exit_code == 0
    _dump_in_process(reference, _PerKind(["a", "b"], reuse), micro, params=True)
    _dump_in_process(c, _PerKind(["b", "a"], reuse), micro,
                     inject=Injector(reference, LOCALIZING))
    table = localize(reference, b, c)
    assert (table["verdict"] == "fine").all() and (table["local_status"] == "equal").all(), \
        table[table["local_status"] != "equal"]


def test_calls_that_feed_each_other_in_another_order_are_a_difference(tmp_path):
    """A block applied three times, told its layer index, in reverse order in B (B's bug): the
    calls feed each other, so their order matters; it is reported as the arguments that
    differ, not renumbered away."""
    _dump_in_process(tmp_path / "a", _Chained([0, 1, 2]))
    _dump_in_process(tmp_path / "b", _Chained([2, 1, 0]))
    shell = CliRunner().invoke(main, [str(tmp_path / "a"), str(tmp_path / "b")])
    assert shell.exit_code == 1, shell.output
    assert "the runs gave the call other arguments" in shell.output.splitlines()[0]

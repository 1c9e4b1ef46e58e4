"""A module called several times per step with other arguments each time, in another order in
each run, pairs by its arguments (ModernBERT's rotary embedding, called once per attention type
in the order of a ``set`` of strings, which changes with the process's hash seed)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from compare import compare_dumps, localize, summarize
from compare.cli import main

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

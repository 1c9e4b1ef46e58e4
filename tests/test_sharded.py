"""Sharded training (FSDP2, FSDP1, tensor parallel, DDP; 2 processes on gloo) with the dumper
attached, in every mode: it trains, and bit-for-bit as without the dumper; sharded tensors are
dumped as shards that put together make the global tensor; the ranks agree where they must
(``h5cmp RUN --ranks``), and a broken all-reduce is found."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from click.testing import CliRunner

from compare import compare_dumps
from compare.cli import main as h5cmp
from compare.dump import load_dump
from compare.ranks import compare_ranks
from compare.status import FAILING

from helpers import read_tensors

CHILD = Path(__file__).with_name("sharded_child.py")
WORLD = 2
TIMEOUT = 180  # seconds for the whole run of one layout; every process is killed after it

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def launch(layout: str, directory: Path, world: int = WORLD) -> list[dict]:
    """Run ``sharded_child.py`` on ``world`` ranks; each rank's JSON report. Every process is
    killed if the run takes longer than ``TIMEOUT``."""
    directory.mkdir(parents=True, exist_ok=True)  # (a file rendezvous: no port to race for
    # with the tests other pytest-xdist workers run at the same time)
    env = dict(os.environ, INIT_METHOD=f"file://{directory / f'.rendezvous-{uuid.uuid4().hex}'}",
               WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(CHILD), layout, str(directory)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for r in range(world)]
    try:
        outputs = [p.communicate(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp2", "fsdp1", "tp", "ddp"])
def test_sharded_training_is_bit_identical_with_the_dumper(layout, tmp_path):
    reports = launch(layout, tmp_path)
    for report in reports:
        for mode, outcome in report["modes"].items():
            assert outcome["identical"], (layout, report["rank"], mode)
            assert len(outcome["files"]) == 2, (layout, report["rank"], mode, outcome)
    for mode in reports[0]["modes"]:
        dump = load_dump(tmp_path / mode)
        assert sorted((s.step, s.rank) for s in dump.steps) == [
            (step, rank) for step in (0, 2) for rank in range(WORLD)]
    for mode in reports[0]["modes"]:  # healthy runs: the ranks agree where they must
        agreed = compare_ranks(tmp_path / mode)
        assert len(agreed) and (agreed["status"] == "equal").all(), (layout, mode)
    result = CliRunner().invoke(h5cmp, [str(tmp_path / "default"), "--ranks"])
    assert result.exit_code == 0 and "every rank agrees with rank 0 bit for bit" in result.output
    if layout == "fsdp1":  # FullyShardedDataParallel is left out of the paths
        _check_plain_names(tmp_path / "default")
    if layout == "tp":
        _check_tensor_parallel_shards(tmp_path / "params")
        marked = {("1.up", "output"), ("1.down", "input"), ("1.act", "output")}
        _check_against_one_process("tp", tmp_path, {"default": marked, "params": marked})
    if layout == "fsdp2":
        _check_fsdp2_gradient_shards(tmp_path / "params")


def _check_plain_names(dump_dir: Path) -> None:
    import sharded_child
    from compare import format as fmt
    from dumper import module_keys
    index = load_dump(dump_dir).index
    keys = {fmt.module_key(m, c) for m, c in zip(index["module"], index["cls"])}
    assert "Transformer" in keys and "blocks.0.mlp.up.Linear" in keys  # the plain model's names
    assert keys <= set(module_keys(sharded_child.Transformer()))


def _rows(dump_dir: Path, step: int = 0):
    index = load_dump(dump_dir).index
    return index[(index["step"] == step) & (index["dataset"] != "")]


def _check_tensor_parallel_shards(dump_dir: Path) -> None:
    """DTensor parameters and activations are dumped as each rank's shard, with mesh,
    placements, global shape and offsets; the shards put together are the global values (the
    initial weights, built here as the ranks built them); a plain tensor marked with
    mark_sharded gets the same columns."""
    import sharded_child
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), sharded_child.MLP(16),
                                    torch.nn.Linear(16, 4))
    rows = _rows(dump_dir)
    expected = {("1.up", "param", 0): ("S(0)", (64, 16), lambda r: (32 * r, 0)),
                ("1.up", "param", 1): ("S(0)", (64,), lambda r: (32 * r,)),
                ("1.down", "param", 0): ("S(1)", (16, 64), lambda r: (0, 32 * r)),
                ("1.down", "param", 1): ("R", (16,), lambda r: (0,)),
                ("1.up", "input", 0): ("R", (2, 5, 16), lambda r: (0, 0, 0)),
                ("1.down", "input", 0): ("S(2)", (2, 5, 64), lambda r: (0, 0, 32 * r)),
                ("1.up", "output", 0): ("S(2)", (2, 5, 64), lambda r: (0, 0, 32 * r))}
    for (module, kind, index), (placement, global_shape, offsets) in expected.items():
        mine = rows[(rows["module"] == module) & (rows["kind"] == kind) & (rows["index"] == index)]
        assert sorted(mine["rank"]) == list(range(WORLD)), (module, kind)
        for row in mine.itertuples():
            assert (row.mesh_shape, row.placements, row.global_shape, row.offsets) == (
                (WORLD,), placement, global_shape, offsets(row.rank)), (module, kind, row)
    assert (rows[rows["module"] == "0"]["placements"] == "").all()  # not sharded
    for module, name, dim in (("1.up", "weight", 0), ("1.down", "weight", 1)):
        shards = [read_tensors(dump_dir, step=0, rank=r)[(module, 0, "param", 0)]
                  for r in range(WORLD)]
        whole = reference.get_submodule(module).get_parameter(name).detach()
        assert torch.equal(torch.cat(shards, dim), whole), module


def _check_fsdp2_gradient_shards(dump_dir: Path) -> None:
    """FSDP2's parameter gradients are reduce-scattered DTensors: dumped as shards along dim 0."""
    grads = _rows(dump_dir).query("kind == 'param_grad'")
    assert len(grads) and (grads["placements"] == "S(0)").all()
    for row in grads.itertuples():
        assert row.offsets[0] == row.rank * row.shape[0] and row.global_shape[0] == (
            WORLD * row.shape[0]), row


@pytest.mark.slow
def test_a_broken_all_reduce_is_found_by_comparing_ranks(tmp_path):
    """DDP whose communication hook does not all-reduce: each rank steps with its own gradient.
    Where gradients are dumped (params=True), they differ at step 0 already: they are recorded
    as the step ends, after the all-reduce; else the replicas' weights differ at the next
    dumped step (2)."""
    launch("ddp-broken", tmp_path)
    for mode in ("default", "stats", "params", "stats-params"):
        result = CliRunner().invoke(h5cmp, [str(tmp_path / mode), "--ranks"])
        assert result.exit_code == 1, (mode, result.output)
        frame = compare_ranks(tmp_path / mode)
        first_step = frame[frame["step"] == 0]
        if mode.endswith("params"):
            assert result.output.startswith(
                "first disagreement: step 0:0, rank 1 differs from rank 0 in "), result.output
            assert "param_grad[" in result.output.splitlines()[0], result.output
            grads = first_step["kind"] == "param_grad"
            assert (first_step[grads]["status"] != "equal").all()
            assert (first_step[~grads]["status"] == "equal").all()
        else:
            assert result.output.startswith(
                "first disagreement: step 0:2, rank 1 differs from rank 0 in embed.Linear#0 "
                "param[0] weight"), result.output
            assert (first_step["status"] == "equal").all()
        assert (frame[frame["step"] == 2]["status"] != "equal").all()


def test_comparing_ranks_needs_a_distributed_dump(tmp_path):
    from helpers import dump_run
    run = dump_run(tmp_path / "run", steps=1)
    result = CliRunner().invoke(h5cmp, [str(run), "--ranks"])
    assert result.exit_code == 2
    assert "comparing ranks needs a dump of two or more ranks (it holds no distributed step)" \
        in result.output


def _in_one_process(layout: str, directory: Path, **options) -> None:
    """The child's model, data and steps of ``layout`` in this process, unsharded."""
    import sharded_child
    from dumper import HookerAndDumper
    sharded_child.train(layout, HookerAndDumper(directory, steps=[0, 2], **options),
                        model=sharded_child.unsharded(layout))


def _check_against_one_process(layout: str, tmp_path: Path,
                               assembled: dict[str, set[tuple[str, str]]]) -> None:
    """``layout``'s dump against the same model trained in one process: every sharded tensor
    (DTensor or marked) is put together from the ranks' shards (at least the
    ``assembled[mode]`` (module, kind) records), and the healthy pair agrees within rounding,
    in values (params) and with statistics for the weights (default)."""
    for mode, options in (("default", {}), ("params", {"params": True})):
        single = tmp_path / f"single-{mode}"
        _in_one_process(layout, single, **options)
        result = compare_dumps(tmp_path / mode, single)
        failing = result[result["status"].isin(FAILING)]  # weights drifted apart: inherited
        assert failing.empty, failing[["module", "kind", "index", "status", "shape_a"]]
        assert (result[result["step"] == 0]["status"].isin(["equal", "close"])).all()
        put_together = result[result["shard_rank"].notna()]
        assert assembled[mode] <= set(zip(put_together["module"], put_together["kind"])), mode
        cli = CliRunner().invoke(h5cmp, [str(tmp_path / mode), str(single)])
        assert cli.exit_code == 0, cli.output
        assert "first divergence" not in cli.output, cli.output
        assert ("A's sharded tensors are put together from the ranks' shards" in cli.output
                ) == bool(assembled[mode]), cli.output


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp2-one-batch", "fsdp1-one-batch", "ddp-one-batch"])
def test_data_parallel_on_one_batch_agrees_with_one_process(layout, tmp_path):
    """FSDP2, FSDP1 and DDP with every rank on the same batch compute what one process
    computes: against it (FSDP1's wrapper left out of the names), the healthy pair has no
    first divergence, though the weights drift apart by rounding (the gradients' reduction
    adds up otherwise); FSDP2's sharded gradients are put together (its parameters are whole
    while the module runs)."""
    launch(layout, tmp_path)
    grads = {("blocks.0.mlp.up", "param_grad"), ("head", "param_grad")}
    _check_against_one_process(layout, tmp_path, {"default": set(), "params": (
        grads if layout.startswith("fsdp2") else set())})


@pytest.mark.slow
def test_a_planted_error_in_one_ranks_shard_is_found_and_attributed(tmp_path):
    """Rank 1's shard of a column-parallel output 1 % off: against one process, the first
    divergence is that output, and its largest error is in rank 1's shard."""
    launch("tp-planted", tmp_path)
    single = tmp_path / "single"
    _in_one_process("tp", single)
    cli = CliRunner().invoke(h5cmp, [str(tmp_path / "default"), str(single)])
    assert cli.exit_code == 1, cli.output
    assert "first at step 0:0 rank 0 forward in 1.up (output[0])" in cli.output, cli.output
    assert "the largest error is in rank 1's shard" in cli.output
    result = compare_dumps(tmp_path / "default", single)
    first = result[result["status"] == "DIFF"].iloc[0]
    assert (first["module"], first["kind"], first["shard_rank"]) == ("1.up", "output", 1)


@pytest.mark.slow
def test_ranks_holding_different_copies_of_a_replicated_tensor_are_a_finding(tmp_path):
    """Rank 1 feeds the tensor-parallel block another input (1 % off) than rank 0: its copy
    of the block's replicated input differs. Against one process, with values or statistics,
    that record is the first divergence, a replica mismatch naming rank 1; --ranks finds it."""
    launch("tp-replica", tmp_path)
    single = tmp_path / "single"
    _in_one_process("tp", single)
    for mode in ("default", "stats"):
        cli = CliRunner().invoke(h5cmp, [str(tmp_path / mode), str(single)])
        assert cli.exit_code == 1, cli.output
        assert "first at step 0:0 rank 0 forward in 1.up (input[0])" in cli.output, cli.output
        assert "status replica_mismatch" in cli.output, cli.output
        assert ("A's ranks hold different copies of this replicated tensor: rank 1's copy "
                "differs from rank 0's; rank 0's is compared") in cli.output, cli.output
        result = compare_dumps(tmp_path / mode, single)
        failing = result[result["status"].isin(FAILING)]
        assert (failing.iloc[0]["module"], failing.iloc[0]["kind"]) == ("1.up", "input")
        mismatches = failing[failing["status"] == "replica_mismatch"]
        assert list(zip(mismatches["step"], mismatches["module"], mismatches["kind"])) == [
            (0, "1.up", "input"), (2, "1.up", "input")]  # each dumped step
        ranks = CliRunner().invoke(h5cmp, [str(tmp_path / mode), "--ranks"])
        assert ranks.exit_code == 1 and "rank 1 differs from rank 0 in 1.up.Linear#0 input[0]" \
            in ranks.output, ranks.output


@pytest.mark.slow
def test_tensor_parallel_layouts_compare_with_each_other(tmp_path):
    """TP=4 (four processes) against TP=2 and against one process: every sharded tensor of
    both sides is put together, and the healthy pairs agree within rounding."""
    launch("tp", tmp_path / "tp2")
    launch("tp", tmp_path / "tp4", world=4)
    _in_one_process("tp", tmp_path / "single")
    index = load_dump(tmp_path / "tp4" / "default").index
    assert set(index["rank"]) == {0, 1, 2, 3}
    assert set(index[index["module"] == "1.down"]["placements"]) >= {"S(2)", "S(1)", "R"}
    for other in ("tp2", "single"):
        result = compare_dumps(tmp_path / "tp4" / "default", tmp_path / other / (
            "default" if other == "tp2" else ""))
        failing = result[result["status"].isin(FAILING)]
        assert failing.empty, (other, failing[["module", "kind", "index", "status"]])
        assert (result[result["step"] == 0]["status"].isin(["equal", "close"])).all()
        assert result.attrs["assembled"].startswith(
            "A and B's" if other == "tp2" else "A's")
    cli = CliRunner().invoke(h5cmp, [str(tmp_path / "tp4" / "default"),
                                     str(tmp_path / "tp2" / "default")])
    assert cli.exit_code == 0 and "not compared" not in cli.output, cli.output

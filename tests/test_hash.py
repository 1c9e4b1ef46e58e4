"""Hash mode (``mode="hash"``): a digest of each tensor's bits, paired with digests or with the
checksums of value records, and the first tensor whose bits differ named."""
from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from compare import compare_dumps, format as fmt
from compare.cli import main
from compare.dump import load_dump
from dumper.digest import tensor_digest, word_sum
from dumper.encoding import encode

import architectures

PLANT = {"include": "transformer.h.1.mlp.c_fc", "scale": 1 + 2 ** -20, "where": "output"}


def _cases():
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8,
                  torch.int64, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn):
        for shape in ((), (0,), (3,), (5, 7), (2, 3, 5)):
            base = torch.randn(shape, generator=gen) * 10
            yield base.to(dtype) if not dtype.is_complex else torch.complex(base, -base)
    x = torch.randn(10, 9, generator=gen)
    yield from (x[1:], x[:, 2:5], x.t(), x[3], x.to(torch.bfloat16)[1:][2:])  # views, offsets
    large = torch.randn(70_000, generator=gen)  # lazy negative and conjugate views, small and
    for t in (x, large):                        # over HOST_SUM_BYTES (torch's sum)
        yield from (torch._neg_view(t), torch.complex(t, t.flip(0)).conj())


def test_a_digest_is_the_checksum_its_dataset_would_have():
    for t in _cases():
        stored, _ = encode(t.contiguous())
        assert tensor_digest(t) == fmt.data_checksum(stored), (t.dtype, tuple(t.shape))


def test_digests_read_in_place_are_torch_word_sums():
    """A plain CPU tensor's digest is summed by numpy over its memory; the rest (views) by
    torch: the same sum either way, the storage left resizable."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.nn.Parameter(torch.randn(9, 3, generator=gen))
    large = torch.randn(70_000, generator=gen)  # over HOST_SUM_BYTES: torch's sum
    for t in (*_cases(), weight, large):
        assert tensor_digest(t) == fmt.fold_word_sum(int(word_sum(t))), (t.dtype, t.shape)
        assert t.untyped_storage().resizable()


def test_one_flipped_bit_changes_the_digest():
    t = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    flipped = t.clone()
    flipped.view(torch.int32)[537] ^= 1
    assert tensor_digest(t) != tensor_digest(flipped)


def _gpt2(directory, mode: str, plant=None) -> None:
    architectures.run_step("gpt2", "float32", directory, seed=1, plant=plant,
                           dumper_options={"mode": mode})


def _h5cmp(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hash")
    made = {}
    for name, mode, plant in (("hash", "hash", None), ("hash_again", "hash", None),
                              ("hash_planted", "hash", PLANT), ("values", "tensors", None),
                              ("values_planted", "tensors", PLANT), ("stats", "stats", None)):
        made[name] = root / name
        _gpt2(made[name], mode, plant)
    return made


def test_a_hash_dump_holds_digests_and_no_values(runs):
    index = load_dump(runs["hash"]).index
    tensors = index[index["index"] >= 0]
    assert len(tensors) and (tensors["dataset"] == "").all()
    assert (tensors[tensors["status"] == "ok"]["digest"] >= 0).all()
    params = tensors[tensors["kind"] == "param"]
    assert len(params) and params["stat_nan"].isna().all()  # weights: a digest only, too
    assert params[list(fmt.SKETCH_COLUMNS)].isna().all().all()


@pytest.mark.parametrize("run", ["values", "stats"])
def test_weights_get_a_digest_besides_their_statistics(runs, run):
    index = load_dump(runs[run]).index
    params = index[(index["kind"] == "param") & (index["index"] >= 0)]
    assert len(params) and (params["digest"] >= 0).all() and params["stat_nan"].notna().all()


def test_identical_runs_agree_bit_for_bit(runs):
    result = _h5cmp(runs["hash"], runs["hash_again"])
    assert result.exit_code == 0 and "B agrees with A exactly" in result.output


@pytest.mark.parametrize("a, b", [("hash", "hash_planted"), ("hash", "values_planted"),
                                  ("values", "hash_planted")])
def test_the_first_tensor_whose_bits_differ_is_named(runs, a, b):
    result = _h5cmp(runs[a], runs[b])
    assert result.exit_code == 1, result.output
    assert ("first divergence: step 0:0, forward, module transformer.h.1.mlp.c_fc (Conv1D) "
            "call 0, output[0]") in result.output
    assert "the bits differ" in result.output
    frame = compare_dumps(runs[a], runs[b])
    before = frame[frame["seq"] < frame[frame["status"] == "hash_mismatch"]["seq"].min()]
    assert len(before) and (before["status"] == "equal").all()


def test_a_hash_dump_pairs_with_the_values_of_the_same_run(runs):
    frame = compare_dumps(runs["hash"], runs["values"])
    assert set(frame["status"]) == {"equal"}


def test_digests_against_statistics_cannot_be_compared(runs):
    frame = compare_dumps(runs["hash"], runs["stats"])
    weights = frame["kind"] == "param"  # both sides have their digest
    assert set(frame[~weights]["status"]) == {"unsupported"}
    assert set(frame[weights]["status"]) == {"equal"}
    result = _h5cmp(runs["hash"], runs["stats"])
    assert f"; {(~weights).sum()} of {len(frame)} records could not be compared (unsupported)" \
        in result.output.splitlines()[0]


def test_a_gradient_changed_between_modules_is_seen_by_its_digests(tmp_path):
    """Hash mode: A hands ``act``'s gradient on unchanged from ``mid``'s grad_input; B's two
    digests of it differ where B scaled it on the way (by how much, digests do not say)."""
    from dumper import HookerAndDumper, perturb
    from helpers import Planted

    def run(name, mode, plant=False):
        torch.manual_seed(0)
        model, x = Planted(), torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
        handle = perturb(model, "act", where="grad_output", scale=1.001) if plant else None
        with HookerAndDumper(tmp_path / name, mode=mode).hooks(model, 0, 0):
            model(x).sum().backward()
        if handle is not None:
            handle.remove()
        return tmp_path / name

    a = run("a", "tensors")
    healthy = compare_dumps(a, run("healthy", "hash"))
    linked = healthy[healthy["transit_rel_diff"].notna()]
    assert len(linked) >= 4 and (linked["transit_rel_diff"] == 0).all()
    planted = compare_dumps(a, run("planted", "hash", plant=True))
    row = planted[(planted["module"] == "act") & (planted["kind"] == "grad_output")].iloc[0]
    assert row["transit_rel_diff"] == float("inf") and row["status"] == "hash_mismatch"
    assert row["transit_from"] == "mid.Linear#0 grad_input[0]"


def test_weights_that_differ_by_one_bit_are_the_first_divergence(tmp_path):
    """Hash mode keeps a digest of each weight, no statistics: a weight one unit off in one
    element is named, before every tensor it changes."""
    from dumper import HookerAndDumper

    def run(name, nudge=False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        if nudge:
            with torch.no_grad():
                model[2].weight[1, 3] = torch.nextafter(model[2].weight[1, 3], torch.tensor(1.0))
        with HookerAndDumper(tmp_path / name, mode="hash").hooks(model, 0, 0):
            model(torch.ones(3, 6)).sum().backward()
        return tmp_path / name

    a, b = run("a"), run("b", nudge=True)
    frame = compare_dumps(a, b)
    first = frame[frame["status"] != "equal"].sort_values("seq").iloc[0]
    assert (first["module"], first["kind"], first["path"], first["status"]) == (
        "2", "param", "weight", "hash_mismatch")
    result = _h5cmp(a, b)
    assert result.exit_code == 1, result.output
    assert "first divergence: step 0:0, forward, module 2 (Linear) call 0, param[0] weight" \
        in result.output, result.output
    assert "this module's weights differ before the step" in result.output


def test_weights_whose_statistics_agree_but_bits_differ_are_not_equal(tmp_path):
    """Statistics dumps: a weight holding -0.0 where the other holds +0.0 has the same
    statistics and sketch; its digest tells them apart (close, not equal), and equal bits are
    equal."""
    from dumper import HookerAndDumper

    def run(name, negative_zero=False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3))
        with torch.no_grad():
            model[0].weight[0, 0] = -0.0 if negative_zero else 0.0
        with HookerAndDumper(tmp_path / name, mode="stats").hooks(model, 0, 0):
            model(torch.ones(2, 4)).sum().backward()
        return tmp_path / name

    a = run("a")
    frame = compare_dumps(a, run("b", negative_zero=True))
    weight = frame[(frame["kind"] == "param") & (frame["path"] == "weight")].iloc[0]
    assert weight["status"] == "close"
    assert (frame[frame["path"] != "weight"]["status"] == "equal").all()
    again = compare_dumps(a, run("again"))
    assert (again["status"] == "equal").all()

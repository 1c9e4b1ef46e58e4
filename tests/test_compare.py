"""compare_dumps end to end: pairing, first divergence and its origin, jobs, chunking."""
from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest
import torch

from click.testing import CliRunner

from compare import compare_dumps, load_dump, summarize
from compare.cli import main
from dumper import HookerAndDumper
from compare.status import BETWEEN_MODULES, ORIGIN

from helpers import dump_run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return {name: dump_run(root / name, **kwargs) for name, kwargs in {
        "ref": {}, "same": {}, "fwd": {"plant": "forward"}, "bwd": {"plant": "backward"},
        "extra": {"extra": True},
    }.items()}


def test_identical_runs_are_equal(runs):
    result = compare_dumps(runs["ref"], runs["same"])
    assert (result["status"] == "equal").all()
    assert set(result["kind"]) == {"input", "output", "grad_input", "grad_output", "param",
                                   "param_grad"}
    summary = summarize(result)
    assert summary.ok and summary.first is None
    # one row per stored tensor of A, in execution order within each step
    index = load_dump(runs["ref"]).index
    assert len(result) == (index["dataset"] != "").sum()
    for _, rows in result.groupby("step"):
        assert rows["seq"].is_monotonic_increasing


def test_forward_error_origin_is_the_planted_module(runs):
    result = compare_dumps(runs["ref"], runs["fwd"])
    first = summarize(result).first
    assert (first.row["module"], first.row["kind"], first.row["step"]) == ("mid", "output", 0)
    assert first.verdict == ORIGIN and first.direction == "forward"
    assert (first.upstream["status"] == "equal").all() and len(first.upstream) >= 1
    assert "the error starts in this module" in first.describe()
    downstream = result[(result["step"] == 0) & (result["module"] == "out") & (result["kind"] == "output")]
    assert downstream["status"].item() == "inherited"
    assert "carries the error of" in downstream["reason"].item()
    # the only failing records are mid's outputs (steps 0 and 1): the rest carry them
    assert set(result[result["status"] == "DIFF"]["module"]) == {"mid"}


def test_backward_error_origin_is_the_planted_module(runs):
    result = compare_dumps(runs["ref"], runs["bwd"])
    step0 = result[result["step"] == 0]
    assert (step0[step0["kind"].isin(["input", "output", "param"])]["status"] == "equal").all()
    first = summarize(result).first
    assert (first.row["module"], first.row["kind"]) == ("mid", "grad_input")
    assert first.verdict == ORIGIN and first.direction == "backward"
    assert set(first.upstream["kind"]) >= {"grad_output", "input"}


def test_error_between_modules(runs, tmp_path):
    # B's input differs from A's: the first divergence is an input, produced outside any module
    other = dump_run(tmp_path / "other_data", seed=5)
    first = summarize(compare_dumps(runs["ref"], other, kinds=["input", "output"])).first
    assert first.verdict == BETWEEN_MODULES and first.row["kind"] == "input"


def test_missing_and_extra_records_are_rows(runs):
    result = compare_dumps(runs["ref"], runs["extra"])
    extra = result[result["module"] == "extra"]
    assert len(extra) and (extra["status"] == "missing_in_a").all()
    assert ((result["module"] != "extra") == result["status"].isin(["equal"])).all()
    reverse = compare_dumps(runs["extra"], runs["ref"])
    assert (reverse[reverse["module"] == "extra"]["status"] == "missing_in_b").all()
    assert not summarize(reverse).ok and summarize(reverse).first is None


def test_shape_mismatch(tmp_path):
    from dumper import HookerAndDumper
    for name, width in (("a", 4), ("b", 5)):
        d = HookerAndDumper(tmp_path / name)
        m = torch.nn.Identity()
        for step in (0, 1):
            with d.hooks(m, 0, step):
                m(torch.zeros(width))
    result = compare_dumps(tmp_path / "a", tmp_path / "b")
    assert set(result["status"]) == {"shape_mismatch"}
    assert summarize(result).first.row["status"] == "shape_mismatch"


def test_mixed_precision_pair_is_compared_in_the_wider_type(tmp_path):
    from dumper import HookerAndDumper
    x = torch.randn(64, 8)
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = torch.nn.Identity()
        d = HookerAndDumper(tmp_path / name)
        with d.hooks(model, 0, 0):
            model(x.to(dtype))
    result = compare_dumps(tmp_path / "fp32", tmp_path / "bf16")
    assert set(result["status"]) == {"close"}
    assert result["rtol"].iloc[0] == pytest.approx(1.6e-2)
    assert (result["dtype_b"] == "bfloat16").all()


def test_filters(runs):
    result = compare_dumps(runs["ref"], runs["fwd"], steps=["1"], modules=["mid*", "*.ReLU"],
                           kinds=["output"])
    assert set(result["step"]) == {1} and set(result["module"]) == {"mid", "relu"}
    assert set(result["kind"]) == {"output"}


def test_jobs_and_chunks_do_not_change_results(runs):
    base = compare_dumps(runs["ref"], runs["fwd"])
    parallel = compare_dumps(runs["ref"], runs["fwd"], jobs=2)
    chunked = compare_dumps(runs["ref"], runs["fwd"], chunk_elements=16)
    pd.testing.assert_frame_equal(base, parallel)
    pd.testing.assert_frame_equal(base, chunked, rtol=1e-12)


def test_user_tolerances_mean_what_they_say(runs):
    loose = compare_dumps(runs["ref"], runs["fwd"], rtol=1e-2, atol=1e-2)
    assert summarize(loose).ok
    assert set(loose["status"]) <= {"equal", "close"}
    tight = compare_dumps(runs["ref"], runs["fwd"], rtol=1e-5, atol=0.0)
    outside = tight["mismatches"] > 0
    assert (tight[~outside]["status"].isin(["equal", "close"])).all()
    assert (tight[outside]["status"].isin(["DIFF", "inherited"])).all()
    first = summarize(tight).first
    assert first.row.name == tight[outside].index[0]  # the first row outside the tolerance


def test_compare_side_never_imports_torch(runs):
    code = ("import sys; from compare import compare_dumps, summarize, format_tree; "
            f"r = compare_dumps({str(runs['ref'])!r}, {str(runs['fwd'])!r}); summarize(r); "
            f"format_tree({str(runs['ref'])!r}); assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_index_with_variable_length_strings_reads_the_same(runs, tmp_path):
    """Format version 1 allows variable-length string columns as well as the fixed-length ones
    the dumper writes; both load to the same index and compare the same."""
    import shutil

    import h5py
    import numpy as np

    copy = tmp_path / "vlen"
    shutil.copytree(runs["ref"], copy)
    files = sorted(copy.glob("*.hdf5"))
    assert files
    for path in files:
        with h5py.File(path, "r+") as f:
            group = next(iter(f.values()))
            table = group["index"][()]
            vlen = h5py.string_dtype("utf-8")
            dtype = [(n, vlen if table.dtype[n].kind == "S" else table.dtype[n])
                     for n in table.dtype.names]
            converted = np.array([tuple(v.decode() if isinstance(v, bytes) else v for v in row)
                                  for row in table.tolist()], dtype=dtype)
            del group["index"]
            group.create_dataset("index", data=converted)
            assert h5py.check_string_dtype(group["index"].dtype["module"]).length is None
    pd.testing.assert_frame_equal(load_dump(copy).index, load_dump(runs["ref"]).index)
    assert (compare_dumps(copy, runs["ref"])["status"] == "equal").all()


def test_non_ascii_names_and_values_round_trip(tmp_path):
    """Index strings are fixed-length UTF-8: module names, leaf paths and reprs with non-ASCII
    characters (of different byte widths in one column) read back exactly."""
    from torch import nn

    from dumper import HookerAndDumper

    class Tagged(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleDict({"blöck": nn.Linear(3, 3), "b": nn.Linear(3, 3)})

        def forward(self, x, note="héllo wörld ∑"):
            return {"ünïcode": self.blocks["blöck"](x), "a": self.blocks["b"](x)}

    torch.manual_seed(0)
    model, batch = Tagged(), torch.randn(2, 3)
    for run in ("a", "b"):
        with HookerAndDumper(tmp_path / run).hooks(model, 0, 0):
            out = model(batch, note="naïve ∑")
            (out["ünïcode"].sum() + out["a"].sum()).backward()
    index = load_dump(tmp_path / "a").index
    assert {"blocks.blöck", "blocks.b"} <= set(index["module"])
    assert "output['ünïcode']" in set(index["path"])
    notes = index[index["path"] == "kwargs['note']"]
    assert list(notes["value"]) == ["'naïve ∑'"]
    import h5py
    with h5py.File(load_dump(tmp_path / "a").steps[0].path) as f:  # as docs/format.md says
        column = h5py.check_string_dtype(f["0-epoch_0-step/index"].dtype["module"])
        assert column.encoding == "utf-8" and column.length == len("blocks.blöck".encode())
    result = compare_dumps(tmp_path / "a", tmp_path / "b")
    assert "blocks.blöck" in set(result["module"]) and (result["status"] == "equal").all()


def test_a_divergence_in_a_later_micro_batch_is_named_so(tmp_path):
    """Gradient accumulation: B's second micro-batch alone differs (its head's weights changed
    between the passes); the first divergence names that micro-batch."""
    from click.testing import CliRunner
    from torch import nn

    from compare.cli import main
    from dumper import HookerAndDumper

    def run(directory, bump):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
        batches = torch.randn(2, 4, 8)
        dumper = HookerAndDumper(directory)
        dumper.register_hooks(model, 0, 0)
        for i, batch in enumerate(batches):
            if i == 1:
                with torch.no_grad():
                    model[2].weight.add_(bump)
            model(batch).square().sum().backward()
        dumper.remove_hooks()

    run(tmp_path / "a", 0.0)
    run(tmp_path / "b", 1e-2)
    result = compare_dumps(tmp_path / "a", tmp_path / "b")
    first = summarize(result).first.row
    assert (first["module"], first["kind"], first["micro_batch"]) == ("2", "output", 1)
    assert (result[result["micro_batch"] == 0]["status"] == "equal").all()
    listing = CliRunner().invoke(main, [str(tmp_path / "a"), str(tmp_path / "b")])
    assert listing.exit_code == 1, listing.output
    assert "module 2 (Linear) call 1 (micro-batch 1), output[0]" in listing.output, listing.output


class _Gated(torch.nn.Module):
    """Its own code consumes its children's outputs (a gated product, a weight of its own)."""

    def __init__(self):
        super().__init__()
        self.value, self.gate = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.scale = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.value(x) * torch.sigmoid(self.gate(x)) * self.scale


def test_a_gradient_back_through_a_parents_own_code_has_what_that_code_used_as_sources(tmp_path):
    """value's grad_output comes back through _Gated's own product: it depends on gate's output
    and the parent's weight and input, not only on the gradient arriving at the parent."""
    from compare.sources import record_sources
    from dumper import HookerAndDumper
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _Gated())
    with HookerAndDumper(tmp_path).hooks(model, 0, 0):
        model(torch.randn(3, 4)).pow(2).sum().backward()
    rows = load_dump(tmp_path).index.reset_index(drop=True)
    label = [(m, k, i) for m, k, i in zip(rows["module"], rows["kind"], rows["index"])]
    sources = record_sources(rows)
    of_value = {label[j] for j in sources[label.index(("1.value", "grad_output", 0))]}
    assert {("1", "grad_output", 0), ("1.gate", "output", 0), ("1", "param", 0),
            ("1", "input", 0), ("1.value", "output", 0)} <= of_value
    of_first = {label[j] for j in sources[label.index(("0", "grad_output", 0))]}
    assert ("1", "param", 0) not in of_first  # consumed by a recorded call: its grad_input
    of_last = {label[j] for j in sources[label.index(("1", "grad_output", 0))]}
    assert ("", "input", 0) not in of_last  # the root's own code, the loss beyond: as before


class _Attention(torch.nn.Module):
    """Attention's projections, fed its input as it is or (``windowed``) as its own code
    rearranged it (no recorded call made that), and ``mix`` fed what its code made of the
    key's output."""

    def __init__(self, windowed: bool):
        super().__init__()
        self.q, self.k, self.v, self.o, self.mix = (torch.nn.Linear(4, 4) for _ in range(5))
        self.windowed = windowed

    def forward(self, x):
        h = x.flip(0) if self.windowed else x
        q, k, v = self.q(h), self.k(h), self.v(h)
        attended = torch.softmax(q @ k.T, dim=-1) @ v
        return self.o(attended) + self.mix(k * 2)


@pytest.mark.parametrize("windowed", [False, True])
def test_a_gradient_has_no_source_in_a_sibling_fed_before_it(tmp_path, windowed):
    """The key's incoming gradient comes back through attention's code from ``o`` and from
    ``mix`` (fed what that code made of the key's output), not from ``v``, which was fed what
    the key was (by the outer layer, or by the code itself: the same values): ``v``'s
    grad_input carries none of the key's gradient."""
    from compare.sources import record_sources
    torch.manual_seed(0)
    model, x = torch.nn.Sequential(torch.nn.Linear(4, 4), _Attention(windowed)), torch.randn(3, 4)
    for side in ("a", "b"):
        with HookerAndDumper(tmp_path / side).hooks(model, 0, 0):
            model(x).pow(2).sum().backward()
    rows = compare_dumps(tmp_path / "a", tmp_path / "b").reset_index(drop=True)
    label = [(m, k, i) for m, k, i in zip(rows["module"], rows["kind"], rows["index"])]
    of_key = {label[j] for j in record_sources(rows)[label.index(("1.k", "grad_output", 0))]}
    assert {("1.o", "grad_input", 0), ("1.mix", "grad_input", 0)} <= of_key, of_key
    assert ("1.v", "grad_input", 0) not in of_key, of_key


class _Captioner(torch.nn.Module):
    """A model given labels: its body's hidden states reach its head as a slice (a view, no
    producer: ``logits_to_keep``), and its own code computes the loss from the head's
    logits."""

    def __init__(self):
        super().__init__()
        self.body, self.head = torch.nn.Linear(4, 8), torch.nn.Linear(8, 5)

    def forward(self, x, labels):
        logits = self.head(self.body(x)[:, :])
        return torch.nn.functional.cross_entropy(logits, labels)


def test_the_loss_gives_the_gradient_of_the_head_it_is_computed_from(tmp_path):
    """The gradient arriving at the head's logits is the loss's, computed from them by code no
    dump records; the body's comes from the head, which took its output, not from the loss."""
    from compare.sources import loss_values
    torch.manual_seed(0)
    model, x, labels = _Captioner(), torch.randn(3, 4), torch.tensor([0, 3, 1])
    for side in ("a", "b"):
        with HookerAndDumper(tmp_path / side).hooks(model, 0, 0):
            model(x, labels).backward()
    rows = compare_dumps(tmp_path / "a", tmp_path / "b").reset_index(drop=True)
    label = [(m, k, i) for m, k, i in zip(rows["module"], rows["kind"], rows["index"])]
    given = {label[i]: {label[j] for j in found} for i, found in enumerate(loss_values(rows))
             if label[i][1] == "grad_output"}
    assert given[("head", "grad_output", 0)] == {("head", "output", 0)}, given
    assert given[("body", "grad_output", 0)] == set(), given
    assert given[("", "grad_output", 0)] == {("", "output", 0)}, given


class _Masked(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, mask=None):
        return self.lin(x) * mask


class _Caller(torch.nn.Module):
    """Calls its block with the mask as a keyword or positionally; with ``cut``, its block
    gets an input cut from the graph (no gradient reaches ``first``: a bug)."""

    def __init__(self, keyword: bool, cut: bool = False):
        super().__init__()
        self.first, self.block = torch.nn.Linear(8, 8), _Masked()
        self.keyword, self.cut = keyword, cut

    def forward(self, x):
        h = self.first(x)
        h = h.detach() if self.cut else h
        mask = (x > 0).float()
        return self.block(h, mask=mask) if self.keyword else self.block(h, mask)


def _caller_step(directory, keyword=True, cut=False, mode="tensors"):
    torch.manual_seed(0)
    model = _Caller(keyword, cut)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    with HookerAndDumper(directory, mode=mode).hooks(model, 0, 0):
        model(x).sum().backward()
    return str(directory)


def test_an_argument_positional_in_one_run_and_a_keyword_in_the_other_pairs_in_order(tmp_path):
    """A port that calls block(x, m) where the reference calls block(x, mask=m): the same
    tensors, in order (a review found them left one-sided by the pairing by place)."""
    result = CliRunner().invoke(main, [_caller_step(tmp_path / "a", keyword=True),
                                       _caller_step(tmp_path / "b", keyword=False)])
    assert result.exit_code == 0 and result.stdout.startswith("B agrees with A exactly"), \
        result.output


@pytest.mark.parametrize("mode", ["tensors", "stats", "hash"])
def test_a_gradient_that_never_arrives_is_missing_in_every_mode(tmp_path, mode):
    """Gradients B never computed are missing records, also where the dumps hold statistics
    or digests (a review found them taken for values held in unlike forms)."""
    result = CliRunner().invoke(main, [_caller_step(tmp_path / "a", mode=mode),
                                       _caller_step(tmp_path / "b", cut=True, mode=mode)])
    assert result.exit_code == 1 and "missing_in_b" in result.stdout, result.output
    assert "unlike forms" not in result.output

"""The asynchronous pipeline: bounded memory (wait / drop), statistics mode, and their compare."""
from __future__ import annotations

import math
import os
import threading
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from compare import compare_dumps, load_dump, summarize
from compare import format as fmt
from compare.statistics import stats_of_chunks
from dumper import HookerAndDumper
from dumper import writer as step_writer
from dumper.claim import StepClaim
from dumper.record import ByteBudget, CallInfo, Record
from dumper.run_info import run_attrs
from dumper.snapshot import Snapshot
from dumper.host_memory import tensor_bytes
from dumper.stats import tensor_stats

from helpers import Planted, read_tensors


def _wide_model():
    torch.manual_seed(0)
    # 128 x 512 float32 activations: 256 KiB each, large enough for the pooled snapshot path
    return nn.Sequential(nn.Linear(512, 512), nn.ReLU(inplace=True), nn.Linear(512, 512),
                         nn.Tanh(), nn.Linear(512, 4))


def _dump(directory, model, batch, **kwargs) -> HookerAndDumper:
    dumper = HookerAndDumper(directory, **kwargs)
    with dumper.hooks(model, 0, 0):
        model(batch).pow(2).mean().backward()
    return dumper


def test_one_record_at_a_time_gives_the_same_dump(tmp_path):
    """A 1-byte budget makes every snapshot wait until the previous one is written: the
    synchronous path. Its dump must equal the default asynchronous one, row for row."""
    batch = torch.randn(128, 512)
    _dump(tmp_path / "async", _wide_model(), batch)
    _dump(tmp_path / "sync", _wide_model(), batch, max_bytes_in_flight=1)
    a, b = load_dump(tmp_path / "async").index, load_dump(tmp_path / "sync").index
    pd.testing.assert_frame_equal(a, b)
    ta, tb = read_tensors(tmp_path / "async"), read_tensors(tmp_path / "sync")
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_pooled_snapshots_are_taken_before_in_place_ops(tmp_path):
    model, batch = _wide_model(), torch.randn(128, 512)
    expected = model[0](batch).detach().clone()
    assert expected.numel() * 4 >= 1 << 17 and (expected < 0).any()
    for _ in range(2):  # the second step reuses the pool's buffers
        _dump(tmp_path, model, batch)
        rec = read_tensors(tmp_path)
        assert torch.equal(rec[("0", 0, "output", 0)], expected)
        assert torch.equal(rec[("1", 0, "input", 0)], expected)


def test_backpressure_bounds_bytes_in_flight(tmp_path, monkeypatch):
    peak = []
    acquire = ByteBudget.acquire

    def tracked(self, n):
        acquire(self, n)
        peak.append(self._used)
    monkeypatch.setattr(ByteBudget, "acquire", tracked)
    limit = 600 * 1024  # about two snapshots
    dumper = _dump(tmp_path, _wide_model(), torch.randn(128, 512), max_bytes_in_flight=limit)
    assert peak and max(peak) <= limit  # hooks waited for the writer instead of exceeding it
    index = load_dump(tmp_path).index
    assert (index["status"] == "ok").all() and len(dumper.written_files) == 1
    _dump(tmp_path / "ref", _wide_model(), torch.randn(128, 512))
    assert len(index) == len(load_dump(tmp_path / "ref").index)


def test_core_left_for_writer_follows_torch_threads():
    cores, threads = len(os.sched_getaffinity(0)), torch.get_num_threads()
    try:
        torch.set_num_threads(cores)
        assert not step_writer.core_left_for_writer()
        if cores > 1:
            torch.set_num_threads(cores - 1)
            assert step_writer.core_left_for_writer()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("core_free, device, ahead", [(True, "cpu", True), (False, "cpu", False),
                                                      (False, "cuda", True)])
def test_large_records_are_written_during_the_step_only_when_a_core_is_free(
        tmp_path, monkeypatch, core_free, device, ahead):
    """Past WRITE_AHEAD_BYTES the writer writes while the step runs if torch leaves it a core
    or the tensors come from an accelerator; else it holds them to the step's end."""
    monkeypatch.setattr(step_writer, "core_left_for_writer", lambda: core_free)
    released, first_released = [], threading.Event()

    def release(record):
        released.append(record.seq)
        first_released.set()
    writer = step_writer.StepWriter(StepClaim(tmp_path / fmt.step_file_name(0, 0, 0)),
                                    fmt.step_group_name(0, 0),
                                    run_attrs(nn.Linear(1, 1), 0, 0, "full"), release)
    values = torch.arange(step_writer.WRITE_AHEAD_BYTES // 4 + 1, dtype=torch.float32)
    call = CallInfo(0, "lin", "Linear", 0)
    for seq in range(2):
        writer.submit(Record(seq, call, "output", seq, "output", values.dtype, values.shape,
                             torch.device(device), False, "ok", snapshot=Snapshot(values)))
    assert first_released.wait(60 if ahead else 0.5) == ahead  # written while "the step" runs
    path = writer.finish()
    assert sorted(released) == [0, 1]
    assert len(load_dump(path).index) == 2
    assert torch.equal(read_tensors(path)[("lin", 0, "output", 1)], values)


def test_drop_mode_records_drops_and_compare_reports_them(tmp_path):
    torch.manual_seed(1)
    batch = torch.randn(128, 512)
    _dump(tmp_path / "full", _wide_model(), batch)
    _dump(tmp_path / "dropping", _wide_model(), batch, max_bytes_in_flight=300 * 1024,
          when_full="drop")
    index = load_dump(tmp_path / "dropping").index
    dropped = index[index["status"] == "dropped"]
    assert len(dropped) > 0 and (dropped["dataset"] == "").all()
    assert dropped["value"].str.contains("bytes in flight").all()
    kept = read_tensors(tmp_path / "dropping")
    full = read_tensors(tmp_path / "full")
    assert kept and all(torch.equal(kept[k], full[k]) for k in kept)
    result = compare_dumps(tmp_path / "full", tmp_path / "dropping")
    assert (result["status"] == "dropped").sum() == len(dropped)
    summary = summarize(result)
    assert summary.counts["dropped"] == len(dropped) and not summary.ok
    assert summary.first is None  # a drop is not a divergence


def test_statistics_equal_numpy_references(tmp_path):
    model = Planted()
    batch = torch.randn(64, 6)
    batch[0, 0] = float("nan")  # NaN propagates: counts must say where
    torch.manual_seed(0)
    _dump(tmp_path / "tensors", Planted(), batch)
    torch.manual_seed(0)
    _dump(tmp_path / "stats", Planted(), batch, mode="stats")
    values = read_tensors(tmp_path / "tensors")
    stats = load_dump(tmp_path / "stats").index
    stats = stats[stats["stat_nan"].notna() & (stats["kind"] != "param")]  # weights: see below
    assert len(stats) == len(values) and (stats["dataset"] == "").all()
    for row in stats.itertuples():
        ref = stats_of_chunks([values[(row.module, row.call_idx, row.kind, row.index)]
                               .double().numpy().ravel()])
        got = (row.stat_min, row.stat_max, row.stat_mean, row.stat_std, row.stat_norm,
               row.stat_nan, row.stat_inf, row.stat_zero)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert (stats["stat_nan"] > 0).any()
    del model


def test_weights_are_described_by_statistics_by_default(tmp_path):
    """Without params=True every dumped step still carries statistics of each module's own
    parameters (once per module), so that a comparison can tell drifted weights apart."""
    model = Planted()
    _dump(tmp_path, model, torch.randn(8, 6))
    index = load_dump(tmp_path).index
    params = index[index["kind"] == "param"]
    expected = [(name, p) for name, p in model.named_parameters()]
    assert len(params) == len(expected) and (params["dataset"] == "").all()
    for row, (name, p) in zip(params.itertuples(), expected):
        assert f"{row.module}.{row.path}" == name
        assert row.stat_norm == pytest.approx(p.detach().double().norm().item(), rel=1e-12)


def _planted_tensor(n, dtype, plant):
    torch.manual_seed(1)
    t = (torch.randn(n) * 4).relu_().to(dtype)  # many zeros
    if plant:  # +inf and -inf: their sum is NaN (and a floating-point warning in numpy)
        t[-1], t[n // 3] = float("inf"), float("-inf")
    if plant == "nan":
        t[7] = float("nan")
    return t


@pytest.mark.parametrize("n", [3000, 3 * (1 << 18) + 5], ids=["numpy path", "chunked path"])
@pytest.mark.parametrize("dtype, plant", [
    (dtype, plant) for dtype in (torch.float32, torch.float64, torch.float16)
    for plant in (None, "inf", "nan")] + [(torch.int32, None)])
def test_statistics_of_cpu_tensors_equal_numpy_references(n, dtype, plant):
    """Both CPU paths (numpy for small tensors, chunked torch for large), with NaN/Inf, and no
    floating-point warning reaching the user (inf - inf in a sum is expected)."""
    t = _planted_tensor(n, dtype, plant)
    ref = stats_of_chunks([t.double().numpy()])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = tensor_stats(t)
    assert got[5:] == pytest.approx(ref[5:], abs=0)  # counts exact
    np.testing.assert_allclose(got[:5], ref[:5], rtol=1e-12, equal_nan=True)
    assert ref[7] > 0 and (ref[6] == 2 if plant else ref[5] == ref[6] == 0)


class _Marked(torch.Tensor):
    """A tensor subclass (read as torch sees it, not by address)."""


@pytest.mark.parametrize("view", ["offset", "strided", "transposed", "negative bit", "subclass",
                                  "parameter"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_statistics_of_views_are_those_of_their_elements(view, dtype):
    """Small CPU tensors are read by address: a view is described by its own elements (not
    its storage's), exactly as its contiguous copy is, and a parameter stays resizable."""
    base = torch.randn(40, 30, dtype=dtype)
    t = {"offset": lambda: base[7:], "strided": lambda: base[::3, ::2],
         "transposed": lambda: base.t(), "negative bit": lambda: torch._neg_view(base),
         "subclass": lambda: base.as_subclass(_Marked),
         "parameter": lambda: nn.Parameter(base.clone())}[view]()
    got = tensor_stats(t)
    assert t.untyped_storage().resizable()
    copy = t.detach().clone().as_subclass(torch.Tensor)
    assert got == tensor_stats(copy)
    assert got == pytest.approx(stats_of_chunks([copy.double().reshape(-1).numpy()]), rel=1e-12)


@pytest.mark.parametrize("value", [1e149, 9.99e149, 1e151, 1e300, -1e300, 1e-160, 1e-320])
@pytest.mark.parametrize("n", [3, 1 << 16])
def test_extreme_float64_values_give_no_numpy_warning_or_error(value, n):
    """Squares of float64 values beyond 1e154 overflow (inf, silently: the norm says so) and
    below 1e-154 underflow, whatever numpy error handling the user set."""
    t = torch.full((n,), value, dtype=torch.float64)
    t[1], t[2] = 1.0, -2.0
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        got = tensor_stats(t)
    assert got[:2] == (min(value, -2.0), max(value, 1.0))
    exact = math.sqrt((n - 2) * value ** 2 + 5) if abs(value) < 1e154 else math.inf
    assert got[4] == pytest.approx(exact, rel=1e-12)


def test_float32_statistics_need_no_error_state():
    """The fast path (no numpy error state) is taken for finite float32 values only, whose
    squares in float64 neither overflow nor underflow, with the user's numpy set to raise."""
    finfo = torch.finfo(torch.float32)
    t = torch.tensor([finfo.max, -finfo.max, finfo.smallest_normal, 1.4e-45, 0.0])
    with np.errstate(all="raise"):
        got = tensor_stats(t)
    assert got[:2] == (-finfo.max, finfo.max) and got[4] == pytest.approx(finfo.max * 2 ** 0.5)


@pytest.mark.parametrize("make, in_place", [
    (lambda: torch.randn(6, 5), True), (lambda: nn.Parameter(torch.randn(6)).detach(), True),
    (lambda: torch.randn(6, 5)[2:], True), (lambda: torch.randn(6, 5).t(), False),
    (lambda: torch._neg_view(torch.randn(6)), False),
    (lambda: torch.randn(3).as_subclass(_Marked), False),
    (lambda: torch._efficientzerotensor(4), False), (lambda: torch.empty(0, 3), True)],
    ids=["plain", "parameter", "offset", "transposed", "negative bit", "subclass", "zero tensor",
         "empty"])
def test_which_tensors_are_read_in_place(make, in_place):
    """Read by address: plain contiguous CPU tensors (read-only); the rest through torch."""
    t = make()
    memory = tensor_bytes(t)
    assert (memory is not None) == in_place
    if in_place:
        assert not memory.flags.writeable
        assert memory.tobytes() == t.contiguous().view(torch.uint8).numpy().tobytes() \
            if t.numel() else memory.size == 0


class _EmptySlice(nn.Module):
    """Outputs an empty tensor next to a normal one (e.g. a zero-width head or mask)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return y, y[:, :0] * 2


def test_empty_tensors_have_statistics(tmp_path):
    """An empty tensor has NaN min/max/mean/std, norm 0 and no NaN/Inf/zero: a statistic like
    any other, compared as equal to a tensor dump's empty dataset (not an unreadable tensor)."""
    for dtype in (torch.float32, torch.float64, torch.float16, torch.int64, torch.complex64):
        got = tensor_stats(torch.empty(0, 3, dtype=dtype))
        assert np.isnan(got[:4]).all() and got[4:] == (0.0, 0.0, 0.0, 0.0), dtype
    assert tensor_stats(torch.empty(0)) == pytest.approx(stats_of_chunks([np.empty(0)]),
                                                         nan_ok=True)

    def run(mode):
        torch.manual_seed(0)
        model = _EmptySlice()
        with HookerAndDumper(tmp_path / mode, mode=mode).hooks(model, 0, 0):
            y, empty = model(torch.randn(3, 4))
            (y.sum() + empty.sum()).backward()
    run("tensors")
    run("stats")
    index = load_dump(tmp_path / "stats").index
    empty = index[index["shape"].map(lambda shape: tuple(shape) == (3, 0))]
    assert len(empty) == 2 and (empty["status"] == "ok").all() and (empty["stat_norm"] == 0).all()
    result = compare_dumps(tmp_path / "tensors", tmp_path / "stats")
    assert set(result["status"]) <= {"equal", "close"}, result[["module", "kind", "status"]]


@pytest.mark.parametrize("n", [3000, 3 * (1 << 18) + 5], ids=["numpy path", "chunked path"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("plant", [None, "nan"])
def test_statistics_leave_the_tensor_untouched(n, dtype, plant):
    """Statistics work in scratch buffers and copies (squares are taken in place there): the
    user's tensor keeps its exact bits, NaN, Inf and -0.0 included."""
    t = _planted_tensor(n, dtype, plant)
    t[11] = -0.0
    before = t.clone()
    tensor_stats(t)
    assert torch.equal(torch.nan_to_num(t), torch.nan_to_num(before))
    assert torch.equal(torch.isnan(t), torch.isnan(before))
    assert torch.equal(torch.signbit(t), torch.signbit(before))


def test_mixed_mode_keeps_values_for_selected_modules(tmp_path):
    _dump(tmp_path, Planted(), torch.randn(8, 6), mode="stats", full_tensors=["mid*"])
    index = load_dump(tmp_path).index
    tensors = index[index["index"] >= 0]
    with_values = set(tensors[tensors["dataset"] != ""]["module"])
    assert with_values == {"mid"}
    assert tensors[tensors["module"] != "mid"]["stat_norm"].notna().all()
    assert load_dump(tmp_path).steps[0].attrs["mode"] == "stats"


@pytest.mark.parametrize("b_mode", ["stats", "tensors"])
def test_statistics_compare_finds_the_planted_module(tmp_path, b_mode):
    batch = torch.randn(16, 6)

    def run(name, mode, plant):
        torch.manual_seed(0)
        model = Planted()
        if plant:
            model.mid.register_forward_hook(lambda m, args, out: out * 1.01)
        _dump(tmp_path / name, model, batch, mode=mode)
        return tmp_path / name

    ref = run("ref", "stats", False)
    same = compare_dumps(ref, run("same", b_mode, False))
    assert set(same["status"]) <= {"equal", "close"}
    assert same["stat_rel_diff"].notna().all()
    first = summarize(compare_dumps(ref, run("planted", b_mode, True))).first
    assert (first.row["module"], first.row["kind"]) == ("mid", "output")
    assert first.verdict == "origin"


def test_nan_appearing_is_reported_by_statistics(tmp_path):
    batch = torch.randn(16, 6)
    torch.manual_seed(0)
    _dump(tmp_path / "a", Planted(), batch, mode="stats")
    torch.manual_seed(0)
    model = Planted()
    model.relu.register_forward_hook(lambda m, args, out: out.masked_fill(out > 0.5, float("nan")))
    _dump(tmp_path / "b", model, batch, mode="stats")
    first = summarize(compare_dumps(tmp_path / "a", tmp_path / "b")).first
    assert (first.row["module"], first.row["kind"], first.row["status"]) == \
        ("relu", "output", "nan_mismatch")
    assert first.row["nan_b"] > 0 == first.row["nan_a"]


@pytest.mark.cuda
def test_cuda_snapshots_are_exact_and_asynchronous(tmp_path):
    model = _wide_model().cuda()
    batch = torch.randn(128, 512, device="cuda")
    expected = model[0](batch).detach().cpu()
    for mode in ("tensors", "stats"):
        _dump(tmp_path / mode, model, batch, mode=mode)
    rec = read_tensors(tmp_path / "tensors")
    assert torch.equal(rec[("0", 0, "output", 0)], expected)
    step = load_dump(tmp_path / "tensors").steps[0]
    assert step.index["device"].str.startswith("cuda").all()
    stats = load_dump(tmp_path / "stats").index
    assert stats["stat_norm"].notna().any()
    result = compare_dumps(tmp_path / "stats", tmp_path / "tensors")
    assert set(result["status"]) <= {"equal", "close"}


def test_statistics_of_large_tensors_agree_with_their_values(tmp_path):
    """Above the numpy path's size the statistics come from torch reductions; a statistics dump
    must still compare as close to a tensor dump of the same run."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 2))
    batch = torch.randn(512, 256) * 3 + 1   # 512 x 1024 activations: 2 MiB, the torch path
    for mode in ("tensors", "stats"):
        _dump(tmp_path / mode, model, batch, mode=mode)
        model.zero_grad()
    result = compare_dumps(tmp_path / "tensors", tmp_path / "stats")
    assert set(result["status"]) <= {"equal", "close"}, result[["module", "kind", "status",
                                                                "stat_rel_diff"]]


class _ChangedBetweenCalls(nn.Module):
    """``a``'s output is ``b``'s input as it is, then changed in place by the parent's code
    before ``c`` reads it: a tensor recorded three times at two versions."""

    def __init__(self, width: int):
        super().__init__()
        self.a, self.c = nn.Linear(width, width), nn.Linear(width, width)
        self.b = nn.Tanh()

    def forward(self, x):
        y = self.a(x)
        z = self.b(y)
        y.mul_(-3.0)  # nothing saved y for backward: allowed
        return self.c(y) + z


@pytest.mark.parametrize("width", [64, 256], ids=["host arena", "reduced in the hook"])
@pytest.mark.parametrize("mode", ["stats", "hash"])
def test_a_tensor_recorded_again_at_its_version_is_taken_once(tmp_path, monkeypatch, width,
                                                              mode):
    """Numbers are taken once per tensor and version (dumper.known): ``b``'s input shares
    ``a``'s output's, while ``c``'s input, changed in place since, gets its own, equal to
    the values ``c`` really got."""
    import dumper.record as record_module
    taken = []

    def counting(t, wanted, batch):
        taken.append((t, t._version, wanted))  # kept alive: ids stay unique
        return take(t, wanted, batch)
    take = record_module._take_numbers
    monkeypatch.setattr(record_module, "_take_numbers", counting)
    torch.manual_seed(0)
    model, x = _ChangedBetweenCalls(width), torch.randn(128, width)
    y = model.a(x).detach()
    with HookerAndDumper(tmp_path, mode=mode).hooks(model, 0, 0):
        model(x).square().mean().backward()
    keys = [(id(t), version, wanted) for t, version, wanted in taken]
    assert len(keys) == len(set(keys))  # never twice the same tensor at the same version
    index = load_dump(tmp_path).index
    row = {(r.module, r.kind, r.index): r for r in index.itertuples()}
    numbers = ["digest"] if mode == "hash" else list(fmt.STAT_COLUMNS)
    a_out, b_in, c_in = (row[key] for key in (("a", "output", 0), ("b", "input", 0),
                                              ("c", "input", 0)))
    assert [getattr(b_in, n) for n in numbers] == [getattr(a_out, n) for n in numbers]
    with_numbers = (index["digest"] != fmt.NO_DIGEST) if mode == "hash" else (
        index["stat_norm"].notna())
    assert len(taken) < with_numbers.sum()  # some records shared their numbers
    changed = (y * -3.0).numpy()
    if mode == "hash":
        assert c_in.digest == fmt.data_checksum(changed) != a_out.digest
    else:
        assert (c_in.stat_min, c_in.stat_max) == (changed.min(), changed.max())
        assert c_in.stat_mean == pytest.approx(changed.astype(np.float64).mean(), rel=1e-9)


def test_numbers_shared_after_their_first_record_is_released_are_taken_anew():
    """A record written and released before the same tensor is recorded again (the writer
    ran ahead) has let its arena's buffers go: the later record takes its own numbers."""
    from dumper.arena import StepBatch
    from dumper.known import KnownTensors
    from dumper.snapshot import SnapshotPool
    batch, known = StepBatch(SnapshotPool(1 << 26)), KnownTensors()
    t = torch.randn(32, 64)
    now = known.identify(t, fmt.OUTPUT)
    first = batch.take(t, stats=True)
    known.put_numbers(t, now, first)
    again = known.numbers(t, known.identify(t, fmt.INPUT), ("stats",))
    assert again is not None and again["stats"] is not first["stats"]
    assert known.numbers(t, now, ("stats", "digest")) is None  # a digest was not taken
    assert known.identify(t, fmt.PARAM) is None  # parameters are never shared
    batch.seal()
    assert again["stats"].wait() == first["stats"].wait()
    first["stats"].release()
    assert known.numbers(t, now, ("stats",)) is None
    again["stats"].release()


def _unscale_in_place(t: torch.Tensor) -> None:
    """GradScaler's in-place unscaling: a write autograd's version counter does not see."""
    torch._amp_foreach_non_finite_check_and_unscale_([t], torch.zeros(1), torch.full((1,), 0.5))


@pytest.mark.parametrize("write", [
    _unscale_in_place,
    lambda t: t.data.mul_(0.5),
    lambda t: setattr(t, "data", torch.full((t.shape[0] // 2, t.shape[1]), 0.25)),
], ids=["foreach unscale", ".data in place", ".data replaced"])
@pytest.mark.parametrize("mode", ["tensors", "stats"])
def test_a_write_autograd_does_not_see_is_taken_anew(tmp_path, write, mode):
    """Between two records of one tensor, a write that leaves its version as it was (the
    in-place ops GradScaler and collectives use, ``.data``) must not make the later record
    repeat the earlier values: the later record holds the values its module really got."""

    class WrittenBetweenCalls(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(64, 64), nn.Tanh(), nn.Tanh()

        def forward(self, x):
            with torch.no_grad():
                y = self.a(x)
            z = self.b(y)
            version = y._version
            write(y)
            assert y._version == version  # what this test is about
            return self.c(y), z

    torch.manual_seed(0)
    model, x = WrittenBetweenCalls(), torch.randn(32, 64)
    with HookerAndDumper(tmp_path, mode=mode).hooks(model, 0, 0):
        _, z = model(x)
    with torch.no_grad():
        y = model.a(x)
    write(y)
    index = load_dump(tmp_path).index
    row = {(r.module, r.kind, r.index): r for r in index.itertuples()}
    if mode == "tensors":
        values = read_tensors(tmp_path)
        assert torch.equal(values["b", 0, "input", 0], model.a(x).detach())
        assert torch.equal(values["c", 0, "input", 0], y)
    else:
        c_in = row["c", "input", 0]
        assert (c_in.stat_min, c_in.stat_max) == (y.min().item(), y.max().item())
        assert c_in.stat_norm != row["b", "input", 0].stat_norm


def test_values_of_a_tensor_recorded_again_are_stored_once_and_linked(tmp_path):
    """Full tensors: ``b``'s input is ``a``'s output's dataset under a second name (a hard
    link: one HDF5 object), ``c``'s input, changed in place since, a dataset of its own;
    every record reads back as the values its module got, and compares as before."""
    import h5py
    torch.manual_seed(0)
    model, x = _ChangedBetweenCalls(256), torch.randn(128, 256)
    y = model.a(x).detach()
    for run in ("a", "b"):
        with HookerAndDumper(tmp_path / run).hooks(model, 0, 0):
            model(x).square().mean().backward()
    index = load_dump(tmp_path / "a").index
    row = {(r.module, r.kind, r.index): r for r in index.itertuples()}
    path = {key: f"{r.group}/{r.dataset}" for key, r in row.items() if r.dataset}
    [file_path] = (tmp_path / "a").glob("*.hdf5")
    with h5py.File(file_path) as f:
        step = f[next(iter(f.keys() - {fmt.DTYPES_GROUP}))]
        assert step[path["b", "input", 0]] == step[path["a", "output", 0]]
        assert step[path["c", "input", 0]] != step[path["a", "output", 0]]
        assert step[path["a", "input", 0]] == step[path["", "input", 0]]
    values = read_tensors(tmp_path / "a")
    assert torch.equal(values["b", 0, "input", 0], y)
    assert torch.equal(values["c", 0, "input", 0], y * -3.0)
    assert row["b", "input", 0].checksum == row["a", "output", 0].checksum
    result = compare_dumps(tmp_path / "a", tmp_path / "b")
    assert len(result) == len(index) and (result["status"] == "equal").all()


@pytest.mark.parametrize("mode", ["tensors", "stats"])
def test_parameter_gradients_unscaled_in_place_are_recorded_as_stepped_with(tmp_path, mode):
    """GradScaler unscales ``p.grad`` in place without a version bump, between the gradient's
    accumulation and the optimizer step: the record holds the unscaled gradient the optimizer
    steps with (parameters and their gradients are never shared, dumper.known)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    stepped = {}
    opt.register_step_pre_hook(lambda o, a, k: stepped.update(
        {name: p.grad.clone() for name, p in model.named_parameters()}))
    with HookerAndDumper(tmp_path, params=True, mode=mode).hooks(model, 0, 0):
        scaler.scale(model(torch.randn(8, 16)).square().mean()).backward()
        scaler.step(opt)
        scaler.update()
    index = load_dump(tmp_path).index
    grads = index[index["kind"] == fmt.PARAM_GRAD]
    assert len(grads) == len(stepped) == 4
    values = read_tensors(tmp_path) if mode == "tensors" else {}
    for row in grads.itertuples():
        want = stepped[f"{row.module}.{row.path}"]
        if mode == "tensors":
            assert torch.equal(values[row.module, row.call_idx, row.kind, row.index], want)
        else:
            assert row.stat_norm == pytest.approx(want.double().norm().item(), rel=1e-12)


def test_values_shared_by_two_records_count_in_the_budget_until_both_are_written():
    """The byte budget bounds the snapshots held: a snapshot two records share counts once,
    until the last of them lets it go, whichever is written first."""
    from dumper.arena import StepBatch
    from dumper.record import RecordMaker
    from dumper.snapshot import SnapshotPool
    t = torch.randn(256, 256)  # 256 KiB: a pooled snapshot
    nbytes = t.numel() * t.element_size()
    for first_out in (True, False):
        budget = ByteBudget(nbytes)
        maker = RecordMaker(SnapshotPool(1 << 26), budget, drop_when_full=True)
        maker.batch = StepBatch(SnapshotPool(1 << 26))
        call = CallInfo(0, "m", "Linear", 0)
        first = maker.tensor(0, call, fmt.OUTPUT, 0, "", t)
        second = maker.tensor(1, CallInfo(1, "n", "Linear", 0), fmt.INPUT, 0, "", t)
        assert second.status == fmt.ST_OK and second.nbytes == 0  # shared, not dropped
        assert torch.equal(second.snapshot.wait(), t)
        maker.release(first if first_out else second)
        assert not budget.try_acquire(1)  # still held by the other record
        assert torch.equal((second if first_out else first).snapshot.wait(), t)
        maker.release(second if first_out else first)
        assert budget.try_acquire(nbytes)

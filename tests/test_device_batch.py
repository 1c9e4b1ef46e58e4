"""Records taken on the device and read once per step (dumper.arena), forced here on CPU tensors:
the same values, statistics, sketches and digests as the host path, one seal and one host sync
per step, however the arenas and tables fill and whoever seals them first."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from compare import compare_dumps
from compare import format as fmt
from compare.dump import load_dump
from dumper import HookerAndDumper
from dumper import arena, hooker, record, stores

from helpers import read_tensors


class Mixed(nn.Module):
    """Token ids in, a mask, bfloat16 and float16 parts, a complex output, and one activation
    larger than an arena slot (``arena.SMALL_BYTES``)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.wide = nn.Linear(16, 4096)
        self.low = nn.Linear(4096, 8).to(torch.bfloat16)
        self.norm = nn.LayerNorm(8)

    def forward(self, ids):
        h = torch.relu(self.wide(self.embed(ids)))   # 32 x 4096 floats: a large tensor
        h = self.low(h.to(torch.bfloat16)).float()
        return self.norm(h * (ids[..., None] > 3))


class Spectrum(nn.Module):
    def forward(self, x):
        return torch.fft.rfft(x, dim=-1), x.half()


def _run(directory, mode: str, steps: int = 2, **options) -> list:
    """Train ``Mixed`` (then ``Spectrum`` on its output) for ``steps`` steps; the step batches."""
    torch.manual_seed(0)
    model, spectrum = Mixed(), Spectrum()
    both = nn.ModuleDict({"mixed": model, "spectrum": spectrum})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dumper = HookerAndDumper(directory, mode=mode, **options)
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        ids = torch.randint(0, 50, (4, 8), generator=gen)
        with dumper.hooks(both, 0, step):
            out = model(ids)
            spec, half = spectrum(out)
            (out.pow(2).mean() + spec.abs().mean() + half.float().mean()).backward()
        opt.step()
        opt.zero_grad()
    dumper.close()
    return dumper


class DevicePath(list):
    """Takes every CPU tensor as an accelerator's once :meth:`on`; lists the step batches."""

    def __init__(self, monkeypatch):
        super().__init__()
        self._monkeypatch = monkeypatch

    def on(self) -> None:
        batches = self

        class Counted(arena.StepBatch):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                batches.append(self)
        self._monkeypatch.setattr(hooker, "StepBatch", Counted)
        self._monkeypatch.setattr(record, "on_device", lambda t: True)


@pytest.fixture
def device_path(monkeypatch):
    return DevicePath(monkeypatch)


@pytest.mark.parametrize("mode", ["tensors", "stats", "hash"])
def test_the_device_path_records_what_the_host_path_does(tmp_path, device_path, mode):
    _run(tmp_path / "host-path", mode)
    device_path.on()
    _run(tmp_path / "device-path", mode)
    assert len(device_path) == 2
    for batch in device_path:  # one seal and one host sync per step, at its end
        assert (batch.seals, batch.host_syncs) == (1, 1)
    _assert_same_records(tmp_path / "host-path", tmp_path / "device-path", mode)


def _assert_same_records(host_dir, device_dir, mode: str) -> None:
    host, device = load_dump(host_dir).index, load_dump(device_dir).index
    keys = ["step", "module", "call_idx", "kind", "index", "occurrence"]
    host, device = host.sort_values(keys).reset_index(), device.sort_values(keys).reset_index()
    assert len(host) == len(device) > 40
    assert (host[keys + ["dtype", "shape", "status"]] == device[keys + ["dtype", "shape",
                                                                        "status"]]).all().all()
    assert set(host["dtype"]) >= {"float32", "bfloat16", "float16", "complex64", "int64"}
    assert (host["status"] == fmt.ST_OK).all() and (device["status"] == fmt.ST_OK).all()
    if mode == "tensors":
        a, b = read_tensors(host_dir / fmt.step_file_name(0, 1)), read_tensors(
            device_dir / fmt.step_file_name(0, 1))
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    # digests (hash mode, and every mode's parameters)
    assert (host["digest"] == device["digest"]).all() and (host["digest"] >= 0).sum() > 10
    if mode == "hash":
        assert (compare_dumps(host_dir, device_dir)["status"] == "equal").all()
        return
    # statistics (stats mode, and the other modes' parameter statistics) and sketches
    rows = host["stat_norm"].notna()
    assert rows.sum() > 10 and (device["stat_norm"].notna() == rows).all()
    for column in fmt.STAT_COLUMNS + fmt.SKETCH_COLUMNS:
        a, b = host.loc[rows, column].to_numpy(), device.loc[rows, column].to_numpy()
        exact = column in ("stat_min", "stat_max", "stat_nan", "stat_inf", "stat_zero")
        np.testing.assert_allclose(b, a, rtol=0 if exact else 1e-12, atol=0 if exact else 1e-9,
                                   equal_nan=True, err_msg=column)


def test_full_arenas_and_tables_keep_one_sync_for_numbers_and_seal_values(tmp_path, device_path, monkeypatch):
    _run(tmp_path / "host-path", "stats")
    _run(tmp_path / "host-path-tensors", "tensors")
    device_path.on()
    monkeypatch.setattr(stores, "ARENA_BYTES", 4096)
    monkeypatch.setattr(stores, "TABLE_ROWS", 2)
    _run(tmp_path / "device-path", "stats")
    # numbers only: full arenas and tables are reduced at once and sent with the step's seal
    assert all((batch.seals, batch.host_syncs) == (1, 1) for batch in device_path)
    _assert_same_records(tmp_path / "host-path", tmp_path / "device-path", "stats")
    _run(tmp_path / "device-path-tensors", "tensors")  # values: a full arena is sealed
    assert all(batch.seals > 2 and batch.host_syncs == batch.seals
               for batch in device_path[2:]), [b.seals for b in device_path]
    _assert_same_records(tmp_path / "host-path-tensors", tmp_path / "device-path-tensors",
                         "tensors")


def test_the_writer_seals_what_it_needs_before_the_step_ends(tmp_path, device_path):
    """A byte budget of a few small tensors: producers wait for the writer, which writes the
    records so far, sealing their arena; the values are the host path's."""
    _run(tmp_path / "host-path", "tensors")
    device_path.on()
    _run(tmp_path / "device-path", "tensors", max_bytes_in_flight=4096)
    assert all(batch.seals > 3 for batch in device_path)
    _assert_same_records(tmp_path / "host-path", tmp_path / "device-path", "tensors")


@pytest.mark.parametrize("path", ["device", "host"])
def test_nan_and_inf_are_counted_on_both_paths(tmp_path, device_path, path):
    if path == "device":
        device_path.on()
    model = nn.Linear(4, 4)
    dumper = HookerAndDumper(tmp_path, mode="stats", kinds=["input"])
    x = torch.tensor([[1.0, math.nan, -math.inf, 0.0]] * 3)
    with dumper.hooks(model, 0, 0):
        model(x)
    row = load_dump(tmp_path).index.iloc[0]
    assert math.isnan(row["stat_min"]) and math.isnan(row["stat_max"])
    assert (row["stat_nan"], row["stat_inf"], row["stat_zero"]) == (3, 3, 3)


def test_a_host_arena_gives_the_numbers_of_the_per_tensor_path(monkeypatch):
    """Small CPU float tensors whose numbers alone are wanted go into host arenas (numpy's
    segmented reductions at the seal): the statistics, sketches and digests each tensor's own
    reductions give (the float64 sums to rounding), whatever their layout, values, sizes, and
    however the arenas fill and their chunks fall."""
    from dumper.digest import tensor_digest
    from dumper.snapshot import SnapshotPool
    from dumper.stats import tensor_sketch, tensor_stats
    monkeypatch.setattr(stores, "ARENA_BYTES", 1 << 17)  # arenas fill, and are reduced then
    monkeypatch.setattr(stores, "HOST_CHUNK", 1000)      # chunks end within and between slots
    gen = torch.Generator().manual_seed(0)
    odd = torch.randn(6, generator=gen)
    odd[1], odd[2], odd[4] = math.nan, math.inf, 0.0
    tensors = [torch.randn(7, generator=gen), torch.randn(3, 5, generator=gen).t(),
               torch.randn(64, dtype=torch.float64, generator=gen), odd, torch.zeros(10),
               torch.full((3,), -math.inf), torch.randn(1, generator=gen),
               torch._neg_view(torch.randn(9, generator=gen)),
               torch.randn(stores.HOST_SMALL, generator=gen) * 1e30]
    tensors += [torch.randn(int(n), generator=gen) - 0.5 for n in
                torch.randint(1, 3000, (60,), generator=gen)]
    batch = arena.StepBatch(SnapshotPool(1 << 26))
    taken = [batch.take(t, stats=True, sketch=i % 2 == 0, digest=i % 3 == 0)
             for i, t in enumerate(tensors)]
    assert all(arena.on_host_arena(t) for t in tensors)
    batch.seal()
    for i, (t, got) in enumerate(zip(tensors, taken)):
        stats, want = got["stats"].wait(), tensor_stats(t)
        exact = [fmt.STAT_COLUMNS.index(c) for c in ("stat_min", "stat_max", "stat_nan",
                                                       "stat_inf", "stat_zero")]
        assert [stats[k] for k in exact] == pytest.approx([want[k] for k in exact], nan_ok=True,
                                                          rel=0, abs=0), i
        np.testing.assert_allclose(stats, want, rtol=1e-12, equal_nan=True, err_msg=str(i))
        if i % 2 == 0:
            np.testing.assert_allclose(got["sketch"].wait(), tensor_sketch(t), rtol=1e-12,
                                       atol=1e-300, equal_nan=True, err_msg=str(i))
        if i % 3 == 0:
            assert got["digest"].wait() == tensor_digest(t), i
        for pending in got.values():
            pending.release()


def test_a_host_arena_released_before_its_seal_takes_no_more():
    """Records released before the seal (a step aborted, a writer failed): the arena's buffer
    goes back to the pool at once, later tensors go into a new arena, nothing is written into
    the buffer given back, and every buffer is back once all is released."""
    from dumper.snapshot import SnapshotPool
    from dumper.stats import tensor_stats
    pool = SnapshotPool(1 << 26)
    batch = arena.StepBatch(pool)
    early = [batch.take(torch.randn(10), stats=True)["stats"] for _ in range(2)]
    for pending in early:
        pending.release()
    assert pool._in_use == 0
    late = torch.randn(10)
    pending = batch.take(late, stats=True)["stats"]
    batch.seal()
    assert pending.wait() == pytest.approx(tensor_stats(late), rel=1e-12, nan_ok=True)
    pending.release()
    assert pool._in_use == 0


def test_an_aborted_step_gives_its_host_arena_back(tmp_path):
    """A step abandoned mid-forward (abort_step) leaves no pool memory counted as in use: the
    writer releases the records it held, and with the last of them the open host arena gives
    its buffer back, unsealed."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    d = HookerAndDumper(tmp_path, mode="stats")
    d.register_hooks(model, 0, 0)
    model(torch.randn(3, 4))
    assert d._pool._in_use > 0  # the open arena's buffer
    d.abort_step()
    assert d._pool._in_use == 0 and not list(tmp_path.glob("*.hdf5"))
    d.close()

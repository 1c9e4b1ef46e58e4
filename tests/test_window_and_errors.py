"""Window semantics, bad input, write errors."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from compare import format as fmt
from dumper import DumpWriteError, HookerAndDumper, every


def _run(dumper, model, epochs=2, steps=5):
    active = []
    for epoch in range(epochs):
        for step in range(steps):
            if dumper.register_hooks(model, epoch, step):
                active.append((epoch, step))
            model(torch.randn(2, 3)).sum().backward()
            dumper.remove_hooks()
    return active


@pytest.mark.parametrize("epochs, steps, expected", [
    ([0], range(3, 5), [(0, 3), (0, 4)]),
    (1, 2, [(1, 2)]),
    (None, {0, 4}, [(0, 0), (0, 4), (1, 0), (1, 4)]),
    (None, every(2, start=1), [(0, 1), (0, 3), (1, 1), (1, 3)]),
    (every(2), (s for s in [1]), [(0, 1)]),
])
def test_window_selects_exactly_its_steps(tmp_path, epochs, steps, expected):
    model = nn.Linear(3, 1)
    dumper = HookerAndDumper(tmp_path, epochs=epochs, steps=steps)
    assert _run(dumper, model) == expected
    names = sorted(os.listdir(tmp_path))
    assert names == sorted(fmt.step_file_name(e, s) for e, s in expected)


def test_outside_window_installs_nothing_and_touches_no_file(tmp_path):
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    dumper = HookerAndDumper(tmp_path, steps=[10])
    assert dumper.register_hooks(model, 0, 0) is False
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    assert dumper.remove_hooks() is None
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("kwargs, error, match", [
    ({"steps": [-1]}, ValueError, "negative"),
    ({"steps": range(-2, 3)}, ValueError, "negative"),
    ({"epochs": "all"}, TypeError, "epochs must be"),
    ({"steps": [1.5]}, TypeError, "ints"),
    ({"kinds": ["gradient"]}, ValueError, "unknown kinds"),
    ({"on_error": "ignore"}, ValueError, "on_error"),
    ({"max_bytes_in_flight": 0}, ValueError, "positive"),
    ({"ops": 123}, TypeError, r"ops takes module globs \(str\) or a list of them"),
    ({"include": ["layer1.*", 2]}, TypeError, "include takes module globs"),
])
def test_bad_constructor_arguments(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        HookerAndDumper(tmp_path, **kwargs)


def test_globs_that_match_no_module_are_named_once(tmp_path):
    """A typo in include= (or ops=, full_tensors=) records nothing, or less than asked: the
    first dumped step says which glob matched nothing, and the model's module names."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
    dumper = HookerAndDumper(tmp_path, include=["lyer*"], ops=["0", "attn*"])
    with pytest.warns(RuntimeWarning) as caught:
        for step in range(2):
            with dumper.hooks(model, 0, step):
                model(torch.randn(2, 3))
    said = [str(w.message) for w in caught]
    assert said.count("h5cmp: include='lyer*', ops='attn*' match no module of the model (its "
                      "modules are named like '0', '1'; globs match a module's path or "
                      "path.Class)") == 1
    assert ("h5cmp: no module call was recorded in 0-epoch_0-step_dump.hdf5: no module of the "
            "model is selected (include=, exclude=, module_types=)") in said


def test_bad_file_paths(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        HookerAndDumper(a_file)
    if os.geteuid() != 0:  # root can write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(PermissionError, match="not writable"):
            HookerAndDumper(locked)
    with pytest.raises(PermissionError, match="cannot create"):
        HookerAndDumper(a_file / "sub")
    with pytest.raises(TypeError, match="file_path"):
        HookerAndDumper(3)


def test_bad_register_calls(tmp_path):
    dumper = HookerAndDumper(tmp_path)
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        dumper.register_hooks(lambda x: x, 0, 0)
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        dumper.register_hooks(model, 0, -1)
    with pytest.raises(ValueError, match="epoch must be a non-negative int"):
        dumper.register_hooks(model, True, 0)
    dumper.register_hooks(model, 0, 0)
    with pytest.raises(RuntimeError, match="twice without remove_hooks"):
        dumper.register_hooks(model, 0, 1)
    with pytest.warns(RuntimeWarning, match="no module call was recorded in 0-epoch_0-step"):
        dumper.remove_hooks()  # the model never ran: said, and the (empty) step is published
    dumper.register_hooks(model, 0, 1)  # usable again
    model(torch.randn(1, 2))
    dumper.remove_hooks()
    assert [p.name for p in dumper.written_files] == ["0-epoch_0-step_dump.hdf5",
                                                      "0-epoch_1-step_dump.hdf5"]


def test_context_manager_discards_a_failed_step(tmp_path):
    dumper = HookerAndDumper(tmp_path)
    model = nn.Linear(2, 2)
    with dumper.hooks(model, 0, 0):
        model(torch.randn(1, 2)).sum().backward()
    with pytest.raises(ZeroDivisionError):
        with dumper.hooks(model, 0, 1):
            model(torch.randn(1, 2))
            1 / 0
    assert os.listdir(tmp_path) == [fmt.step_file_name(0, 0)]
    assert all(not m._forward_hooks for m in model.modules())


def _fail_writes(monkeypatch):
    from dumper import writer

    def broken(self, *args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(writer.LowLevelGroup, "write", broken)


def test_write_error_raises_at_step_end_and_keeps_earlier_steps(tmp_path, monkeypatch):
    dumper = HookerAndDumper(tmp_path)
    model = nn.Linear(2, 2)
    with dumper.hooks(model, 0, 0):
        model(torch.randn(1, 2)).sum().backward()
    _fail_writes(monkeypatch)
    dumper.register_hooks(model, 0, 1)
    model(torch.randn(1, 2)).sum().backward()  # training itself is not interrupted
    with pytest.raises(DumpWriteError, match="No space left on device.*earlier steps are intact"):
        dumper.remove_hooks()
    assert os.listdir(tmp_path) == [fmt.step_file_name(0, 0)]  # no temporary file left behind
    assert all(not m._forward_hooks for m in model.modules())


def test_write_error_can_warn_and_continue(tmp_path, monkeypatch):
    dumper = HookerAndDumper(tmp_path, on_error="warn")
    model = nn.Linear(2, 2)
    _fail_writes(monkeypatch)
    dumper.register_hooks(model, 0, 0)
    model(torch.randn(1, 2)).sum().backward()
    with pytest.warns(RuntimeWarning, match="No space left"):
        assert dumper.remove_hooks() is None
    monkeypatch.undo()
    with dumper.hooks(model, 0, 1):
        model(torch.randn(1, 2)).sum().backward()
    assert os.listdir(tmp_path) == [fmt.step_file_name(0, 1)]


def test_distributed_rank_is_in_the_file_name(tmp_path):
    import torch.distributed as dist
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        dumper = HookerAndDumper(tmp_path / "dumps")
        model = nn.Linear(2, 2)
        with dumper.hooks(model, 1, 2):
            model(torch.randn(1, 2)).sum().backward()
    finally:
        dist.destroy_process_group()
    assert os.listdir(tmp_path / "dumps") == [fmt.step_file_name(1, 2, rank=0)]
    from compare.dump import load_dump
    step = load_dump(tmp_path / "dumps").steps[0]
    assert step.rank == 0 and step.attrs["world_size"] == 1
    assert fmt.parse_step_file_name(fmt.step_file_name(1, 2, rank=0)) == (1, 2, 0)


def test_hdf5_types_keep_string_encodings_apart():
    """The writer's shared HDF5 type cache must not hand a UTF-8 string type to an ASCII
    array of the same width (numpy's dtype equality ignores h5py's encoding mark)."""
    import h5py
    import numpy as np
    from h5py import h5t

    from dumper.hdf5 import _hdf5_type
    utf8, ascii_ = h5py.string_dtype("utf-8", 10), np.dtype("S10")
    assert utf8 == ascii_  # why the key needs more than the dtype
    assert _hdf5_type(utf8).get_cset() == h5t.CSET_UTF8
    assert _hdf5_type(ascii_).get_cset() == h5t.CSET_ASCII
    table = np.dtype([("name", utf8), ("n", "i8")])
    assert _hdf5_type(table) is _hdf5_type(np.dtype([("name", utf8), ("n", "i8")]))
    member = _hdf5_type(np.dtype([("name", ascii_), ("n", "i8")])).get_member_type(0)
    assert member.get_cset() == h5t.CSET_ASCII

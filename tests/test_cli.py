"""The h5cmp command: exit codes, output formats, listing, and every bad-input case."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import h5py
import pytest
from click.testing import CliRunner

from compare import compare_dumps
from compare import format as fmt
from compare.cli import main

from helpers import dump_run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    return {"ref": dump_run(root / "ref"), "same": dump_run(root / "same"),
            "fwd": dump_run(root / "fwd", plant="forward")}


def h5cmp(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_exit_codes(runs):
    same = h5cmp(runs["ref"], runs["same"])
    assert same.exit_code == 0, same.output
    assert same.output.startswith("B agrees with A exactly")
    diff = h5cmp(runs["ref"], runs["fwd"])
    assert diff.exit_code == 1
    assert "first divergence: step 0:0, forward, module mid (Linear) call 0, output[0]" in diff.output
    assert "the error starts in this module" in diff.output
    assert h5cmp(runs["ref"], runs["fwd"], "-q").output == ""
    assert h5cmp(runs["ref"], runs["fwd"], "--rtol", "0.1", "--atol", "0.1").exit_code == 0


def test_verdict_on_top_then_failing_rows_then_all(runs):
    out = h5cmp(runs["ref"], runs["fwd"], "--top", "1").output
    lines = out.splitlines()
    assert lines[0].startswith("B diverges from A: first at step 0:0 forward in mid (output[0])")
    # mid's output and, scaled by the hook as well, the gradient it sends back and its bias's
    # gradient (1e-3 off the sum of the gradient its output got), in each step
    table = lines.index("failing rows, worst added error first (first 1 of 6; --top N for more):")
    assert "mid.Linear#0" in lines[table + 2] and "DIFF" in lines[table + 2]
    in_order = h5cmp(runs["ref"], runs["fwd"], "--order", "execution").output
    assert "failing rows in execution order:" in in_order
    every = h5cmp(runs["ref"], runs["fwd"], "--all").output
    assert "all rows in execution order:" in every  # every row: no "first N of"
    assert "equal" in every and "inp.Linear#0" in every and "inherited" in every
    assert len(every.split("all rows in execution order:\n")[1].splitlines()) == 1 + len(
        compare_dumps(runs["ref"], runs["fwd"]))
    assert "(first 3 of" in h5cmp(runs["ref"], runs["fwd"], "--all", "--top", "3").output


def test_filters_step_module_kind(runs):
    out = h5cmp(runs["ref"], runs["fwd"], "--step", "0:1", "--module", "out*", "--kind",
                "grad_output", "--all").output
    summary, table = out.split("\n\n")
    # the verdict is the step's, whatever is shown: the weights already differ (step 0, not
    # compared here, trained them differently), and mid still adds an error of its own
    assert "first divergence: step 0:1, forward, module inp (Linear)" in summary
    assert "step 0:1 forward  mid.Linear#0 output[0]" in summary
    assert "out.Linear#0 grad_output[0]" in table and "mid" not in table and "0:0" not in table


@pytest.mark.parametrize("ext", ["csv", "json", "html", "xlsx"])
def test_output_formats(runs, tmp_path, ext):
    target = tmp_path / f"report.{ext}"
    result = h5cmp(runs["ref"], runs["fwd"], "-q", "-o", target)
    assert result.exit_code == 1 and target.stat().st_size > 0
    if ext == "csv":
        import pandas as pd
        frame = pd.read_csv(target)
        assert {"module", "kind", "status", "max_abs_err", "rel_l2_err"} <= set(frame.columns)
        assert (frame["status"] == "DIFF").any()
    elif ext == "json":
        payload = json.loads(target.read_text())
        assert payload["summary"]["first_divergence"].startswith("first divergence")
        assert payload["rows"][0]["status"] == "equal"
    elif ext == "html":
        text = target.read_text()
        assert text.startswith("<!DOCTYPE html>") and "<table" in text and "first divergence" in text
    else:
        import openpyxl
        sheet = openpyxl.load_workbook(target).active
        assert sheet.max_row > 10


def test_plot(runs, tmp_path):
    pytest.importorskip("matplotlib")
    target = tmp_path / "errors.png"
    assert h5cmp(runs["ref"], runs["fwd"], "-q", "--plot", target).exit_code == 1
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_listing_one_dump(runs):
    result = h5cmp(runs["ref"])
    assert result.exit_code == 0
    assert "0-epoch_0-step_dump.hdf5" in result.output and "0002_act.Tanh" in result.output
    assert "grad_input_0" in result.output


def test_jobs_option(runs):
    assert h5cmp(runs["ref"], runs["fwd"], "--jobs", "2").exit_code == 1


def test_steps_only_one_run_dumped_are_named_and_left_out(runs, tmp_path):
    """A run dumped in more steps than the other (A every step, B the suspect one): the shared
    steps get the verdict; the others are named, not counted as missing records."""
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(runs["ref"] / fmt.step_file_name(0, 1), partial)
    result = CliRunner().invoke(main, [str(runs["ref"]), str(partial)])
    assert result.exit_code == 0, result.output
    assert "h5cmp: A's step 0:0 is not compared: B recorded no tensor in it" in result.stderr
    assert "missing" not in result.output
    shutil.copy(runs["fwd"] / fmt.step_file_name(0, 1), partial)  # B's step 0:1 goes wrong
    result = CliRunner().invoke(main, [str(runs["ref"]), str(partial)])
    assert result.exit_code == 1 and "first divergence: step 0:1" in result.output
    asked = CliRunner().invoke(main, [str(runs["ref"]), str(partial), "--step", "1"])
    assert "not compared" not in asked.stderr
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(runs["ref"] / fmt.step_file_name(0, 0), other)
    apart = CliRunner().invoke(main, [str(other), str(partial)])
    assert apart.exit_code == 2 and "the dumps share no step" in apart.output, apart.output


def test_console_script_starts_without_torch():
    code = ("import sys; from compare.cli import main\n"
            "try: main(['--help'])\nexcept SystemExit: pass\n"
            "assert 'torch' not in sys.modules and 'pandas' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_a_reader_that_closes_the_output_early_ends_it_quietly(runs):
    """``h5cmp A B | head``: the output's reader is gone; h5cmp stops with 141, as a shell
    reports a tool SIGPIPE ended, and says nothing (it was an internal error, exit 2)."""
    read, write = os.pipe()
    os.close(read)
    code = "import sys; from compare.cli import main; main(sys.argv[1:])"
    done = subprocess.run([sys.executable, "-c", code, str(runs["ref"]), str(runs["fwd"]),
                           "--all"], stdout=write, stderr=subprocess.PIPE, text=True,
                          timeout=120)
    os.close(write)
    assert done.returncode == 141 and done.stderr == "", done.stderr


# ---- bad input: one line on stderr naming the file, exit 2, no traceback --------------------
def _bad(*args, match: str):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("h5cmp: error: "), result.output
    assert match in result.output, result.output
    return result


def test_missing_path(runs, tmp_path):
    _bad(tmp_path / "nope", runs["ref"], match="nope: no such file or directory")


def test_directory_without_dumps(runs, tmp_path):
    _bad(tmp_path, runs["ref"], match="holds no dump step files")


def test_not_hdf5(runs, tmp_path):
    bogus = tmp_path / "x.hdf5"
    bogus.write_text("hello")
    _bad(bogus, runs["ref"], match="x.hdf5: not an HDF5 file")


def test_truncated_hdf5(runs, tmp_path):
    src = runs["ref"] / fmt.step_file_name(0, 0)
    cut = tmp_path / fmt.step_file_name(0, 0)
    cut.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    _bad(cut, src, match=str(cut))


def test_hdf5_that_is_not_a_dump(runs, tmp_path):
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["x"] = [1, 2, 3]
    _bad(other, runs["ref"], match="is not an h5cmp dump")


def test_unknown_format_version(runs, tmp_path):
    future = tmp_path / fmt.step_file_name(0, 0)
    shutil.copy(runs["ref"] / fmt.step_file_name(0, 0), future)
    with h5py.File(future, "a") as f:
        f.attrs[fmt.ATTR_FORMAT_VERSION] = 99
    _bad(future, runs["ref"], match="format version 99 is not supported")


def test_same_file_twice(runs):
    path = runs["ref"] / fmt.step_file_name(0, 0)
    _bad(path, path, match="same file is on both sides")


def test_unreadable_file(runs, tmp_path, monkeypatch):
    locked = tmp_path / fmt.step_file_name(0, 0)
    shutil.copy(runs["ref"] / fmt.step_file_name(0, 0), locked)
    os.chmod(locked, 0)
    if os.geteuid() == 0:  # root reads anything: make the access check say what it would say
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(locked) else real(p, mode))
    _bad(locked, runs["ref"], match="permission denied")


def test_file_still_being_written(runs, tmp_path):
    temp = tmp_path / fmt.temp_file_name(fmt.step_file_name(0, 0), 123)
    shutil.copy(runs["ref"] / fmt.step_file_name(0, 0), temp)
    _bad(temp, runs["ref"], match="still being written")


def test_unknown_output_format(runs, tmp_path):
    _bad(runs["ref"], runs["fwd"], "-o", tmp_path / "r.txt", match="unknown output format .txt")


def test_unsupported_tensors_are_reported_but_do_not_fail_the_compare(tmp_path):
    """A tensor the dumper cannot store (here a sparse kwarg) pairs as `unsupported`: counted
    and listed with --all, not a failure (exit 0), in tensors-vs-tensors and vs statistics."""
    import torch
    from torch import nn

    from dumper import HookerAndDumper

    class Scale(nn.Module):
        def forward(self, x, lookup):
            return x * 2

    model = Scale()
    for name, mode in (("a", "tensors"), ("b", "tensors"), ("s", "stats")):
        with HookerAndDumper(tmp_path / name, mode=mode).hooks(model, 0, 0):
            model(torch.ones(3), lookup=torch.eye(3).to_sparse())
    for other in ("b", "s"):
        out = h5cmp(tmp_path / "a", tmp_path / other, "--all")
        assert out.exit_code == 0, out.output
        assert "3 tensor pairs: 2 equal, 1 unsupported" in out.output
        assert out.output.startswith("B agrees with A exactly; 1 of 3 records could not be "
                                     "compared (unsupported)")
        assert len([line for line in out.output.splitlines() if "unsupported" in line]) == 3
        quiet = h5cmp(tmp_path / "a", tmp_path / other)  # the failure table leaves it out
        assert "rows outside tolerance" not in quiet.output


def test_single_process_dump_compares_with_a_ddp_rank(tmp_path):
    """The port-to-DDP case: the dumper hooks the model inside DistributedDataParallel (plain
    module names), and a non-distributed dump pairs with a rank of the distributed one."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from compare import compare_dumps
    from dumper import HookerAndDumper

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    x = torch.randn(3, 4)
    with HookerAndDumper(tmp_path / "single").hooks(model, 0, 0):
        model(x).sum().backward()
    model.zero_grad()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    try:
        ddp = DistributedDataParallel(model)
        dumper = HookerAndDumper(tmp_path / "ddp")
        with dumper.hooks(ddp, 0, 0):
            ddp(x).sum().backward()
    finally:
        dist.destroy_process_group()
    assert [p.name for p in dumper.written_files] == ["0-epoch_0-step_rank0_dump.hdf5"]
    result = compare_dumps(tmp_path / "single", tmp_path / "ddp")
    assert len(result) > 10 and (result["status"] == "equal").all()
    assert not any(m.startswith("module") for m in result["module"])
    out = h5cmp(tmp_path / "single", tmp_path / "ddp")
    assert out.exit_code == 0, out.output
    assert "A is not distributed: compared with rank 0 of B" in out.output
    wrong = h5cmp(tmp_path / "single", tmp_path / "ddp", "--rank", 1)
    assert wrong.exit_code == 2 and "no step of rank 1" in wrong.output


def test_nothing_to_compare_or_show_is_an_error_not_a_verdict(runs):
    for args, says in ((("--step", "99"), "nothing to compare: no tensor record in step 99"),
                       (("--module", "no_such"), "nothing to show: no record matches --module")):
        result = h5cmp(runs["ref"], runs["fwd"], *args)
        assert result.exit_code == 2 and says in result.output, result.output


def test_options_that_cannot_apply_are_refused(runs):
    """An option the comparison would ignore or choke on is a user's mistake: exit 2 with one
    line saying what to do, never a silent no-op or an internal error."""
    for args, says in (
            (("--rtol", "-1"), "-1.0 is not in the range x>=0"),
            (("--atol", "-0.1"), "-0.1 is not in the range x>=0"),
            (("--rank", "3"), "--rank 3: neither dump is distributed"),
            (("--track", "mid:output:0"), "plots one tensor over the steps of one dump"),
            (("--scheduler", "notaurl"), "--scheduler notaurl: "),
            (("--step", "x:y"), "'x:y' is no step; give S or E:S")):
        result = h5cmp(runs["ref"], runs["fwd"], *args)
        assert result.exit_code == 2 and says in result.output, (args, result.output)
        assert "internal error" not in result.output


def test_outputs_are_checked_before_comparing(runs, tmp_path):
    for args, says in ((("-o", tmp_path / "missing" / "r.csv"), "does not exist"),
                       (("-o", tmp_path), "is a directory"),
                       (("--plot", tmp_path / "missing" / "p.png"), "does not exist")):
        result = h5cmp(runs["ref"], runs["fwd"], *args)
        assert result.exit_code == 2 and says in result.output, result.output


def test_several_outputs_and_pictures_of_a_selection(runs, tmp_path):
    pytest.importorskip("matplotlib")
    outputs = [tmp_path / "r.csv", tmp_path / "r.html", tmp_path / "p.png"]
    result = h5cmp(runs["ref"], runs["fwd"], "-q", "--module", "out", "-o", outputs[0], "-o",
                   outputs[1], "--plot", outputs[2])
    assert result.exit_code == 1 and all(p.stat().st_size > 0 for p in outputs), result.output


def test_an_internal_error_exits_2_with_one_line(runs, monkeypatch):
    import compare.comparison

    def broken(*args, **kwargs):
        raise RuntimeError("something we did not foresee")
    monkeypatch.setattr(compare.comparison, "compare_dumps", broken)
    result = h5cmp(runs["ref"], runs["fwd"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "h5cmp: internal error: RuntimeError: something we did not foresee; this is a bug in "
        "h5cmp: rerun with --debug (or H5CMP_DEBUG=1) for the traceback and report it"]
    assert isinstance(h5cmp(runs["ref"], runs["fwd"], "--debug").exception, RuntimeError)

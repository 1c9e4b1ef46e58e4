"""A crash or a full disk during step N leaves every earlier step readable and exact."""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from compare import format as fmt
from compare.dump import load_dump

from helpers import read_tensors

CHILD = Path(__file__).with_name("crash_child.py")
ROOT = Path(__file__).resolve().parent.parent


def _lines_until(proc: subprocess.Popen, wanted: set, timeout: float, limit: int = 12
                 ) -> list[str]:
    """The child's lines until all of ``wanted`` came (or ``limit`` lines, or ``timeout``
    seconds: a child that stopped talking fails the test instead of hanging it). A thread
    reads them: a blocking read has no timeout."""
    arrived: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [arrived.put(line.strip()) for line in proc.stdout],
                     daemon=True).start()
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while not wanted <= set(lines) and len(lines) < limit:
        try:
            lines.append(arrived.get(timeout=max(0.0, deadline - time.monotonic())))
        except queue.Empty:
            break
    return lines


def _child(*args) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, str(CHILD), *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _assert_steps_equal(dir_a: Path, dir_b: Path, steps: range) -> None:
    for step in steps:
        name = fmt.step_file_name(0, step)
        a, b = read_tensors(dir_a / name), read_tensors(dir_b / name)
        assert a.keys() == b.keys() and len(a) > 20
        for key in a:
            assert torch.equal(a[key], b[key]), (step, key)


@pytest.mark.slow
def test_kill_9_mid_step_keeps_completed_steps(tmp_path):
    reference = tmp_path / "reference"
    ref = _child(reference, 3)
    assert ref.wait(timeout=120) == 0, ref.stderr.read()
    crashed = tmp_path / "crashed"
    proc = _child(crashed, 5, "--hang-at", 3)
    lines = []
    for line in proc.stdout:
        lines.append(line.strip())
        if line.startswith("HANGING"):
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert lines == ["DONE 0", "DONE 1", "DONE 2", "HANGING"]
    published = sorted(n for n in os.listdir(crashed) if not n.startswith("."))
    assert published == [fmt.step_file_name(0, s) for s in range(3)]
    leftovers = [n for n in os.listdir(crashed) if n.startswith(".")]
    assert all(fmt.is_temp_file_name(n) or n == fmt.lock_file_name(fmt.step_file_name(0, 3))
               for n in leftovers), leftovers
    assert len(load_dump(crashed).steps) == 3  # the directory still loads, the temp file ignored
    _assert_steps_equal(reference, crashed, range(3))
    # the dead writer's lock file claims nothing: a rerun writes every step again
    rerun = _child(crashed, 4)
    assert rerun.wait(timeout=120) == 0, rerun.stderr.read()
    assert len(load_dump(crashed).steps) == 4


@pytest.mark.slow
def test_full_disk_reports_error_and_keeps_completed_steps(tmp_path):
    reference = tmp_path / "reference"
    assert _child(reference, 1).wait(timeout=120) == 0
    one_step = (reference / fmt.step_file_name(0, 0)).stat().st_size
    limited = tmp_path / "limited"
    proc = _child(limited, 3, "--fsize-limit", int(one_step * 1.5))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    lines = out.splitlines()
    assert lines[0] == "DONE 0"
    assert lines[1].startswith("WRITE-ERROR step 1") and "earlier steps are intact" in lines[1]
    assert "Free disk space" in lines[1]
    assert sorted(os.listdir(limited))[0] == fmt.step_file_name(0, 0)
    assert not any(fmt.is_temp_file_name(n) for n in os.listdir(limited))
    _assert_steps_equal(reference, limited, range(1))


@pytest.mark.slow
def test_kill_9_while_publishing_in_the_background_loses_only_that_step(tmp_path):
    """publish="background": step 2's file is being written when the process dies; training
    went on, and the steps published before and after it are complete and exact."""
    reference = tmp_path / "reference"
    ref = _child(reference, 4)
    assert ref.wait(timeout=120) == 0, ref.stderr.read()
    crashed = tmp_path / "crashed"
    proc = _child(crashed, 5, "--hang-publishing-at", 2)
    expected = [fmt.step_file_name(0, s) for s in (0, 1, 3)]
    wanted = {"DONE 0", "DONE 1", "DONE 2", "PUBLISHING"}
    try:
        # (the writer's PUBLISHING and the training thread's DONE 2 come in either order)
        lines = _lines_until(proc, wanted, timeout=120)
        deadline = time.monotonic() + 60
        while not all((crashed / name).exists() for name in expected):
            assert time.monotonic() < deadline, os.listdir(crashed)
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    # training went on while step 2 was being published: remove_hooks had returned for it
    assert wanted <= set(lines), lines
    published = sorted(n for n in os.listdir(crashed) if not n.startswith("."))
    assert published == expected
    assert sorted(s.step for s in load_dump(crashed).steps) == [0, 1, 3]
    _assert_steps_equal(reference, crashed, (0, 1, 3))

"""Sharded training (FSDP2, FSDP1, tensor parallel, DDP; 2 processes on gloo) with the dumper
attached, in every mode: it trains, and bit-for-bit as without the dumper."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from compare.dump import load_dump

CHILD = Path(__file__).with_name("sharded_child.py")
WORLD = 2
TIMEOUT = 180  # seconds for the whole run of one layout; every process is killed after it

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(layout: str, directory: Path, world: int = WORLD) -> list[dict]:
    """Run ``sharded_child.py`` on ``world`` ranks; each rank's JSON report. Every process is
    killed if the run takes longer than ``TIMEOUT``."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
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

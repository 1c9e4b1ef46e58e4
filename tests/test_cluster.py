"""Comparing on a Dask cluster (h5cmp[dask]): a LocalCluster of two worker processes gives the
rows of a local comparison, through the API and the CLI."""
from __future__ import annotations

import logging

import pandas as pd
import pytest
from click.testing import CliRunner

from compare import compare_dumps
from compare.cli import main as h5cmp

from helpers import dump_run

distributed = pytest.importorskip("distributed")


@pytest.fixture(scope="module")
def client():
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None, silence_logs=logging.ERROR) as cluster:
        with distributed.Client(cluster, timeout="60s") as connected:
            yield connected


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    return (dump_run(root / "a", steps=3), dump_run(root / "b", steps=3, plant="forward"))


@pytest.mark.slow
def test_the_cluster_gives_the_rows_of_a_local_compare(client, dumps):
    local = compare_dumps(*dumps)
    remote = compare_dumps(*dumps, client=client)
    assert (local["status"] == "DIFF").any()
    pd.testing.assert_frame_equal(local, remote)
    assert local.attrs == remote.attrs


@pytest.mark.slow
def test_the_cli_compares_on_a_scheduler(client, dumps):
    local = CliRunner().invoke(h5cmp, [str(dumps[0]), str(dumps[1])])
    remote = CliRunner().invoke(h5cmp, [str(dumps[0]), str(dumps[1]), "--scheduler",
                                        client.scheduler.address])
    assert (remote.exit_code, remote.output) == (local.exit_code, local.output) == (
        1, local.output)


def test_an_unreachable_scheduler_is_one_line_and_exit_2(dumps, monkeypatch):
    monkeypatch.setattr("compare.cluster.CONNECT_TIMEOUT", "1s")
    result = CliRunner().invoke(h5cmp, [str(dumps[0]), str(dumps[1]), "--scheduler",
                                        "tcp://127.0.0.1:9"])
    assert result.exit_code == 2
    assert result.output.startswith("h5cmp: error: --scheduler tcp://127.0.0.1:9: cannot reach "
                                    "the Dask scheduler") and result.output.count("\n") == 1


def test_a_scheduler_without_workers_is_one_line_and_exit_2(dumps, monkeypatch):
    monkeypatch.setattr("compare.cluster.STALL_TIMEOUT", 1.0)
    with distributed.LocalCluster(n_workers=0, processes=False, dashboard_address=":0",
                                  silence_logs=logging.ERROR) as idle:
        result = CliRunner().invoke(h5cmp, [str(dumps[0]), str(dumps[1]), "--scheduler",
                                            idle.scheduler_address])
    assert result.exit_code == 2
    assert result.output.startswith(f"h5cmp: error: --scheduler {idle.scheduler_address}: no "
                                    "work unit finished in 1 s") and result.output.count("\n") == 1
    assert "workers: 0" in result.output

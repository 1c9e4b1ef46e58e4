import pytest
import torch


@pytest.fixture
def one_thread():
    """torch on one thread, as a process of a multi-process launch runs (torchrun sets
    OMP_NUM_THREADS=1): CPU kernels then add their sums serially."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)

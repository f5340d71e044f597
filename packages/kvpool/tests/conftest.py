import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture
def ssd_dirs(tmp_path):
    paths = []
    for i in range(2):
        p = tmp_path / f"ssd{i}"
        p.mkdir()
        paths.append(p)
    return paths


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a slower end-to-end test (still run by nox -s tests)")
